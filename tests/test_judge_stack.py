"""Issue 49, for real: `sparkrl up` serves the tiny model with `vllm serve` (from .venv-vllm) as an LLM judge
on loopback, and the run's reward is a mix of that judge's grade and a reward model's score (a sequence
classifier built here, run by the reward service): every group trained once, the judge's replies in the
samples' details, and its API key in no log, config copy, status answer or page.

The judge's grades are noise (a countdown model asked to grade); the path is what is tested: HTTP to a
real OpenAI-compatible server, its replies parsed or `unparseable` (named, neutral in their group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from _faults import History
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import clean_env
from test_reward_mixing import _tiny_classifier

from sparkrl.services.common.tasks import countdown

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
KEY = "sk-judge-test-7f3a9c0e5d"
# The tiny model has no chat template: vLLM's chat route needs one (each message's text, one a line).
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
MIX = {"judged": {"combine": "weighted", "parts": [{"verifier": "judge"}, {"verifier": "reward_model"}]}}


def _questions(path: Path, count: int) -> Path:
    """Countdown problems as a file of open questions (the tiny model answers them as it learned to)."""
    import random

    rng = random.Random(0)
    rows = [{"prompt": countdown.format_prompt(countdown.generate_problem(rng))} for _ in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _live_views(run_dir: Path) -> str:
    """What a user sees of the live run: the page and the control service's read routes."""
    control = yaml.safe_load((run_dir / "config" / "control.yaml").read_text())["control"]["url"]
    token = (run_dir / "control-token").read_text().strip()
    headers = {"Authorization": f"Bearer {token}"}
    seen = [httpx.get(f"{control}/", timeout=10).text]
    for route in ("status", "workers", "metrics"):
        seen.append(httpx.get(f"{control}/api/v1/{route}", headers=headers, timeout=10).text)
    return "\n".join(seen)


def _workers_judge(run_dir: Path) -> list[dict[str, Any]]:
    """The page's judge panel's data: each live worker's `judge` in the control service's workers view."""
    control = yaml.safe_load((run_dir / "config" / "control.yaml").read_text())["control"]["url"]
    token = (run_dir / "control-token").read_text().strip()
    view = httpx.get(
        f"{control}/api/v1/workers", headers={"Authorization": f"Bearer {token}"}, timeout=10
    ).json()
    return [w["judge"] for w in view["workers"] if w["judge"]]


def test_a_run_rewarded_by_a_vllm_judge_and_a_reward_model_trains_every_group_once(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    if not VLLM_PYTHON.is_file():
        pytest.fail(f"{VLLM_PYTHON} is missing: `make vllm-env` (make test does it)")
    run_dir, template = tmp_path / "run", tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    serve_args = [
        "--chat-template",
        str(template),
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(1 << 28),
    ]
    overrides = [
        f"model={tiny_model_dir}",
        f"prompts.path={_questions(tmp_path / 'questions.jsonl', 16)}",
        "prompts.task=judged",
        f"reward.mixes={json.dumps(MIX)}",
        f"reward.judge.serve={tiny_model_dir}",
        f"reward.judge.serve_python={VLLM_PYTHON}",
        f"reward.judge.serve_args={json.dumps(serve_args)}",
        "reward.judge.api_key_env=JUDGE_KEY",
        "reward.judge.rubric={question} {completion} =",  # short: the tiny model's context is 256
        "reward.judge.score_range=[0, 1000]",
        "reward.judge.max_tokens=8",
        f"reward.model.path={_tiny_classifier(tmp_path / 'rm')}",
        "learner.max_steps=2",
    ]
    command = [sys.executable, "-m", "sparkrl.cli", "up", "--preset", "smoke", "--run-dir", str(run_dir)]
    env = clean_env() | {"JUDGE_KEY": KEY}
    up = subprocess.Popen(
        [*command, *(a for o in overrides for a in ("--set", o))],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 400
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.is_file() and metrics.stat().st_size > 0):
            assert up.poll() is None, "sparkrl up ended before its first step"
            assert time.monotonic() < deadline, "no step within 400 s"
            time.sleep(0.5)
        live = _live_views(run_dir)
        spent = []  # the page's judge panel: what the judge spent on the worker's groups (its heartbeat's)
        while not spent and up.poll() is None and time.monotonic() < deadline:
            spent = _workers_judge(run_dir)
            time.sleep(0.5)
        output, _ = up.communicate(timeout=400)
    finally:
        up.kill()
    assert up.returncode == 0, output[-4000:]
    rows = [json.loads(line)["metrics"] for line in metrics.read_text().splitlines()]
    assert len(rows) == 2
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["detail"].startswith("judge: ") for s in samples), samples[:2]
    assert all("reward_model: " in s["detail"] and "reward model: " in s["detail"] for s in samples)
    judged = [s for s in samples if s["status"] != "unparseable"]
    assert all(s["status"] in ("correct", "incorrect") and 0 <= s["score"] <= 1 for s in judged)
    statuses = {key: value for row in rows for key, value in row.items() if key.startswith("rollout/status_")}
    assert statuses, rows[0]
    history = History.read(run_dir)  # every group trained once, and the checkpoint agrees
    assert sorted(history.steps) == [1, 2] and len(history.group_ids) == len(set(history.group_ids))
    state = json.loads((run_dir / "checkpoints" / "latest" / "trainer_state.json").read_text())
    assert (state["step"], state["groups_trained"]) == (2, len(history.group_ids))
    assert spent and spent[0]["calls"] > 0 and sum(spent[0]["items"].values()) > 0, spent
    judge_log = (run_dir / "logs" / "judge.log").read_text()
    assert "POST /v1/chat/completions" in judge_log  # the reward service called the served judge
    written = [
        p.read_text(errors="replace")
        for p in run_dir.rglob("*")
        if p.is_file() and p.stat().st_size < 50 << 20
    ]
    assert KEY not in output and KEY not in live and not any(KEY in text for text in written)
    assert os.environ.get("JUDGE_KEY") != KEY  # the key lived in the launcher's environment only
