"""The learner's train state: what a checkpoint keeps besides the weights and the optimizer, and what
`--resume` restores. A plain record (no torch, no DeepSpeed): the ledger, the collector and the reports
read it too."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainState:
    """Counters of the run so far, saved as `trainer_state.json` in every checkpoint (its field names are
    that file's keys)."""

    step: int = 0  # steps taken: batches trained, each ending in a new version
    policy_version: int = 0  # the newest version: what the learner publishes
    groups_trained: int = 0
    groups_filtered: int = 0  # uninformative groups set aside, never trained (learner.filter_groups)
    groups_dropped_stale: int = 0
    started_at: float = 0.0
    trained_group_ids: list[str] = field(default_factory=list)  # of the last step, for inspection
    hparam_overrides: dict[str, bool | int | float | str] = field(default_factory=dict)  # live changes
    # Policy versions a lossy resume discarded ([lo, hi], inclusive): never produced again, and a group
    # sampled by one of them is refused (its weights no longer exist).
    void_versions: list[list[int]] = field(default_factory=list)
    nonfinite_skipped: int = 0  # optimizer updates not applied: their loss or gradient norm was not finite
    checkpoint_failures: int = 0  # checkpoints that could not be written (the run went on journaling)
