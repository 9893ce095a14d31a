"""The reward service's cost per verified completion, this checkout against a git revision, in one invocation.

    .venv/bin/python bench/reward_bench.py --baseline HEAD~1

Starts the service (`services/reward/app.py`, 2 verifier processes, a loopback port) from this checkout and
from `--baseline` (its tree from `git archive`, run with the same interpreter), in turn `--rounds` times each,
and sends it what a wide run's rollout workers send: `--clients` clients at once, each `--requests`
requests of one prompt batch (16 countdown problems × 16 short answers, some right). Per run: items a
second (wall) and CPU milliseconds per 1,000 items — the service's process and its pool's (from /proc),
the figure that matters on a machine whose cores the workers and the learner share. Prints each, the
median per side, and the ratios. Pause a running experiment first (`bench/hold_experiment.py stop`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
_SERVE = (
    "import sys\n"
    "from sparkrl.services.common.settings import RewardSettings\n"
    "from sparkrl.services.reward.app import main\n"
    "main(RewardSettings.model_validate_json(sys.argv[1]))\n"
)
_PROBLEMS, _ANSWERS = 16, 16  # a prompt batch: rollout.prompts_per_batch × sampling.n of the wide preset


@dataclass
class Run:
    items_per_s: float
    cpu_ms_per_1k: float


def _batches(count: int, seed: int) -> list[bytes]:
    """`count` request bodies: three-number countdown problems and answers like a small model's — an
    expression over the numbers, right about a third of the time, sometimes with text around it."""
    rng = random.Random(seed)
    bodies = []
    for _ in range(count):
        items = []
        for _ in range(_PROBLEMS):
            a, b, c = (rng.randint(1, 20) for _ in range(3))
            target = (a + b) * c
            for _ in range(_ANSWERS):
                x, y, z = rng.sample([a, b, c], 3)
                expression = rng.choice([f"({a}+{b})*{c}", f"{x}+{y}*{z}", f"{x}*{y}-{z}", f"{x}+{y}+{z}"])
                completion = rng.choice([expression, f"{expression} = {target}", f"<answer>{expression}"])
                task_data = {"numbers": [a, b, c], "target": target}
                items.append({"task": "countdown", "completion": completion, "task_data": task_data})
        bodies.append(json.dumps({"items": items}).encode())
    return bodies


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of `pid` and of every process below it (the forkserver and the verifiers)."""
    table: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            table[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    tree, frontier = {pid}, {pid}
    while frontier:
        frontier = {child for child, parent in table.items() if parent in frontier} - tree
        tree |= frontier
    ticks = 0
    for member in tree:
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


@contextmanager
def _service(source: Path | None) -> Iterator[tuple[httpx.Client, int]]:
    """The service from `source` (a tree laid out like this repository; None: this checkout) on a free
    loopback port, until the block ends."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = {"host": "127.0.0.1", "port": port, "url": f"http://127.0.0.1:{port}", "verifier_processes": 2}
    env = {**os.environ, "PYTHONPATH": str(source) if source else os.environ.get("PYTHONPATH", "")}
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVE, json.dumps(settings)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=source or ROOT,
    )
    client = httpx.Client(base_url=settings["url"], timeout=120.0)
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise SystemExit(f"the reward service exited: {process.stderr.read().decode()[-2000:]}")
            with contextlib.suppress(httpx.TransportError):  # not listening yet
                if client.get("/healthz", timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit("the reward service was not healthy after 60 s")
            time.sleep(0.2)
        yield client, process.pid
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=30)


def _baseline_tree(revision: str, into: Path) -> Path:
    """`revision`'s files, importable as `sparkrl` the way the installed package maps them."""
    archive = subprocess.run(["git", "archive", revision], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    for package in ("proto", "services", "configs"):  # pyproject's package-dir
        (into / "sparkrl" / package).symlink_to(into / package)
    return into


def _measure(source: Path | None, bodies: list[bytes], clients: int) -> Run:
    with _service(source) as (client, pid):
        for body in bodies[:2]:  # warm: the verifiers' first parses, the connection
            client.post("/score", content=body, headers={"content-type": "application/json"})
        errors: list[str] = []

        def send(share: list[bytes]) -> None:
            with httpx.Client(base_url=str(client.base_url), timeout=120.0) as own:
                for body in share:
                    reply = own.post("/score", content=body, headers={"content-type": "application/json"})
                    if reply.status_code != 200:
                        errors.append(f"{reply.status_code}: {reply.text[:200]}")

        shares = [bodies[i::clients] for i in range(clients)]
        cpu, started = _cpu_seconds(pid), time.perf_counter()
        threads = [threading.Thread(target=send, args=(share,)) for share in shares]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall, cpu = time.perf_counter() - started, _cpu_seconds(pid) - cpu
        if errors:
            raise SystemExit(f"the service refused requests: {errors[:3]}")
    items = len(bodies) * _PROBLEMS * _ANSWERS
    return Run(items_per_s=items / wall, cpu_ms_per_1k=1000 * cpu / items * 1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="HEAD", help="the git revision to compare with (default HEAD)")
    parser.add_argument("--requests", type=int, default=60, help="requests per client and run")
    parser.add_argument("--clients", type=int, default=2, help="clients sending at once (rollout workers)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per side, alternating")
    args = parser.parse_args()
    bodies = _batches(args.requests * args.clients, seed=0)
    results: dict[str, list[Run]] = {"baseline": [], "this checkout": []}
    with tempfile.TemporaryDirectory(prefix="reward-bench-") as tmp:
        baseline = _baseline_tree(args.baseline, Path(tmp))
        print(f"{len(bodies)} requests of {_PROBLEMS * _ANSWERS} items, {args.clients} clients at once; "
              f"baseline {args.baseline}")  # fmt: skip
        for round_ in range(args.rounds):
            for name, source in (("baseline", baseline), ("this checkout", None)):
                run = _measure(source, bodies, args.clients)
                results[name].append(run)
                print(f"  round {round_ + 1} {name:>13}: {run.items_per_s:7.0f} items/s, "
                      f"{run.cpu_ms_per_1k:6.1f} CPU ms per 1,000 items")  # fmt: skip
    median = {
        name: Run(*(statistics.median(getattr(r, f) for r in runs) for f in ("items_per_s", "cpu_ms_per_1k")))
        for name, runs in results.items()
    }
    for name, run in median.items():
        print(f"median {name:>13}: {run.items_per_s:7.0f} items/s, {run.cpu_ms_per_1k:6.1f} CPU ms per 1k")
    base, this = median["baseline"], median["this checkout"]
    print(f"ratio (this / baseline): items/s ×{this.items_per_s / base.items_per_s:.2f}, "
          f"CPU per item ×{this.cpu_ms_per_1k / base.cpu_ms_per_1k:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
