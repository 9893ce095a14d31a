"""A newcomer's first hour (issue 12): each problem a first-time user hit, reproduced and now passing.

Numbered as in the issue: (3) the README's math command, run as printed; (5) a finite dataset ends the
run with a message, stale groups (made again) shown; (8) a value means the same whichever way it
arrives; (9) `sparkrl prompts` never writes into a Redis it was not pointed at; (10) completions to read,
verdicts counted, what the model saw (the rendered prompt), and settings errors without library noise.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import clean_env

from sparkrl.proto import Prompt, decode_message
from sparkrl.services.common.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]
STATUSES = ("correct", "incorrect", "no_answer", "timeout", "error")
README_REDIS = "redis://127.0.0.1:6380/0"  # the address the README's example names
SYSTEM = "Answer with one expression."  # test 5's rollout.system_prompt


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    clean = clean_env()
    return subprocess.run(
        [sys.executable, "-m", "sparkrl.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=clean | (env or {}),
    )


def _readme_math_command() -> list[str]:
    """The README's `sparkrl prompts … math …` example, as a shell would split it."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"```bash\n\s*(sparkrl prompts [^`]*?prompts\.task=math[^`]*?)\n\s*```", text)
    assert match, "the README has no `sparkrl prompts … prompts.task=math` example"
    return shlex.split(match.group(1).replace("\\\n", " "))


def test_3_the_readme_math_command_runs_as_printed(redis_url: str) -> None:
    if not (ROOT.parent / "shared" / "data" / "math-eval").is_dir():
        pytest.skip("the README's command reads ../shared/data/math-eval/, not beside this checkout")
    command = _readme_math_command()
    assert command[:2] == ["sparkrl", "prompts"] and f"bus.url={README_REDIS}" in command
    # The one change: the README's Redis address becomes this test's private server.
    args = [arg.replace(README_REDIS, redis_url) for arg in command[1:]]
    done = _cli(*args, "--set", "prompts.count=5")
    assert done.returncode == 0, done.stderr
    assert "feeding" in done.stderr and "127.0.0.1" in done.stderr  # it says where it writes
    client = redis.Redis.from_url(redis_url)
    entries = client.xrange("sparkrl:prompts")
    assert len(entries) == 5
    prompt = decode_message(entries[0][1][b"payload"], Prompt)
    assert prompt.task == "math" and prompt.answer
    assert prompt.text.endswith("put your final answer within \\boxed{}.")  # braces as written
    client.close()


def test_3_templates_keep_their_braces_and_need_the_prompt() -> None:
    cfg = load_settings(None, ["prompts.template=Q: {prompt} A: \\boxed{}"])
    assert cfg.prompts.template == "Q: {prompt} A: \\boxed{}"
    with pytest.raises(ValueError, match="has no \\{prompt\\}"):
        load_settings(None, ["prompts.template=no placeholder"])


@pytest.mark.slow
def test_5_a_finite_dataset_ends_the_run_with_a_message(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    run_dir = tmp_path / "run"
    done = _cli(
        "up", "--preset", "smoke", "--run-dir", str(run_dir),
        "--set", f"model={tiny_model_dir}", "--set", "prompts.count=10", "--set", "learner.max_steps=1000",
        "--set", "learner.prompts_per_step=4", "--workers", "1", "--set", f"rollout.system_prompt={SYSTEM}",
        timeout=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # 10 prompts, 4 a step: two full steps and a last one of 2 groups (a group gone stale is made again).
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = sum(int(r["metrics"]["rollout/groups"]) for r in rows)
    stale = int(rows[-1]["metrics"]["rollout/dropped_stale_total"])
    assert trained == 10 and len(rows) <= 3
    assert "ended: the data ran out: all 10 prompts fed (1 epoch) were trained" in done.stdout
    assert f"groups gone stale: {stale}" in done.stdout
    assert (run_dir / "checkpoints" / f"step-{len(rows):06d}").is_dir()  # the last step is checkpointed
    ended = json.loads((run_dir / "ended.json").read_text())
    assert ended["step"] == len(rows) and ended["reason"].startswith("the data ran out")

    # (10) What the model says: a few completions per step, and the verdicts counted in every row.
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and {s["step"] for s in samples} <= {r["step"] for r in rows}
    assert all(s["prompt"].startswith("Use ") and isinstance(s["completion"], str) for s in samples)
    # What the model saw: the tiny model has no chat template, so the system prompt, a newline, the prompt.
    assert all(s["rendered_prompt"] == f"{SYSTEM}\n{s['prompt']}" for s in samples)
    assert all(s["status"] in STATUSES and s["reward"] in (0.0, 1.0) for s in samples)
    for row in rows:
        counted = sum(row["metrics"][f"rollout/status_{status}"] for status in STATUSES)
        assert counted == row["metrics"]["rollout/groups"] * 4  # smoke: 4 samples a group


def test_8_a_variant_switch_is_the_same_whichever_way_it_arrives(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("SPARKRL_")]:
        monkeypatch.delenv(key)
    by_set = load_settings("demo", ["learner.loss.name=grpo"]).learner.loss
    monkeypatch.setenv("SPARKRL_LEARNER__LOSS__NAME", "grpo")
    by_env = load_settings("demo").learner.loss
    assert by_set == by_env and by_env.name == "grpo"  # the preset's lp_reg fields went with lp_reg
    monkeypatch.delenv("SPARKRL_LEARNER__LOSS__NAME")
    # A field the user set for the variant they then switched away from is an error, in either order.
    for order in (
        ["learner.loss.rho=0.5", "learner.loss.name=grpo"],
        ["learner.loss.name=grpo", "learner.loss.rho=0.5"],
    ):
        with pytest.raises(ValueError, match="rho"):
            load_settings("demo", order)
    monkeypatch.setenv("SPARKRL_LEARNER__LOSS__RHO", "0.5")
    with pytest.raises(ValueError, match="rho"):
        load_settings("demo", ["learner.loss.name=grpo"])


def test_10_a_bad_setting_is_one_plain_line_per_problem() -> None:
    done = _cli("learner", "--preset", "demo", "--set", "learner.lr=-1", "--set", "learner.loss.name=nope")
    assert done.returncode == 2
    assert "learner.lr: Input should be greater than or equal to 0.0000000001 (got -1)" in done.stderr
    assert "errors.pydantic.dev" not in done.stderr and "Traceback" not in done.stderr


def test_9_prompts_refuses_a_redis_it_was_not_pointed_at() -> None:
    done = _cli("prompts", "--set", "prompts.count=3")
    assert done.returncode == 2 and "say which Redis" in done.stderr
