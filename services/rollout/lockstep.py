"""Lockstep generation (`rollout.lockstep_groups`): a worker makes its share of one policy version's groups,
then waits for the next version instead of running ahead.

With `learner.max_staleness: 0` this is exactly on-policy training: the learner trains on groups of the
version it holds and nothing else, and a worker never spends CPU on groups that would arrive stale. The
wait is bounded (`rollout.lockstep_wait_s`): a group lost on the way (dead-lettered, a prompt reclaimed)
would otherwise leave the learner waiting for it and the worker waiting for the learner.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("sparkrl.rollout")


@dataclass
class Lockstep:
    """Counts the groups made with the held version; `holds` says when to wait. One thread uses it."""

    groups_per_version: int | None  # None: asynchronous, never waits
    wait_s: float
    version: int | None = None  # the version the count is for
    made: int = 0
    full_since: float | None = None  # when the share was complete (monotonic)

    def record(self, version: int | None, published: int) -> None:
        """`published` groups made with `version` went out."""
        if version != self.version:
            self.version, self.made, self.full_since = version, 0, None
        self.made += published

    def holds(self, version: int | None) -> bool:
        """Whether to wait for a version newer than `version` (the one held) before the next batch."""
        if self.groups_per_version is None:
            return False
        if version != self.version:  # new weights: a new share
            self.version, self.made, self.full_since = version, 0, None
            return False
        if self.made < self.groups_per_version:
            return False
        now = time.monotonic()
        if self.full_since is None:
            self.full_since = now
        if now - self.full_since <= self.wait_s:
            return True
        log.warning(
            "lockstep: no version after %s within %.0fs of its %d groups; making more (a group may have "
            "been lost on the way)",
            version,
            self.wait_s,
            self.made,
        )
        self.made, self.full_since = 0, None
        return False
