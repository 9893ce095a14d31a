"""`sparkrl report RUN_DIR`: charts and a markdown summary of a finished (or running) run, from its files.

It reads only what the run leaves on disk (`metrics.jsonl`; `weights.jsonl` and `eval.jsonl` where there
are any), through `run_files`, so it works after the fleet is gone and on a copied run directory.
matplotlib is imported inside the functions that draw, so importing this module (e.g. to wire the CLI)
costs nothing.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkrl.proto.control import HparamValue
from sparkrl.proto.telemetry import EvalRecord, StepMetrics, SyncEvent
from sparkrl.run_files import (
    METRICS_FILE,
    MISSING,
    Steps,
    fmt,
    last_present,
    mean,
    read_evals,
    read_steps,
    read_sync_events,
    reward_halves,
    wall_text,
    wall_time,
    worker_key,
)

REPORT_DIR = "report"


@dataclass
class _Run:
    """What the report is drawn from: the step rows (one per step, in step order) and the run's other
    files."""

    run_dir: Path
    steps: Steps
    events: list[SyncEvent] | None  # None: no weights.jsonl
    evals: list[EvalRecord]  # the in-training evaluator's records (eval.jsonl), by version

    @property
    def rows(self) -> list[StepMetrics]:
        return self.steps.rows


def load_run(run_dir: Path | str) -> _Run:
    """The run's files, with errors that tell the user what to do when there is nothing to report."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(
            f"run directory {run_dir} does not exist: pass the RUN_DIR the learner writes metrics.jsonl to"
        )
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: is {run_dir} a run directory? The learner writes it as it finishes steps"
        )
    steps = read_steps(run_dir)
    if not steps.rows:
        note = f" ({steps.skipped} unreadable lines skipped)" if steps.skipped else ""
        raise ValueError(f"no steps in {path}{note}: the learner has not finished a step yet")
    return _Run(run_dir, steps, read_sync_events(run_dir), read_evals(run_dir))


# ── small helpers ─────────────────────────────────────────────────────────────────────────────────────


def _gaps(values: list[float | None] | list[int | None]) -> list[float]:
    """None → NaN, which matplotlib draws as a gap in the line."""
    return [math.nan if value is None else float(value) for value in values]


def _moving_average(values: list[float | None], window: int) -> list[float]:
    """Trailing mean over the present values of the last `window` steps (NaN where none are present)."""
    out = []
    for index in range(len(values)):
        average = mean(values[max(0, index - window + 1) : index + 1])
        out.append(math.nan if average is None else average)
    return out


def _cell(text: str) -> str:
    """A markdown table cell: a `|` in a worker id or hparam value would split the row."""
    return text.replace("|", "\\|")


# ── charts ────────────────────────────────────────────────────────────────────────────────────────────


