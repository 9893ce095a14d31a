"""The weight-transport seam: how one backend moves a version between the learner and an epoch's members.

The contract around it (announce, join, verify, acknowledge) is the same for every backend and written
once: the learner's side in `sender.py`, the worker's in `receiver.py`. A transport only forms an epoch's
link and moves the tensors over it:

- join: a member writes `offer(...)` as its joined key; once every member has, the learner's `plan(...)`
  writes whatever members read after the start, the learner writes START_GO, and every rank calls
  `join(...)`, which returns the epoch's link: an instance of the same class, bound to that epoch. Every
  value written through `Rendezvous.store` is sealed with the run's secret (`sealed_store.py`).
- send (rank 0, the learner) / receive (ranks 1..N) over the link. A receive returns `Received` (the
  tensors, for the caller to load) or `LoadedInPlace` (the engine took them itself).
- abort: the link is dead (a failure, a later epoch); peers blocked on it fail fast.

Every wait is bounded by the rendezvous's timeout, so a dead or hung peer costs one failed sync, never a
hang. A library's errors surface as RuntimeError; the contract turns them into SyncFailed. An instance made
by `backends.make_transport` is not joined: it holds only what outlives epochs (buffers, an engine), and
raises BackendUnavailable, naming the fix, when its library or device is not here.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar, Protocol

from torch import Tensor

from sparkrl.proto import WeightAnnouncement
from sparkrl.services.common.settings.sync import SyncBackend as Backend
from sparkrl.services.common.weight_sync.rendezvous import local_address_towards
from sparkrl.services.common.weight_sync.sealed_store import SealedStore


@dataclass(frozen=True)
class Received:
    """The version's tensors for the caller to load: views into the received buckets, in manifest order."""

    tensors: dict[str, Tensor]
    checksum: str  # of the bytes as they arrived
    problem: str | None = None  # why it is not the announced version (a tensor not its digest, …)


@dataclass(frozen=True)
class LoadedInPlace:
    """The engine loaded the version itself (vLLM's own transfer): there is nothing to hand over."""

    checksum: str  # of what the engine took, as it reports it
    problem: str | None = None  # why the engine refused the version, if it did
    # For a version refused (a problem, or another checksum): puts back the version the engine held. Called
    # once the refusal is acknowledged (a reload takes a while: the learner hears of the refusal first).
    undo: Callable[[], None] | None = None


Delivery = Received | LoadedInPlace


class Sending(Protocol):
    """A send in flight on the learner's link."""

    def wait(self) -> None:
        """Blocks until the send completed; raises RuntimeError when it failed or outlived the timeout."""


@dataclass(frozen=True)
class Rendezvous:
    """One rank joining one epoch's link."""

    # The learner's TCPStore: what the contract writes there is sealed (`sealed_store.py`); a link's own
    # rendezvous (gloo's, NCCL's) goes through `store.raw`.
    store: SealedStore
    epoch: int
    rank: int  # 0: the learner; i + 1: members[i]
    members: tuple[str, ...]  # the epoch's members in rank order
    host: str  # the learner's store address (where a link hosted by the learner listens too)
    port: int
    timeout: timedelta  # bounds every wait of forming and using the link
    # The link this rank still holds from the same learner's previous epoch, handed over only to a transport
    # that `shrinks`; the caller aborts it once `join` returned or failed.
    held: "Transport | None" = None

    @property
    def size(self) -> int:
        return len(self.members) + 1

    def listen_address(self) -> str:
        """Where this rank's connections listen: the learner's own address; a member's on its route to it."""
        return self.host if self.rank == 0 else local_address_towards(self.host, self.port)


class Transport(ABC):
    """One backend: `offer` / `plan` / `join` form an epoch's link; `send`, `receive` and `abort` use it."""

    name: ClassVar[Backend]  # `sync.backend`, announced as `WeightAnnouncement.backend`
    shrinks: ClassVar[bool] = False  # whether a later epoch that only drops members is derived from a link
    epoch: int  # the link's epoch; -1 before `join`
    members: tuple[str, ...]  # the link's members in rank order

    @abstractmethod
    def offer(self, rendezvous: Rendezvous) -> bytes:
        """A member, before the start: the value of its joined key (`rendezvous.JOINED` when there is
        nothing to say). Written last: any key a transport writes here is there once the learner sees it."""

    @abstractmethod
    def plan(self, rendezvous: Rendezvous, joined: Mapping[str, bytes]) -> None:
        """The learner, once every member joined (`joined`: member → its offer), before START_GO: writes
        what the members read when they `join` (nothing, for most)."""

    @abstractmethod
    def join(self, rendezvous: Rendezvous) -> "Transport":
        """Every rank, after START_GO: the epoch's link. Blocks until every rank connected, at most the
        timeout; raises RuntimeError."""

    @abstractmethod
    def send(self, named_tensors: Mapping[str, Tensor], announcement: WeightAnnouncement) -> Sending:
        """The learner's link: starts sending the announced tensors to every member."""

    @abstractmethod
    def receive(self, announcement: WeightAnnouncement) -> Delivery:
        """A member's link: the announced version, as it arrived (verifying it is the caller's)."""

    @abstractmethod
    def abort(self) -> None:
        """Closes the link; peers blocked on it fail fast. May wait out a hung peer: the learner calls it
        off its own thread."""
