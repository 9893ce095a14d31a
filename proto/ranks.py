"""Between the learner's own ranks: the orders rank 0 gives the others (`services/learner/ranks.py`).

Only the learner's processes read these, over a gloo group of their own; no other service does, so they
have no exported schema. Groups travel in the codec's binary form (`encode_group`), validated on arrival.
"""

from typing import Any, Literal

from pydantic import Field

from sparkrl.proto.base import WireModel

RankOrderKind = Literal["train", "gather", "save", "stop"]


class RankOrder(WireModel):
    """What every learner rank must take part in next. Writer: rank 0. Readers: ranks 1..N-1.

    - `train`: the step's update on `groups` (every rank builds the same micro-batches, takes its share);
      `learner` is rank 0's live learner settings (control commands change them between steps).
    - `gather`: gather the ZeRO-3 partitions for a copy of the full weights (rank 0 publishes it).
    - `save`: DeepSpeed's checkpoint into `path` (each rank writes its partitions; rank 0 the rest).
    - `stop`: the run is over; `save` first when a final checkpoint is wanted.
    """

    kind: RankOrderKind = Field(description="What to do.")
    step: int = Field(0, ge=0, description="`train`: the learner step being taken (1-based).")
    groups: list[bytes] = Field(default_factory=list, description="`train`: the step's encoded groups.")
    learner: dict[str, Any] = Field(
        default_factory=dict, description="`train`: rank 0's learner settings in force (a model dump)."
    )
    path: str | None = Field(None, description="`save`: the DeepSpeed checkpoint directory.")