@contextlib.contextmanager
def _figure(path: Path, panels: int = 1) -> Iterator[list[Any]]:
    """Axes to draw on; saved to `path` on success and closed either way, so a long session of reports
    does not pile up figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(panels, 1, figsize=(8, 3.2 + 2.6 * panels), sharex=True, squeeze=False)
    try:
        yield list(axes[:, 0])
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def _metric_chart(run: _Run, path: Path, name: str, title: str, ylabel: str) -> bool:
    """One metric against step; False (nothing drawn) when every step lacks it."""
    values = run.steps.series(name)
    if all(value is None for value in values):
        return False
    with _figure(path) as (ax,):
        ax.plot([row.step for row in run.rows], _gaps(values), marker=".")
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
    return True


def _reward_chart(run: _Run, path: Path) -> str | None:
    values = run.steps.series("rollout/reward_mean")
    if all(value is None for value in values):
        return None
    window = max(1, len(run.rows) // 20)
    steps = [row.step for row in run.rows]
    with _figure(path) as (ax,):
        ax.plot(steps, _gaps(values), marker=".", alpha=0.5, label="reward mean")
        if window > 1:
            ax.plot(steps, _moving_average(values, window), linewidth=2, label=f"{window}-step moving avg")
        ax.set(title="Rollout reward", xlabel="step", ylabel="mean reward per rollout")
        ax.grid(alpha=0.3)
        ax.legend()
    smoothing = f", with a {window}-step trailing moving average" if window > 1 else ""
    return f"Mean verifier reward of the rollouts each step trained on{smoothing}."


def _heldout_chart(run: _Run, path: Path) -> str | None:
    if not run.evals:
        return None
    versions = [e.policy_version for e in run.evals]
    n = run.evals[-1].n
    with _figure(path) as (ax,):
        for key, label in (("1", "pass@1"), (str(n), f"pass@{n}")):
            ax.plot(versions, [e.pass_at.get(key, math.nan) for e in run.evals], marker="o", label=label)
        ax.plot(versions, [e.greedy for e in run.evals], marker=".", linestyle="--", label="greedy")
        ax.set(title="Held-out evaluation", xlabel="policy version", ylabel="accuracy", ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend()
    last = run.evals[-1]
    return (
        f"The in-training evaluator (eval.jsonl): {last.problems} held-out {last.task} problems, {n} samples "
        f"at T={last.temperature:g} and a greedy answer, per evaluated version; the last, version "
        f"{last.policy_version}: pass@1 {last.pass_at['1']:.3f}, pass@{n} {last.pass_at[str(n)]:.3f}."
    )


def _entropy_chart(run: _Run, path: Path) -> str | None:
    if not _metric_chart(run, path, "loss/entropy", "Policy entropy", "entropy (nats per token)"):
        return None
    return "Mean token entropy of the policy per step: a collapse toward 0 means it stopped exploring."


def _reg_tokens_chart(run: _Run, path: Path) -> str | None:
    if not _metric_chart(run, path, "loss/reg_tokens", "Lp-Reg regularized tokens", "tokens per step"):
        return None
    return "Tokens the Lp-Reg term regularized each step (low-probability tokens pulled toward the proxy)."


def _sparks_chart(run: _Run, path: Path) -> str | None:
    if not _metric_chart(
        run, path, "explore/sparks", "Sparks", "low-probability tokens in correct responses"
    ):
        return None
    return (
        "Sampled tokens with p < 0.1 in responses judged correct, per step: the rare tokens Lp-Reg is meant "
        "to keep alive (`explore/low_prob_share` and `explore/below_minp_share` are in metrics.jsonl)."
    )


def _worker_versions_chart(run: _Run, path: Path) -> str | None:
    workers = sorted({worker for row in run.rows for worker in row.worker_versions}, key=worker_key)
    if not workers:
        return None
    steps = [row.step for row in run.rows]
    max_lag = 0
    with _figure(path, panels=2) as (held_ax, lag_ax):
        for worker in workers:
            held = [row.worker_versions.get(worker) for row in run.rows]
            lag = [
                None if v is None else row.policy_version - v for row, v in zip(run.rows, held, strict=True)
            ]
            max_lag = max([max_lag, *(value for value in lag if value is not None)])
            held_ax.plot(steps, _gaps(held), marker=".", label=worker)
            lag_ax.plot(steps, _gaps(lag), marker=".", label=worker)
        held_ax.plot(steps, [row.policy_version for row in run.rows], "k--", label="learner")
        held_ax.set(title="Policy version held by each worker", ylabel="policy version")
        lag_ax.set(title="Worker lag behind the learner", xlabel="step", ylabel="lag (versions)")
        for ax in (held_ax, lag_ax):
            ax.yaxis.get_major_locator().set_params(integer=True)  # versions are whole numbers
            ax.grid(alpha=0.3)
            if len(workers) <= 12:
                ax.legend(fontsize="small", ncol=min(4, len(workers) + 1))
    return (
        f"Top: the version each of {len(workers)} workers held (gaps: initial weights or not reporting) "
        f"against the learner's (dashed); bottom: versions each lagged behind, at most {max_lag}."
    )


def _sync_chart(run: _Run, path: Path) -> str | None:
    events = run.events or []
    ok = sorted((e for e in events if e.outcome == "ok" and e.seconds is not None), key=lambda e: e.version)
    failed = [e for e in events if e.outcome == "failed"]
    if not ok and not failed:
        if not _metric_chart(run, path, "sync/seconds", "Weight sync time", "sync time (s)"):
            return None
        return "Seconds the learner spent on weight sync each step (`sync/seconds`; no weights.jsonl)."
    with _figure(path) as (ax,):
        if ok:
            ax.plot([e.version for e in ok], [e.seconds for e in ok], marker="o", label="ok")
        if failed:
            ax.scatter([e.version for e in failed], [0.0] * len(failed), marker="x", c="red", label="failed")
        ax.set(title="Weight broadcasts", xlabel="policy version", ylabel="announce → all acked (s)")
        ax.grid(alpha=0.3)
        ax.legend()
    return (
        f"Seconds from announcement to every member's acknowledgement, per ok broadcast ({len(ok)}); "
        f"failed broadcasts ({len(failed)}) are the red crosses at 0."
    )


_CHARTS: tuple[tuple[str, str, Callable[[_Run, Path], str | None]], ...] = (
    ("reward", "`rollout/reward_mean`", _reward_chart),
    ("heldout", "eval.jsonl (set `eval.every`)", _heldout_chart),
    ("entropy", "`loss/entropy`", _entropy_chart),
    ("reg_tokens", "`loss/reg_tokens`", _reg_tokens_chart),
    ("sparks", "`explore/sparks`", _sparks_chart),
    ("worker_versions", "`worker_versions`", _worker_versions_chart),
    ("sync_seconds", "weights.jsonl or `sync/seconds`", _sync_chart),
)


# ── summary ───────────────────────────────────────────────────────────────────────────────────────────


def _hparam_text(value: HparamValue | None) -> str:
    if value is None:
        return MISSING
    return f"{value:.4g}" if isinstance(value, float) else str(value)  # 6e-05, not 5.9999999999999995e-05


SCHEDULED = 4  # a value that changes at more steps than this is a schedule, not a live change


def hparam_changes(rows: list[StepMetrics]) -> list[str]:
    """`lr: 0.0003 → 0.0001 at step 40` for every live change, so a curve's kink can be explained; a value
    that moves at many steps (an lr schedule) is summed up as one range instead of a change per step."""
    changes: dict[str, list[str]] = {}
    for previous, row in itertools.pairwise(rows):
        for key in sorted(previous.hparams.keys() | row.hparams.keys()):
            before, after = previous.hparams.get(key), row.hparams.get(key)
            if before != after or type(before) is not type(after):
                text = f"{key}: {_hparam_text(before)} → {_hparam_text(after)} at step {row.step}"
                changes.setdefault(key, []).append(text)
    out = []
    for key, lines in changes.items():
        if len(lines) <= SCHEDULED:
            out += lines
            continue
        values = [row.hparams.get(key) for row in rows]
        first, last = values[0], values[-1]
        out.append(
            f"{key}: scheduled, {_hparam_text(first)} → {_hparam_text(last)} over steps "
            f"{rows[0].step}–{rows[-1].step} ({len(lines)} changes)"
        )
    return out


def _broadcasts_text(events: list[SyncEvent] | None) -> str:
    if events is None:
        return "no weights.jsonl"
    counts = {outcome: sum(e.outcome == outcome for e in events) for outcome in ("ok", "failed")}
    if any(e.outcome == "no_members" for e in events):
        counts["no_members"] = sum(e.outcome == "no_members" for e in events)
    return ", ".join(f"{outcome} {count}" for outcome, count in counts.items())


def top_sparks(rows: list[StepMetrics], count: int = 10) -> list[tuple[str, int]]:
    """The run's most frequent sparks (each step row carries its own most frequent), decoded."""
    total: collections.Counter[str] = collections.Counter()
    for row in rows:
        total.update(row.top_sparks)
    return total.most_common(count)


