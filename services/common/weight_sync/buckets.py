"""Moving a version as buckets over one broadcast group: what gloo, torch's NCCL and nccl4py share.

The learner packs the announced tensors into the manifest's buckets and broadcasts them in order; each
member posts every receive up front and hashes each bucket's tensors as it arrives (on every core), so
hashing overlaps receiving the rest, and each tensor is checked against its announced digest. The group
behind it is the backend's (`torch_groups.py`, `nccl4py_group.py`).
"""

from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import torch
from torch import Tensor

from sparkrl.proto import WeightAnnouncement
from sparkrl.proto.weights import root_checksum
from sparkrl.services.common.weight_sync.hashing import PendingDigest, shared_hasher
from sparkrl.services.common.weight_sync.manifest import (
    pack_into,
    raw_bytes,
    specs_by_bucket,
    tensor_view,
    unpack,
    zero_copy_bucket,
)
from sparkrl.services.common.weight_sync.transport import Received


class BroadcastGroup(Protocol):
    """One epoch's process group or communicator: rank 0 broadcasts each bucket in place."""

    device: torch.device  # where buckets live

    def broadcast(self, bucket: Tensor) -> Any:
        """Starts broadcasting `bucket` from rank 0; every rank calls it in the same order. Returns the
        work to `wait` for."""

    def wait(self, work: Any) -> None:
        """Blocks until `work` completes; raises RuntimeError (a dead peer fast, a hung one at the
        timeout)."""


class Buffers:
    """Bucket memory that outlives a version: the learner's staging buffers, and with `reuse_received` a
    member's receive buckets. Fresh buckets cost page faults that halve gloo's throughput here, but a
    reused bucket is overwritten by the next receive, even one that fails: reuse is only for a caller
    that copies the tensors into its engine before receiving again."""

    reuse_received: bool
    _staging: list[Tensor]
    _received: list[Tensor]

    def __init__(self, reuse_received: bool = False) -> None:
        self.reuse_received = reuse_received
        self._staging, self._received = [], []

    def staging(self, slot: int, size: int, device: torch.device, bucket_bytes: int) -> Tensor:
        """The learner's packing buffer `slot`, at least `size` bytes on `device`."""
        while len(self._staging) <= slot:
            self._staging.append(torch.empty(0, dtype=torch.uint8, device=device))
        if self._staging[slot].numel() < size or self._staging[slot].device != device:
            self._staging[slot] = torch.empty(max(size, bucket_bytes), dtype=torch.uint8, device=device)
        return self._staging[slot]

    def receiving(self, sizes: list[int], device: torch.device) -> list[Tensor]:
        """A member's buckets for one version: the previous ones when reused and the layout is the same."""
        held = [(bucket.numel(), bucket.device) for bucket in self._received]
        if self.reuse_received and held == [(size, device) for size in sizes]:
            return self._received
        buckets = [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]
        self._received = buckets if self.reuse_received else []
        return buckets


class BucketsInFlight:
    """The learner's broadcasts still going out; `wait` for all of them."""

    group: BroadcastGroup
    works: deque[Any]

    def __init__(self, group: BroadcastGroup) -> None:
        self.group, self.works = group, deque()

    def wait(self) -> None:
        while self.works:
            self.group.wait(self.works[0])
            self.works.popleft()


def send_buckets(
    group: BroadcastGroup,
    named_tensors: Mapping[str, Tensor],
    announcement: WeightAnnouncement,
    buffers: Buffers,
    *,
    all_at_once: bool,
) -> BucketsInFlight:
    """Posts the announced buckets in order; returns the broadcasts still in flight.

    `all_at_once` (gloo): every bucket packed into its own buffer and posted at once, so a member that
    stops reading holds up nobody else: the healthy members receive everything and acknowledge while its
    sends wait. Otherwise (NCCL) two in flight, packing the next while the current one goes out (a
    collective moves at the pace of its slowest rank anyway).
    """
    sending = BucketsInFlight(group)
    staged = 0
    sizes = announcement.bucket_sizes()
    for specs, size in zip(specs_by_bucket(announcement.manifest), sizes, strict=True):
        if size == 0:
            continue  # only empty tensors; receivers skip it too
        if len(sending.works) == 2 and not all_at_once:
            # The oldest send must finish before its staging buffer can be packed again.
            group.wait(sending.works.popleft())
        bucket = zero_copy_bucket(specs, named_tensors, group.device)
        if bucket is None:
            slot = staged if all_at_once else staged % 2
            staging = buffers.staging(slot, size, group.device, announcement.bucket_bytes)
            bucket = pack_into(staging, specs, named_tensors)
            staged += 1
        sending.works.append(group.broadcast(bucket))
    return sending


def receive_buckets(group: BroadcastGroup, announcement: WeightAnnouncement, buffers: Buffers) -> Received:
    """A member's side of `send_buckets`: the tensors (views into the buckets) and the checksum of their
    bytes, each tensor hashed (on every core) as its bucket lands and checked against its spec's digest."""
    sizes = announcement.bucket_sizes()
    buckets = buffers.receiving(sizes, group.device)
    # Every receive is posted up front (gloo runs them in order on its own threads), so hashing an
    # arrived bucket overlaps receiving the next ones.
    works = [group.broadcast(bucket) if size else None for bucket, size in zip(buckets, sizes, strict=True)]
    pending = list(_hashed_as_they_arrive(group, works, buckets, announcement))
    return verified(announcement, pending, unpack(buckets, announcement.manifest))


def verified(
    announcement: WeightAnnouncement, pending: list[PendingDigest], tensors: dict[str, Tensor]
) -> Received:
    """The received tensors with the checksum of their digests, and the first tensor (in manifest order)
    whose digest is not its spec's: what a receiver names when it refuses the version."""
    digests = [p.result() for p in pending]
    mismatch = next(
        (
            spec.name
            for spec, digest in zip(announcement.manifest, digests, strict=True)
            if spec.digest is not None and spec.digest != digest.hex()
        ),
        None,
    )
    checksum = root_checksum(digests)
    said = (
        None
        if mismatch is None
        else f"checksum mismatch: {mismatch} is not the announced tensor (got {checksum})"
    )
    return Received(tensors, checksum, said)


def _hashed_as_they_arrive(
    group: BroadcastGroup, works: list[Any], buckets: list[Tensor], announcement: WeightAnnouncement
) -> Iterator[PendingDigest]:
    """Each tensor's digest being computed, in manifest order, waiting for buckets in bucket order as they
    are needed.

    Waiting in bucket order keeps each wait's timeout about one bucket long: every earlier bucket has
    already arrived when a wait starts. A GPU bucket is copied to the host once, not tensor by tensor.
    """
    hasher = shared_hasher()
    arrived = 0
    host: tuple[int, Tensor] = (-1, buckets[0])
    for spec in announcement.manifest:
        while arrived <= spec.bucket:
            if works[arrived] is not None:
                group.wait(works[arrived])
            arrived += 1
        if host[0] != spec.bucket:
            host = (spec.bucket, buckets[spec.bucket].cpu())
        yield hasher.submit(raw_bytes(tensor_view(host[1], spec)))
    for work in works[arrived:]:
        if work is not None:
            group.wait(work)
