"""Learning quality at the paper's tokens per step (`python bench/learning_quality.py --wide`).

    python bench/learning_quality.py --wide                # configs/explore-wide.yaml: 8 runs of 300 steps
    python bench/learning_quality.py --wide --record-only  # record the finished runs of runs/, start nothing
    python bench/learning_quality.py --wide --report-only  # the report section from the records alone
    python bench/learning_quality.py --wide --quick        # the smoke scale: the same pipeline in minutes

The runs, seed-major: Lp-Reg (the preset's ρ = 1%, κ = 2%), GRPO and KL-Cov (the best baseline of the
`explore` report) at seeds 1 and 2; then Lp-Reg's dose response on seed 1 at ρ = 3% and 10% (ρ = 1% is
lp_reg-s1). Every other setting is the preset's, the same for every loss. Held-out evaluation every 50
versions and on the final one (RUN/eval.jsonl), the step rows in RUN/metrics.jsonl, under
runs/learning-quality-wide/ (git-ignored: it stays on the machine that ran it).

Records, which outlive a checkout: a finished run (`sparkrl up` summarized it at its last step and an
evaluation of that version is in) is recorded right away at OUT/wide/RUN/ — docs/learning-quality/wide/RUN/
for the experiment, beside the report — as lq_records.py says: step rows (gzipped), evaluations, summary,
configs without their secrets; no weights, about 120 KB for a 300-step run. Committed, the records are
the experiment's state: a run whose record is there is done (no runs/ needed), so a fresh clone continues
where the last one stopped. Each pass first records any finished run under runs/ that has no record
(runs finished before records existed); `--record-only` does just that and exits, so a record can be
committed while the experiment goes on.

Resumable within a checkout: a run cut short goes on from its last checkpoint (`sparkrl up --resume`: the
journal replays the steps after it) or, without one, is redone.

The report is one section of OUT/report.md between markers (`WIDE_BEGIN` / `WIDE_END`): written anew on
each pass, the rest of the file kept. Its figures come from the records only; until every run is in
(`--report-only` writes it at any time), it says "n of 8 runs" and calls its verdict preliminary.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from learning_quality import ROOT, Scale, up_command
from lq_records import recorded_steps, remove_stale_partials, write_record
from lq_wide_others import EARLIER, RERUNS, others
from lq_wide_report import read_record, splice, wide_report

from sparkrl.run_files import SUMMARY_FILE, read_evals, read_steps

WIDE = Scale("explore-wide", steps=300, seeds=(1, 2), eval_every=50, eval_problems=256, eval_n=8)
WIDE_QUICK = Scale(
    "smoke",
    steps=4,
    seeds=(1,),
    eval_every=2,
    eval_problems=16,
    eval_n=4,
    overrides=("workers=1", "learner.skip_zero_advantage=false"),
)
WIDE_LOSSES = ("lp_reg", "grpo", "kl_cov")  # Lp-Reg, its baseline, the best baseline of the explore report
DOSE_RHOS = (0.03, 0.10)  # besides the preset's ρ = 1%, on the first seed
RUN_TIMEOUT_S = 6 * 3600  # one run is about an hour here
PROGRESS_EVERY_S = 60.0
RECORDS_DIR = "wide"  # in OUT, beside report.md: docs/learning-quality/wide/ for the experiment


@dataclass(frozen=True)
class Spec:
    """One run of the experiment: a loss, a seed and, for the dose response, Lp-Reg's ρ."""

    loss: str
    seed: int
    rho: float | None = None  # None: the preset's

    @property
    def name(self) -> str:
        return f"{self.loss}{'' if self.rho is None else f'-rho{self.rho:.2f}'}-s{self.seed}"

    @property
    def extra(self) -> tuple[str, ...]:
        return () if self.rho is None else (f"learner.loss.rho={self.rho}",)


def specs(losses: tuple[str, ...], seeds: tuple[int, ...], rhos: tuple[float, ...]) -> list[Spec]:
    """Seed-major, the dose runs last: a stopped experiment has every loss of its first seeds."""
    plan = [Spec(loss, seed) for seed in seeds for loss in losses]
    return plan + ([Spec("lp_reg", seeds[0], rho) for rho in rhos] if "lp_reg" in losses else [])


