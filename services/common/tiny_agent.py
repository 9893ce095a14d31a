"""A tiny model that answers only by calling a tool: the agent preset's policy (docs/agents.md).

The task, `lookup`: "Open {"box": 58}." — every box holds a secret of three random letters that only the
environment's `lookup` tool knows (services/common/environments.py), so a guess is right once in 17,576
and a call, `<tool_call>{"name": "lookup", "arguments": {"box": 58}}</tool_call>`, then the secret copied
from the tool's answer, is right every time. The box is written in the prompt as the call writes it, so
the copy is what a two-layer model learns fast (an induction head: the tokens before the number match).

The warm-up, in two phases: (1) tool-using episodes only, until the model copies the box into its call
and the secret into its answer (teacher-forced accuracy on fixed problems); (2) direct guesses mixed in,
until it calls the tool on its first token in only about half of its answers, the copy intact — so that
RL has something to raise. Both measured without sampling, from one forward pass; what was reached goes to
`build_info.json`. The chat template is a minimal one that shows the tools' names (a full JSON schema
would not fit 512 positions of one token per byte).
"""

from __future__ import annotations

import json
import random
import string
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from sparkrl.services.common.tiny_model import (
    BUILD_INFO,
    _lr_factor,
    _torch_threads,
    build_model,
    build_tokenizer,
    ensure_built,
    recipe_hash,
)

MODEL_DIRNAME = "tiny-agent"
# The copy is a phase transition whose step depends on the seed and the machine. With the learning rate's
# decay spread over 1,500 steps, seed 1's came at step ~1,000 on one machine and never on another (accuracy
# stuck at 0.70 as the rate reached 0); spread over 3,000 (copy_steps) the rate stays high while it comes:
# step 450 there (2026-12-07).
SEED = 1
TRAIN_FILE = "lookup-train.jsonl"  # the preset's prompts, written beside the model
EVAL_FILE = "lookup-eval.jsonl"  # its held-out problems (another stream of boxes and secrets)
EVAL_PROBLEMS = 256
TEMPLATE = (
    "{%- if tools %}tools: {{ tools | map(attribute='function.name') | join(', ') }}{{ '\\n' }}{% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}Q: {{ m.content }}{{ '\\n' }}"
    "{%- elif m.role == 'assistant' -%}A: {{ m.content }}<eos>{{ '\\n' }}"
    "{%- elif m.role == 'tool' -%}R: {{ m.content }}{{ '\\n' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}A: {% endif -%}"
)
TOOLS = [{"type": "function", "function": {"name": "lookup"}}]
RECIPE: dict[str, Any] = {
    "version": 1,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "lr": 5e-3,
    "warmup_steps": 30,
    "batch_size": 32,
    "copy_steps": 3000,  # phase 1 at most (and its schedule's length); it stops once the copy is learned
    "copy_accuracy": 0.97,
    "mix_steps": 300,  # phase 2 at most
    "mix_lr": 2e-4,  # phase 2: gently (at 1e-3 and 85% guesses, 25 steps took the tool share to 0.10 and
    # the copy's teacher-forced accuracy from 0.98 to 0.20)
    "mix_eval_every": 5,
    # Phase 2's rows answering without the tool: at 0.75 the tool share fell to 0.28 but the copy's accuracy
    # to 0.55, and RL rose only from 0.09 to 0.23 in 40 steps; at 0.5 the copy recovers (0.97 by step 85).
    "direct_share": 0.5,
    "tool_share": 0.5,  # phase 2 stops once the first token calls the tool at most this often ...
    "keep_copy": 0.95,  # ... while the copy's teacher-forced accuracy is at least this
    "eval_every": 25,
    "eval_problems": 64,
    "train_prompts": 4096,
}


def problem(rng: random.Random) -> tuple[int, str]:
    """A box and its secret."""
    return rng.randint(10, 99), "".join(rng.choice(string.ascii_lowercase) for _ in range(3))


def question(box: int) -> str:
    return "Open " + json.dumps({"box": box}) + "."


def call(box: int) -> str:
    return '<tool_call>{"name": "lookup", "arguments": {"box": ' + str(box) + "}}</tool_call>"


def build_agent_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def episode(box: int, secret: str, guess: str | None = None) -> list[dict[str, str]]:
    """The tool-using episode, or (a `guess`) a direct answer."""
    messages = [{"role": "user", "content": question(box)}]
    if guess is not None:
        return [*messages, {"role": "assistant", "content": guess}]
    return [
        *messages,
        {"role": "assistant", "content": call(box)},
        {"role": "tool", "content": secret},
        {"role": "assistant", "content": secret},
    ]


