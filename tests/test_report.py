"""`sparkrl report`: charts and summary from a synthetic run directory (resume, live lr change, nulls, a cut
last line), with and without weights.jsonl, and the errors a user sees before the first step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sparkrl.report import write_report

CHARTS = ("reward", "heldout", "entropy", "reg_tokens", "sparks", "worker_versions", "sync_seconds")
T0 = 1_764_570_000.0


def _row(step: int, reward: float | None, *, t: float, **metrics: float | None) -> dict[str, Any]:
    return {
        "schema_version": 1,
        "step": step,
        "policy_version": step,
        "time": t,
        "metrics": {
            "loss/value": -0.004,
            "loss/entropy": 2.0 - step / 30,
            "loss/reg_tokens": float(step % 7),
            "explore/sparks": float(step % 5),
            "rollout/reward_mean": reward,
            "sync/seconds": 0.2 + step / 100,
            **metrics,
        },
        "worker_versions": {"worker-0": step - 1 if step > 1 else None, "worker-1": max(0, step - 2)},
        "hparams": {"lr": 0.0003 if step < 15 else 0.0001, "beta": 1.0, "loss": "lp_reg"},
        "top_sparks": {"+": 2, "7": step % 3},
    }


def _reward(step: int) -> float | None:
    return None if step == 2 else step / 30


def _write_metrics(run: Path) -> None:
    """Steps 1–20, then a resume from step 15 redoes 16–30; the first pass's 16–20 must not count."""
    rows = [_row(s, _reward(s), t=T0 + s) for s in range(1, 21)]
    rows[16]["metrics"]["rollout/reward_mean"] = 99.0  # step 17, first pass: superseded
    rows += [_row(s, _reward(s), t=T0 + 100 + s) for s in range(16, 31)]
    rows[6]["metrics"]["loss/entropy"] = None  # step 7: not finite
    del rows[8]["metrics"]["loss/reg_tokens"]  # step 9: not measured
    text = "".join(json.dumps(row) + "\n" for row in rows)
    (run / "metrics.jsonl").write_text(text + json.dumps(_row(31, 0.5, t=T0 + 200))[:40])


def _write_weights(run: Path) -> None:
    events = [{"version": 0, "outcome": "no_members", "seconds": None}]
    events += [{"version": v, "outcome": "ok", "seconds": 0.1 + v / 100} for v in range(1, 31) if v != 10]
    events.append({"version": 10, "outcome": "failed", "phase": "transfer", "error": "nccl timeout"})
    lines = []
    for event in events:
        base = {"epoch": 1, "announced_at": T0, "bytes": 1234, "buckets": 2, "members": ["worker-0"]}
        if event["outcome"] == "failed":
            base["dropped"] = {"worker-1": "did not join in time"}
        lines.append(json.dumps({**base, **event}))
    (run / "weights.jsonl").write_text("\n".join(lines) + "\n")


def _write_evals(run: Path) -> None:
    """The evaluator's records: versions 0, 10, 20, 30 (and 20 again: the last written counts)."""
    lines = []
    for version, p1 in ((0, 0.1), (10, 0.2), (20, 0.9), (30, 0.4), (20, 0.3)):
        record = {"policy_version": version, "time": T0 + version, "task": "countdown", "problems": 64}
        record |= {"n": 8, "temperature": 1.0, "greedy": p1, "pass_at": {"1": p1, "8": 2 * p1}, "seconds": 1}
        lines.append(json.dumps(record))
    (run / "eval.jsonl").write_text("\n".join(lines) + "\n")


def _assert_png(path: Path) -> None:
    import matplotlib.image

    data = path.read_bytes()
    assert data[:4] == b"\x89PNG" and len(data) > 1000, path
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200 and image.shape[2] in (3, 4)


