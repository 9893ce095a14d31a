"""sparkrl against TRL's GRPOTrainer on the same work, one after the other in one invocation.

usage: python bench/e2e_bench.py [--peer-python .venv-peer/bin/python] [--steps 200] [--long-steps 10]
                                 [--only demo|long]

Two workloads, each run by sparkrl (`sparkrl up`) and by the TRL peer (`../shared/peers/trl_same_model.py`,
in its own virtual environment: `make bench-e2e` creates `.venv-peer`):

- `demo`: the demo preset (the tiny countdown model, 16 prompts × 8 completions per step, ≤ 24 new tokens,
  temperature 1, lr 3e-4). sparkrl runs it twice: asynchronous (the `demo` preset) and in lockstep,
  exactly on-policy (the `onpolicy` preset: the same work, max_staleness 0, workers waiting for each
  version).
- `long`: the same preset and batch on a 3.3M-parameter model built here (`bench/long_model.py`, the same
  tokenizer) with completions of exactly 128 tokens (EOS suppressed: sparkrl's sampling.min_new_tokens,
  TRL's generation_kwargs min_new_tokens via `bench/trl_fixed_length.py`).

Printed per run: wall time, start-up (until the first step), steady seconds per step (median of the step
intervals after the first 10%), completions/s and generated tokens/s (steady), CPU utilisation of the
whole process tree (user + sys over wall × cores; for sparkrl also over its steady state alone); then
the ratios sparkrl / TRL (> 1: sparkrl is faster) on wall time and on the steady step, the async/lockstep
ratio, and last one JSON line. After the demo workload, `sparkrl eval` scores both trained models on the
same 512 held-out problems (pass@1, pass@8, greedy): what each learned, not only how fast.
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

import psutil

from sparkrl.run_files import read_steps
from sparkrl.services.common.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from long_model import ensure_long_model  # noqa: E402

DEMO = load_settings("demo")
PER_STEP = DEMO.learner.prompts_per_step * DEMO.rollout.sampling.n  # completions per step, both systems
PEER = ROOT.parent / "shared" / "peers" / "trl_same_model.py"
FIXED_LENGTH = ROOT / "bench" / "trl_fixed_length.py"
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


def _run(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float, TreeCpu]:
    """Wall seconds, whole-tree CPU utilisation, and the sampler (for windows) of one command."""
    start = time.time()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    with subprocess.Popen(command, env=env, cwd=ROOT, **quiet) as proc:
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


def sparkrl_run_dir(work: Workload, preset: str, workdir: Path) -> Path:
    return workdir / f"sparkrl-{work.name}-{preset}"


def run_sparkrl(work: Workload, preset: str, workdir: Path) -> dict[str, float | None]:
    run_dir = sparkrl_run_dir(work, preset, workdir)
    command = [sys.executable, "-m", "sparkrl.cli", "up", "--preset", preset, "--run-dir", str(run_dir)]
    for override in [f"model={work.model}", f"learner.max_steps={work.steps}", *work.overrides]:
        command += ["--set", override]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKRL_")}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    t0 = time.time()
    wall, cpu, sampler = _run(command, env)
    rows = read_steps(run_dir).rows
    times = [r.time for r in rows]
    skip = max(1, len(times) // 10)
    per_step = statistics.median(b - a for a, b in zip(times[skip:], times[skip + 1 :], strict=False))
    tokens = statistics.mean(r.metrics["rollout/tokens"] / r.metrics["rollout/groups"] for r in rows)
    rewards = [r.metrics["rollout/reward_mean"] for r in rows]
    fifth = max(1, len(rewards) // 5)
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
    }


def heldout(model: Path) -> dict[str, float]:
    """`sparkrl eval` of a trained model (or a run's latest checkpoint): held-out pass@1, pass@8, greedy."""
    command = [sys.executable, "-m", "sparkrl.cli", "eval", str(model), "--problems", "512", "--n", "8"]
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
    row = json.loads(done.stdout.strip().splitlines()[-1])
    return {"heldout_pass@1": row["pass@1"], "heldout_pass@8": row["pass@8"], "heldout_greedy": row["greedy"]}


def run_trl(python: str, work: Workload, workdir: Path) -> dict[str, float | None]:
    out = workdir / f"trl-{work.name}.json"
    script = [str(FIXED_LENGTH), str(PEER)] if work.fixed_length else [str(PEER)]
    command = [python, *script, "--model", str(work.model), "--steps", str(work.steps), "--out", str(out)]
    command += ["--prompts-per-step", str(DEMO.learner.prompts_per_step), "--n", str(DEMO.rollout.sampling.n)]
    command += ["--max-new", str(work.max_new), "--lr", str(DEMO.learner.lr)]
    command += ["--workdir", str(workdir / f"trl-{work.name}")]
    if not work.fixed_length:  # the trained model, for the held-out evaluation
        command += ["--save", str(workdir / f"trl-{work.name}-model")]
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
    }