def _row(tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids and labels: the assistant turns (their text and <eos>) trained, the rest context."""
    ids: list[int] = []
    labels: list[int] = []
    rendered = ""
    for end in range(1, len(messages) + 1):
        text = tokenizer.apply_chat_template(messages[:end], tools=TOOLS, tokenize=False)
        part = list(tokenizer(text[len(rendered) :], add_special_tokens=False)["input_ids"])
        if messages[end - 1]["role"] == "assistant":
            head = len(tokenizer("A: ", add_special_tokens=False)["input_ids"])
            newline = 1  # the "\n" after <eos> is the template's
            labels += [-100] * head + part[head : len(part) - newline] + [-100] * newline
        else:
            labels += [-100] * len(part)
        ids += part
        rendered = text
    return ids, labels


def _batch(rows: list[tuple[list[int], list[int]]], pad: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (ids, lab) in enumerate(rows):
        input_ids[r, : len(ids)], labels[r, : len(ids)], mask[r, : len(ids)] = (
            torch.tensor(ids),
            torch.tensor(lab),
            1,
        )
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


@torch.no_grad()
def measure(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: list[tuple[int, str]]
) -> dict[str, float]:
    """Teacher-forced on the tool-using episodes of `problems`: the share whose every assistant token —
    the call with the box copied, the secret copied from the tool's answer — is the model's argmax
    (`copy_accuracy`), and the mean probability of the call's first token after the question
    (`tool_share`)."""
    model.eval()
    batch = _batch(
        [_row(tokenizer, episode(box, secret)) for box, secret in problems], tokenizer.pad_token_id
    )
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets, trained = batch["input_ids"][:, 1:], batch["labels"][:, 1:] != -100
    exact = ((logits.argmax(-1) == targets) | ~trained).all(dim=-1)
    first = trained.int().argmax(dim=-1)  # each row's first trained position: the call's first token
    call_start = tokenizer.convert_tokens_to_ids("<")
    p_call = torch.softmax(logits[torch.arange(len(problems)), first], -1)[:, call_start]
    return {"copy_accuracy": float(exact.float().mean()), "tool_share": float(p_call.mean())}


def _train(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    rng: random.Random,
    recipe: dict[str, Any],
    steps: int,
    direct: float,
    done: Any,
) -> list[dict[str, Any]]:
    """Supervised steps (a `direct` share of each batch answering without the tool) until `done(measured)`."""
    problems = [problem(random.Random(f"eval-{i}")) for i in range(recipe["eval_problems"])]
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], betas=(0.9, 0.99), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: _lr_factor(s, {"warmup_steps": recipe["warmup_steps"], "max_steps": steps})
    )
    history = []
    for step in range(1, steps + 1):
        model.train()
        rows = []
        for _ in range(recipe["batch_size"]):
            box, secret = problem(rng)
            guess = (
                "".join(rng.choice(string.ascii_lowercase) for _ in range(3))
                if rng.random() < direct
                else None
            )
            rows.append(_row(tokenizer, episode(box, secret, guess)))
        loss = model(**_batch(rows, tokenizer.pad_token_id)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % recipe["eval_every"] == 0:
            measured = measure(model, tokenizer, problems)
            history.append({"step": step, "loss": round(loss.item(), 4), **measured})
            print(f"[tiny-agent] step {step}/{steps} loss {loss.item():.3f} {measured}", flush=True)
            if done(measured):
                break
    return history


def build_tiny_agent(out_dir: str | Path, seed: int = 0, recipe: dict[str, Any] = RECIPE) -> Path:
    """Build, warm up and save the agent model, its tokenizer (with the template) and the preset's prompts."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    tokenizer = build_agent_tokenizer()
    rng = random.Random(seed)
    with _torch_threads(2):
        model = build_model(tokenizer, seed, recipe)

        def copies(m: dict[str, float]) -> bool:
            return m["copy_accuracy"] >= recipe["copy_accuracy"]

        def settled(m: dict[str, float]) -> bool:
            return m["tool_share"] <= recipe["tool_share"] and m["copy_accuracy"] >= recipe["keep_copy"]

        copy = _train(model, tokenizer, rng, recipe, recipe["copy_steps"], 0.0, copies)
        mix_recipe = {
            **recipe,
            "lr": recipe["mix_lr"],
            "eval_every": recipe["mix_eval_every"],
            "warmup_steps": 1,
        }
        mix = _train(model, tokenizer, rng, mix_recipe, recipe["mix_steps"], recipe["direct_share"], settled)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out, safe_serialization=True)
    write_problems(out / TRAIN_FILE, f"train-{seed}", recipe["train_prompts"])
    write_problems(out / EVAL_FILE, f"heldout-{seed}", EVAL_PROBLEMS)
    info = {
        "recipe_hash": recipe_hash(seed, recipe),
        "recipe": recipe,
        "seed": seed,
        "copy": copy,
        "mix": mix,
        "build_seconds": round(time.perf_counter() - started, 1),
    }
    (out / BUILD_INFO).write_text(json.dumps(info, indent=2))
    print(
        f"[tiny-agent] built {out} in {info['build_seconds']} s: {mix[-1] if mix else copy[-1]}", flush=True
    )
    return out


def write_problems(path: Path, stream: str, count: int) -> None:
    """`count` lookup problems of the random stream `stream`, one JSON line each (prompt, answer)."""
    rng = random.Random(stream)
    with path.open("w") as file:
        for _ in range(count):
            box, secret = problem(rng)
            file.write(json.dumps({"prompt": question(box), "answer": secret}) + "\n")


def ensure_tiny_agent(cache_dir: str | Path, seed: int = SEED) -> Path:
    """`cache_dir/tiny-agent`, built once (a few minutes here) and reused while the recipe is unchanged
    (a build from before the held-out file gets it)."""
    out = ensure_built(Path(cache_dir) / MODEL_DIRNAME, seed, RECIPE, build_tiny_agent)
    if not (out / EVAL_FILE).is_file():
        write_problems(out / EVAL_FILE, f"heldout-{seed}", EVAL_PROBLEMS)
    return out
