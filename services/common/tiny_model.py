"""A tiny character-level Qwen2 that plays Countdown a little: the CPU stand-in for a real policy.

`ensure_tiny_model(cache_dir)` builds it once (about 30 s on 2 cores) and reuses it: a one-token-per-byte
tokenizer (`tokenizers`, wrapped as `PreTrainedTokenizerFast`; for ASCII text, one token per character),
a 2-layer `Qwen2ForCausalLM`, and a short supervised warm-up on (prompt, random correct expression) pairs
that stops early, once the sampled reward at temperature 1 is clearly above 0 and still far from solved,
so RL has something to improve. The measured reward goes to `build_info.json`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from sparkrl.services.common.tasks.countdown import (
    CountdownProblem,
    format_prompt,
    generate_problem,
    random_solution,
    score_countdown,
)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
MODEL_DIRNAME = "tiny-countdown"
BUILD_INFO = "build_info.json"

# Everything that shapes the result; its hash names the build, so editing it triggers a rebuild. Bump
# `version` when the code behind it changes (tokenizer, architecture, countdown's generator defaults).
RECIPE: dict[str, Any] = {
    "version": 6,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "lr": 5e-3,
    "warmup_steps": 30,
    "batch_size": 32,
    "max_steps": 700,
    "eval_every": 50,
    "eval_problems": 256,
    # Stop once the model plays a little (≈0.25-0.3 on fresh problems): an RL start with room to improve.
    "stop_reward": 0.3,
    "final_eval_problems": 256,
    "max_new_tokens": 24,
}

# Recipes by name (`ensure_tiny_model(recipe_name=...)`): a recipe may set `countdown` (the warm-up's
# problem distribution, generate_problem's keyword arguments). A 3-layer model warmed up on 3-4 numbers up
# to 12 reached a sampled reward of only 0.02 after 1500 steps (4 min here): configs/explore.yaml uses the
# tiny model on three-number problems instead.
RECIPES: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": (MODEL_DIRNAME, RECIPE),
}


def recipe_hash(seed: int, recipe: dict[str, Any] = RECIPE) -> str:
    text = json.dumps({**recipe, "seed": seed}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _byte_alphabet() -> list[str]:
    """The 256 byte-level characters in byte order (GPT-2's printable stand-ins for raw bytes)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in kept:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[byte] for byte in range(256)]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (so any text encodes): byte-level BPE with no merges, plus pad/bos/eos/unk.

    The pipeline is exactly the one `Qwen2Tokenizer` rebuilds from a vocabulary (transformers 5 maps
    model type `qwen2` to it whatever the saved class), so AutoTokenizer, vLLM and this object agree.
    No BOS is prepended (Qwen2Tokenizer never does); EOS ends every completion.
    """
    vocab = {token: i for i, token in enumerate([PAD, BOS, EOS, UNK, *_byte_alphabet()])}
    # Qwen2's pre-tokenizer split and byte-level mapping; with no merges the split cannot change the
    # tokens, but matching it keeps both loading paths byte-for-byte identical.
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
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        # The default cleanup deletes spaces before punctuation, which would change prompts and answers.
        clean_up_tokenization_spaces=False,
    )
    return wrapped


SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int, shape: dict[str, int]) -> Qwen2ForCausalLM:
    """A randomly initialised (seeded) Qwen2 of `shape` (the SHAPE_KEYS) for `tokenizer`, sampling with
    the full distribution by default."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        **{key: shape[key] for key in SHAPE_KEYS},
        # Untied: the learner, both engines and vLLM's loader then see every weight under its own name.
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
    )
    return model


