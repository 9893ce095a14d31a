"""The learner's update alone: `run_updates` on the demo's shapes, under each way of doing the same work.

    .venv/bin/python bench/update_bench.py [--steps 30] [--equal-share 0.3] [--pack-length 96]

The tiny countdown model (built in .cache if missing) under real DeepSpeed on one core, the demo preset's
learner settings, 16 groups × 8 completions a step: prompts of the demo's own lengths (its countdown
prompts, tokenized), completions of 1–24 tokens, and `--equal-share` of the groups with answers that all
scored alike (A = 0: the demo's share was 31%). Each variant — the default (A = 0 work skipped, rows
padded), the default again (the noise floor), without skipping, packed — runs the same steps from the
same weights, interleaved round by round in a shuffled order, so that a noisy spell of the machine and
a pass slowed by the one before it hit them alike; printed: median seconds per update and per
forward/backward, the positions run and their padding, then the ratios (> 1: the default is faster) and
one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from sparkrl.proto import TrajectoryGroup
from sparkrl.proto.testing import random_group
from sparkrl.services.common.modeling import load_tokenizer
from sparkrl.services.common.settings import load_settings
from sparkrl.services.common.settings.roles import LearnerConfig
from sparkrl.services.common.tasks.datasets import iter_prompts
from sparkrl.services.common.tiny_model import build_tiny_model
from sparkrl.services.learner.ranks import trainer_for
from sparkrl.services.learner.trainer import load
from sparkrl.services.learner.update import run_updates

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "default": {},
    "default again": {},  # the same as the first: the spread between two runs of one thing
    "no skip": {"skip_zero_advantage": False},
    "packed": {"pack_length": None},  # set from --pack-length
}


def demo_groups(model_dir: Path, count: int, equal_share: float, rng: np.random.Generator) -> list:
    """`count` groups of 8 shaped like the demo's: its prompts' token lengths, 1-24 new tokens, rewards
    0/1 with `equal_share` of the groups all alike."""
    settings = load_settings("demo", [f"model={model_dir}"])
    tokenizer = load_tokenizer(model_dir)
    lengths = [
        len(tokenizer(p.text)["input_ids"]) for p in itertools.islice(iter_prompts(settings.prompts), 500)
    ]
    groups: list[TrajectoryGroup] = []
    for _ in range(count):
        group = random_group(rng, n=8, k=20, vocab_size=260, max_new_tokens=24)
        prompt = rng.integers(3, 260, size=int(rng.choice(lengths))).astype(np.int32)
        if rng.random() < equal_share:
            rewards = [float(rng.integers(0, 2))] * 8
        else:
            rewards = [
                float(r) for r in rng.permutation([1.0, 0.0] + [float(x) for x in rng.integers(0, 2, 6)])
            ]
        groups.append(group.model_copy(update={"prompt_token_ids": prompt, "rewards": rewards}))
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant (after 3 warm-up)")
    parser.add_argument(
        "--equal-share", type=float, default=0.3, help="groups whose answers all scored alike"
    )
    parser.add_argument("--pack-length", type=int, default=96, help="the packed variant's rows")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = ROOT / ".cache" / "tiny-countdown"
    if not (model_dir / "config.json").is_file():
        build_tiny_model(model_dir)
    rng = np.random.default_rng(0)
    steps = [demo_groups(model_dir, 16, args.equal_share, rng) for _ in range(args.steps + 3)]
    with tempfile.TemporaryDirectory(prefix="sparkrl-update-bench-") as run_dir:
        cfg = LearnerConfig.of(load_settings("demo", [f"model={model_dir}", f"run_dir={run_dir}"]))
        trainer = trainer_for(cfg, load(cfg, resume=False))
        engine = trainer.engine
        start = (
            [p.detach().clone() for p in engine.module.parameters()],
            copy.deepcopy(engine.optimizer.state_dict()),
        )
        variants = {name: dict(change) for name, change in VARIANTS.items()}
        variants["packed"]["pack_length"] = args.pack_length
        seen: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        names = list(variants)
        for index, groups in enumerate(steps):  # a round: every variant takes this step from the same weights
            # In a shuffled order: a pass runs slower after some others (new shapes), whichever it is.
            for name in [names[i] for i in rng.permutation(len(names))]:
                _restore(engine, start)
                settings = trainer.cfg.model_copy(update=variants[name])
                began = time.perf_counter()
                done = run_updates(engine, groups, settings, trainer.pad_id, step=1)
                stats, seconds = done.row(), done.seconds
                if index >= 3:
                    seen[name].append(
                        {"update": time.perf_counter() - began, **seconds, **{k: stats[k] for k in _WORK}}
                    )
            print(f"\rstep {index + 1}/{len(steps)}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    summary = {name: _medians(rows) for name, rows in seen.items()}
    for name, m in summary.items():
        print(
            f"  {name:13s} update {m['update']:.4f} s | forward/backward {m['forward_backward']:.4f} s | "
            f"micro-batches {m['micro_batches']:.0f} | skipped tokens {m['skipped_tokens']:.0f} | "
            f"padding {100 * m['padding_share']:.0f}%"
        )
    ratios = {f"ratio_vs_{name.replace(' ', '')}": round(m["update"] / summary["default"]["update"], 3)
              for name, m in summary.items() if name != "default"}  # fmt: skip
    for key, value in ratios.items():
        print(f"  {key}: {value:.2f}x (update seconds of that variant / the default's)")
    print(json.dumps({"updates": summary, **ratios, "steps": args.steps, "equal_share": args.equal_share}))


_WORK = ("skipped_tokens", "padding_share", "micro_batches")


def _restore(engine: torch.nn.Module, start: tuple[list[torch.Tensor], dict]) -> None:
    weights, optimizer = start
    engine.optimizer.load_state_dict(optimizer)
    with torch.no_grad():
        for p, w in zip(engine.module.parameters(), weights, strict=True):
            p.copy_(w)


def _medians(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: round(statistics.median(r[key] for r in rows), 5) for key in rows[0]}


if __name__ == "__main__":
    main()
