"""Tiny random models of the families users RL-train, in Hugging Face format, built from transformers' own
classes alone (nothing is downloaded, ever).

`build_family(key, out_dir)` writes `out_dir/<key>` (config, float32 safetensors, generation_config.json,
tokenizer with its chat template) and reuses it while the recipe holds; `family_dir` is a session fixture
that builds into the repo's `.cache/families`. Every model: 2 layers, hidden 64, 2 query heads and 1 KV
head of size 32 (vLLM's CPU attention takes 32, not 16), 512 positions, seeded random weights. The tie,
special tokens, EOS ids and chat template follow the real family (`FAMILIES[key].notes` says where not).

Tokenizers. One token per byte, as the demo's tiny model (tiny_model.build_tokenizer: byte-level BPE with
no merges, Qwen2's pre-tokenizer split), with the family's special tokens first (ids 0..k-1), then the 256
byte tokens; config.vocab_size is len(tokenizer) rounded up to a multiple of 64. Families whose tokenizer
prepends BOS (llama, mistral, gemma2, gemma3) carry a TemplateProcessing post-processor, and their templates
write `bos_token` too: tokenize a rendered chat with `add_special_tokens=False`, or the prompt gets two.

How AutoTokenizer loads them (transformers 5.25 in .venv, 5.19 in .venv-vllm, whose AutoTokenizer vLLM
uses): `save_pretrained` writes `tokenizer_class: "TokenizersBackend"`, which both keep for every model type
here but qwen2 and which loads tokenizer.json verbatim (a saved generic class is trusted over the model
type's). Model type qwen2 is on transformers' list whose saved class is ignored: it always loads as
Qwen2Tokenizer, which rebuilds the pipeline from vocab and merges (the pipeline built here, so the ids
agree) and makes <|endoftext|> the unk token (so the qwen2 family names it too). A family's own class name
saved instead breaks it: `GemmaTokenizer` (both versions) rebuilds a SentencePiece-style pipeline in which
every space becomes <unk>; `LlamaTokenizer` on model type llama drops spaces and newlines under 5.19 (5.25
sees a byte-level tokenizer.json and falls back, with a warning). test_families_build.py checks ids,
special ids and chat renderings under both versions.

config.vocab_size pads past the tokenizer, as real checkpoints do; on random weights the padded ids get
real probability, and vLLM samples them (a decode gives them no text).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from filelock import FileLock
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

CACHE_DIR = Path(__file__).resolve().parents[1] / ".cache" / "families"
RECIPE_FILE = "family_recipe.json"
# Bump when the code behind a recipe changes (tokenizer pipeline, what is saved).
VERSION = 1
SHAPE: dict[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,  # hidden / heads = 32: the head size where a config has no head_dim
    "num_key_value_heads": 1,
    "max_position_embeddings": 512,
}
HEAD_DIM = {"head_dim": 32}
# transformers' default 0.02 gives logits of std ≈ 0.16 at hidden 64: every next-token distribution is then
# uniform to 2 decimals (entropy ≈ log V), so a wrong logprob or a misloaded weight would hide. 0.2 gives
# std ≈ 1.6 (entropy ≈ 4.5 nats; ≈ 1.9 for Gemma, whose tied embedding is scaled by sqrt(hidden)).
INIT_RANGE = 0.2

# ── chat templates: the families' formats, simplified (no tools, no default system prompt) ───────────────
CHATML_TURNS = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
)
CHATML = CHATML_TURNS + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
# Qwen3's switch: with enable_thinking false the answer starts after an empty think block.
QWEN3 = CHATML_TURNS + (
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% endif %}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# Mistral and Gemma have no system turn: a system message is folded into the first user turn.
FOLD_SYSTEM = (
    "{% set system = messages[0]['content'] + '\\n\\n' if messages[0]['role'] == 'system' else '' %}"
    "{{ bos_token }}{% for message in messages if message['role'] != 'system' %}"
)
MISTRAL = FOLD_SYSTEM + (
    "{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
GEMMA = FOLD_SYSTEM + (
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (system if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
PHI3 = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
TULU = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\\n' + message['content'] + eos_token + ('' if loop.last else '\\n') }}"
    "{% else %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class Family:
    """One model family's recipe: its transformers class and its tokenizer's conventions."""

    key: str
    description: str
    tied: bool  # lm_head is the input embedding (saved once, under the embedding's name)
    notes: str
    model_class: str  # transformers' *ForCausalLM; its config_class builds the config
    config: dict[str, Any] = field(hash=False)  # the family's config fields on top of SHAPE
    specials: tuple[str, ...]  # special tokens, ids 0..k-1 in this order
    eos: str
    stop: tuple[str, ...]  # generation_config.json's eos_token_id, in order
    chat_template: str
    prompt_end: str  # how a rendered user turn with the generation prompt ends
    bos: str | None = None
    pad: str | None = None
    unk: str | None = None
    added: tuple[str, ...] = ()  # added tokens that are not special (kept by decode's skip_special_tokens)
    add_bos: bool = False  # encoding prepends BOS


# Token conventions shared within a lineage (Family's fields).
QWEN_TOKENS: dict[str, Any] = {
    "specials": ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    "eos": "<|im_end|>",
    "pad": "<|endoftext|>",
    "stop": ("<|im_end|>", "<|endoftext|>"),
    "prompt_end": "<|im_start|>assistant\n",
}
QWEN3_TOKENS = {**QWEN_TOKENS, "added": ("<think>", "</think>"), "chat_template": QWEN3}
GEMMA_TOKENS: dict[str, Any] = {
    "specials": ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
    "bos": "<bos>",
    "eos": "<eos>",
    "pad": "<pad>",
    "unk": "<unk>",
    "add_bos": True,
    "stop": ("<eos>", "<end_of_turn>"),
    "chat_template": GEMMA,
    "prompt_end": "<start_of_turn>model\n",
}
LLAMA3_SPECIALS = tuple(
    "<|begin_of_text|> <|end_of_text|> <|start_header_id|> <|end_header_id|> <|eot_id|>".split()
)
PHI3_SPECIALS = tuple("<unk> <s> </s> <|endoftext|> <|assistant|> <|system|> <|end|> <|user|>".split())

FAMILIES: dict[str, Family] = {
    f.key: f
    for f in [
        Family(
            key="qwen2",
            description="Qwen2.5-style: ChatML, untied, EOS <|im_end|>, pad <|endoftext|>, no BOS",
            tied=False,
            notes="No default system prompt. unk is <|endoftext|>: Qwen2Tokenizer, which model type qwen2 "
            "always loads as, makes it so.",
            model_class="Qwen2ForCausalLM",
            config={},
            **QWEN_TOKENS,
            unk="<|endoftext|>",
            chat_template=CHATML,
        ),
        Family(
            key="qwen3",
            description="Qwen3-style: ChatML with enable_thinking, tied (as the small Qwen3s), no BOS",
            tied=True,
            notes="<think>/</think> are added tokens, not special (decode keeps them), as in Qwen3; "
            "past turns' think blocks are not stripped.",
            model_class="Qwen3ForCausalLM",
            config=HEAD_DIM,
            **QWEN3_TOKENS,
        ),
        Family(
            key="qwen3_moe",
            description="Qwen3-MoE-style: 4 experts, top-2, untied; Qwen3's tokenizer and template",
            tied=False,
            notes="Every layer sparse (decoder_sparse_step 1), top-k weights renormalised.",
            model_class="Qwen3MoeForCausalLM",
            config={
                **HEAD_DIM,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 64,
                "norm_topk_prob": True,  # as Qwen3-MoE's releases (the config's default is False)
            },
            **QWEN3_TOKENS,
        ),
        Family(
            key="llama",
            description="Llama-3.2-style: tied, BOS prepended, NO pad token, two EOS ids",
            tied=True,
            notes="The tokenizer's EOS is <|eot_id|> (an instruct model's), config.json's too; "
            "generation_config.json stops at <|end_of_text|> and <|eot_id|>.",
            model_class="LlamaForCausalLM",
            config=HEAD_DIM,
            specials=LLAMA3_SPECIALS,
            bos="<|begin_of_text|>",
            eos="<|eot_id|>",
            stop=("<|end_of_text|>", "<|eot_id|>"),
            add_bos=True,
            chat_template=LLAMA3,
            prompt_end="<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        Family(
            key="mistral",
            description="Mistral-7B-Instruct-style: [INST] template, untied, BOS prepended, no pad token",
            tied=False,
            notes="No pad token either, as Mistral's releases; [INST]/[/INST] are special tokens (v0.3). "
            "sliding_window 4096 never binds at 512 positions.",
            model_class="MistralForCausalLM",
            config=HEAD_DIM,
            specials=("<unk>", "<s>", "</s>", "[INST]", "[/INST]"),
            bos="<s>",
            eos="</s>",
            unk="<unk>",
            stop=("</s>",),
            add_bos=True,
            chat_template=MISTRAL,
            prompt_end=" [/INST]",
        ),
        Family(
            key="gemma2",
            description="Gemma-2-style: tied, <start_of_turn> template writing BOS, soft-capped logits",
            tied=True,
            notes="vLLM's Gemma2 has no lm_head module: load_weights refuses lm_head.weight. Attention "
            "logits are soft-capped: vLLM and eager attention apply it, sdpa drops it (transformers 5.19's "
            "default: 0.01 off vLLM's logprobs here; 5.25 refuses sdpa). Layers alternate sliding (window "
            "4096, never binding here) and full attention.",
            model_class="Gemma2ForCausalLM",
            config={**HEAD_DIM, "query_pre_attn_scalar": 32},
            **GEMMA_TOKENS,
        ),
        Family(
            key="gemma3",
            description="Gemma-3-style text model (Gemma3ForCausalLM): tied, Gemma's template and tokens",
            tied=True,
            notes="Layer 0 sliding (window 4096, never binding here), layer 1 full attention.",
            model_class="Gemma3ForCausalLM",
            config={
                **HEAD_DIM,
                "query_pre_attn_scalar": 32,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            **GEMMA_TOKENS,
        ),
        Family(
            key="phi3",
            description="Phi-3-mini-style: <|user|>/<|assistant|>/<|end|>, untied, fused qkv and gate_up",
            tied=False,
            notes="The tokenizer's EOS is <|endoftext|> (as Phi-3-mini first shipped), a turn ends with "
            "<|end|>: generation_config.json stops at both. No BOS from tokenizer or template.",
            model_class="Phi3ForCausalLM",
            config={"original_max_position_embeddings": 512},
            specials=PHI3_SPECIALS,
            bos="<s>",
            eos="<|endoftext|>",
            pad="<|endoftext|>",
            unk="<unk>",
            stop=("<|endoftext|>", "<|end|>"),
            chat_template=PHI3,
            prompt_end="<|assistant|>\n",
        ),
        Family(
            key="olmo2",
            description="OLMo-2-Instruct-style: Tülu template, untied, BOS = EOS = <|endoftext|>",
            tied=False,
            notes="The template's <|user|>/<|assistant|> markers are plain text here, not special tokens. "
            "vLLM 0.32 runs it on its Transformers backend, which patches transformers' Olmo2Model in its "
            "process: an HF OLMo 2 called there afterwards fails (no attribute 'do_not_compile').",
            model_class="Olmo2ForCausalLM",
            config={},
            specials=("<|endoftext|>", "<|pad|>"),
            bos="<|endoftext|>",
            eos="<|endoftext|>",
            pad="<|pad|>",
            stop=("<|endoftext|>",),
            chat_template=TULU,
            prompt_end="<|assistant|>\n",
        ),
    ]
}


def build_tokenizer(family: Family) -> PreTrainedTokenizerFast:
    """The byte-level tokenizer (tiny_model's pipeline) with `family`'s special tokens and chat template."""
    byte_chars = bytes_to_unicode()
    vocab = {
        t: i for i, t in enumerate([*family.specials, *family.added, *(byte_chars[b] for b in range(256))])
    }
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=[], continuing_subword_prefix="", end_of_word_suffix="")
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # Registered on the backend itself, so they keep their vocab ids and are never split into bytes.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.specials])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    if family.add_bos:
        assert family.bos is not None
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A",
            pair=f"{family.bos} $A {family.bos} $B",
            special_tokens=[(family.bos, vocab[family.bos])],
        )
    named = {
        "bos_token": family.bos,
        "eos_token": family.eos,
        "pad_token": family.pad,
        "unk_token": family.unk,
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        **{name: token for name, token in named.items() if token is not None},
        chat_template=family.chat_template,
        # The default cleanup deletes spaces before punctuation, which would change prompts and answers.
        clean_up_tokenization_spaces=False,
    )


def padded_vocab_size(tokenizer: PreTrainedTokenizerFast) -> int:
    return -(-len(tokenizer) // 64) * 64


def build_model(family: Family, tokenizer: PreTrainedTokenizerFast, seed: int) -> PreTrainedModel:
    """`family`'s model with seeded random float32 weights and its generation config."""
    model_cls = getattr(transformers, family.model_class)

    def ids(token: str | None) -> int | None:
        return None if token is None else tokenizer.convert_tokens_to_ids(token)

    config = model_cls.config_class(
        vocab_size=padded_vocab_size(tokenizer),
        **SHAPE,
        **family.config,
        initializer_range=INIT_RANGE,
        tie_word_embeddings=family.tied,
        bos_token_id=ids(family.bos),
        eos_token_id=ids(family.eos),
        pad_token_id=ids(family.pad),
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    stop = [ids(t) for t in family.stop]
    model.generation_config = GenerationConfig(
        bos_token_id=ids(family.bos),
        eos_token_id=stop if len(stop) > 1 else stop[0],
        pad_token_id=ids(family.pad),
    )
    return model


def recipe(family: Family, seed: int) -> dict[str, Any]:
    """Everything that shapes the files (the prose fields do not)."""
    shaping = {k: v for k, v in asdict(family).items() if k not in ("description", "notes")}
    return {"version": VERSION, "seed": seed, "shape": SHAPE, "init": INIT_RANGE, "family": shaping}


def recipe_hash(family: Family, seed: int) -> str:
    return hashlib.sha256(json.dumps(recipe(family, seed), sort_keys=True).encode()).hexdigest()[:16]


def _is_current(model_dir: Path, family: Family, seed: int) -> bool:
    try:
        saved = json.loads((model_dir / RECIPE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return saved.get("recipe_hash") == recipe_hash(family, seed)


def _write(family: Family, out: Path, seed: int) -> None:
    started = time.perf_counter()
    tokenizer = build_tokenizer(family)
    model = build_model(family, tokenizer, seed)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    info = {
        "recipe_hash": recipe_hash(family, seed),
        "recipe": recipe(family, seed),
        "transformers": transformers.__version__,
        "build_seconds": round(time.perf_counter() - started, 2),
    }
    (out / RECIPE_FILE).write_text(json.dumps(info, indent=2))


def build_family(key: str, out_dir: Path, seed: int = 0) -> Path:
    """`out_dir/<key>`, built once and reused while its recipe holds.

    Safe across processes (pytest-xdist workers): builders serialize on a file lock, write into a temporary
    directory and rename it into place, so a reader never sees a half-written model.
    """
    family = FAMILIES[key]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = out_dir / (key if seed == 0 else f"{key}-s{seed}")
    if _is_current(model_dir, family, seed):
        return model_dir
    with FileLock(str(model_dir) + ".lock"):
        if _is_current(model_dir, family, seed):  # another process built it while we waited
            return model_dir
        staging = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-", dir=out_dir))
        try:
            _write(family, staging, seed)
            if model_dir.exists():
                stale = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-stale-", dir=out_dir))
                model_dir.rename(stale / "old")
                shutil.rmtree(stale)
            staging.rename(model_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return model_dir


@pytest.fixture(scope="session")
def family_dir() -> Callable[[str], Path]:
    """`family_dir("gemma2")`: that family's model directory under the repo's `.cache/families`."""
    return lambda key: build_family(key, CACHE_DIR)
