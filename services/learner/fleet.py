"""The rollout fleet as the learner sees it: the publisher that sends it each version (on its own thread,
so a slow or dead worker never stalls training) and the telemetry that says which versions it holds.

Training does not wait for the fleet, with two exceptions: before a step after which the fleet's groups
would be too stale to train on (`in_reach`: a slow broadcast costs time, not data), and at the last
step (`settle`: the last row shows where the fleet ends up).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sparkrl.proto import SyncEvent
from sparkrl.proto.staleness import too_stale
from sparkrl.services.common.telemetry import Telemetry
from sparkrl.services.learner.publisher import WeightPublisher

log = logging.getLogger("sparkrl.learner")


@dataclass
class Fleet:
    telemetry: Telemetry
    publisher: WeightPublisher
    timeout_s: float  # sync.timeout_s: how long the learner waits for the fleet, at most

    def publish(
        self,
        version: int,
        weights: dict[str, torch.Tensor],
        broadcast: bool = True,
        adapter_base: str | None = None,
    ) -> None:
        """Hand `version` to the publisher's thread (CPU tensors nothing modifies later). `broadcast=False`
        only announces it: for weights the fleet holds already. `adapter_base`: `weights` is a LoRA
        adapter alone, for the base of that checksum (lora.adapter_tensors)."""
        self.publisher.submit(version, weights, broadcast=broadcast, adapter_base=adapter_base)

    @property
    def last_sync(self) -> SyncEvent | None:
        """The newest broadcast every member acknowledged."""
        return self.publisher.last_sync

    def in_reach(
        self,
        version: int,
        max_staleness: int,
        read_ahead: Callable[[int], bool],
        interrupted: Callable[[], bool],
    ) -> bool:
        """Before a step after which the fleet's groups would be too stale to train on, wait (at most
        `timeout_s`) until every live member holds a version within reach, and has published the older
        groups it had in hand (reading them ahead meanwhile: `read_ahead(version)`, False once the
        collector is full, so a full stream cannot keep them out). A member the publisher dropped (hung,
        straggling) is not waited for, nor is anyone once the collector holds all it could train in time.
        False: `interrupted()`."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            excluded = set(self.publisher.excluded)
            held, oldest = self.telemetry.worker_versions(), self.telemetry.worker_oldest_versions()
            behind = {
                w: v for w, v in held.items() if w not in excluded and _behind(v, version, max_staleness)
            }
            in_hand = {
                w: v for w, v in oldest.items() if w not in excluded and _behind(v, version, max_staleness)
            }
            # Groups in hand need room in the stream: read ahead, unless the collector is already full.
            if not behind and (not in_hand or not read_ahead(version)):
                return True
            if interrupted():
                return False
            if time.monotonic() > deadline:
                log.warning(
                    "workers %s are still too stale for the next step (learner at version %d, max_staleness "
                    "%d) after %.0fs; training on",
                    behind or in_hand,
                    version,
                    max_staleness,
                    self.timeout_s,
                )
                return True
            time.sleep(0.05)

    def drain(self) -> None:
        """Wait (at most `timeout_s`) until the version handed over last is published: its snapshot
        written, its broadcast ended. Before the learner says it is paused, so a paused run's files hold
        still (a user may copy them)."""
        self.publisher.flush(self.timeout_s)

    def settle(self, version: int) -> None:
        """At the last step: the last row should show where the fleet ends up, not where it was
        mid-broadcast; and a worker outside the group (it joined late, or is still loading) catches up
        over HTTP while we still serve the snapshot: a fleet under compose or Kubernetes outlives us."""
        self.drain()
        fleet = tuple(dict.fromkeys([*self.publisher.members, *self.telemetry.worker_versions()]))
        self.telemetry.wait_for_fleet(fleet, version, timeout_s=self.timeout_s)

    def close(self) -> None:
        """The last version's broadcast, then the publisher's thread ends."""
        self.publisher.close()


def _behind(held: int | None, version: int, max_staleness: int) -> bool:
    """Whether groups of version `held` (a worker's weights, or the oldest it has in hand; None: nothing
    said yet, as old as the initial model's 0) would be too stale for the learner's next step, the one
    after `version`. The current version is always within reach: no worker can hold a newer one, so at
    max_staleness 0 (on-policy) the learner waits for every worker to hold its version."""
    held = held or 0
    return held < version and too_stale(held, version + 1, max_staleness)
