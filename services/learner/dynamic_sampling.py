"""Dynamic sampling (`learner.filter_groups: zero_variance`): DAPO's filter (Yu et al., arXiv 2503.14476,
§3.2; verl `algorithm.filter_groups.{enable, metric}`, NeMo-RL and AReaL ship it too). A group whose
rewards are all equal has advantage 0 on every completion: it carries no gradient. DAPO drops such groups
and samples more until the batch holds `prompts_per_step` informative ones, so every step's gradient
comes from a full batch.

In an asynchronous fleet the extra sampling costs no waiting loop: the workers keep producing, and the
collector (collect.py) counts only informative groups toward a batch. An uninformative group is
*filtered*: held until the next batch is formed, then committed with that step like its trained groups
(journaled, its trained mark set so a redelivery is acknowledged, acknowledged) but never trained and
never sent back to be made again, whatever its staleness: the ledger counts it (`groups_filtered`), the
audit trail (`trained_groups.jsonl`) lists it under `filtered_ids`, the step row counts it
(`rollout/groups_filtered`, `rollout/filtered_share`). So every published group is trained once or
filtered once. At the data's end a step may hold filtered groups alone: it commits them, trains nothing.

Not to be confused with `learner.skip_zero_advantage` (the same gradient as the full batch, less work:
the batch still shrinks to its informative groups) or `learner.advantage.drop_equal_groups` (those
groups left out of the loss, the batch smaller by them).
"""

from __future__ import annotations

from sparkrl.proto import TrajectoryGroup
from sparkrl.services.common.settings import LearnerSettings


def equal_rewards(group: TrajectoryGroup) -> bool:
    """Whether every completion of `group` got the same reward: its advantages are all 0."""
    return len(set(group.rewards)) <= 1


def filtered(group: TrajectoryGroup, cfg: LearnerSettings) -> bool:
    """Whether the collector sets `group` aside as uninformative (`learner.filter_groups`)."""
    return cfg.filter_groups == "zero_variance" and equal_rewards(group)


def out_of_loss(group: TrajectoryGroup, cfg: LearnerSettings) -> bool:
    """Whether the update leaves `group` out of the loss: filtered, or dropped for equal rewards
    (`learner.advantage.drop_equal_groups`)."""
    return (cfg.advantage.drop_equal_groups or cfg.filter_groups != "none") and equal_rewards(group)