def test_report_charts_and_summary(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    run = tmp_path / "run-a"
    run.mkdir()
    _write_metrics(run)
    _write_weights(run)
    _write_evals(run)
    report = write_report(run)
    assert report == run / "report" / "report.md"
    text = report.read_text()
    assert text.startswith("# Run report: run-a")
    for chart in CHARTS:
        assert f"]({chart}.png)" in text
        _assert_png(report.parent / f"{chart}.png")
    assert "no data" not in text
    assert plt.get_fignums() == []  # every figure closed

    early = (1 + 3 + 4 + 5 + 6) / 30 / 5  # first 6 of 30 steps; step 2's reward is null
    late = sum(range(25, 31)) / 30 / 6
    assert f"first 6 steps {early:.3f} → last 6 steps {late:.3f}" in text
    assert "lr: 0.0003 → 0.0001 at step 15" in text
    assert text.count("→") == 2  # the reward means and the one hparam change: beta/loss never changed
    assert "30 (steps 1–30; 5 rows superseded by a resume)" in text
    assert "| wall time | 2m 09s |" in text  # step 1 at T0+1, redone step 30 at T0+130
    assert "| final entropy | 1 |" in text
    assert "| final policy version | 30 |" in text
    assert "worker-0: 29, worker-1: 28" in text
    assert "ok 29, failed 1, no_members 1" in text
    assert "lr=0.0001" in text and "loss=lp_reg" in text
    assert "Skipped 1 unreadable line" in text  # the cut last line
    assert "version 30: pass@1 0.400, pass@8 0.800" in text  # the evaluator's last record
    # 30 rows × "+" 2 = 60; "7" counts step % 3 over steps 1-30 (the superseded first-pass rows excluded)
    assert f"| most frequent sparks | '+' 60, '7' {sum(s % 3 for s in range(1, 31))} |" in text


def test_report_without_weights_or_workers(tmp_path: Path) -> None:
    rows = [_row(s, _reward(s), t=T0 + s) for s in range(1, 11)]
    for row in rows:
        row["worker_versions"], row["top_sparks"] = {}, {}
        del row["metrics"]["loss/reg_tokens"], row["metrics"]["explore/sparks"]  # runs from before explore/
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    stale = tmp_path / "report" / "reg_tokens.png"
    stale.parent.mkdir()
    stale.write_bytes(b"old")

    text = write_report(tmp_path).read_text()
    _assert_png(tmp_path / "report" / "sync_seconds.png")
    assert "](sync_seconds.png)" in text and "`sync/seconds`" in text
    assert "_no data for reg_tokens_" in text and "_no data for worker_versions_" in text
    assert "_no data for sparks_" in text and "_no data for heldout_" in text
    assert "| most frequent sparks | — |" in text
    assert not stale.exists() and not (tmp_path / "report" / "worker_versions.png").exists()
    assert "| broadcasts | no weights.jsonl |" in text
    assert "| hyperparameter changes | none |" in text


def test_report_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_report(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"metrics\.jsonl not found"):
        write_report(tmp_path)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("")
    with pytest.raises(ValueError, match="the learner has not finished a step yet") as empty:
        write_report(tmp_path)
    assert f"no steps in {metrics}" in str(empty.value)
    metrics.write_text('{"schema_version": 1, "step": 1, "pol')
    with pytest.raises(ValueError, match=r"1 unreadable lines skipped"):
        write_report(tmp_path)


def test_import_is_cheap() -> None:
    code = "import sys, sparkrl.report; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_schedule_is_one_line_and_values_are_short() -> None:
    """A cosine lr moves at every step: one 'scheduled' line, not one change per step, and 6e-05 rather
    than 5.9999999999999995e-05; a live change among them is still its own line."""
    import math

    from sparkrl.proto import StepMetrics
    from sparkrl.report import hparam_changes

    rows = []
    for step in range(1, 41):
        row = _row(step, 0.5, t=T0 + step)
        row["hparams"] = {"lr": 6e-05 * 0.5 * (1 + math.cos(math.pi * (step - 1) / 40)), "beta": 1.0}
        row["hparams"]["beta"] = 1.0 if step < 30 else 0.5
        rows.append(StepMetrics.model_validate(row))
    assert hparam_changes(rows) == [
        "lr: scheduled, 6e-05 → 9.248e-08 over steps 1–40 (39 changes)",
        "beta: 1 → 0.5 at step 30",
    ]


def test_the_summary_and_the_report_say_the_same_wall_time(tmp_path: Path) -> None:
    """One figure, from the launch (the learner's config, written before the first spawn) to the last
    step row: the summary said '200 steps in 212.7s' where the report said 'wall time 1m 50s'."""
    import os

    from sparkrl.report import write_report
    from sparkrl.run_report import summarize

    run = tmp_path / "run"
    run.mkdir()
    rows = [_row(s, 0.5, t=T0 + 20 + 3 * s) for s in range(1, 11)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = run / "config" / "learner.yaml"
    config.parent.mkdir()
    config.write_text("{}\n")
    os.utime(config, (T0, T0))  # launched 23 s before the first step row, 50 s before the last
    said = "50.0 s (start-up 23.0 s, training 27.0 s)"
    assert summarize(run).splitlines()[0] == f"run {run}: 10 steps in {said}"
    assert f"| wall time | {said} |" in write_report(run).read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["wall_seconds"], summary["startup_seconds"]) == (50.0, 23.0)


def test_the_summary_and_the_report_tell_one_story_of_a_resumed_run(tmp_path: Path) -> None:
    """Both read the step rows through `run_files`: the redone steps of a resume count once, the reward
    means cover the same steps, and a value the run never recorded prints the same way."""
    from sparkrl.run_files import MISSING
    from sparkrl.run_report import summarize

    run = tmp_path / "run"
    run.mkdir()
    # Steps 1–7, then a resume redoes 6–7 with other rewards; no step records an entropy. Seven steps:
    # the first and last 20% are 2 steps each (rounded up): (0.1 + 0.2) / 2 and (0.6 + 0.7) / 2 = 0.650.
    rows = [_row(s, s / 10, t=T0 + s, **{"loss/entropy": None}) for s in range(1, 8)]
    rows[5]["metrics"]["rollout/reward_mean"] = rows[6]["metrics"]["rollout/reward_mean"] = 5.0
    rows += [_row(s, s / 10, t=T0 + 10 + s, **{"loss/entropy": None}) for s in (6, 7)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    text = summarize(run)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 7
    assert summary["reward_mean_first_20pct"] == pytest.approx(0.15)
    assert summary["reward_mean_last_20pct"] == pytest.approx(0.65)
    assert "reward mean: 0.150 (first 20% of steps) → 0.650 (last 20%)" in text
    assert f"final entropy: {MISSING}" in text
    report = write_report(run).read_text()
    assert "| reward mean | first 2 steps 0.150 → last 2 steps 0.650 |" in report
    assert f"| final entropy | {MISSING} |" in report


def test_the_summary_names_the_workers_versions_from_the_last_row_that_has_them(tmp_path: Path) -> None:
    """After Ctrl-C the workers stop before the learner's last row: it has no worker versions, the row
    before does ('workers none reported' said nothing useful)."""
    from sparkrl.run_report import summarize

    run = tmp_path / "run"
    run.mkdir()
    rows = [_row(s, 0.5, t=T0 + s) for s in range(1, 6)]
    rows[-1]["worker_versions"] = {}
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summarize(run)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["worker_versions"] == {"worker-0": 3, "worker-1": 2}
