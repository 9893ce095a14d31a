"""sparkrl against TRL's GRPOTrainer on the same work, one after the other in one invocation.

usage: python bench/e2e_bench.py [--peer-python .venv-peer/bin/python] [--steps 200] [--long-steps 10]
                                 [--only demo|long] [--baseline REF] [--quality-target 0.40]

Two workloads, each run by sparkrl (`sparkrl up`) and by the TRL peer (`../shared/peers/trl_same_model.py`,
in its own virtual environment: `make bench-e2e` creates `.venv-peer`):

- `demo`: the demo preset (the tiny countdown model, 16 prompts × 8 completions per step, ≤ 24 new tokens,
  temperature 1, lr 3e-4). sparkrl runs it also in lockstep, exactly on-policy (the `onpolicy` preset:
  the same work, max_staleness 0, workers waiting for each version).
- `long`: the same preset and batch on a 3.3M-parameter model built here (`bench/long_model.py`, the same
  tokenizer) with completions of exactly 128 tokens (EOS suppressed: sparkrl's sampling.min_new_tokens,
  TRL's generation_kwargs min_new_tokens via `bench/trl_fixed_length.py`).

On each workload sparkrl also runs without exact work skipping (`learner.skip_zero_advantage=false`: the
same gradient, every completion run), on the demo's with packed rows (`learner.pack_length=96`: two of
its 20-46-token rows in one; the long workload's rows are all of one length, nothing to pack) and, with
`--baseline REF`, as commit REF (bench/e2e_baseline.py): the before and after of this round's changes,
back to back.

Printed per run: wall time, start-up (until the first step; sparkrl's phases per service from its
summary.json), steady seconds per step (median of the step intervals after the first 10%), completions/s
and generated tokens/s (steady), CPU utilisation of the whole process tree, and sparkrl's share of tokens
skipped (A = 0) and of padding; then the ratios (> 1: the first named is faster) and last one JSON line.
After the demo workload, `sparkrl eval` scores the trained models on the same 512 held-out problems
(pass@1, pass@8, greedy), and every saved model of each system (every 40 steps) is scored too: the time
to quality is the wall time at which held-out pass@1 first reaches `--quality-target` (bench/e2e_quality.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from sparkrl.run_files import read_steps
from sparkrl.services.common.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from e2e_baseline import checkout, commit_of, environment, remove  # noqa: E402
from e2e_quality import curve, first_reaching, scored, sparkrl_points, trl_points  # noqa: E402
from long_model import ensure_long_model  # noqa: E402

DEMO = load_settings("demo")
PER_STEP = DEMO.learner.prompts_per_step * DEMO.rollout.sampling.n  # completions per step, both systems
PEER = ROOT.parent / "shared" / "peers" / "trl_same_model.py"
FIXED_LENGTH = ROOT / "bench" / "trl_fixed_length.py"
SAVING_PEER = ROOT / "bench" / "trl_checkpoints.py"
CORES = os.cpu_count() or 1


@dataclass(frozen=True)
class Workload:
    name: str
    model: Path
    max_new: int
    steps: int
    fixed_length: bool  # EOS suppressed: every completion is max_new tokens
    overrides: list[str] = field(default_factory=list)


class TreeCpu(threading.Thread):
    """Samples (time, CPU seconds of a process and all its descendants) every `period_s`."""

    def __init__(self, pid: int, period_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.root, self.period_s, self.samples = psutil.Process(pid), period_s, []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.period_s):
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0.0
            for proc in procs:
                try:
                    times = proc.cpu_times()
                    total += times.user + times.system
                except psutil.NoSuchProcess:
                    continue
            self.samples.append((time.time(), total))

    def utilisation(self, start: float, end: float) -> float | None:
        inside = [(t, c) for t, c in self.samples if start <= t <= end]
        if len(inside) < 2:
            return None
        (t0, c0), (t1, c1) = inside[0], inside[-1]
        return (c1 - c0) / ((t1 - t0) * CORES)


def _run(
    command: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT
) -> tuple[float, float, TreeCpu]:
    """Wall seconds, whole-tree CPU utilisation, and the sampler (for windows) of one command."""
    start = time.time()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    with subprocess.Popen(command, env=env, cwd=cwd, **quiet) as proc:
        sampler = TreeCpu(proc.pid)
        sampler.start()
        cpu_before = _reaped_cpu()
        code = proc.wait()
    sampler.done.set()
    wall = time.time() - start
    if code != 0:
        raise SystemExit(f"{' '.join(command[:6])} … exited with {code}")
    return wall, (_reaped_cpu() - cpu_before) / (wall * CORES), sampler


def _reaped_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # every reaped descendant, services included
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class Variant:
    """One way sparkrl runs a workload: `key` names it in the JSON line (`sparkrl_<workload><key>`)."""

    label: str
    key: str
    preset: str = "demo"
    overrides: tuple[str, ...] = ()
    code: Path | None = None  # an earlier commit's package tree (bench/e2e_baseline.py); None: this one


NOW = Variant("sparkrl", "")
NO_SKIP = Variant("sparkrl no skip", "_noskip", overrides=("learner.skip_zero_advantage=false",))
PACKED = Variant("sparkrl packed", "_packed", overrides=("learner.pack_length=96",))
LOCKSTEP = Variant("sparkrl lockstep", "_lockstep", preset="onpolicy")
# The demo's runs keep a model every 40 steps for the time to quality (TRL's alike: bench/trl_checkpoints.py).
SAVE_EVERY = 40
SAVING = [f"learner.checkpoint_every={SAVE_EVERY}", "learner.keep_checkpoints=100"]


def sparkrl_run_dir(work: Workload, variant: Variant, workdir: Path) -> Path:
    return workdir / f"sparkrl-{work.name}{variant.key}"


def run_sparkrl(work: Workload, variant: Variant, workdir: Path) -> dict[str, Any]:
    run_dir = sparkrl_run_dir(work, variant, workdir)
    command = [
        sys.executable,
        "-m",
        "sparkrl.cli",
        "up",
        "--preset",
        variant.preset,
        "--run-dir",
        str(run_dir),
    ]
    saving = SAVING if not work.fixed_length and variant.preset == "demo" else []
    for override in [f"model={work.model}", f"learner.max_steps={work.steps}", *saving, *work.overrides]:
        command += ["--set", override]
    for override in variant.overrides:
        command += ["--set", override]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKRL_")}
    if variant.code is not None:
        env = environment(variant.code)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    # An earlier commit's code runs from a folder without sparkrl/ (e2e_baseline.py says why).
    t0 = time.time()
    wall, cpu, sampler = _run(command, env, cwd=ROOT if variant.code is None else workdir)
    rows = read_steps(run_dir).rows
    times = [r.time for r in rows]
    skip = max(1, len(times) // 10)
    per_step = statistics.median(b - a for a, b in zip(times[skip:], times[skip + 1 :], strict=False))
    tokens = statistics.mean(r.metrics["rollout/tokens"] / r.metrics["rollout/groups"] for r in rows)
    rewards = [r.metrics["rollout/reward_mean"] for r in rows]
    fifth = max(1, len(rewards) // 5)
    skipped = [r.metrics.get("loss/skipped_tokens") for r in rows]
    padding = [r.metrics.get("loss/padding_share") for r in rows]
    all_tokens = sum(r.metrics["rollout/tokens"] for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "wall_s": wall,
        "startup_s": times[0] - t0,
        "s_per_step": per_step,
        "completions_per_s": PER_STEP / per_step,
        "tokens_per_s": PER_STEP * tokens / DEMO.rollout.sampling.n / per_step,
        "cpu_utilisation": cpu,
        "cpu_utilisation_steady": sampler.utilisation(times[skip], times[-1]),
        "reward_first20": statistics.mean(rewards[:fifth]),
        "reward_last20": statistics.mean(rewards[-fifth:]),
        "skipped_share": sum(skipped) / all_tokens if None not in skipped and all_tokens else None,
        "padding_share": statistics.mean(padding) if None not in padding else None,
        "startup_phases": (summary.get("startup") or {}).get("learner") or None,
        "started_at": t0,
    }


def heldout(model: Path) -> dict[str, float]:
    """`sparkrl eval` of a trained model (or a run's latest checkpoint): held-out pass@1, pass@8, greedy."""
    command = [sys.executable, "-m", "sparkrl.cli", "eval", str(model), "--problems", "512", "--n", "8"]
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
    row = json.loads(done.stdout.strip().splitlines()[-1])
    return {"heldout_pass@1": row["pass@1"], "heldout_pass@8": row["pass@8"], "heldout_greedy": row["greedy"]}


def run_trl(python: str, work: Workload, workdir: Path) -> dict[str, float | None]:
    out = workdir / f"trl-{work.name}.json"
    saving = [str(SAVING_PEER), "--save-every", str(SAVE_EVERY)]
    script = [str(FIXED_LENGTH), str(PEER)] if work.fixed_length else [*saving, str(PEER)]
    command = [python, *script, "--model", str(work.model), "--steps", str(work.steps), "--out", str(out)]
    command += ["--prompts-per-step", str(DEMO.learner.prompts_per_step), "--n", str(DEMO.rollout.sampling.n)]
    command += ["--max-new", str(work.max_new), "--lr", str(DEMO.learner.lr)]
    command += ["--workdir", str(workdir / f"trl-{work.name}")]
    if not work.fixed_length:  # the trained model, for the held-out evaluation
        command += ["--save", str(workdir / f"trl-{work.name}-model")]
    t0 = time.time()
    wall, cpu, _ = _run(command)
    peer = json.loads(out.read_text())
    per_step = peer["s_per_step_median"]
    return {
        "wall_s": wall,
        "startup_s": wall - peer["wall_s"],
        "s_per_step": per_step,
        "completions_per_s": PER_STEP / per_step,
        "tokens_per_s": PER_STEP * peer["mean_len_last20"] / per_step,
        "cpu_utilisation": cpu,
        "cpu_utilisation_steady": None,  # the peer reports no step times to window by
        "reward_first20": peer["reward_first20"],
        "reward_last20": peer["reward_last20"],
        "started_at": t0,
    }


def _rounded(result: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items() if k != "started_at"}


def _line(name: str, r: dict[str, Any]) -> str:
    steady = r["cpu_utilisation_steady"]
    steady_text = f" ({100 * steady:3.0f}% steady)" if steady is not None else ""
    work = ""
    if r.get("skipped_share") is not None:
        work = f" | skipped {100 * r['skipped_share']:.0f}%, padding {100 * r['padding_share']:.0f}%"
    phases = r.get("startup_phases") or {}
    started = f" ({', '.join(f'{k} {v:.1f}' for k, v in phases.items())})" if phases else ""
    return (
        f"  {name:18s} wall {r['wall_s']:6.1f} s | start-up {r['startup_s']:5.1f} s{started} | "
        f"{r['s_per_step']:.3f} s/step | {r['completions_per_s']:6.1f} completions/s | "
        f"{r['tokens_per_s']:7.0f} tokens/s | CPU {100 * r['cpu_utilisation']:3.0f}%{steady_text} | "
        f"reward {r['reward_first20']:.3f} → {r['reward_last20']:.3f}{work}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer-python", default=str(ROOT / ".venv-peer" / "bin" / "python"))
    parser.add_argument("--steps", type=int, default=200, help="demo workload steps")
    parser.add_argument("--long-steps", type=int, default=10, help="long workload steps (TRL: ~15 s each)")
    parser.add_argument("--only", choices=["demo", "long"], help="one workload only")
    parser.add_argument("--baseline", metavar="REF", help="also run sparkrl as this commit (before/after)")
    parser.add_argument("--quality-target", type=float, default=0.40, help="held-out pass@1 to reach")
    args = parser.parse_args()
    if not Path(args.peer_python).exists():
        raise SystemExit(f"no TRL environment at {args.peer_python}: `make bench-e2e` creates .venv-peer")
    if not PEER.is_file():
        raise SystemExit(f"the TRL peer script is not at {PEER}")
    cache = ROOT / ".cache"
    workloads = [
        Workload("demo", cache / "tiny-countdown", DEMO.rollout.sampling.max_new_tokens, args.steps, False),
        Workload(
            "long",
            ensure_long_model(cache),
            128,
            args.long_steps,
            True,
            ["rollout.sampling.max_new_tokens=128", "rollout.sampling.min_new_tokens=128"],
        ),
    ]
    summary: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="sparkrl-e2e-") as tmp:
        variants = [NOW, NO_SKIP, PACKED]
        if args.baseline:
            commit = commit_of(args.baseline)
            variants.append(
                Variant(f"sparkrl @{commit}", "_baseline", code=checkout(commit, Path(tmp) / "base"))
            )
            summary["baseline"] = commit
        try:
            for work in workloads:
                if not args.only or work.name == args.only:
                    runs = [v for v in variants if v is not PACKED or work.name == "demo"]
                    summary |= compare(work, runs, args.peer_python, Path(tmp), args.quality_target)
        finally:
            if args.baseline:
                remove(Path(tmp) / "base")
    print(json.dumps(summary))


