"""A finite data set on one real `sparkrl up` (issue 23, items 2, 3 and 4): 20 prompts (and 2 too long
for `rollout.max_prompt_tokens`) × 2 epochs, exactly on-policy (max_staleness 0, so groups go stale).

(2) While it runs (held paused, so it surely is live), a second `up` on its directory is refused with
`--resume`, `--overwrite` and neither, saying it is live and who runs it; `sparkrl dead` reads its live
Redis and `sparkrl report` says it is live. The run then ends untouched. (3) Every one of the 40 prompts
is trained once, none dropped: a group gone stale is made again; `ended.json` counts trained, dropped and
dead-lettered prompts, and the progress line's total is what the data allows. (4) Once it is over, `sparkrl
dead` answers from what it left (its private Redis is gone), and the summary counts the dead letters.
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
from _faults import History
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import clean_env

from sparkrl.proto import group_id_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SHORT, LONG = 20, (5, 15)  # 20 prompts that fit; rows 5 and 15 are too long and get dead-lettered
EPOCHS = 2


@dataclass
class FinishedRun:
    run_dir: Path
    pid: int  # of the `sparkrl up` that ran it
    returncode: int
    stdout: str
    probes: dict[str, subprocess.CompletedProcess[str]]  # what was tried while it was live


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sparkrl.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=clean_env(),
    )


def _said(done: subprocess.CompletedProcess[str]) -> str:
    """stderr without the terminal box typer draws errors in (which wraps their lines)."""
    return " ".join(re.sub("[│╭╮╰╯─]", " ", done.stderr).split())


def _dataset(path: Path) -> Path:
    rows = [{"prompt": f"What is {i} + {i + 3}?", "answer": str(2 * i + 3)} for i in range(SHORT)]
    for index in LONG:
        rows.insert(index, {"prompt": "What is the sum of " + " + ".join(["1"] * 60) + "?", "answer": "60"})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _wait(what: str, condition: object, up: subprocess.Popen[str], run_dir: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if up.poll() is not None or time.monotonic() > deadline:
            up.kill()
            logs = "\n".join(
                f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                for log in sorted((run_dir / "logs").glob("*.log"))
            )
            pytest.fail(f"gave up waiting for {what} (sparkrl up exited {up.poll()})\n{logs}")
        time.sleep(0.5)


def _probe_while_live(run_dir: Path, data: Path) -> dict[str, subprocess.CompletedProcess[str]]:
    again = ["up", "--preset", "smoke", "--run-dir", str(run_dir), "--dataset", str(data)]
    return {
        "up": _cli(*again),
        "up --resume": _cli(*again, "--resume"),
        "up --overwrite": _cli(*again, "--overwrite"),
        "dead": _cli("dead", "--run-dir", str(run_dir)),
        "report": _cli("report", str(run_dir)),
    }


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[FinishedRun]:  # noqa: F811
    base = tmp_path_factory.mktemp("finite")
    run_dir, data = base / "run", _dataset(base / "data.jsonl")
    out = (base / "up.out").open("w+")
    up = subprocess.Popen(
        [sys.executable, "-m", "sparkrl.cli", "up", "--preset", "smoke", "--run-dir", str(run_dir),
         "--dataset", str(data), "--epochs", str(EPOCHS), "--workers", "1",
         "--set", f"model={tiny_model_dir}", "--set", "learner.max_steps=1000",
         "--set", "learner.max_staleness=0", "--set", "rollout.max_prompt_tokens=48",
         "--set", "prompts.template={prompt}"],
        stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=clean_env(),
    )  # fmt: skip
    try:
        metrics = run_dir / "metrics.jsonl"  # the file is made at start: the first row is what tells
        _wait(
            "the first step",
            lambda: metrics.is_file() and metrics.read_text().strip() != "",
            up,
            run_dir,
            600,
        )
        paused = _cli("pause", "--run-dir", str(run_dir))  # live for as long as the probes take
        assert paused.returncode == 0, paused.stderr
        probes = _probe_while_live(run_dir, data)
        resumed = _cli("resume", "--run-dir", str(run_dir))
        assert resumed.returncode == 0, resumed.stderr
        _wait("the run to end", lambda: up.poll() is not None, up, run_dir, 900)
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait(60)
    out.seek(0)
    yield FinishedRun(run_dir, up.pid, up.returncode, out.read(), probes)
    out.close()


def test_2_a_live_run_directory_is_never_joined_twice_nor_deleted(finished_run: FinishedRun) -> None:
    run = finished_run
    for name, words in (
        ("up", "is live"),
        ("up --resume", "--resume joins a run only once it has stopped"),
        ("up --overwrite", "--overwrite never deletes a live run"),
    ):
        done = run.probes[name]
        assert done.returncode == 2, f"{name}: {done.stdout}{done.stderr}"
        said = _said(done)
        assert f"{run.run_dir} is live: sparkrl up (pid {run.pid} on host " in said and words in said, said
        assert "sparkrl up: preset" not in done.stdout  # nothing was started beside it
    dead = run.probes["dead"]
    assert dead.returncode == 0 and "dead letters in sparkrl:dead" in dead.stdout  # its live Redis
    report = run.probes["report"]
    assert report.returncode == 0 and f"{run.run_dir} is live (sparkrl up (pid {run.pid}" in report.stderr
    # The live run was neither joined nor deleted: it ended as it would have alone.
    assert run.returncode == 0, run.stdout[-3000:]
    assert "ended: the data ran out" in run.stdout


def test_3_twenty_prompts_two_epochs_train_forty_groups_none_dropped(finished_run: FinishedRun) -> None:
    run = finished_run
    long_ids = {f"data-{index:06d}" for index in LONG}
    fed = [f"data-{i:06d}" for i in range(SHORT + len(LONG))]
    expected = {
        group_id_for(p + (f"@{e}" if e else "")) for p in fed if p not in long_ids for e in range(EPOCHS)
    }
    trained = History.read(run.run_dir).group_ids
    assert len(trained) == len(set(trained)) == SHORT * EPOCHS and set(trained) == expected
    ended = json.loads((run.run_dir / "ended.json").read_text())
    counts = ended["prompts"]
    assert (counts["fed"], counts["trained"], counts["dropped"]) == (44, 40, 0)
    assert (counts["dead_lettered_prompts"], counts["dead_lettered_groups"]) == (4, 0)
    assert ended["reason"].startswith(
        "the data ran out: of the 44 prompts fed (2 epochs), 40 were trained, 4 dead-lettered (4 prompts by "
        "the workers, 0 groups by the learner;"
    )
    assert "and 0 dropped (neither trained nor dead-lettered)" in ended["reason"]
    # The progress line's total is what the data allows (11 steps at most: 44 prompts, 4 a step), never
    # learner.max_steps (1000).
    totals = [int(m.group(1)) for m in re.finditer(r"^step \d+/(\d+) \|", run.stdout, re.MULTILINE)]
    assert totals and max(totals) <= 11, totals


def test_4_dead_on_an_ended_run_answers_from_what_it_left(finished_run: FinishedRun) -> None:
    run = finished_run
    done = _cli("dead", "--run-dir", str(run.run_dir))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    path = run.run_dir / "dead_letters.jsonl"
    assert lines[0] == f"the run in {run.run_dir} is over: 4 dead letters as it left them ({path}):"
    assert sum("over rollout.max_prompt_tokens (48)" in line for line in lines) == 4
    assert {line.split()[3] for line in lines[1::2]} == {"data-000005", "data-000015", "data-000005@1",
                                                         "data-000015@1"}  # fmt: skip
    assert "reconnect" not in done.stderr and "Traceback" not in done.stderr
    requeue = _cli("dead", "--run-dir", str(run.run_dir), "--requeue", lines[1].split()[0])
    assert requeue.returncode == 1 and "is over and its Redis with it" in requeue.stderr
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["dead_lettered"] == {"prompts": 4, "groups": 0}
    # The start-up, phase by phase from the heartbeats, said with the first step and kept in the summary.
    startup = summary["startup"]
    assert list(startup["learner"]) == ["imports", "comm", "model", "engine", "ready"]
    assert startup["workers"] and all(
        list(p) == ["imports", "engine", "ready"] for p in startup["workers"].values()
    )
    assert startup["learner"]["imports"] > 0.5 and startup["to_first_step_s"] > startup["learner"]["imports"]
    said = r"^started in [\d.]+ s \| learner: imports [\d.]+ s, comm [\d.]+ s, model"
    assert re.search(said, run.stdout, re.MULTILINE)
    assert "dead-lettered: 4 prompts (by the workers), 0 groups (by the learner)" in run.stdout