def finished(run_dir: Path, steps: int) -> bool:
    """`sparkrl up` summarized the run at its last step and the evaluator saw that version."""
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return False
    evals = read_evals(run_dir)
    return summary.get("steps", 0) >= steps and bool(evals) and evals[-1].policy_version >= steps


def run_spec(spec: Spec, scale: Scale, runs: Path) -> None:
    """Runs `spec` to its end: resumed from its last checkpoint, or from the start without one (or when
    the resume fails)."""
    run_dir = runs / spec.name
    start = "--resume" if (run_dir / "checkpoints" / "latest").exists() else "--overwrite"
    said = "started" + (" again from step 0 (no checkpoint)" if run_dir.is_dir() else "")
    print(f"  {spec.name}: {'resumed from its last checkpoint' if start == '--resume' else said}", flush=True)
    code = launch(spec, scale, runs, start)
    if code != 0 and start == "--resume":
        print(f"  {spec.name}: the resume failed (exit {code}); redone from step 0", flush=True)
        code = launch(spec, scale, runs, "--overwrite")
    if code != 0 or not finished(run_dir, scale.steps):
        log = runs / f"{spec.name}.log"
        tail = log.read_text()[-3000:]
        raise SystemExit(f"{spec.name} did not finish (exit {code}); {log} ends:\n{tail}")


def launch(spec: Spec, scale: Scale, runs: Path, start: str) -> int:
    """One `sparkrl up`, a progress line a minute; its exit code (SIGTERM after RUN_TIMEOUT_S)."""
    command = up_command(spec.loss, spec.seed, scale, runs / spec.name, spec.extra, start)
    return watch(command, spec.name, runs, scale.steps, RUN_TIMEOUT_S)


def watch(command: list[str], name: str, runs: Path, steps: int, timeout_s: float) -> int:
    """Runs `command` (a `sparkrl up` into runs/NAME, its output appended to runs/NAME.log), a progress
    line every PROGRESS_EVERY_S; its exit code (SIGTERM after `timeout_s`)."""
    run_dir, log_path = runs / name, runs / f"{name}.log"
    deadline = time.monotonic() + timeout_s
    with (
        log_path.open("a") as log,
        subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT) as child,
    ):
        while True:
            try:
                return child.wait(timeout=PROGRESS_EVERY_S)
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    child.send_signal(signal.SIGTERM)  # `sparkrl up` stops its stack tier by tier
                    return child.wait()
                print(progress(name, run_dir, steps), flush=True)