def compare(
    work: Workload, variants: list[Variant], peer_python: str, workdir: Path, target: float
) -> dict[str, object]:
    """sparkrl (each variant), then TRL, on one workload (and, on the demo's, sparkrl in lockstep and the
    time to quality): the ratios printed, the summary's entries returned."""
    print(f"{work.name} workload, {work.steps} steps, {CORES} cores: sparkrl, then TRL", flush=True)
    runs: dict[str, dict[str, Any]] = {}
    for variant in variants:
        runs[variant.key] = run_sparkrl(work, variant, workdir)
        print(_line(variant.label, runs[variant.key]), flush=True)
    ours = runs[NOW.key]
    theirs = run_trl(peer_python, work, workdir)
    print(_line("TRL", theirs), flush=True)
    summary: dict[str, object] = {}
    if not work.fixed_length:  # what each learned: the same held-out problems, after the run and on the way
        ours |= heldout(sparkrl_run_dir(work, NOW, workdir))
        theirs |= heldout(workdir / f"trl-{work.name}-model")
        print(
            f"  held-out pass@1 / pass@8 / greedy (512 problems, 8 samples at T=1): "
            f"sparkrl {ours['heldout_pass@1']:.3f} / {ours['heldout_pass@8']:.3f} / "
            f"{ours['heldout_greedy']:.3f}, TRL {theirs['heldout_pass@1']:.3f} / "
            f"{theirs['heldout_pass@8']:.3f} / {theirs['heldout_greedy']:.3f}",
            flush=True,
        )
        summary |= time_to_quality(work, variants, runs, theirs, workdir, target)
    ratio_wall = theirs["wall_s"] / ours["wall_s"]
    ratio_step = theirs["s_per_step"] / ours["s_per_step"]
    print(f"  ratio sparkrl / TRL (speed): wall {ratio_wall:.2f}x, steady step {ratio_step:.2f}x")
    summary |= {
        f"ratio_vs_trl_{work.name}": round(ratio_wall, 3),
        f"ratio_vs_trl_{work.name}_steady": round(ratio_step, 3),
        f"cpu_utilisation_{work.name}": _rounded(ours)["cpu_utilisation_steady"],
        f"skipped_share_{work.name}": _rounded(ours)["skipped_share"],
        f"padding_share_{work.name}": _rounded(ours)["padding_share"],
        f"trl_{work.name}": _rounded(theirs),
    }
    for variant in variants:
        summary[f"sparkrl_{work.name}{variant.key}"] = _rounded(runs[variant.key])
        if variant is not NOW:  # before (the variant) and after (now): > 1, now is faster
            other = runs[variant.key]
            wall, step = other["wall_s"] / ours["wall_s"], other["s_per_step"] / ours["s_per_step"]
            start = other["startup_s"] / ours["startup_s"]
            print(
                f"  ratio sparkrl / {variant.label} (speed): wall {wall:.2f}x, steady step {step:.2f}x, "
                f"start-up {start:.2f}x",
                flush=True,
            )
            summary[f"ratio_vs{variant.key}_{work.name}"] = {
                "wall": round(wall, 3),
                "steady": round(step, 3),
                "startup": round(start, 3),
            }
    if work.name == "demo":
        summary |= against_lockstep(work, ours, workdir)
    return summary


