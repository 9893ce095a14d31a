"""`sparkrl eval`: the pass@k estimator against exact combinatorics, the tiny model reproducing the pass@1
its warm-up recorded (on the warm-up's own final problems, within that one-sample estimate's noise), and
the command's table, JSON line and error on a path with no model."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import pytest
from _tiny import tiny_model_dir  # noqa: F401  (fixture)

from sparkrl.evaluate import evaluate, heldout_countdown, pass_at_k, resolve_model
from sparkrl.services.common.countdown import generate_problem
from sparkrl.services.common.datasets import countdown_prompts
from sparkrl.services.common.settings import PromptSettings


@pytest.mark.parametrize(("n", "c"), [(8, 0), (8, 1), (8, 3), (8, 8), (5, 2)])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample(n: int, c: int) -> None:
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(combinations(samples, k))
        exact = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(exact)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_the_heldout_split_is_not_the_training_stream() -> None:
    training = [p.task_data for p in countdown_prompts(PromptSettings(task="countdown", count=64, seed=1))]
    heldout = [{"numbers": list(p.numbers), "target": p.target} for p in heldout_countdown(64)]
    assert heldout != training and heldout == [
        {"numbers": list(p.numbers), "target": p.target} for p in heldout_countdown(64)
    ]  # fixed, and another stream than the feeder's


def test_the_tiny_model_reproduces_its_warm_up_pass_at_1(tiny_model_dir: Path) -> None:  # noqa: F811
    info = json.loads((tiny_model_dir / "build_info.json").read_text())
    seed, count = info["seed"], info["warmup_reward_samples"]
    final = [generate_problem(random.Random(f"final-{seed}-{i}")) for i in range(count)]
    result = evaluate(tiny_model_dir, n=8, threads=1, tasks=final)
    # The warm-up drew one sample per problem: its own noise is √(p(1−p)/count) ≈ 0.03.
    noise = math.sqrt(info["warmup_reward"] * (1 - info["warmup_reward"]) / count)
    assert abs(result.pass_at[1] - info["warmup_reward"]) < 3 * noise + 0.01
    assert result.pass_at[1] <= result.pass_at[2] <= result.pass_at[4] <= result.pass_at[8] <= 1.0
    assert 0.0 <= result.greedy <= 1.0 and result.problems == count


def test_the_command_prints_a_table_and_a_json_line(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    command = [sys.executable, "-m", "sparkrl.cli", "eval", str(tiny_model_dir), "--problems", "32"]
    done = subprocess.run(
        [*command, "--n", "4", "--threads", "1"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    *table, last = done.stdout.strip().splitlines()
    row = json.loads(last)
    assert row["problems"] == 32 and row["n"] == 4 and {"greedy", "pass@1", "pass@4"} <= set(row)
    assert any(line.strip().startswith("pass@1") for line in table)
    missing = subprocess.run(
        [sys.executable, "-m", "sparkrl.cli", "eval", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and "no model here" in missing.stderr
    with pytest.raises(FileNotFoundError):
        resolve_model(tmp_path)
