"""The `nccl4py` backend: one epoch's broadcast group as an NVIDIA nccl4py communicator (`nccl.core`).

Same role as the ProcessGroupNCCL of `sync.backend: nccl`, but every NCCL call is ours to bound:

- The communicator is *non-blocking* (`NCCLConfig(blocking=False)`): init, shrink and any collective
  that must wait for a peer return `ncclInProgress` at once, and `Communicator.get_async_error()` is
  polled until it says `Success` (or an error) against the sync timeout. A hung peer costs `timeout`,
  never a hang; on any failure the caller aborts (`Communicator.abort()`), which ends the kernels still
  waiting on the peer.
- Rank 0 (the learner) draws the NCCL unique id (`get_unique_id()`) and writes its bytes into the
  epoch's own keys of the learner's TCPStore (`epoch/{E}/group/nccl4py/unique_id`, the link's own
  rendezvous, unsealed like gloo's: `sealed_store.py`); members read it.
- A membership that only loses members keeps its connections: `shrink` (`ncclCommShrink`) derives the
  next epoch's communicator from this one, without a new rendezvous. New members need a new epoch.

nccl4py is imported only here, lazily: CPU installs never need it. `require_nccl4py()` is the one clear
error when the backend is chosen without it (or without a GPU).

Shrinking, over the learner's store: a member that holds the previous epoch's link offers
`HOLDS <that epoch>` as its joined value; when every member of the new epoch does and they are the old
ones minus some, in the old order (`shrink_plan`), the learner writes `shrink_key(E)` before START_GO and
every rank derives its communicator from the held one (a shrink key whose seal does not verify is not
there). Otherwise every rank connects afresh.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from sparkrl.proto import WeightAnnouncement
from sparkrl.services.common.weight_sync.buckets import (
    BucketsInFlight,
    Buffers,
    receive_buckets,
    send_buckets,
)
from sparkrl.services.common.weight_sync.errors import BackendUnavailable
from sparkrl.services.common.weight_sync.rendezvous import JOINED, group_prefix
from sparkrl.services.common.weight_sync.transport import Received, Rendezvous, Transport

log = logging.getLogger("sparkrl.weight_sync")

POLL_S = 0.0005  # how often a pending NCCL call or bucket is looked at: a bucket takes milliseconds
UNIQUE_ID_KEY = "nccl4py/unique_id"  # under the epoch's group prefix (`rendezvous.group_prefix`)
NCCL_SUCCESS, NCCL_IN_PROGRESS = 0, 7  # ncclResult_t values (nccl.h); `get_async_error` returns a Result
INSTALL_HINT = "pip install 'nccl4py[cu12]' (or [cu13] for CUDA 13) in this environment"
HOLDS = b"holds "  # + an epoch: a member's joined value when it holds that epoch's communicator


def require_nccl4py() -> Any:
    """The `nccl.core` module, or BackendUnavailable saying what is missing and how to get it."""
    try:
        import nccl.core as nccl
    except ImportError as exc:
        raise BackendUnavailable(
            f"sync.backend=nccl4py needs NVIDIA's nccl4py, which does not import here ({exc}): "
            f"{INSTALL_HINT}, or set sync.backend=nccl"
        ) from exc
    if not torch.cuda.is_available():
        raise BackendUnavailable(
            "sync.backend=nccl4py moves GPU tensors and this process sees no CUDA device: run it on a GPU "
            "(learner.device / rollout.gpus), or set sync.backend=gloo"
        )
    return nccl


@dataclass
class Nccl4pyWork:
    """One posted broadcast: done when its event has fired on the communicator's stream."""

    event: torch.cuda.Event
    bucket: Tensor  # kept alive until the broadcast is done (the caller may drop its reference)