def time_to_quality(
    work: Workload,
    variants: list[Variant],
    runs: dict[str, dict[str, Any]],
    theirs: dict[str, Any],
    workdir: Path,
    target: float,
) -> dict[str, object]:
    """Each system's saved models scored on the held-out problems: when pass@1 first reaches `target`."""
    curves = {
        f"sparkrl{v.key}": scored(
            sparkrl_points(sparkrl_run_dir(work, v, workdir), runs[v.key]["started_at"])
        )
        for v in variants
        if v is not NO_SKIP  # the same gradient as NOW: its curve says nothing more
    }
    curves["trl"] = scored(trl_points(workdir / f"trl-{work.name}", theirs["started_at"]))
    reached = {name: first_reaching(points, target) for name, points in curves.items()}
    for name, points in curves.items():
        at = reached[name]
        said = f"{at:.1f} s" if at is not None else "not reached"
        steps = ", ".join(f"{p.step}: {p.pass_at_1:.3f}" for p in points)
        print(f"  held-out pass@1 ≥ {target:.2f}: {name} {said} ({steps})", flush=True)
    ours, trl = reached["sparkrl"], reached["trl"]
    ratio = trl / ours if ours and trl else None
    print(f"  ratio sparkrl / TRL (time to quality): {f'{ratio:.2f}x' if ratio else 'n/a'}", flush=True)
    return {
        f"ratio_time_to_quality_{work.name}": None if ratio is None else round(ratio, 3),
        f"time_to_quality_{work.name}": {
            "target_pass@1": target,
            "seconds": {name: None if at is None else round(at, 1) for name, at in reached.items()},
            "curves": {name: curve(points) for name, points in curves.items()},
        },
    }


def against_lockstep(work: Workload, ours: dict[str, Any], workdir: Path) -> dict[str, object]:
    """sparkrl on-policy in lockstep on the same workload: its steady step against the asynchronous one."""
    lockstep = run_sparkrl(work, LOCKSTEP, workdir)
    lockstep |= heldout(sparkrl_run_dir(work, LOCKSTEP, workdir))
    print(_line(LOCKSTEP.label, lockstep), flush=True)
    print(f"  held-out pass@1 after lockstep: {lockstep['heldout_pass@1']:.3f}", flush=True)
    ratio = lockstep["s_per_step"] / ours["s_per_step"]
    print(f"  ratio async / lockstep (speed): steady step {ratio:.2f}x", flush=True)
    return {"ratio_async_vs_lockstep_demo": round(ratio, 3), "sparkrl_demo_lockstep": _rounded(lockstep)}


if __name__ == "__main__":
    main()
