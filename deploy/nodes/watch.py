"""What the smoke watches, seen from a node: the learner's and each worker's status in the run's Redis, one
JSON line every `--every` seconds on stdout. Runs on node-a (the smoke itself stays in the root namespace,
which reaches none of the nodes' addresses).

    python deploy/nodes/watch.py --settings RUN_DIR/config/learner.yaml [--every 0.5]

The settings are read as the services read them (the file, then SPARKRL_* from the environment); the file
is waited for until it names the bus (`sparkrl up` writes it when it plans the run). A Redis that does not
answer yet, or any more, is a line with `"error"`, not an exit: the watcher lives until it is stopped.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import redis

from sparkrl.proto import WeightAnnouncement
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.bus.records import BusUnavailable
from sparkrl.services.common.settings import SparkSettings, load_settings
from sparkrl.services.common.telemetry import Telemetry


def state(telemetry: Telemetry) -> dict:
    learner = telemetry.learner()
    raw = telemetry.bus.get_value("weights")
    announced = WeightAnnouncement.model_validate_json(raw).version if raw else None
    return {
        "t": time.time(),
        "announced": announced,
        "learner": None if learner is None else {"step": learner.step, "version": learner.policy_version},
        "workers": {
            wid: {"version": w.policy_version, "state": w.state, "checksum": (w.weights_checksum or "")[:12]}
            for wid, w in telemetry.live_workers().items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", type=Path, required=True)
    parser.add_argument("--every", type=float, default=0.5)
    args = parser.parse_args()
    telemetry = Telemetry(RedisBus(settings(args.settings, args.every).bus))
    while True:
        try:
            line = state(telemetry)
        except (redis.RedisError, OSError, BusUnavailable) as exc:
            line = {"t": time.time(), "error": f"{type(exc).__name__}: {exc}"[:300]}
        print(json.dumps(line), flush=True)
        time.sleep(args.every)


def settings(path: Path, every: float) -> SparkSettings:
    """The file's settings once it is written whole: one that names no bus (missing, or read while
    `sparkrl up` writes it) would be the default Redis on 127.0.0.1, which is not the run's."""
    while True:
        if path.is_file():
            try:
                cfg = load_settings(str(path))
            except (ValueError, OSError):
                cfg = None
            if cfg is not None and "url" in cfg.bus.model_fields_set:
                return cfg
        time.sleep(every)


if __name__ == "__main__":
    main()