def _rounded(result: dict[str, float | None]) -> dict[str, float | None]:
    return {k: None if v is None else round(v, 4) for k, v in result.items()}


def _line(name: str, r: dict[str, float | None]) -> str:
    steady = r["cpu_utilisation_steady"]
    steady_text = f" ({100 * steady:3.0f}% steady)" if steady is not None else ""
    return (
        f"  {name:16s} wall {r['wall_s']:6.1f} s | start-up {r['startup_s']:5.1f} s | "
        f"{r['s_per_step']:.3f} s/step | {r['completions_per_s']:6.1f} completions/s | "
        f"{r['tokens_per_s']:7.0f} tokens/s | CPU {100 * r['cpu_utilisation']:3.0f}%{steady_text} | "
        f"reward {r['reward_first20']:.3f} → {r['reward_last20']:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer-python", default=str(ROOT / ".venv-peer" / "bin" / "python"))
    parser.add_argument("--steps", type=int, default=200, help="demo workload steps")
    parser.add_argument("--long-steps", type=int, default=10, help="long workload steps (TRL: ~15 s each)")
    parser.add_argument("--only", choices=["demo", "long"], help="one workload only")
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
        for work in workloads:
            if not args.only or work.name == args.only:
                summary |= compare(work, args.peer_python, Path(tmp))
    print(json.dumps(summary))


def compare(work: Workload, peer_python: str, workdir: Path) -> dict[str, object]:
    """sparkrl, then TRL, on one workload (and, on the demo's, sparkrl in lockstep): the ratios printed,
    the summary's entries returned."""
    print(f"{work.name} workload, {work.steps} steps, {CORES} cores: sparkrl, then TRL", flush=True)
    ours = run_sparkrl(work, "demo", workdir)
    print(_line("sparkrl", ours), flush=True)
    theirs = run_trl(peer_python, work, workdir)
    print(_line("TRL", theirs), flush=True)
    if not work.fixed_length:  # what each learned: the same held-out problems, after the run
        ours |= heldout(sparkrl_run_dir(work, "demo", workdir))
        theirs |= heldout(workdir / f"trl-{work.name}-model")
        print(
            f"  held-out pass@1 / pass@8 / greedy (512 problems, 8 samples at T=1): "
            f"sparkrl {ours['heldout_pass@1']:.3f} / {ours['heldout_pass@8']:.3f} / "
            f"{ours['heldout_greedy']:.3f}, TRL {theirs['heldout_pass@1']:.3f} / "
            f"{theirs['heldout_pass@8']:.3f} / {theirs['heldout_greedy']:.3f}",
            flush=True,
        )
    ratio_wall = theirs["wall_s"] / ours["wall_s"]
    ratio_step = theirs["s_per_step"] / ours["s_per_step"]
    print(f"  ratio sparkrl / TRL (speed): wall {ratio_wall:.2f}x, steady step {ratio_step:.2f}x")
    summary: dict[str, object] = {
        f"ratio_vs_trl_{work.name}": round(ratio_wall, 3),
        f"ratio_vs_trl_{work.name}_steady": round(ratio_step, 3),
        f"cpu_utilisation_{work.name}": _rounded(ours)["cpu_utilisation_steady"],
        f"sparkrl_{work.name}": _rounded(ours),
        f"trl_{work.name}": _rounded(theirs),
    }
    if work.name == "demo":
        summary |= against_lockstep(work, ours, workdir)
    return summary


def against_lockstep(work: Workload, ours: dict[str, float | None], workdir: Path) -> dict[str, object]:
    """sparkrl on-policy in lockstep on the same workload: its steady step against the asynchronous one."""
    lockstep = run_sparkrl(work, "onpolicy", workdir)
    lockstep |= heldout(sparkrl_run_dir(work, "onpolicy", workdir))
    print(_line("sparkrl lockstep", lockstep), flush=True)
    print(f"  held-out pass@1 after lockstep: {lockstep['heldout_pass@1']:.3f}", flush=True)
    ratio = lockstep["s_per_step"] / ours["s_per_step"]
    print(f"  ratio async / lockstep (speed): steady step {ratio:.2f}x", flush=True)
    return {"ratio_async_vs_lockstep_demo": round(ratio, 3), "sparkrl_demo_lockstep": _rounded(lockstep)}


if __name__ == "__main__":
    main()