def _summary(run: _Run) -> list[str]:
    """The table at the top: what a reader checks before looking at any chart."""
    first, last = run.rows[0], run.rows[-1]
    count, early, late = reward_halves(run.steps)
    superseded = run.steps.superseded
    resumed = f"; {superseded} rows superseded by a resume" if superseded else ""
    versions = ", ".join(
        f"{worker}: {'initial' if version is None else version}"
        for worker, version in sorted(last.worker_versions.items(), key=lambda item: worker_key(item[0]))
    )
    hparams = ", ".join(f"{key}={_hparam_text(value)}" for key, value in sorted(last.hparams.items()))
    table = [
        ("steps", f"{len(run.rows)} (steps {first.step}–{last.step}{resumed})"),
        ("wall time", wall_text(wall_time(run.run_dir, [row.time for row in run.rows]))),  # the summary's
        ("reward mean", f"first {count} steps {fmt(early, '.3f')} → last {count} steps {fmt(late, '.3f')}"),
        ("final entropy", fmt(last_present(run.steps.series("loss/entropy")))),
        ("final policy version", str(last.policy_version)),
        ("final worker versions", versions or MISSING),
        ("broadcasts", _broadcasts_text(run.events)),
        ("hyperparameters (last step)", hparams or MISSING),
        ("hyperparameter changes", "; ".join(hparam_changes(run.rows)) or "none"),
        ("most frequent sparks", ", ".join(f"{text!r} {n}" for text, n in top_sparks(run.rows)) or MISSING),
    ]
    lines = ["| | |", "|---|---|"]
    lines += [f"| {name} | {_cell(value)} |" for name, value in table]
    if run.steps.skipped:
        lines += [
            "",
            f"Skipped {run.steps.skipped} unreadable line(s) of metrics.jsonl (truncated or malformed).",
        ]
    return lines


# ── entry point ───────────────────────────────────────────────────────────────────────────────────────


def write_report(run_dir: Path | str) -> Path:
    """Write `RUN_DIR/report/report.md` and its PNGs; returns the path of `report.md`.

    A chart whose data is absent is skipped (and its stale PNG from an earlier report removed), and the
    report says so, so a half-instrumented run still gets a report.
    """
    run = load_run(run_dir)
    out = run.run_dir / REPORT_DIR
    out.mkdir(exist_ok=True)
    lines = [f"# Run report: {run.run_dir.resolve().name}", "", *_summary(run), "", "## Charts"]
    for stem, source, draw in _CHARTS:
        png = out / f"{stem}.png"
        caption = draw(run, png)
        if caption is None:
            png.unlink(missing_ok=True)
            lines += ["", f"_no data for {stem}_: {source} is absent or null throughout the run."]
        else:
            lines += ["", f"![{stem}]({png.name})", "", caption]
    report = out / "report.md"
    partial = out / "report.md.tmp"
    partial.write_text("\n".join(lines) + "\n", encoding="utf-8")
    partial.replace(report)
    return report
