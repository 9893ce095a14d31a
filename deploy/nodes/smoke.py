"""`make nodes-smoke`: sparkrl on three hosts, the way docs/deployment.md's "Three machines, step by step"
types it, on a test bed of three network namespaces (deploy/nodes/netns.py: node-a, node-b, node-c at
198.18.0.1-3 on a bridge, no route out). Root only; CI runs it (.ci/run).

1. Plain processes (plain.py): Redis, reward, control, the feeder and the learner's rank 0 on node-a, rank
   1 on node-b (torchrun --nnodes=2 over the bridge), a rollout worker on node-c without the model (it
   fetches node-a's over HTTP); every group trained once (the audit: trail, checkpoint, bus), every listener
   on its node's address. Then one optimizer step on fixed groups, one rank against a rank on node-a and one
   on node-b: the same parameters, to 1e-5.
2. Ray (on_ray.py): a Ray head on node-a, a node on node-b and on node-c; `sparkrl up --ray --address` on
   node-a places the learner and the reward replica there and one worker on each other node by custom
   resources. node-c cut off mid-run (its bridge port down): the learner drops its worker within the
   broadcast's timeout, trains on, and the worker catches up once the link is back; then every process of
   node-b SIGKILLed and its Ray started again: Ray restarts the worker there. Every group trained once.

It prints a line per change of state, which node runs what at which address, each fault's times, and a
JSON report (also RUN/nodes-smoke/report.json). Exit 0 when every check held, 1 when one failed.

    sudo .venv/bin/python deploy/nodes/smoke.py [--only plain|equality|ray ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns import NODES, PREFIX, TestBed
from observe import SmokeFailed
from on_ray import run_ray
from plain import run_equality, run_plain
from recipe import read
from runner import Smoke, say

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "runs" / "nodes-smoke"
# The smoke's own settings, through the environment as any SPARKRL_* setting (they beat the preset): runs
# of a few dozen steps, and timeouts that make a fault cost seconds.
COMMON = {
    "SPARKRL_SYNC__TIMEOUT_S": "15",
    "SPARKRL_SYNC__STRAGGLER_S": "3",
    "SPARKRL_BUS__CLAIM_IDLE_MS": "5000",
}
TUNING = {
    "plain": COMMON | {"SPARKRL_LEARNER__MAX_STEPS": "8", "SPARKRL_LEARNER__CHECKPOINT_EVERY": "4"},
    "equality": {},
    # Ended by `sparkrl stop` once the faults are over.
    "ray": COMMON | {"SPARKRL_LEARNER__MAX_STEPS": "1000", "SPARKRL_LEARNER__CHECKPOINT_EVERY": "10"},
}
SCENARIOS = {"plain": run_plain, "equality": run_equality, "ray": run_ray}


def run(only: list[str]) -> dict:
    shutil.rmtree(WORK, ignore_errors=True)
    (WORK / "shared").mkdir(parents=True)
    report: dict = {"nodes": {n.name: f"{n.address}/{PREFIX}" for n in NODES}}
    with TestBed() as bed:
        s = Smoke(bed, read(ROOT / "docs" / "deployment.md"), ROOT, WORK)
        say("test bed up: " + ", ".join(f"{n.name} {n.address}" for n in bed.nodes) + " (bridge spk-br0)")
        say(f"the smoke's own settings, by scenario: {TUNING}")
        s.run("", "A", "install -d", on="A", label="secrets")
        for name in only:
            s.tuning = TUNING[name]
            began = time.monotonic()
            say(f"— {name} —")
            try:
                report[name] = SCENARIOS[name](s)
            except (KeyboardInterrupt, SystemExit):
                say("interrupted: stopping every node's processes, then removing the test bed")
                raise
            finally:
                s.end_nodes()
            report[name]["wall_s"] = round(time.monotonic() - began, 1)
            say(f"{name}: passed in {report[name]['wall_s']} s")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    args = parser.parse_args()
    began = time.monotonic()
    try:
        report = run(args.only)
    except KeyboardInterrupt:
        say("interrupted; the test bed is removed")
        raise SystemExit(130) from None
    except SmokeFailed as exc:
        say(f"FAILED: {exc}")
        say(f"logs: {WORK / 'logs'}/ (each chunk's output), the runs under {WORK / 'shared' / 'runs'}/")
        raise SystemExit(1) from None
    except Exception:
        traceback.print_exc()
        say(f"FAILED with an error; logs: {WORK / 'logs'}/")
        raise SystemExit(1) from None
    report["wall_s"] = round(time.monotonic() - began, 1)
    (WORK / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2), flush=True)
    say(f"all passed in {report['wall_s']} s; test bed torn down")


if __name__ == "__main__":
    main()
