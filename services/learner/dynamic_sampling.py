"""Dynamic sampling (`learner.filter_groups: zero_variance`): DAPO's filter (Yu et al., arXiv 2503.14476,
§3.2; verl `algorithm.filter_groups.{enable, metric}`, NeMo-RL and AReaL ship it too). A group whose
rewards are all equal has advantage 0 on every completion: it carries no gradient. DAPO drops such groups
and samples more until the batch holds `prompts_per_step` informative ones, so every step's gradient
comes from a full batch.

In an asynchronous fleet the extra sampling costs no waiting loop: the workers keep producing, and the
collector (collect.py) counts only informative groups toward a batch. An uninformative group is
*filtered* as soon as it is read: recorded in `RUN_DIR/filtered_groups.jsonl` (fsynced), its trained
mark set (a redelivery is acknowledged, and the feeder does not feed its prompt again after a Redis
wipe) and acknowledged, by the ledger's `FilteredLog`, in that order. It is never trained and never made
again; it holds no place in the trajectory stream (held until a step, a run of them filled the stream
and stopped the workers). The step row counts those set aside while its batch was gathered
(`rollout/groups_filtered`, `rollout/filtered_share`, `rollout/groups_filtered_total`), `ended.json`
all of them. So every published group is trained once or filtered once.

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
