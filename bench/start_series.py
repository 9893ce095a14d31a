"""Start-up times of `make demo` and a hand-run `sparkrl up`, alternating, as a user who runs one and then
the other would see them (issue 36, item 1: DeepSpeed's op used to be rebuilt at every switch).

    .venv/bin/python bench/start_series.py --runs 10

Odd starts are `make demo` (which runs `.venv/bin/sparkrl` with the venv not on PATH); even starts are
`sparkrl up --preset demo --run-dir runs/demo --overwrite` in a shell that sourced `.venv/bin/activate`.
Both run in a fresh environment (PATH=/usr/local/bin:/usr/bin:/bin and HOME only). Each start is read off
the launcher's `started in N s | learner: …` line at the first step, then stopped with Ctrl-C (SIGINT to
its process group, as a terminal sends it). Prints each start, its ratio to the README's figure and to
the first start, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HAND_RUN = "source .venv/bin/activate && exec sparkrl up --preset demo --run-dir runs/demo --overwrite"
COMMANDS = {
    "make demo": ["make", "demo"],
    "sparkrl up (venv activated)": ["bash", "-c", HAND_RUN],
}
STARTED = re.compile(r"started in ([\d.]+) s \| learner: ([^|]*)")


@dataclass
class Start:
    how: str
    startup_s: float | None  # the launcher's `started in N s` (the stack's start to the first step)
    learner: str  # the learner's phases as the launcher printed them
    wall_s: float  # the command's whole run, Ctrl-C and shutdown included


def fresh_env() -> dict[str, str]:
    """What a new login shell has: no venv on PATH, no SPARKRL_* or TORCH_* left over."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
    }


def one_start(how: str, timeout_s: float) -> Start:
    began = time.monotonic()
    proc = subprocess.Popen(
        COMMANDS[how],
        cwd=ROOT,
        env=fresh_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own group: the SIGINT below reaches make and sparkrl, as Ctrl-C would
    )
    assert proc.stdout is not None
    found: re.Match[str] | None = None
    try:
        for line in proc.stdout:
            found = STARTED.search(line)
            if found or time.monotonic() - began > timeout_s:
                break
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    startup = float(found.group(1)) if found else None
    return Start(how, startup, found.group(2).strip() if found else "no first step", time.monotonic() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--readme-s", type=float, default=6.0, help="the README's 'later runs start in'")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per start, to the first step")
    args = parser.parse_args()
    hows = list(COMMANDS)
    starts: list[Start] = []
    for index in range(args.runs):
        start = one_start(hows[index % 2], args.timeout_s)
        starts.append(start)
        first = starts[0].startup_s
        ratios = ""
        if start.startup_s is not None:
            ratios = f" ({start.startup_s / args.readme_s:.2f}x the README's {args.readme_s:g} s"
            ratios += f", {start.startup_s / first:.2f}x the first)" if first else ")"
        print(f"start {index + 1:2d} {start.how:28s} {start.startup_s} s{ratios} | learner: {start.learner}")
    later = [s.startup_s for s in starts[1:]]
    within = all(s is not None and s <= 2 * args.readme_s for s in later)
    print(
        json.dumps(
            {"starts": [asdict(s) for s in starts], "readme_s": args.readme_s, "later_within_2x": within}
        )
    )


if __name__ == "__main__":
    main()
