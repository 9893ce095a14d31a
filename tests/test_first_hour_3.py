"""The first hour, third round (issue 36): each friction a new user hit, reproduced on the real stack.

(3) `--resume` reports this start as a fresh start does: not the start before's phases, not its last step
row, a start-up line while it starts, and a summary that splits start-up, training and paused time; the
console says when the run is paused, resumed and re-tuned. (4) The control clients on a run that ended
say why it ended, find the newest live run without `--run-dir`, and answer a misspelled name with the
names that are live-settable. (7) `sparkrl check` takes `up`'s flags and warns where a run would learn
nothing (n = 1) or end after a step or two (a small file: `--epochs`); a malformed line and a missing
model directory are called what they are.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import clean_env

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sparkrl.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=clean_env(),
    )


def _up(model: Path, run_dir: Path, *extra: str) -> list[str]:
    args = ["up", "--preset", "smoke", "--run-dir", str(run_dir), "--workers", "1", "--set", f"model={model}"]
    return [sys.executable, "-m", "sparkrl.cli", *args, *extra]


def _said(done: subprocess.CompletedProcess[str]) -> str:
    """stderr without the box typer draws errors in (it wraps their lines)."""
    return " ".join(re.sub("[│╭╮╰╯─]", " ", done.stderr).split())


@dataclass
class Resumed:
    run_dir: Path
    first: subprocess.CompletedProcess[str]  # the run to step 3
    output: str  # the resumed start's stdout and stderr, in order
    returncode: int
    launched_before: float  # the first start's launched_at
    clients: dict[str, subprocess.CompletedProcess[str]]  # what the clients said while it was live


def _steps_written(run_dir: Path) -> int:
    lines = (
        (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").is_file() else []
    )
    return max((json.loads(line)["step"] for line in lines if line.strip()), default=0)


def _run_resumed(model: Path, run_dir: Path) -> tuple[str, int, dict[str, subprocess.CompletedProcess[str]]]:
    """`up --resume` to step 30, paused for a few seconds and re-tuned at step 5 or later by the clients,
    which find the run without --run-dir (run from the directory above it, as a user in the checkout)."""
    up = subprocess.Popen(
        _up(model, run_dir, "--resume", "--set", "learner.max_steps=30", "--set", "prompts.count=400"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=clean_env(),
    )
    clients: dict[str, subprocess.CompletedProcess[str]] = {}
    try:
        deadline = time.monotonic() + 300
        while _steps_written(run_dir) < 5:
            assert up.poll() is None and time.monotonic() < deadline, "the resumed run never reached step 5"
            time.sleep(0.5)
        where = run_dir.parent  # the clients look for runs/*/ and ./*/ under the working directory
        clients["pause"] = _cli("pause", cwd=where)
        time.sleep(3)
        clients["set typo"] = _cli("set", "lrr=1e-4", cwd=where)
        clients["set"] = _cli("set", "lr=2e-4", cwd=where)
        clients["resume"] = _cli("resume", cwd=where)
        output, _ = up.communicate(timeout=300)
    finally:
        up.kill()
    return output, up.wait(), clients


@pytest.fixture(scope="module")
def resumed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Resumed]:  # noqa: F811
    run_dir = tmp_path_factory.mktemp("first-hour-3") / "run"
    first = subprocess.run(
        _up(tiny_model_dir, run_dir), capture_output=True, text=True, timeout=400, cwd=ROOT, env=clean_env()
    )
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    launched_before = json.loads((run_dir / "startup.json").read_text())["launched_at"]
    output, returncode, clients = _run_resumed(tiny_model_dir, run_dir)
    yield Resumed(run_dir, first, output, returncode, launched_before, clients)


@pytest.mark.slow
def test_3_a_resume_reports_itself_as_a_fresh_start(resumed: Resumed) -> None:
    assert resumed.returncode == 0, resumed.output[-3000:]
    lines = resumed.output.splitlines()
    # No row of the start before (it ended at step 3, checkpointed): the first step line is of step 4 or
    # later (the line shows the newest row when the launcher looks: steps 4 and 5 may both pass before).
    steps = [line for line in lines if line.startswith("step ")]
    assert steps and "/30 " in steps[0], steps[:3]
    assert int(steps[0].split()[1].split("/")[0]) >= 4, steps[:3]
    # While it starts, it says so (once per change off a terminal, not once a second), then its own phases.
    started = next(i for i, line in enumerate(lines) if line.startswith("started in "))
    starting = [line for line in lines[:started] if line.startswith("starting ")]
    assert starting and len(starting) < 8, starting
    assert lines.index(steps[0]) > started
    facts = json.loads((resumed.run_dir / "startup.json").read_text())
    assert facts["launched_at"] > resumed.launched_before and facts["to_first_step_s"] > 0
    assert f"started in {facts['to_first_step_s']:.1f} s" in lines[started]
    # The summary: this start's own start-up, training and paused time, which add up to its total.
    summary = json.loads((resumed.run_dir / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["steps_this_start"] == 27
    assert summary["startup_seconds"] is not None and summary["paused_seconds"] >= 2.5
    head = next(line for line in lines if line.startswith(f"run {resumed.run_dir}: 30 steps"))
    assert "(27 in this start) in " in head and "start-up" in head and "training" in head and "paused" in head


@pytest.mark.slow
def test_3_the_console_says_paused_resumed_and_retuned(resumed: Resumed) -> None:
    for name in ("pause", "set", "resume"):
        assert resumed.clients[name].returncode == 0, (name, resumed.clients[name].stderr)
    said = [line for line in resumed.output.splitlines() if line.startswith("control: ")]
    assert any(
        re.fullmatch(r"control: paused at step \d+ \(`sparkrl resume --run-dir .*` goes on\)", s)
        for s in said
    )
    assert any(re.fullmatch(r"control: learner set lr=0\.0002 at step \d+", s) for s in said), said
    assert any(re.fullmatch(r"control: resumed at step \d+ after \d+\.\d s paused", s) for s in said), said


@pytest.mark.slow
def test_4_clients_find_the_live_run_and_suggest_names(resumed: Resumed) -> None:
    said = _said(resumed.clients["pause"])
    assert "control API http://127.0.0.1:" in said and f"(the live run {resumed.run_dir.name})" in said
    typo = resumed.clients["set typo"]
    assert typo.returncode != 0
    message = _said(typo)
    assert "lrr: not a live-settable name (did you mean lr?)" in message, message
    assert "live-settable:" in message and " beta" in message and " temperature" in message


@pytest.mark.slow
def test_4_clients_on_an_ended_run_say_why_it_ended(resumed: Resumed) -> None:
    ended = f"the run in {resumed.run_dir} ended at step 30: learner.max_steps (30) reached"
    status = _cli("status", "--run-dir", str(resumed.run_dir))  # a question with an answer: exit 0
    assert status.returncode == 0 and status.stdout.startswith(ended), (status.stdout, status.stderr)
    for command in (["pause"], ["set", "lr=1e-4"]):
        done = _cli(*command, "--run-dir", str(resumed.run_dir))
        assert done.returncode == 1, (command, done.stdout, done.stderr)
        said = _said(done)
        assert ended in said and "--resume" in said and "cannot reach" not in said, said
    # Without --run-dir and no live run under the working directory: it says to pass one.
    done = _cli("status", cwd=resumed.run_dir.parent)
    assert done.returncode == 1 and "no live run" in _said(done) and "--run-dir" in _said(done)


def _check(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return _cli("check", "--preset", "demo", *args, cwd=cwd, timeout=120)


def test_7_check_takes_ups_flags(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(40)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = ["--model", str(tiny_model_dir), "--dataset", str(data), "--workers", "2", "--epochs", "3"]
    done = _check(*flags, "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    assert f"ok: model {tiny_model_dir}, math prompts" in done.stdout  # --dataset implies task math
    assert not (tmp_path / "run").exists()  # a check starts nothing


def test_7_check_warns_where_a_run_would_learn_nothing_or_end_at_once(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    one = _check("--set", f"model={tiny_model_dir}", "--set", "rollout.sampling.n=1")
    assert one.returncode == 0  # a warning, not a refusal
    assert "warning: rollout.sampling.n: 1 completion a prompt: every group's advantage is 0" in _said(one)
    batch = _check("--set", f"model={tiny_model_dir}", "--set", "rollout.sampling.n=1",
                   "--set", "learner.advantage.level=batch")  # fmt: skip
    assert "rollout.sampling.n" not in batch.stderr  # batch-level advantages learn from one sample
    data = tmp_path / "small.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(10))
    )
    small = _check("--model", str(tiny_model_dir), "--dataset", str(data))
    assert "warning: prompts.epochs: 10 prompts × 1 epoch(s) make 1 step(s) of up to 16 groups" in _said(
        small
    )
    assert "`--epochs N`" in _said(small)
    assert "prompts.epochs" not in _said(_check("--model", str(tiny_model_dir), "--dataset", str(data),
                                                "--epochs", "5"))  # fmt: skip


def test_7_a_malformed_line_and_a_missing_model_are_called_what_they_are(tmp_path: Path) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "1 + 1?", "answer": "2"}\n{"prompt": "2 + 2?", "answer": \n')
    done = _check("--dataset", str(data))
    said = _said(done)
    assert done.returncode == 2 and f"error: prompts.path: {data}:2: not JSON" in said, said
    assert "each line must be one JSON object" in said and "map the file's fields" not in said
    assert f"error: model: {tmp_path / 'none'} does not exist" in _said(
        _check("--model", str(tmp_path / "none"))
    )
    (tmp_path / "empty").mkdir()
    empty = _said(_check("--model", str(tmp_path / "empty")))
    assert "empty has no config.json (not a Hugging Face model directory)" in empty
