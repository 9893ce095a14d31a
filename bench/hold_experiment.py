"""Pause or continue a long experiment and every process it started (`sparkrl up` puts each service in a
session of its own, so signalling the experiment's process group alone would leave its learner running).

    .venv/bin/python bench/hold_experiment.py stop    # before a benchmark or a timed check
    .venv/bin/python bench/hold_experiment.py cont    # after it

Finds `bench/learning_quality.py --wide` (or `--match TEXT`) and sends SIGSTOP / SIGCONT to it and to all
its descendants (stop: children first, so none sees its parent stop; cont: parents first).
"""

from __future__ import annotations

import argparse
import signal

import psutil


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("stop", "cont"))
    parser.add_argument("--match", default="learning_quality.py --wide")
    args = parser.parse_args()
    roots = [p for p in psutil.process_iter(["cmdline"]) if args.match in " ".join(p.info["cmdline"] or [])]
    if not roots:
        raise SystemExit(f"no process runs {args.match!r}")
    tree = [p for root in roots for p in [root, *root.children(recursive=True)]]
    sig = signal.SIGSTOP if args.action == "stop" else signal.SIGCONT
    for process in reversed(tree) if args.action == "stop" else tree:
        try:
            process.send_signal(sig)
        except psutil.NoSuchProcess:
            continue
    print(f"{args.action}: {len(tree)} processes of {args.match!r}")


if __name__ == "__main__":
    main()
