"""The planted-fork experiment of issue 47: does Lp-Reg keep a useful rare token that plain GRPO
extinguishes? On-policy runs of `sparkrl up` from the fork's start state, each recorded when it ends.

    python bench/fork_experiment.py                 # every run not recorded yet, then the report section
    python bench/fork_experiment.py --record-only   # record the finished runs of runs/fork/, start nothing
    python bench/fork_experiment.py --report-only   # the report section from the records alone
    python bench/fork_experiment.py --quick         # the same pipeline at the smoke scale, in minutes

Two conditions, each its own start model (bench/fork_model.py, built once into .cache/fork-<condition>):
`tail` plants a noise tail at the fork (Z ≈ 0.65: the on-policy pull of Lp-Reg, β(1/Z − 1), is then about
half an advantage), `plain` has none (Z ≈ 1: the pull vanishes). Four arms on each: GRPO; Lp-Reg with β =
0 (its clip range without its regularizer, the control); Lp-Reg with β = 1 at the ρ `fork_probe.needed_rho`
measured on the start model; DPPO. Seeds 1–4, paired: a seed's prompts, sampling seed and learner seed are
the same in every arm. Every run is exactly on-policy: the `onpolicy` preset (lockstep, max_staleness 0,
one update per rollout), a checkpoint every CHECKPOINT_EVERY steps.

After a run, every checkpoint is probed (fork_probe.py): p(spark) and Z at the fork on 256 fixed problems,
and every PATH_EVERY steps the success of each path by sampling. Its record (lq_records.py: step rows,
held-out evaluations, summary, configs, and probe.jsonl) goes to docs/learning-quality/fork/RUN/ and is
committed: a run whose record is there is done, so a fresh clone goes on where the last one stopped. The
verdict (fork_report.py) is written from the records alone, into docs/learning-quality/report.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from fork_model import RECIPE, build
from fork_probe import fork_numbers, path_success, probe_problems
from fork_report import write_report
from fork_task import SPARK, write_prompts
from learning_quality import ROOT
from learning_quality_wide import finished, watch
from lq_records import recorded_steps, remove_stale_partials, write_record

from sparkrl.services.common.modeling import load_model, load_tokenizer

# The start state the design log settled on (docs/learning-quality/fork/README.md): copies in capitals,
# 8,000 skill steps, the answer given on 10% of the rare phase's spark paths (a letter on the rest).
FORK_RECIPE = {**RECIPE, "skill_steps": 8000, "step_accuracy": 0.7, "answer_share": 0.1}
CONDITIONS = {"tail": 0.35, "plain": 0.0}  # the noise tail's mass at the fork
# Lp-Reg's ρ: the smallest whose k covers ≥ 90% of the failing spark tokens of a first step, measured on
# each start model over 32 simulated steps (`python bench/fork_probe.py .cache/fork-tail --rho`): with the
# tail, the junk tokens are the lowest-probability A < 0 tokens and the spark comes after them (ρ = 0.10
# covers 18%, 0.15 covers 91%); without, the spark is the lowest (0.01: 44%, 0.02: 96%).
RHO = {"tail": 0.15, "plain": 0.02}
ARMS = ("grpo", "lpreg-b0", "lpreg", "dppo")
SEEDS = (1, 2, 3, 4)
STEPS, QUICK_STEPS = 500, 6
QUICK_BUILD = {"skill_steps": 60, "steps": 30, "probe_problems": 16, "probe_samples": 2}
CHECKPOINT_EVERY, PATH_EVERY = 10, 50
PROMPTS_PER_STEP = 16  # the onpolicy preset's
RUN_TIMEOUT_S = 3600
PROBE_FILE = "probe.jsonl"
DATA = ROOT / ".cache" / "fork-data"
OUT = ROOT / "docs" / "learning-quality"


@dataclass(frozen=True)
class Spec:
    condition: str
    arm: str
    seed: int
    quick: bool = False  # --quick: a start model warmed up for seconds (the pipeline, not the state)

    @property
    def name(self) -> str:
        return f"{self.condition}-{self.arm}-s{self.seed}"


def plan(seeds: tuple[int, ...], quick: bool = False) -> list[Spec]:
    """Seed-major, the tail first: a stopped experiment has every arm of its first seeds."""
    return [Spec(c, arm, seed, quick) for seed in seeds for c in CONDITIONS for arm in ARMS]


def start_model(condition: str, quick: bool = False) -> Path:
    """.cache/fork-<condition>: built here the first time (the skill phase, shared, about 15 minutes;
    --quick's in seconds, into .cache/fork-quick-<condition>)."""
    out = ROOT / ".cache" / f"fork{'-quick' if quick else ''}-{condition}"
    if not (out / "fork_build.json").is_file():
        print(f"building the {condition} start model at {out} (bench/fork_model.py)", flush=True)
        torch.set_num_threads(1)
        build(out, {**FORK_RECIPE, **(QUICK_BUILD if quick else {}), "tail": CONDITIONS[condition]})
    return out


def data_files() -> tuple[Path, Path]:
    train, heldout = DATA / "train.jsonl", DATA / "heldout.jsonl"
    if not train.is_file():
        write_prompts(train, 50_000, FORK_RECIPE["n_digits"], seed=1)
    if not heldout.is_file():
        write_prompts(heldout, 512, FORK_RECIPE["n_digits"], seed=2)
    return train, heldout


def up_command(spec: Spec, steps: int, run_dir: Path, start: str) -> list[str]:
    """The run's `sparkrl up`: the onpolicy preset on the fork's model and data."""
    settings = overrides(spec, steps, start_model(spec.condition, spec.quick), *data_files())
    command = [sys.executable, "-m", "sparkrl.cli", "up", "--preset", "onpolicy", "--run-dir", str(run_dir)]
    return [*command, start, *(arg for o in settings for arg in ("--set", o))]


def overrides(spec: Spec, steps: int, model: Path, train: Path, heldout: Path) -> list[str]:
    """What the run sets over the onpolicy preset: the fork's model and data, the arm's loss, the seed
    (prompts, sampling and learner alike in every arm), a checkpoint every CHECKPOINT_EVERY steps, and
    the proxy from the learner's own logits (exact where the worker's top-20 does not hold every kept
    token: the tail's flat rows)."""
    loss = {
        "grpo": ["learner.loss.name=grpo"],
        "dppo": ["learner.loss.name=dppo"],
        "lpreg-b0": ["learner.loss.name=lp_reg", f"learner.loss.rho={RHO[spec.condition]}",
                     "learner.loss.beta=0.0"],
        "lpreg": ["learner.loss.name=lp_reg", f"learner.loss.rho={RHO[spec.condition]}",
                  "learner.loss.beta=1.0"],
    }[spec.arm]  # fmt: skip
    return [
        f"model={model}",
        "prompts.task=math", f"prompts.path={train}", "prompts.prompt_field=problem",
        f"prompts.count={steps * PROMPTS_PER_STEP * 2}", f"prompts.seed={spec.seed}",
        "rollout.sampling.max_new_tokens=32", f"rollout.sampling.seed={spec.seed}",
        "eval.task=math", f"eval.path={heldout}", f"eval.every={max(steps // 3, 1)}", "eval.problems=256",
        "eval.n=4", "eval.max_new_tokens=32",
        f"learner.seed={spec.seed}", f"learner.max_steps={steps}",
        f"learner.proxy_kappa={FORK_RECIPE['kappa']}",
        f"learner.checkpoint_every={min(CHECKPOINT_EVERY, steps)}", "learner.keep_checkpoints=1000",
        "learner.micro_batch_tokens=16384", "learner.samples_per_step=16", "learner.proxy_source=logits",
        *loss,
    ]  # fmt: skip


def run(spec: Spec, steps: int, runs: Path) -> None:
    """The run to its end (resumed from its last checkpoint when there is one), then its probe."""
    run_dir = runs / spec.name
    runs.mkdir(parents=True, exist_ok=True)
    start = "--resume" if (run_dir / "checkpoints" / "latest").exists() else "--overwrite"
    code = watch(up_command(spec, steps, run_dir, start), spec.name, runs, steps, RUN_TIMEOUT_S)
    if code != 0 and start == "--resume":
        print(f"  {spec.name}: the resume failed (exit {code}); redone from step 0", flush=True)
        code = watch(up_command(spec, steps, run_dir, "--overwrite"), spec.name, runs, steps, RUN_TIMEOUT_S)
    if code != 0 or not finished(run_dir, steps):
        tail = (runs / f"{spec.name}.log").read_text()[-3000:]
        raise SystemExit(f"{spec.name} did not finish (exit {code}); {runs / spec.name}.log ends:\n{tail}")
    probe(run_dir, start_model(spec.condition, spec.quick), steps)


def probe(run_dir: Path, start: Path, steps: int) -> None:
    """RUN/probe.jsonl: the fork's numbers of the start model (step 0) and of every checkpoint, each path's
    success every PATH_EVERY steps and at the last."""
    saved = [f for f in (run_dir / "checkpoints").glob("step-*") if (f / "hf").is_dir()]
    folders = {0: start} | {int(f.name.split("-")[1]): f / "hf" for f in saved}
    problems, paths = probe_problems(FORK_RECIPE), probe_problems(FORK_RECIPE, 64)
    rows = []
    for step in sorted(folders):
        model, tokenizer = load_model(folders[step]).eval(), load_tokenizer(folders[step])
        row: dict[str, Any] = {"step": step, **fork_numbers(model, tokenizer, problems, FORK_RECIPE["kappa"])}
        if step % PATH_EVERY == 0 or step == steps:
            with torch.no_grad():
                row["success_spark"] = path_success(model, tokenizer, paths, 4, SPARK, seed=step + 1)
                row["success_common"] = path_success(model, tokenizer, paths, 4, "", seed=step + 2)
        rows.append(row)
    (run_dir / PROBE_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows))


