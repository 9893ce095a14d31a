"""What a resume must settle before training on: the versions it discarded, and how safe the bus is.

With the journal (`journal.py`) a resume rebuilds every version it had produced, so nothing is
discarded. Without it (the journal lost with its disk), versions past the checkpoint are gone for
good: they are never produced again (the learner goes on numbering after them) and a group sampled by
one of them is refused, since the weights that sampled it no longer exist.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sparkrl.proto import WeightAnnouncement
from sparkrl.services.common.bus import BusError, RedisBus
from sparkrl.services.learner.checkpoint import TrainState
from sparkrl.services.learner.publisher import ANNOUNCEMENT_KEY, SNAPSHOT_NAME

log = logging.getLogger("sparkrl.learner.resume")


def last_announced_version(bus: RedisBus, snapshot_dir: Path) -> int | None:
    """The highest version this run ever announced: the bus's announcement or the snapshot's."""
    versions = []
    try:
        raw = bus.get_value(ANNOUNCEMENT_KEY)
        if raw is not None:
            versions.append(WeightAnnouncement.model_validate_json(raw).version)
    except (BusError, ValueError) as exc:
        log.warning("cannot read the last weight announcement: %s", exc)
    snapshot = snapshot_dir / SNAPSHOT_NAME
    if snapshot.is_file():
        from safetensors import safe_open

        with safe_open(str(snapshot), framework="pt") as file:
            version = (file.metadata() or {}).get("version")
        if version is not None:
            versions.append(int(version))
    return max(versions, default=None)


def void_discarded_versions(state: TrainState, announced: int | None) -> None:
    """If versions past the state's were announced and could not be rebuilt, retire them for good."""
    if announced is None or announced <= state.policy_version:
        return
    lost = [state.policy_version + 1, announced]
    log.error(
        "versions %d..%d were announced but are in neither the checkpoint nor the journal: they are retired "
        "(groups they sampled are refused) and the next version is %d",
        lost[0],
        lost[1],
        announced + 1,
    )
    state.void_versions.append(lost)
    # The weights in hand go out under a number no retired group carries (under `announced` itself, the
    # groups sampled with them would be refused as retired).
    state.policy_version = announced + 1
