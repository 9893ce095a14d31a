"""`sparkrl eval`: the pass@k estimator against exact combinatorics, the tiny model reproducing the pass@1
its warm-up recorded (on the warm-up's own final problems, within that one-sample estimate's noise), the
held-out split at a preset's difficulty, math benchmark files through the reward service's verifier, and
the command's table, JSON line and errors."""

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

from sparkrl.evaluate import evaluate, heldout_countdown, local_scorer, math_tasks, pass_at_k, resolve_model
from sparkrl.proto import Prompt
from sparkrl.services.common.settings import CountdownSettings, PromptSettings
from sparkrl.services.common.tasks.countdown import format_prompt, generate_problem
from sparkrl.services.common.tasks.datasets import DatasetError, countdown_prompts

MATH_EVAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "math-eval"
needs_math_eval = pytest.mark.skipif(
    not MATH_EVAL.is_dir(), reason=f"{MATH_EVAL} not found (shared/ is not beside this checkout)"
)


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
    heldout = [p.task_data for p in heldout_countdown(64)]
    assert heldout != training and heldout == [p.task_data for p in heldout_countdown(64)]
    # fixed, and another stream than the feeder's; at a harder difficulty, the same seeds, harder problems
    harder = heldout_countdown(64, CountdownSettings(min_count=3, max_count=3))
    assert all(len(p.task_data["numbers"]) == 3 for p in harder) and harder[0].prompt_id == "heldout-000000"
    fed = countdown_prompts(PromptSettings(count=8, countdown=CountdownSettings(min_count=4, max_count=4)))
    assert all(len(p.task_data["numbers"]) == 4 for p in fed)
    with pytest.raises(ValueError, match="min_count 4 > max_count 3"):
        CountdownSettings(min_count=4, max_count=3)


def test_the_tiny_model_reproduces_its_warm_up_pass_at_1(tiny_model_dir: Path) -> None:  # noqa: F811
    info = json.loads((tiny_model_dir / "build_info.json").read_text())
    seed, count = info["seed"], info["warmup_reward_samples"]
    final = []
    for i in range(count):
        problem = generate_problem(random.Random(f"final-{seed}-{i}"))
        data = {"numbers": list(problem.numbers), "target": problem.target}
        final.append(
            Prompt(prompt_id=f"final-{i}", task="countdown", text=format_prompt(problem), task_data=data)
        )
    result = evaluate(tiny_model_dir, n=8, threads=1, tasks=final)
    # The warm-up drew one sample per problem: its own noise is √(p(1−p)/count) ≈ 0.03.
    noise = math.sqrt(info["warmup_reward"] * (1 - info["warmup_reward"]) / count)
    assert abs(result.pass_at[1] - info["warmup_reward"]) < 3 * noise + 0.01
    assert result.pass_at[1] <= result.pass_at[2] <= result.pass_at[4] <= result.pass_at[8] <= 1.0
    assert 0.0 <= result.greedy <= 1.0 and result.problems == count


@pytest.mark.slow
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
    said = " ".join(missing.stderr.replace("│", " ").split())  # rich wraps the error in a box
    assert missing.returncode == 2 and "no model here" in said, missing.stderr
    with pytest.raises(FileNotFoundError):
        resolve_model(tmp_path)


@needs_math_eval
def test_math_files_load_with_their_own_field_names_and_score_through_the_verifier() -> None:
    amc = math_tasks(MATH_EVAL / "amc23.jsonl", count=3)
    olympiad = math_tasks(MATH_EVAL / "olympiadbench.jsonl", count=2)  # question / final_answer
    minerva = math_tasks(MATH_EVAL / "minerva_math.jsonl", count=2)  # the answer is solution's last box
    assert [len(amc), len(olympiad), len(minerva)] == [3, 2, 2]
    assert all(p.task == "math" and p.text and p.answer for p in [*amc, *olympiad, *minerva])
    right = [f"so the answer is \\boxed{{{p.answer}}}" for p in amc]
    assert local_scorer(amc, right) == [True] * 3
    assert local_scorer(amc, ["\\boxed{-123456}", "no idea", ""]) == [False] * 3
    with pytest.raises(DatasetError, match="does not exist"):
        math_tasks(MATH_EVAL / "nope.jsonl")


@pytest.mark.slow
@needs_math_eval
def test_math_eval_of_the_tiny_model_runs_end_to_end(tiny_model_dir: Path) -> None:  # noqa: F811
    command = [sys.executable, "-m", "sparkrl.cli", "eval", str(tiny_model_dir), "--task", "math"]
    command += ["--data", str(MATH_EVAL / "math500.jsonl"), "--problems", "4", "--n", "2", "--threads", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout.strip().splitlines()[-1])
    # A countdown model answers no MATH problem; what counts is that 4 problems went through the verifier.
    assert (row["task"], row["problems"], row["n"]) == ("math", 4, 2) and 0 <= row["pass@1"] <= row["pass@2"]
    wrong = subprocess.run(
        [*command[:7], "--problems", "4"], capture_output=True, text=True, timeout=120
    )  # --task math without --data
    assert wrong.returncode == 2 and "--data FILE goes with --task math" in wrong.stderr
