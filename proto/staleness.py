"""The staleness rule, written once: whether a group is too old to train on.

A group's *lag* is counted in policy versions: the learner's version it would be trained against, minus
the version that sampled its oldest token (`TrajectoryGroup.oldest_policy_version`; a completion is
tagged with the version its worker held, token by token). It is too stale when the lag exceeds
`learner.max_staleness`: 0 is on-policy (only the learner's current version), `n` lets a group be made
by any of the `n` versions before it as well. A group sampled by a version ahead of the learner (lag
below 0) is never too stale by this rule; the learner refuses it for another reason (a version it never
produced).

Callers: the learner's collector, against its version now (a group in hand that has gone stale goes back
to be made again) and against the next one (a held group that cannot wait a step joins this one); the
learner's fleet check, against the next version (before a step after which a worker's groups would be
too stale, it waits for that worker); and a rollout worker, against the learner's version in its status
(it does not publish a group the learner would not train).
"""


def too_stale(sampled_version: int, current_version: int, max_staleness: int) -> bool:
    """Whether a group whose oldest token was sampled by `sampled_version` is too stale to train against
    `current_version`: its lag `current_version - sampled_version` exceeds `max_staleness` (all in
    policy versions)."""
    return current_version - sampled_version > max_staleness