def progress(name: str, run_dir: Path, steps: int) -> str:
    rows = read_steps(run_dir).rows
    if len(rows) < 2:
        return f"  {name}: starting"
    recent = rows[-20:]
    per_step = (recent[-1].time - recent[0].time) / (len(recent) - 1)
    left = (steps - rows[-1].step) * per_step / 60
    return f"  {name}: step {rows[-1].step}/{steps}, {per_step:.1f} s a step, ~{left:.0f} min left"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options only `--wide` reads (learning_quality.py's parser holds the shared ones)."""
    parser.add_argument(
        "--rhos", nargs="*", type=float, default=None, help="--wide: the dose-response ρ (default 0.03 0.1)."
    )
    parser.add_argument(
        "--record-only", action="store_true",
        help="--wide: record the finished runs under --runs that have no record yet, then exit (nothing "
        "is started; the report is left as it is).",
    )  # fmt: skip


def about(spec: Spec, scale: Scale) -> dict[str, Any]:
    """What record.json says of the run besides its files: its spec and the experiment's scale."""
    scale_said = {**scale.__dict__, "seeds": list(scale.seeds), "overrides": list(scale.overrides)}
    return {
        "run": spec.name,
        "spec": {"loss": spec.loss, "seed": spec.seed, "rho": spec.rho},
        "scale": scale_said,
    }


def record_finished(plan: list[Spec], scale: Scale, runs_dir: Path, records: Path) -> None:
    """Records every run of `plan` finished under `runs_dir` that has no record yet."""
    for partial in remove_stale_partials(records):
        print(f"removed {partial}: a record's write that never finished", flush=True)
    for spec in plan:
        run_dir, record_dir = runs_dir / spec.name, records / spec.name
        if recorded_steps(record_dir) is None and finished(run_dir, scale.steps):
            if write_record(run_dir, record_dir, about(spec, scale)):
                print(f"  {spec.name}: recorded from {run_dir} at {record_dir}", flush=True)


def done(spec: Spec, scale: Scale, records: Path) -> bool:
    """The run's record is in, at this scale's steps (a shorter one is an error, not a run to redo: its
    folder would stand in the way of the new record)."""
    steps = recorded_steps(records / spec.name)
    if steps is not None and steps < scale.steps:
        raise SystemExit(
            f"{records / spec.name} records {steps} steps, this experiment runs {scale.steps}: move the "
            "record away (git rm -r) to run it again"
        )
    return steps is not None


def run_plan(plan: list[Spec], todo: list[Spec], scale: Scale, runs_dir: Path, records: Path) -> None:
    """The runs of `todo`, in plan order, each recorded as soon as it finishes."""
    started = time.perf_counter()
    if todo:
        runs_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "sparkrl.cli", "build-tiny-model", "--out", ".cache"], cwd=ROOT,
                       check=True, capture_output=True)  # fmt: skip
    for index, spec in enumerate(plan, 1):
        at = f"[{index}/{len(plan)}] {spec.name}"
        if spec not in todo:
            print(f"{at}: recorded before, kept ({records / spec.name})", flush=True)
            continue
        print(at, flush=True)
        run_spec(spec, scale, runs_dir)
        write_record(runs_dir / spec.name, records / spec.name, about(spec, scale))
        final, minutes = read_evals(runs_dir / spec.name)[-1], (time.perf_counter() - started) / 60
        print(f"{at}: done, version {final.policy_version} pass@1 {final.pass_at['1']:.3f}, recorded at "
              f"{records / spec.name}, {minutes:.1f} min so far", flush=True)  # fmt: skip


def run_wide(args: argparse.Namespace) -> None:
    """`learning_quality.py --wide`: the finished runs recorded, the runs not recorded yet run (unless
    `--record-only` / `--report-only`), then the report section from the records."""
    scale = WIDE_QUICK if args.quick else WIDE
    seeds = tuple(range(1, args.seeds + 1)) if args.seeds else scale.seeds
    scale = Scale(**{**scale.__dict__, "seeds": seeds, "steps": args.steps or scale.steps})
    losses = tuple(args.losses or WIDE_LOSSES)
    rhos = DOSE_RHOS if args.rhos is None else tuple(args.rhos)
    name = "runs/learning-quality-wide" + ("-quick" if args.quick else "")
    runs_dir = args.runs or ROOT / name
    out = args.out or (ROOT / name / "report" if args.quick else ROOT / "docs/learning-quality")
    records = out / RECORDS_DIR
    if args.record_only and args.report_only:
        raise SystemExit("--record-only and --report-only: choose one")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    plan = specs(losses, seeds, rhos)
    record_finished(plan, scale, runs_dir, records)
    todo = [spec for spec in plan if not done(spec, scale, records)]
    if args.record_only:
        kept = ", ".join(spec.name for spec in plan if spec not in todo) or "none"
        print(f"{len(plan) - len(todo)} of {len(plan)} runs recorded at {records}: {kept}", flush=True)
        return
    if todo and args.report_only:
        said = f"not finished: {', '.join(s.name for s in todo)}"
        if len(todo) == len(plan) and not any((out / f).is_dir() for f in (*EARLIER, *RERUNS)):
            raise SystemExit(f"no run recorded in {records} yet; {said} (run without --report-only)")
        print(f"{said}: the section says {len(plan) - len(todo)} of {len(plan)} runs", flush=True)
    if not args.report_only:
        run_plan(plan, todo, scale, runs_dir, records)
    runs = {
        spec: read_record(spec, records) for spec in plan if recorded_steps(records / spec.name) is not None
    }
    out.mkdir(parents=True, exist_ok=True)
    section, stats = wide_report(runs, plan, scale, records, out, args.quick)
    splice(out / "report.md", "\n".join([section, *others(plan, scale, out, records)]))
    print(json.dumps({"report": str(out / "report.md"), "records": str(records), "runs": stats}))
