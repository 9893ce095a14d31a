"""What a weight sync raises, on either side."""

from collections.abc import Sequence
from functools import partial
from typing import Literal

Phase = Literal["join", "connect", "transfer", "verify"]


class BackendUnavailable(RuntimeError):
    """The configured `sync.backend` cannot run in this interpreter; the message names the fix."""


class SyncFailed(RuntimeError):
    """A weight sync did not complete. The link of `epoch` is gone; the next sync needs a new epoch.

    `phase` is where it failed: `join` (members never wrote their joined key), `connect` (forming the
    epoch's link), `transfer` (moving the tensors failed or timed out), `verify` (checksum mismatch or
    no acknowledgement). `missing` names the members to drop from the next epoch when they are known:
    the ones that never joined, or never acknowledged (a member blocked behind a hung one may be among
    them). Empty when the failure cannot be pinned on a member.
    """

    reason: str
    epoch: int
    phase: Phase
    missing: list[str]

    def __init__(self, message: str, *, epoch: int, phase: Phase, missing: Sequence[str] = ()) -> None:
        detail = f"; missing: {', '.join(missing)}" if missing else ""
        super().__init__(f"weight sync failed in epoch {epoch} ({phase}): {message}{detail}")
        self.reason = message
        self.epoch = epoch
        self.phase = phase
        self.missing = list(missing)

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only fields: the default exception pickling would call __init__ with the message alone.
        rebuild = partial(type(self), self.reason, epoch=self.epoch, phase=self.phase, missing=self.missing)
        return (rebuild, ())


class NotAMember(SyncFailed):
    """This worker is not in the epoch's member list: it must not join (it waits for a later epoch)."""


class EpochOver(SyncFailed):
    """The announced epoch can no longer be joined: the learner moved on to a newer one, another learner
    holds its store now, or it started without this process. Raised at once, before joining; the worker
    catches up from the snapshot instead, as a late joiner does."""
