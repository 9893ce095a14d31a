"""The issue's fairness rule checked from the records: nothing tuned for one loss that the others did not
get, and every loss of a seed fed the same prompts. Each record keeps the settings every service ran with
(`config/*.yaml`, lq_records.py); this compares them setting by setting across a series' runs.

What may differ, and why:
- the loss (`learner.loss.*`): what the experiment compares;
- the seeds (`learner.seed`, `prompts.seed`): one pair per seed, which every run of that seed must share
  (the prompt stream is drawn from `prompts.seed`, so equal seeds and equal `prompts.*` settings mean the
  same prompts for every loss);
- where a run's services met (addresses, ports, paths: `ADDRESS_KEYS`); the model by its folder's name;
- work-only settings (`WORK_ONLY`): how much work a step does for the same gradient, each proven equal by
  a gradient-equality test.

Anything else that differs is named in the report as a difference. A setting recorded by only some runs
(the code gained it between them) is counted, not compared. What settings cannot show, how far off-policy
each run trained (a later checkout's faster fleet shifts it), `staleness_line` gives from the step rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ADDRESS_KEYS = frozenset({"url", "port", "host", "run_dir", "token_file", "secret"})
SEED_KEYS = frozenset({"learner.seed", "prompts.seed"})
LOSS_PREFIX = "learner.loss."
# Same gradient, less work (tests/test_work_skipping.py, tests/test_prompt_sharing.py, tests/test_packing.py).
WORK_ONLY = frozenset({
    "learner.skip_zero_advantage",
    "learner.entropy_of_skipped",
    "learner.pack_length",
    "learner.share_prompts",
    "learner.micro_batch_tokens",
})  # fmt: skip
ABSENT = "<absent>"


@dataclass
class Comparison:
    """A series' settings across its runs."""

    compared: int = 0  # settings every run recorded and the comparison applies to
    seeds_shared: bool = True  # every run of a seed has that seed's learner.seed and prompts.seed
    work_only: dict[str, dict[str, Any]] = field(default_factory=dict)  # setting → value per run
    differing: dict[str, dict[str, Any]] = field(default_factory=dict)  # setting → value per run
    partial: set[str] = field(default_factory=set)  # recorded by some runs only


def flatten(value: Any, at: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` → `{"a.b": 1}`; lists stay values."""
    if not isinstance(value, dict):
        return {at: value}
    out: dict[str, Any] = {}
    for key, inner in value.items():
        out |= flatten(inner, f"{at}.{key}" if at else str(key))
    return out


def run_settings(record_dir: Path) -> dict[str, Any]:
    """Every setting of one record, keyed `file:setting` (`learner.yaml:learner.lr`), where services'
    files are compared with the same file of the other runs."""
    settings: dict[str, Any] = {}
    for path in sorted((record_dir / "config").glob("*.yaml")):
        flat = flatten(yaml.safe_load(path.read_text()) or {})
        settings |= {f"{path.name}:{key}": value for key, value in flat.items()}
    return settings


def compare(records: dict[str, tuple[int, Path]]) -> Comparison:
    """Compare the runs `records` (name → (seed, record folder))."""
    settings = {name: run_settings(folder) for name, (_, folder) in records.items()}
    seeds = {name: seed for name, (seed, _) in records.items()}
    result = Comparison()
    for key in sorted(set().union(*settings.values())):
        setting = key.split(":", 1)[1]
        leaf = setting.rsplit(".", 1)[-1]
        if leaf in ADDRESS_KEYS or setting.startswith(LOSS_PREFIX):
            continue
        values = {name: s.get(key, ABSENT) for name, s in settings.items()}
        if setting == "model":
            values = {name: Path(str(v)).name for name, v in values.items()}
        if ABSENT in values.values():
            result.partial.add(setting)
            continue
        result.compared += 1
        if setting in SEED_KEYS:
            by_seed: dict[int, set[str]] = {}
            for name, value in values.items():
                by_seed.setdefault(seeds[name], set()).add(repr(value))
            result.seeds_shared &= all(len(v) == 1 for v in by_seed.values())
            continue
        if len({repr(v) for v in values.values()}) > 1:
            (result.work_only if setting in WORK_ONLY else result.differing)[setting] = values
    return result


def _values(values: dict[str, Any]) -> str:
    """`a: 1, b: 1, c: 2` as `1 (a, b); 2 (c)`."""
    by_value: dict[str, list[str]] = {}
    for name, value in values.items():
        by_value.setdefault(repr(value), []).append(name)
    return "; ".join(f"{value} ({', '.join(names)})" for value, names in by_value.items())


def settings_line(records: dict[str, tuple[int, Path]]) -> str:
    """The report's sentence on what the runs shared, from their recorded settings."""
    if len(records) < 2:
        return ""
    c = compare(records)
    text = (
        f" **Same settings for every loss, checked** from the {len(records)} records' `config/*.yaml` "
        f"(bench/lq_settings.py): of {c.compared} settings, "
    )
    if c.differing:
        listed = ". ".join(f"`{k}`: {_values(v)}" for k, v in c.differing.items())
        n = len(c.differing)
        text += f"**{n} differ{'s' if n == 1 else ''} besides the loss**: {listed}."
    else:
        text += "none differs besides the loss (`learner.loss.*`), the seeds and where the services met."
    text += (
        " Every run of a seed has that seed's `learner.seed` and `prompts.seed`, so every loss of a seed is "
        "fed the same prompt stream."
        if c.seeds_shared
        else " **Runs of the same seed do not share their seeds** (`learner.seed`, `prompts.seed`)."
    )
    if c.work_only:
        listed = "; ".join(f"`{k}`: {_values(v)}" for k, v in c.work_only.items())
        text += f" Work-only settings (the same gradient, less work) differ: {listed}."
    if c.partial:
        n = len(c.partial)
        said = "1 setting is" if n == 1 else f"{n} settings are"
        text += f" {said} recorded by some runs only (the code gained them between runs)."
    return text


def staleness_line(stats: dict[str, dict[str, float]]) -> str:
    """How far off-policy each run trained: the runs of a series may sample on fleets of different speed
    (a later checkout's), and this is where that shows."""
    if len(stats) < 2:
        return ""
    by_run = ", ".join(f"{name} {v['staleness']:.2f}" for name, v in stats.items())
    return (
        f" Mean staleness (`rollout/staleness_mean`, the policy versions a trained group lagged): {by_run}."
    )
