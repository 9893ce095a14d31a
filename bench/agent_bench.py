"""Multi-turn episodes (issue 48): the environment in the worker's process against an environment service
over HTTP (`sparkrl env`), in one invocation.

usage: python bench/agent_bench.py [--rounds 6] [--prompts 8] [--n 4] [--steps 12] [--hold]

The tiny countdown model plays `countdown_retry` (a wrong answer is told so and asked again, three tries):

- **engine**: `rounds` batches of `prompts` prompts x `n` episodes on the torch engine (`agent_loop.play`),
  in process and served, alternating per round (the same seeds both ways: the same episodes). Episodes
  and model turns per second, and the environment's calls per second.
- **stack**: `sparkrl up --preset smoke` for `steps` steps with the environment in the workers and then
  served (the service started here, `rollout.agent.url`): steady steps per second and the learner's wait
  for data per step (`time/wait_data_s`, from the step rows).

Prints each figure and the ratio served / in process; the last line is JSON. `--hold` pauses the
running fork experiment (bench/hold_experiment.py --match fork_experiment.py) and continues it after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path

import httpx

from sparkrl.ports import free_ports
from sparkrl.processes import answers_healthz
from sparkrl.proto import Prompt
from sparkrl.services.common.settings import PromptFormat, SamplingSettings, TorchEngineSettings
from sparkrl.services.common.settings.rollout import AgentSettings
from sparkrl.services.rollout.agent_loop import play
from sparkrl.services.rollout.remote_env import RemoteSession
from sparkrl.services.rollout.torch_engine import TorchEngine

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / ".cache" / "tiny-countdown"
AGENT = AgentSettings(environment="countdown_retry", max_turns=3, reward="environment")


@contextmanager
def env_service() -> Iterator[str]:
    """`sparkrl env` on a free port, until the block ends."""
    (port,) = free_ports(1)
    command = [sys.executable, "-m", "sparkrl.cli", "env", "--set", f"env.port={port}"]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not answers_healthz(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"sparkrl env did not come up on {url} (exit {process.poll()})")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@contextmanager
def held(hold: bool) -> Iterator[None]:
    script = [sys.executable, str(ROOT / "bench" / "hold_experiment.py")]
    paused = hold and subprocess.run([*script, "stop", "--match", "fork_experiment.py"]).returncode == 0
    try:
        yield
    finally:
        if paused:
            subprocess.run([*script, "cont", "--match", "fork_experiment.py"], check=True)


def prompts(round_: int, count: int) -> list[Prompt]:
    rows = []
    for i in range(count):
        numbers, target = [2 + (round_ + i) % 9, 7, 8], 15 + (3 * round_ + i) % 20
        rows.append(
            Prompt(
                prompt_id=f"bench/{round_}/{i}@0",
                task="countdown",
                text=f"Use {' '.join(map(str, numbers))} to make {target}.\n",
                task_data={"numbers": numbers, "target": target},
            )
        )
    return rows


def engine_part(args: argparse.Namespace, url: str) -> dict[str, dict[str, float]]:
    engine = TorchEngine(MODEL, TorchEngineSettings())
    totals = {where: {"seconds": 0.0, "episodes": 0, "turns": 0} for where in ("in_process", "served")}
    try:
        with httpx.Client() as http:
            for round_ in range(args.rounds):
                sampling = SamplingSettings(n=args.n, max_new_tokens=16, seed=round_, topk_logprobs=8)
                order = ("in_process", "served") if round_ % 2 == 0 else ("served", "in_process")
                for where in order:
                    remote = (
                        None if where == "in_process" else lambda: RemoteSession(http, url, "countdown_retry")
                    )
                    started = time.perf_counter()
                    episodes, _ = play(
                        engine, prompts(round_, args.prompts), sampling, AGENT, PromptFormat(), remote
                    )
                    totals[where]["seconds"] += time.perf_counter() - started
                    runs = [run for group in episodes for run in group]
                    totals[where]["episodes"] += len(runs)
                    totals[where]["turns"] += sum(run.episode.turns for run in runs)
    finally:
        engine.close()
    return {
        where: {
            "episodes_per_s": t["episodes"] / t["seconds"],
            "turns_per_s": t["turns"] / t["seconds"],
            "turns_per_episode": t["turns"] / max(t["episodes"], 1),
        }
        for where, t in totals.items()
    }


def stack_part(args: argparse.Namespace, url: str) -> dict[str, dict[str, float]]:
    out = {}
    for where, extra in (("in_process", []), ("served", [f"rollout.agent.url={url}"])):
        with tempfile.TemporaryDirectory() as tmp:
            sets = [
                f"model={MODEL}",
                f"learner.max_steps={args.steps}",
                "rollout.agent.environment=countdown_retry",
                "rollout.agent.reward=environment",
                "rollout.agent.max_turns=3",
                *extra,
            ]
            command = [
                sys.executable,
                "-m",
                "sparkrl.cli",
                "up",
                "--preset",
                "smoke",
                "--run-dir",
                f"{tmp}/run",
            ]
            done = subprocess.run(
                [*command, *(a for s in sets for a in ("--set", s))], cwd=ROOT, capture_output=True, text=True
            )
            if done.returncode != 0:
                raise SystemExit(f"{where}: sparkrl up failed\n{done.stderr[-3000:]}")
            rows = [json.loads(line) for line in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
        steady = rows[max(1, len(rows) // 10) :]
        intervals = [b["time"] - a["time"] for a, b in pairwise(steady)]
        out[where] = {
            "steps_per_s": 1 / statistics.median(intervals),
            "wait_data_s": statistics.mean(r["metrics"].get("time/wait_data_s") or 0.0 for r in steady),
            "model_turns_mean": statistics.mean(r["metrics"]["rollout/model_turns_mean"] for r in steady),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--hold", action="store_true")
    args = parser.parse_args()
    with held(args.hold), env_service() as url:
        results = {"engine": engine_part(args, url), "stack": stack_part(args, url)}
    for part, by_where in results.items():
        for name in by_where["in_process"]:
            here, there = by_where["in_process"][name], by_where["served"][name]
            ratio = there / here if here else float("nan")
            print(
                f"{part:6s} {name:18s} in process {here:9.3f}   served {there:9.3f}   "
                f"served/in process {ratio:.3f}"
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
