"""`sync.backend: gloo` and `nccl`: torch's ProcessGroupGloo / ProcessGroupNCCL, one per epoch.

Not the default process group (the learner's DeepSpeed owns that): each epoch's group is formed on the
learner's TCPStore under the epoch's own prefix, and moves the manifest's buckets (`buckets.py`).
"""

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

# The common base of ProcessGroupGloo and ProcessGroupNCCL; torch exports it only from its C module.
from torch._C._distributed_c10d import Backend as C10dBackend

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


class C10dGroup:
    """A torch.distributed process group as a `buckets.BroadcastGroup`."""

    device: torch.device
    timeout: timedelta
    _pg: C10dBackend

    def __init__(self, pg: C10dBackend, device: torch.device, timeout: timedelta) -> None:
        self._pg, self.device, self.timeout = pg, device, timeout

    def broadcast(self, bucket: Tensor) -> dist.Work:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        # The per-collective timeout is what turns a hung peer into an error instead of a hang.
        options.timeout = self.timeout
        return self._pg.broadcast([bucket], options)

    def wait(self, work: dist.Work) -> None:
        # With a timeout, NCCL's wait blocks the CPU thread (not only the stream) and raises when it
        # expires; gloo's op has already failed by then through its own timeout.
        work.wait(self.timeout)

    def abort(self) -> None:
        self._pg.abort()


def gloo_group(store: dist.Store, rank: int, size: int, timeout: timedelta, address: str) -> C10dGroup:
    """A ProcessGroupGloo bound to `address` (by default gloo listens on whatever the hostname resolves
    to). Blocks until all `size` ranks connected, or raises after `timeout`."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    options._timeout = timeout
    return C10dGroup(dist.ProcessGroupGloo(store, rank, size, options), torch.device("cpu"), timeout)


class GlooTransport(Transport):
    """Host memory; every bucket posted at once (a member that stops reading holds up no one else)."""

    name = "gloo"
    buffers: Buffers
    _group: C10dGroup | None

    def __init__(
        self, buffers: Buffers, group: C10dGroup | None = None, epoch: int = -1, members: tuple[str, ...] = ()
    ) -> None:
        self.buffers, self._group, self.epoch, self.members = buffers, group, epoch, members

    def offer(self, rendezvous: Rendezvous) -> bytes:
        return JOINED

    def plan(self, rendezvous: Rendezvous, joined: Mapping[str, bytes]) -> None:
        return None  # the group's own rendezvous needs nothing from the learner

    def join(self, rendezvous: Rendezvous) -> "GlooTransport":
        r = rendezvous
        store = dist.PrefixStore(group_prefix(r.epoch), r.store.raw)
        group = gloo_group(store, r.rank, r.size, r.timeout, r.listen_address())
        return GlooTransport(self.buffers, group, r.epoch, r.members)

    def send(self, named_tensors: Mapping[str, Tensor], announcement: WeightAnnouncement) -> BucketsInFlight:
        return send_buckets(_joined(self._group), named_tensors, announcement, self.buffers, all_at_once=True)

    def receive(self, announcement: WeightAnnouncement) -> Received:
        return receive_buckets(_joined(self._group), announcement, self.buffers)

    def abort(self) -> None:
        if self._group is not None:
            self._group.abort()


@contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


class TorchNcclTransport(Transport):
    """torch's ProcessGroupNCCL on the current GPU; two buckets in flight, the next packed meanwhile."""

    name = "nccl"
    buffers: Buffers
    _group: C10dGroup | None

    def __init__(
        self, buffers: Buffers, group: C10dGroup | None = None, epoch: int = -1, members: tuple[str, ...] = ()
    ) -> None:
        if not dist.is_nccl_available():
            raise BackendUnavailable(
                "sync.backend=nccl needs a CUDA build of torch (this one has no NCCL): use gloo"
            )
        self.buffers, self._group, self.epoch, self.members = buffers, group, epoch, members

    def offer(self, rendezvous: Rendezvous) -> bytes:
        return JOINED

    def plan(self, rendezvous: Rendezvous, joined: Mapping[str, bytes]) -> None:
        return None  # the group's own rendezvous needs nothing from the learner

    def join(self, rendezvous: Rendezvous) -> "TorchNcclTransport":
        from torch.distributed import ProcessGroupNCCL  # present only in CUDA builds of torch

        r = rendezvous
        options = ProcessGroupNCCL.Options(is_high_priority_stream=False)
        options._timeout = r.timeout
        # By default NCCL's watchdog tears the whole process down when a collective times out; a hung
        # worker must cost the learner one failed sync, not its life. Read once, in this constructor.
        with _env("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0"):
            store = dist.PrefixStore(group_prefix(r.epoch), r.store.raw)
            pg = ProcessGroupNCCL(store, r.rank, r.size, options)
        device = torch.device("cuda", torch.cuda.current_device())
        return TorchNcclTransport(self.buffers, C10dGroup(pg, device, r.timeout), r.epoch, r.members)

    def send(self, named_tensors: Mapping[str, Tensor], announcement: WeightAnnouncement) -> BucketsInFlight:
        return send_buckets(
            _joined(self._group), named_tensors, announcement, self.buffers, all_at_once=False
        )

    def receive(self, announcement: WeightAnnouncement) -> Received:
        return receive_buckets(_joined(self._group), announcement, self.buffers)

    def abort(self) -> None:
        if self._group is not None:
            self._group.abort()


def _joined(group: C10dGroup | None) -> C10dGroup:
    if group is None:
        raise ValueError("send and receive run on the link `join` returned, not on the transport itself")
    return group
