"""The planted-fork start state of issue 47: a tiny model warmed up on fork_task.py's two paths, and the
measurements that say whether it is the state the experiment needs, taken before any RL run.

    python bench/fork_model.py --out .cache/fork            # no noise tail
    python bench/fork_model.py --out .cache/fork --tail 0.35 # junk tokens below the min-p cut

The warm-up is supervised, in two phases: `skill_steps` with `skill_share` of the rows on the spark path
(its steps then learned, each right with probability `step_accuracy` in the labels, the answer given with
probability `skill_answer_share`), then `steps` with `spark_share` of them and the answer given with
probability `answer_share` (the spark made rare again and its path unreliable at the end); the other rows
take the common path (the right digit at once). The first phase's model is kept beside `--out`
(`fork-skill-<hash>.pt`, the hash over what it depends on), so variants of the second phase start from it.
With `tail` > 0, in the second phase, the first answer token's target also spreads that much mass over
junk tokens (every byte but digits, `?`, `#`, space and `=`), each far below κ · p_max: the mass min-p
drops, Z = 1 − tail, which the on-policy pull of Lp-Reg, β(1/Z − 1), predicts it needs.

Measured on a fixed probe set (`start_state`), at the fork (the first answer token) and by sampling at
T = 1: p(spark), Z (the mass of the tokens with p ≥ κ · p_max), the common and the spark path's success
(the spark's with `?` forced), the overall success, and E[A | spark] = (success_spark − mean) / std of a
group's reward (GRPO's normalization with the mean rate): it must be negative. Written with the model to
`fork_build.json`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

import torch
from fork_probe import start_state
from fork_task import common_completion, generate, junk_completion, spark_completion

from sparkrl.services.common.tiny_model import build_model, build_tokenizer

RECIPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "n_digits": 5,
    "skill_steps": 1000,  # first phase: the spark path's steps learned, at `skill_share` of the rows
    "skill_share": 0.5,
    "spark_share": 0.03,  # second phase (`steps`): the spark made rare again
    "step_accuracy": 0.7,
    "skill_answer_share": 1.0,
    "answer_share": 1.0,
    "tail": 0.0,
    "noise_rows": 0.5,  # with a tail: rows of a junk token then the common answer, at tail × this share
    "lr": 3e-3,
    "batch_size": 64,
    "steps": 800,
    "kappa": 0.02,
    "probe_problems": 256,
    "probe_samples": 8,
}
KEPT_CHARS = set("0123456789?# =abcdefABCDEF")


def junk_ids(tokenizer: Any) -> torch.Tensor:
    """Every byte token whose text is not one the task writes."""
    ids = [
        i for token, i in tokenizer.get_vocab().items() if i > 3 and tokenizer.decode([i]) not in KEPT_CHARS
    ]
    return torch.tensor(sorted(ids))


def sft_batch(
    tokenizer: Any, rng: random.Random, recipe: dict[str, Any], phase: tuple[float, float, float]
) -> tuple[torch.Tensor, ...]:
    """Right-padded prompt + completion + EOS rows, the loss's targets (-100 off the completion) and each
    row's prompt length (its fork position − 1 predicts the first answer token). `phase`: the share of
    spark rows, the share of their answers given, the share of noise rows (a junk token, its label
    masked: only what follows it is taught, the fork's own tail is the loss's spread)."""
    spark_share, answer_share, junk_share = phase
    junk = [tokenizer.decode([i]) for i in junk_ids(tokenizer).tolist()]
    rows = []
    for _ in range(recipe["batch_size"]):
        problem = generate(rng, recipe["n_digits"])
        kind = rng.random()
        if kind < spark_share:
            text = spark_completion(problem, rng, recipe["step_accuracy"], answer_share)
        elif kind < spark_share + junk_share:
            text = junk_completion(problem, rng.choice(junk))
        else:
            text = common_completion(problem)
        prompt = tokenizer(problem.prompt(), add_special_tokens=False)["input_ids"]
        answer = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((prompt, answer, spark_share <= kind < spark_share + junk_share))
    width = max(len(p) + len(a) for p, a, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    starts = torch.tensor([len(p) for p, _, _ in rows])
    for row, (prompt, answer, noise) in enumerate(rows):
        ids[row, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[row, len(prompt) + noise : len(prompt) + len(answer)] = torch.tensor(answer[noise:])
    return ids, labels, starts


def sft_loss(model: Any, batch: tuple[torch.Tensor, ...], junk: torch.Tensor, tail: float) -> torch.Tensor:
    """Token cross-entropy over the completions; at the fork the target keeps 1 − tail on the real token
    and spreads `tail` evenly over `junk`."""
    ids, labels, starts = batch
    logits = model(input_ids=ids, attention_mask=(labels != -100) | (ids != 0)).logits[:, :-1].float()
    targets = labels[:, 1:]
    logp = torch.log_softmax(logits, dim=-1)
    valid = targets != -100
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    rows = torch.arange(len(ids))
    fork = starts - 1  # the position whose next token is the first answer token
    at_fork = torch.zeros_like(valid)
    at_fork[rows, fork] = True
    nll = -(picked * valid).sum()
    if tail > 0:
        spread = logp[rows, fork][:, junk].mean(dim=-1)  # uniform over the junk tokens
        real = valid[rows, fork]  # a noise row's fork label is masked
        nll = nll + tail * ((picked[rows, fork] - spread) * real).sum()  # (1 − tail)·real + tail·junk
    return nll / valid.sum()


SKILL_KEYS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "max_position_embeddings", "n_digits", "skill_steps", "skill_share", "step_accuracy",
    "skill_answer_share", "lr", "batch_size",
)  # fmt: skip


def _train(
    model: Any, tokenizer: Any, recipe: dict[str, Any], rng: random.Random, phase: str, optimizer: Any
) -> None:
    """One warm-up phase: the skill phase on a cosine from lr to lr/10, the second at lr/10."""
    junk = junk_ids(tokenizer)
    skill = phase == "skill"
    steps = recipe["skill_steps"] if skill else recipe["steps"]
    shares = (
        (recipe["skill_share"], recipe["skill_answer_share"], 0.0)
        if skill
        else (recipe["spark_share"], recipe["answer_share"], recipe["tail"] * recipe["noise_rows"])
    )
    model.train()
    for step in range(steps):
        scale = 0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)) if skill else 0.1
        for group in optimizer.param_groups:
            group["lr"] = recipe["lr"] * scale
        tail = 0.0 if skill else recipe["tail"]  # the noise tail planted in the second phase only
        loss = sft_loss(model, sft_batch(tokenizer, rng, recipe, shares), junk, tail)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0:
            print(f"{phase} step {step}/{steps}: loss {loss.item():.3f}", file=sys.stderr, flush=True)
    model.eval()


def _skilled(tokenizer: Any, recipe: dict[str, Any], seed: int, cache: Path) -> tuple[Any, Any, Any]:
    """The model, optimizer and data stream after the skill phase: from `cache` when it was made before."""
    key = json.dumps({k: recipe[k] for k in SKILL_KEYS} | {"seed": seed}, sort_keys=True)
    path = cache / f"fork-skill-{hashlib.sha256(key.encode()).hexdigest()[:12]}.pt"
    torch.manual_seed(seed)
    model = build_model(tokenizer, seed, recipe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], weight_decay=0.0)
    rng = random.Random(seed)
    if path.is_file():
        saved = torch.load(path, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        rng.setstate(saved["rng"])
        print(f"skill phase: {path.name}, made before", file=sys.stderr)
    else:
        _train(model, tokenizer, recipe, rng, "skill", optimizer)
        cache.mkdir(parents=True, exist_ok=True)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng.getstate()}
        torch.save(state | {"key": key}, path)
    return model, optimizer, rng


def build(out: Path, recipe: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """Warm the model up, save it (Hugging Face format) with `fork_build.json`; the start state."""
    tokenizer = build_tokenizer()
    model, optimizer, rng = _skilled(tokenizer, recipe, seed, out.resolve().parent)
    _train(model, tokenizer, recipe, rng, "rare", optimizer)
    state = start_state(model, tokenizer, recipe)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "fork_build.json").write_text(
        json.dumps({"recipe": recipe, "seed": seed, "start_state": state}, indent=1)
    )
    return state


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tail", type=float, default=0.0, help="mass spread over junk tokens at the fork")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", nargs="*", default=[], help="recipe overrides, key=value")
    args = parser.parse_args()
    recipe = {**RECIPE, "tail": args.tail}
    for item in args.set:
        key, value = item.split("=", 1)
        recipe[key] = type(RECIPE[key])(value)
    torch.set_num_threads(1)
    print(json.dumps(build(args.out, recipe, args.seed)))


if __name__ == "__main__":
    main()