class Nccl4pyGroup:
    """One epoch's communicator (rank 0 = learner), its own CUDA stream, and the deadline of every call.

    A `buckets.BroadcastGroup`: `broadcast` posts a bucket and returns at once, `wait` blocks until it
    is done (raising on a peer's error or at the timeout); plus `abort` and `shrink`. Raises RuntimeError
    on every failure, which the sender and receiver turn into SyncFailed.
    """

    rank: int
    size: int
    device: torch.device
    timeout: timedelta
    _nccl: Any  # the nccl.core module
    _comm: Any  # nccl.core.Communicator
    _stream: torch.cuda.Stream

    def __init__(self, nccl: Any, comm: Any, rank: int, size: int, timeout: timedelta) -> None:
        """Wraps an initialized (or initializing) communicator; use `connect` or `shrink` to get one."""
        self._nccl, self._comm = nccl, comm
        self.rank, self.size, self.timeout = rank, size, timeout
        self.device = torch.device("cuda", torch.cuda.current_device())
        # NCCL runs on its own stream: a bucket in flight never blocks the caller's compute stream.
        self._stream = torch.cuda.Stream(self.device)
        try:
            self._settle("forming the communicator")
        except BaseException:
            self.abort()
            raise

    @classmethod
    def connect(cls, store: dist.Store, rank: int, size: int, timeout: timedelta) -> Nccl4pyGroup:
        """Every rank of the epoch calls it: the unique id goes through `store`, then NCCL connects."""
        nccl = require_nccl4py()
        if rank == 0:
            unique_id = nccl.get_unique_id()
            store.set(UNIQUE_ID_KEY, unique_id.as_bytes)
        else:
            try:
                store.wait([UNIQUE_ID_KEY], timeout)
            except dist.DistStoreError as exc:
                raise RuntimeError("the learner never published the NCCL unique id") from exc
            unique_id = nccl.UniqueId.from_bytes(store.get(UNIQUE_ID_KEY))
        config = nccl.NCCLConfig(blocking=False, comm_name=f"sparkrl-sync-rank{rank}")
        try:
            comm = nccl.Communicator.init(nranks=size, rank=rank, unique_id=unique_id, config=config)
        except Exception as exc:  # nccl.bindings.NCCLError and friends: not RuntimeErrors
            raise RuntimeError(f"ncclCommInitRankConfig failed: {exc}") from exc
        return cls(nccl, comm, rank, size, timeout)

    def shrink(self, exclude: Sequence[int], rank: int) -> Nccl4pyGroup:
        """The communicator without the ranks `exclude` (this one's numbering), as rank `rank` of it.

        Collective over the ranks that stay (the excluded ones must not call it); needs no outstanding
        operation, so only a healthy epoch is shrunk (a failed one was aborted). NCCL keeps the order of
        the remaining ranks, so `rank` is this rank's position among them.
        """
        config = self._nccl.NCCLConfig(blocking=False, comm_name=f"sparkrl-sync-rank{rank}")
        try:
            comm = self._comm.shrink(exclude_ranks=list(exclude), config=config)
        except Exception as exc:
            raise RuntimeError(f"ncclCommShrink failed: {exc}") from exc
        return Nccl4pyGroup(self._nccl, comm, rank, self.size - len(exclude), self.timeout)

    def broadcast(self, bucket: Tensor) -> Nccl4pyWork:
        """Posts an in-place broadcast of `bucket` from rank 0 on the group's stream."""
        if bucket.device != self.device:
            raise RuntimeError(f"bucket on {bucket.device}, the communicator is on {self.device}")
        # The bucket was just packed (or allocated) on the caller's stream: NCCL must start after that.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            self._comm.broadcast(bucket, bucket, root=0, stream=self._stream.cuda_stream)
        except Exception as exc:
            raise RuntimeError(f"ncclBroadcast failed: {exc}") from exc
        # A non-blocking communicator may return ncclInProgress while it connects to the peers (first
        # collective): no other NCCL call until it settles.
        self._settle("posting a broadcast")
        event = torch.cuda.Event()
        event.record(self._stream)
        bucket.record_stream(self._stream)  # its memory is not reused before NCCL is done with it
        return Nccl4pyWork(event, bucket)

    def wait(self, work: Nccl4pyWork) -> None:
        """Blocks until `work` is done; raises on an error a peer caused, or when the timeout expires."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not work.event.query():
            self._check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"a broadcast did not finish within {self.timeout.total_seconds():g}s")
            time.sleep(POLL_S)
        self._check()
        # Whoever reads the bucket next (hashing, unpacking) reads it on its own stream.
        torch.cuda.current_stream(self.device).wait_event(work.event)

    def abort(self) -> None:
        """`ncclCommAbort`: ends every operation still waiting on a peer and frees the communicator."""
        comm, self._comm = self._comm, None
        if comm is not None:
            try:
                comm.abort()
            except Exception as exc:  # aborting is the last resort: say so, raise nothing
                log.warning("ncclCommAbort failed (%s): the communicator is left to the process exit", exc)

    def _check(self) -> None:
        """Raises if the communicator reports an asynchronous error (a peer died, a network error)."""
        if self._comm is None:
            raise RuntimeError("the communicator was aborted")
        state = int(self._comm.get_async_error())
        if state not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            raise RuntimeError(f"NCCL error {state}: {self._comm.get_last_error()}")

    def _settle(self, what: str) -> None:
        """Polls `ncclCommGetAsyncError` until the pending call completes, fails, or the timeout passes."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            if self._comm is None:
                raise RuntimeError(f"{what}: the communicator was aborted")
            state = int(self._comm.get_async_error())
            if state == NCCL_SUCCESS:
                return
            if state != NCCL_IN_PROGRESS:
                raise RuntimeError(f"{what}: NCCL error {state}: {self._comm.get_last_error()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not complete within {self.timeout.total_seconds():g}s")
            time.sleep(POLL_S)


