"""The staleness rule (proto/staleness.py), at its edges: a lag of exactly `max_staleness` versions still
trains, one more does not; 0 is on-policy; a group from a version ahead of the learner is not stale by
this rule. The learner's fleet check reads it for the next step, with the current version always in
reach."""

from __future__ import annotations

import pytest

from sparkrl.proto.staleness import too_stale
from sparkrl.services.learner.fleet import _behind


@pytest.mark.parametrize(
    ("sampled", "current", "max_staleness", "stale"),
    [
        (3, 5, 2, False),  # lag 2 = max_staleness: still trained
        (2, 5, 2, True),  # lag 3: one past
        (5, 5, 0, False),  # on-policy: the current version only
        (4, 5, 0, True),
        (0, 0, 0, False),  # the first step, from the initial model
        (6, 5, 0, False),  # ahead of the learner (another lineage): refused elsewhere, not stale
        (0, 100_000, 100_000, False),  # the largest max_staleness: never dropped in a run this long
    ],
)
def test_too_stale_at_its_edges(sampled: int, current: int, max_staleness: int, stale: bool) -> None:
    assert too_stale(sampled, current, max_staleness) is stale


def test_the_fleet_waits_for_what_would_be_too_stale_at_the_next_step() -> None:
    # max_staleness 2, the learner at 5: the next step trains against 6, so version 4 is the oldest in reach.
    assert [_behind(held, 5, 2) for held in (3, 4, 5)] == [True, False, False]
    # On-policy: the next step would want version 6, which no worker can hold yet: the current one is
    # in reach, anything older is not.
    assert [_behind(held, 5, 0) for held in (4, 5)] == [True, False]
    assert _behind(None, 1, 0) and not _behind(None, 0, 0)  # nothing reported: as the initial model's 0
