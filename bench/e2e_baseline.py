"""An earlier commit of sparkrl, run beside this one in the same `bench/e2e_bench.py` invocation (`--baseline
REF`): the before and after of a change measured back to back on the same machine.

The ref is checked out as a git worktree, and a tree of links makes its code the `sparkrl` package (its
sparkrl/, proto/, services/ and configs/ under one `sparkrl/`, as `make lint`'s import tree and the
install do). With that tree first on PYTHONPATH and a working folder that holds no `sparkrl/`, `python -m
sparkrl.cli` and every service it starts import the ref's code from this checkout's environment, whose
editable install only maps names Python's path did not already find.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checkout(ref: str, into: Path) -> Path:
    """`ref` checked out under `into`; returns the folder to put first on PYTHONPATH."""
    src, tree = into / "src", into / "tree" / "sparkrl"
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(src), ref], cwd=ROOT, check=True)
    tree.mkdir(parents=True)
    for entry in (src / "sparkrl").iterdir():
        (tree / entry.name).symlink_to(entry)
    for package in ("proto", "services", "configs"):
        (tree / package).symlink_to(src / package)
    return tree.parent


def commit_of(ref: str) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"--baseline {ref}: not a commit of this repository ({done.stderr.strip()})")
    return done.stdout.strip()


def environment(path: Path) -> dict[str, str]:
    """The environment a run of the checked-out ref starts with."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKRL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(path), *filter(None, [env.get("PYTHONPATH")])])
    return env


def remove(into: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(into / "src")], cwd=ROOT, check=False)