def shrink_key(epoch: int) -> str:
    """Written by the learner before START_GO when `epoch` is formed by shrinking an earlier epoch's
    communicator: b"<parent epoch> <excluded parent ranks, comma-separated>". Absent: connect afresh."""
    return f"epoch/{epoch}/shrink"


def shrink_plan(
    parent_epoch: int, parent_members: Sequence[str], members: Sequence[str], joined: Mapping[str, bytes]
) -> list[int] | None:
    """The parent's ranks to exclude when the new epoch's communicator can be shrunk from the parent's.

    Possible when the new members are the parent's minus some, in the parent's order (NCCL keeps the
    order of the ranks that stay, so rank i + 1 is still members[i]), and every one of them offered
    (its joined value) that it holds the parent's communicator. None: connect afresh.
    """
    held = HOLDS + str(parent_epoch).encode()
    remaining = [m for m in parent_members if m in members]
    if not members or remaining != list(members) or any(joined.get(m) != held for m in members):
        return None
    excluded = [rank + 1 for rank, member in enumerate(parent_members) if member not in members]
    return excluded or None  # same members: the epoch changed for another reason, start afresh


def encode_shrink(parent_epoch: int, excluded: Sequence[int]) -> bytes:
    """The `shrink_key` value."""
    return f"{parent_epoch} {','.join(map(str, excluded))}".encode()


def decode_shrink(value: bytes) -> tuple[int, list[int]]:
    """(parent epoch, excluded parent ranks) from a `shrink_key` value."""
    parent, excluded = value.decode().split(" ")
    return int(parent), [int(rank) for rank in excluded.split(",")]


class Nccl4pyTransport(Transport):
    """`sync.backend: nccl4py`: buckets over a non-blocking nccl4py communicator, shrunk when members
    only leave a healthy epoch."""

    name = "nccl4py"
    shrinks = True
    buffers: Buffers
    _group: Nccl4pyGroup | None

    def __init__(
        self,
        buffers: Buffers,
        group: Nccl4pyGroup | None = None,
        epoch: int = -1,
        members: tuple[str, ...] = (),
    ) -> None:
        if group is None:
            require_nccl4py()  # made from the settings: fail at start-up, not at the first sync
        self.buffers, self._group, self.epoch, self.members = buffers, group, epoch, members

    def offer(self, rendezvous: Rendezvous) -> bytes:
        held = rendezvous.held
        return HOLDS + str(held.epoch).encode() if held is not None else JOINED

    def plan(self, rendezvous: Rendezvous, joined: Mapping[str, bytes]) -> None:
        held = rendezvous.held
        if held is None:
            return
        excluded = shrink_plan(held.epoch, held.members, rendezvous.members, joined)
        if excluded is not None:
            rendezvous.store.set(shrink_key(rendezvous.epoch), encode_shrink(held.epoch, excluded))

    def join(self, rendezvous: Rendezvous) -> Nccl4pyTransport:
        r, held = rendezvous, rendezvous.held
        shrink = r.store.value(shrink_key(r.epoch))
        if isinstance(held, Nccl4pyTransport) and held._group is not None and shrink is not None:
            parent_epoch, excluded = decode_shrink(shrink)
            if parent_epoch == held.epoch:
                return Nccl4pyTransport(
                    self.buffers, held._group.shrink(excluded, r.rank), r.epoch, r.members
                )
        store = dist.PrefixStore(group_prefix(r.epoch), r.store.raw)
        group = Nccl4pyGroup.connect(store, r.rank, r.size, r.timeout)
        return Nccl4pyTransport(self.buffers, group, r.epoch, r.members)

    def send(self, named_tensors: Mapping[str, Tensor], announcement: WeightAnnouncement) -> BucketsInFlight:
        return send_buckets(self._link(), named_tensors, announcement, self.buffers, all_at_once=False)

    def receive(self, announcement: WeightAnnouncement) -> Received:
        return receive_buckets(self._link(), announcement, self.buffers)

    def abort(self) -> None:
        if self._group is not None:
            self._group.abort()

    def _link(self) -> Nccl4pyGroup:
        if self._group is None:
            raise ValueError("send and receive run on the link `join` returned, not on the transport itself")
        return self._group
