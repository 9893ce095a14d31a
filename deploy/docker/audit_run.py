"""Exactly-once audit of a compose run, from inside one of its sparkrl containers; prints one JSON line.

    docker compose run --rm --no-deps -T --entrypoint python learner - < deploy/docker/audit_run.py

It reads what the run left behind — the run directory's audit trail (`trained_groups.jsonl`, one record
per step, a redone step's later record superseding the earlier one), the latest checkpoint's trainer
state, and in Redis the ids every published group left (`{ns}:published:trajectories:*`), the groups still
queued in the trajectory stream and the dead letters — and accounts for every published group: trained
once, still queued, or dead-lettered. A group the learner dropped as stale was sent back (its prompt fed
again, its dedup mark forgotten: the group made again keeps its id), so it counts as whatever its remake
became; `dropped_stale` is the learner's count of such drops. `ok` is true when no group was trained twice,
steps run 1..N without a gap, the checkpoint agrees with the trail, and published = trained + queued +
dead-lettered. The settings are the mounted preset under the
container's environment (`SETTINGS`, default /etc/sparkrl/compose.yaml).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import redis

from sparkrl.services.common.settings import load_settings

cfg = load_settings(os.environ.get("SETTINGS", "/etc/sparkrl/compose.yaml"))
run_dir = Path(cfg.run_dir)
records = [json.loads(line) for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
steps: dict[int, list[str]] = {}
for record in records:
    steps[record["step"]] = record["group_ids"]
trained = [gid for step in sorted(steps) for gid in steps[step]]
marker = run_dir / "checkpoints" / "latest"  # a link to the newest checkpoint (a file naming it, earlier)
latest = os.readlink(marker) if marker.is_symlink() else marker.read_text().strip()
state = json.loads((run_dir / "checkpoints" / latest / "trainer_state.json").read_text())

client = redis.Redis.from_url(cfg.bus.url)
ns = cfg.bus.namespace
prefix = f"{ns}:published:trajectories:"
published = {key.decode()[len(prefix) :] for key in client.scan_iter(match=prefix + "*", count=1000)}
queued = {fields[b"id"].decode() for _, fields in client.xrange(f"{ns}:trajectories")}
dead = {
    fields[b"id"].decode()
    for _, fields in client.xrange(f"{ns}:dead")
    if fields.get(b"stream", b"").decode() == f"{ns}:trajectories"
}
untrained = published - set(trained)
dropped = int(state.get("groups_dropped_stale", 0))
problems = []
if sorted(steps) != list(range(1, len(steps) + 1)):
    problems.append(f"steps {sorted(steps)} are not 1..{len(steps)}")
if len(trained) != len(set(trained)):
    problems.append(f"{len(trained) - len(set(trained))} groups trained twice")
if not set(trained) <= published:
    problems.append(f"{len(set(trained) - published)} trained groups were never published")
if (state["step"], state["groups_trained"]) != (max(steps, default=0), len(trained)):
    problems.append(f"checkpoint at step {state['step']} with {state['groups_trained']} groups disagrees")
if untrained - queued - dead:
    problems.append(f"{len(untrained - queued - dead)} published groups unaccounted for ({dropped} dropped)")
print(
    json.dumps(
        {
            "ok": not problems,
            "problems": problems,
            "steps": max(steps, default=0),
            "records": len(records),
            "groups_trained": len(trained),
            "groups_unique": len(set(trained)),
            "published": len(published),
            "queued": len(untrained & queued),
            "dead_lettered": len(untrained & dead),
            "dropped_stale": dropped,
            "checkpoint": latest,
        }
    )
)
