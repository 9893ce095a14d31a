"""What the wide section reports after the current series: each earlier series (EARLIER), by the same
measures, and runs of this series recorded once before and run again (RERUNS), side by side.

A re-run has the same seed, settings and prompts as its first record; only what the series' code did
around the math changed (a faster fleet, say). What moves between the two is what an asynchronous run
moves with timing alone: a floor under any difference between losses."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from learning_quality import Run, Scale, table
from lq_dose import dose_line
from lq_records import RECORD_FILE, recorded_steps
from lq_settings import settings_line
from lq_verdict import verdict
from lq_wide_report import compared_runs, k_line, per_spec, read_record

if TYPE_CHECKING:
    from learning_quality_wide import Spec

EARLIER = {  # earlier series' records, beside the report: folder → what set that series apart
    "wide-v1": "the first series, without dynamic sampling (`learner.filter_groups: none`): a step trained "
    "the 256 groups sampled, however many of them scored alike",
}
RERUNS = {  # first records of runs this series ran again, beside the report: folder → why
    "wide-old-fleet": "these runs first ran on the fleet as it was before cf248e3 (its reward service, "
    "worker publishing and engine since made a late wide step ×0.46 the time, "
    "`bench/wide_late_bench.py`). The math, settings and prompts are the same, but on the faster fleet "
    "the workers outrun the learner early on, so a trained group lags more (staleness). They were run "
    "again on the fleet every other run of the series used, so that the verdict compares runs of one "
    "fleet; their first records are kept here",
}


def others(plan: list[Spec], scale: Scale, out: Path, records: Path) -> list[str]:
    """The lines after the series' own section (each starts with a blank line)."""
    return [*reruns(plan, scale, out, records), *earlier(plan, scale, out)]


def recorded(plan: list[Spec], records: Path) -> dict[Spec, Run]:
    """The runs of `plan` with a record in `records`."""
    return {spec: read_record(spec, records) for spec in plan if recorded_steps(records / spec.name)}


def sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def commit_of(record_dir: Path) -> str:
    """The commit the run's checkout was at (record.json), short; "?" where a record lacks it."""
    about = json.loads((record_dir / RECORD_FILE).read_text())
    return (about.get("recorded_at_commit") or "?")[:7]


def reruns(plan: list[Spec], scale: Scale, out: Path, records: Path) -> list[str]:
    """Each RERUNS folder's runs: the first record against the re-run's, where the re-run is in."""
    lines: list[str] = []
    n = scale.eval_n
    for folder, why in RERUNS.items():
        first_runs = recorded(plan, out / folder)
        if not first_runs:
            continue
        first = per_spec(first_runs, out / folder, n)
        again = per_spec({s: read_record(s, records) for s in first_runs if recorded_steps(records / s.name)},
                         records, n)  # fmt: skip
        lines += [
            "",
            f"### Runs recorded twice: {folder}/",
            "",
            f"{sentence(why)}. A run and its re-run share the seed, settings and prompts; what moves between "
            "them is what timing alone moves.",
            "",
            f"| run | checkout | pass@1 | pass@{n} | greedy | entropy kept | staleness | wall, all steps "
            "(min) |",
            "|---" * 8 + "|",
        ]
        for spec in first_runs:
            pairs = [(f"first ({commit_of(out / folder / spec.name)})", first[spec.name])]
            if spec.name in again:
                pairs.append((f"again ({commit_of(records / spec.name)})", again[spec.name]))
            for label, v in pairs:
                staleness = "—" if math.isnan(v["staleness"]) else f"{v['staleness']:.2f}"
                lines.append(
                    f"| {spec.name} | {label} | {v['pass@1']:.3f} | {v[f'pass@{n}']:.3f} | "
                    f"{v['greedy']:.3f} | {v['entropy_kept']:.2f} | {staleness} | {v['train_s'] / 60:.0f} |"
                )
            if spec.name not in again:
                lines.append(f"| {spec.name} | again: to come | | | | | | |")
        moved = [abs(again[name]["pass@1"] - first[name]["pass@1"]) for name in first if name in again]
        if moved:
            lines += ["", f"Held-out pass@1 moved by {max(moved):.3f} at most between a run and its re-run."]
    return lines


def earlier(plan: list[Spec], scale: Scale, out: Path) -> list[str]:
    """Each earlier series whose records are beside the report (EARLIER): its verdict, k and table, by
    the same measures as the series above."""
    lines: list[str] = []
    for folder, how in EARLIER.items():
        records = out / folder
        runs = recorded(plan, records)
        if not runs:
            continue
        stats = per_spec(runs, records, scale.eval_n)
        losses, seeds, at_preset, dose = compared_runs(runs, plan, scale, records)
        lines += [
            "",
            f"### An earlier series: {folder}/",
            "",
            f"{sentence(how)}; otherwise the preset above ({len(runs)} runs, records at `{folder}/RUN/`). "
            + verdict(stats, losses, seeds)
            + k_line(stats, at_preset)
            + dose_line(stats, dose, losses, scale.seeds[0])
            + settings_line({spec.name: (spec.seed, records / spec.name) for spec in runs}),
            "",
            table(stats, losses, seeds, scale.eval_n),
        ]
    return lines