def about(spec: Spec, steps: int) -> dict[str, Any]:
    model = start_model(spec.condition, spec.quick)
    return {
        "run": spec.name,
        "spec": asdict(spec),
        "steps_planned": steps,
        "start_state": json.loads((model / "fork_build.json").read_text()),
        "rho": RHO[spec.condition],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke scale: seed 1, a few steps, own folders")
    parser.add_argument("--record-only", action="store_true", help="record finished runs, start nothing")
    parser.add_argument("--report-only", action="store_true", help="the report section from the records")
    parser.add_argument(
        "--pilot", metavar="LABEL", default=None,
        help="calibration runs of a candidate start state, before the pre-registered ones: seed 0, "
        "records in fork/pilot/LABEL/, no report",
    )  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="*", default=None, help="seeds to run (default 1-4)")
    parser.add_argument("--arms", nargs="*", choices=ARMS, default=None, help="arms to run (default all)")
    parser.add_argument("--conditions", nargs="*", choices=tuple(CONDITIONS), default=None)
    parser.add_argument("--steps", type=int, default=None, help=f"steps a run (default {STEPS})")
    args = parser.parse_args()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    name = "fork-quick" if args.quick else f"fork-pilot-{args.pilot}" if args.pilot else "fork"
    runs = ROOT / "runs" / name
    out = runs / "report" if args.quick else OUT
    records = out / (f"fork/pilot/{args.pilot}" if args.pilot else "fork")
    seeds = (0,) if args.pilot else (1,) if args.quick else SEEDS
    if args.pilot and not args.pilot.replace("-", "").isalnum():
        raise SystemExit(f"--pilot {args.pilot!r}: a label of letters, digits and dashes (a folder's name)")
    specs = [
        s for s in plan(tuple(args.seeds or seeds), args.quick)
        if s.arm in (args.arms or ARMS) and s.condition in (args.conditions or CONDITIONS)
    ]  # fmt: skip
    if args.quick:
        specs = [s for s in specs if s.condition == "tail"]
    for partial in remove_stale_partials(records):
        print(f"removed {partial}: a record's write that never finished", flush=True)
    for spec in specs:  # finished before, not recorded yet
        if recorded_steps(records / spec.name) is None and (runs / spec.name / PROBE_FILE).is_file():
            write_record(runs / spec.name, records / spec.name, about(spec, steps), (PROBE_FILE,))
    todo = [s for s in specs if recorded_steps(records / s.name) is None]
    if not (args.record_only or args.report_only):
        for index, spec in enumerate(specs, 1):
            if spec in todo:
                print(f"[{index}/{len(specs)}] {spec.name}", flush=True)
                run(spec, steps, runs)
                write_record(runs / spec.name, records / spec.name, about(spec, steps), (PROBE_FILE,))
                print(f"[{index}/{len(specs)}] {spec.name}: recorded at {records / spec.name}", flush=True)
    if args.pilot is None:
        print(json.dumps(write_report(records, out, [s.name for s in specs], steps)), flush=True)


if __name__ == "__main__":
    main()