def _sft_batch(
    tokenizer: PreTrainedTokenizerFast, rng: random.Random, batch_size: int, countdown: dict[str, int]
) -> dict[str, torch.Tensor]:
    """Right-padded (prompt + solution + EOS) rows; the loss sees only the solution and EOS."""
    rows: list[tuple[list[int], int]] = []
    for _ in range(batch_size):
        problem = generate_problem(rng, **countdown)
        prompt_ids = tokenizer(format_prompt(problem))["input_ids"]
        answer_ids = tokenizer(random_solution(problem, rng), add_special_tokens=False)["input_ids"]
        rows.append(([*prompt_ids, *answer_ids, tokenizer.eos_token_id], len(prompt_ids)))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((batch_size, width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((batch_size, width), -100, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, width), dtype=torch.long)
    for row, (ids, prompt_len) in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
        attention_mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


@torch.no_grad()
def sample_reward(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    problems: list[CountdownProblem],
    seed: int,
    max_new_tokens: int = RECIPE["max_new_tokens"],
) -> float:
    """Mean countdown reward of one sample per problem at temperature 1 (full distribution, no top-k/p)."""
    model.eval()
    prompts = [tokenizer(format_prompt(p))["input_ids"] for p in problems]
    width = max(len(ids) for ids in prompts)
    # Left padding: every row's next token is then predicted at the last column.
    input_ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    scores = [
        score_countdown(text, list(p.numbers), p.target)[0] for text, p in zip(texts, problems, strict=True)
    ]
    return sum(scores) / len(scores)


def _lr_factor(step: int, recipe: dict[str, Any]) -> float:
    """Linear warm-up, then cosine decay to 10% at `max_steps` (a constant rate plateaus early)."""
    warmup, total = recipe["warmup_steps"], recipe["max_steps"]
    progress = min(step, total) / total
    return min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def _warm_up(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, seed: int, recipe: dict[str, Any]
) -> dict[str, Any]:
    """Supervised steps until the sampled reward on a fixed eval set reaches `stop_reward`."""
    rng, countdown = random.Random(seed), recipe.get("countdown", {})
    eval_problems = [
        generate_problem(random.Random(f"eval-{seed}-{i}"), **countdown)
        for i in range(recipe["eval_problems"])
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], betas=(0.9, 0.99), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, recipe))
    step, reward, history, started = 0, 0.0, [], time.perf_counter()
    total = recipe["max_steps"]
    while step < total:
        model.train()
        loss = model(**_sft_batch(tokenizer, rng, recipe["batch_size"], countdown)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        step += 1
        if step % recipe["eval_every"] == 0:
            reward = sample_reward(
                model, tokenizer, eval_problems, seed=seed + step, max_new_tokens=recipe["max_new_tokens"]
            )
            history.append({"step": step, "loss": round(loss.item(), 4), "eval_reward": reward})
            elapsed = time.perf_counter() - started
            left = elapsed / step * (total - step)
            print(
                f"[tiny-model] step {step}/{total} loss {loss.item():.3f} eval reward {reward:.3f} "
                f"(stops at ≥ {recipe['stop_reward']}) | {elapsed:.0f}s, at most {left:.0f}s to go",
                flush=True,
            )
            if reward >= recipe["stop_reward"]:
                break
    return {"sft_steps": step, "history": history}


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def build_tiny_model(out_dir: str | Path, seed: int = 0, recipe: dict[str, Any] = RECIPE) -> Path:
    """Build, warm up and save the tiny model and tokenizer into `out_dir`; returns it.

    Deterministic for a seed on a given machine and thread count (the build pins its threads).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    tokenizer = build_tokenizer()
    with _torch_threads(min(4, os.cpu_count() or 1)):
        model = build_model(tokenizer, seed, recipe)
        warm = _warm_up(model, tokenizer, seed, recipe)
        countdown = recipe.get("countdown", {})
        final_problems = [
            generate_problem(random.Random(f"final-{seed}-{i}"), **countdown)
            for i in range(recipe["final_eval_problems"])
        ]
        reward = sample_reward(
            model, tokenizer, final_problems, seed=seed + 10**6, max_new_tokens=recipe["max_new_tokens"]
        )
    tokenizer.save_pretrained(out)
    model.save_pretrained(out, safe_serialization=True)
    info = {
        "recipe_hash": recipe_hash(seed, recipe),
        "recipe": recipe,
        "seed": seed,
        "warmup_reward": reward,
        "warmup_reward_samples": len(final_problems),
        "build_seconds": round(time.perf_counter() - started, 2),
        **warm,
    }
    (out / BUILD_INFO).write_text(json.dumps(info, indent=2))
    print(f"[tiny-model] built {out} in {info['build_seconds']} s, warm-up reward {reward:.3f}", flush=True)
    return out


def _is_current(model_dir: Path, seed: int, recipe: dict[str, Any]) -> bool:
    try:
        info = json.loads((model_dir / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return False
    return info.get("recipe_hash") == recipe_hash(seed, recipe)


def ensure_tiny_model(cache_dir: str | Path, seed: int = 0, recipe_name: str = "tiny") -> Path:
    """`cache_dir/tiny-countdown` (seed 0; `explore-countdown` for the "explore" recipe) built once and
    reused while the recipe is unchanged."""
    dirname, recipe = RECIPES[recipe_name]
    cache = Path(cache_dir)
    return ensure_built(
        cache / (dirname if seed == 0 else f"{dirname}-s{seed}"), seed, recipe, build_tiny_model
    )


def ensure_built(
    model_dir: Path, seed: int, recipe: dict[str, Any], build: Callable[[Path, int, dict[str, Any]], Path]
) -> Path:
    """`model_dir`, built by `build(dir, seed, recipe)` unless it holds this recipe's build already.

    Safe across processes: builders serialize on a file lock, build into a temporary directory and move
    it into place with a rename, so a reader never sees a half-written model.
    """
    cache = model_dir.parent
    cache.mkdir(parents=True, exist_ok=True)
    if _is_current(model_dir, seed, recipe):
        return model_dir
    with FileLock(str(model_dir) + ".lock"):
        if _is_current(model_dir, seed, recipe):  # another process built it while we waited
            return model_dir
        staging = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-", dir=cache))
        try:
            build(staging, seed, recipe)
            if model_dir.exists():
                stale = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-stale-", dir=cache))
                model_dir.rename(stale / "old")
                shutil.rmtree(stale)
            staging.rename(model_dir)
            print(f"[tiny-model] ready at {model_dir}", flush=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return model_dir
