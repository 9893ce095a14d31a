"""The rollout worker's side: join the announced epoch's group, receive the buckets, verify, unpack."""

from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from sparkrl.proto import WeightAnnouncement
from sparkrl.proto import weights_checksum as checksum_of_bytes
from sparkrl.services.common.weight_sync.group import (
    ACK_OK,
    HOLDS,
    JOINED,
    START_GO,
    Backend,
    EpochGroup,
    NotAMember,
    SyncFailed,
    ack_key,
    connect_store,
    decode_shrink,
    joined_key,
    learner_still_there,
    local_address_towards,
    require_backend,
    shrink_key,
    start_key,
)
from sparkrl.services.common.weight_sync.manifest import raw_bytes, tensor_view, unpack

Install = Callable[[dict[str, Tensor], WeightAnnouncement], str]
"""Loads a verified version into the engine; returns the checksum of what the engine now holds."""


class WeightReceiver:
    """Receives announced versions (into fresh buckets unless `reuse_buffers`); keeps the epoch's group
    between versions.

    `timeout_s` bounds every wait (the learner starting the epoch, forming the group, each bucket), so a
    dead or hung learner costs one failed `receive`, never a hang. Any failure drops the group and the
    store connection, so the next epoch starts clean.
    """

    worker_id: str
    backend: Backend
    timeout: timedelta
    reuse_buffers: bool
    _store: dist.TCPStore | None
    _address: tuple[str, int] | None
    _group: EpochGroup | None
    _buckets: list[Tensor]  # kept between receives only with reuse_buffers
    install: Install | None
    failed_epoch: int | None  # the last epoch a receive failed in: dead, the learner forms a new one

    def __init__(
        self,
        worker_id: str,
        *,
        backend: Backend = "gloo",
        timeout_s: float = 60.0,
        reuse_buffers: bool = False,
        install: Install | None = None,
    ) -> None:
        """`reuse_buffers`: receive every version into the same buckets. Fresh buckets cost page faults
        that halve gloo's throughput here, but with reuse the tensors `receive` returned are overwritten
        by the next `receive`, even one that fails: only for a caller that copies them into its engine
        before receiving again. Raises BackendUnavailable (naming the fix) when `backend` cannot run
        here; `vllm_nccl` is received by the engine itself (`services/rollout/vllm_transfer.py`).

        `install`: the acknowledgement waits until the engine holds the version (`receive` then returns
        None); it acknowledges the checksum `install` returns (a vLLM engine's, of what it loaded)."""
        if backend == "vllm_nccl":
            raise ValueError("sync.backend=vllm_nccl is received by vLLM itself: use VllmNativeReceiver")
        require_backend(backend)
        self.worker_id = worker_id
        self.backend = backend
        self.timeout = timedelta(seconds=timeout_s)
        self.reuse_buffers = reuse_buffers
        self._store = None
        self._address = None
        self._group = None
        self._buckets = []
        self.install = install
        self.failed_epoch = None

    @property
    def held_epoch(self) -> int | None:
        """The epoch whose group this receiver holds (it received a version in it), or None."""
        return self._group.epoch if self._group is not None else None

    def receive(self, announcement: WeightAnnouncement) -> dict[str, Tensor] | None:
        """The announced weights, in manifest order, checksum verified (None: `install` loaded them).

        `announcement.members` lists the epoch in rank order (rank i + 1 = members[i]). The tensors are
        views into freshly received buckets (no copy), on the CPU for gloo and on the current GPU for NCCL.
        Raises NotAMember (joining nothing) when this worker is not listed, SyncFailed on any failure.
        """
        epoch, members = announcement.group_epoch, announcement.members
        if self.worker_id not in members:
            self.close()  # excluded: whatever group this worker held is not the learner's any more
            raise NotAMember(f"{self.worker_id} is not a member", epoch=epoch, phase="join")
        if announcement.world_size != len(members) + 1 or announcement.backend != self.backend:
            raise ValueError(
                f"announcement (world_size {announcement.world_size}, {announcement.backend}) does not fit "
                f"{len(members)} members on {self.backend}"
            )
        try:
            store, group = self._connection(announcement, rank=list(members).index(self.worker_id) + 1)
            tensors, checksum = self._receive_buckets(group, announcement)
            if self.install is not None and checksum == announcement.checksum:
                checksum = self.install(tensors, announcement)
            verified = checksum == announcement.checksum
            # The learner waits for one acknowledgement per member; a mismatch is acknowledged too, so
            # the learner learns it now rather than at its timeout.
            ack = ACK_OK if verified else f"bad {checksum}".encode()
            store.set(ack_key(epoch, announcement.version, self.worker_id), ack)
        except SyncFailed:
            self._fail(epoch)
            raise
        except RuntimeError as exc:  # gloo/NCCL errors and timeouts, store errors
            self._fail(epoch)
            raise SyncFailed(str(exc), epoch=epoch, phase="transfer") from exc
        except BaseException:  # a group left with receives posted must never be reused
            self._fail(epoch)
            raise
        if not verified:
            self._fail(epoch)
            raise SyncFailed(f"checksum mismatch: got {checksum}", epoch=epoch, phase="verify")
        return None if self.install is not None else tensors

    def close(self) -> None:
        """Drops the group and the store connection."""
        if self._group is not None:
            self._group.abort()
        self._group = None
        self._store = None
        self._address = None

    def _fail(self, epoch: int) -> None:
        self.failed_epoch = epoch
        self.close()

    def __enter__(self) -> "WeightReceiver":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _connection(self, announcement: WeightAnnouncement, rank: int) -> tuple[dist.TCPStore, EpochGroup]:
        """The store and the epoch's group: the ones held when they still fit, else joined afresh."""
        epoch = announcement.group_epoch
        address = (announcement.rendezvous_host, announcement.rendezvous_port)
        group, store = self._group, self._store
        wanted = (address, epoch, rank, announcement.world_size)
        if group is not None and store is not None:
            held = (self._address, group.epoch, group.rank, group.size)
            if held == wanted and learner_still_there(store, epoch):
                return store, group
        # A healthy nccl4py group from the same learner may be shrunk into this epoch's (if the learner
        # says so once the epoch starts); any other is closed now.
        parent = group if group is not None and group.can_shrink and self._address == address else None
        if parent is not None:
            self._group = None  # out of close()'s reach: aborted below, once shrunk from or not
        self.close()
        try:
            return self._join(announcement, rank, address, parent)
        finally:
            if parent is not None:
                parent.abort()  # shrunk from, or not: this epoch never uses it

    def _join(
        self, announcement: WeightAnnouncement, rank: int, address: tuple[str, int], parent: EpochGroup | None
    ) -> tuple[dist.TCPStore, EpochGroup]:
        epoch = announcement.group_epoch
        try:
            store = connect_store(*address, self.timeout)
        except RuntimeError as exc:
            raise SyncFailed(f"cannot reach the learner's store: {exc}", epoch=epoch, phase="join") from exc
        self._store, self._address = store, address
        # Joined key first: the learner reads these keys to name the members that never showed up, and
        # their values to decide whether the parent's group can be shrunk.
        store.set(joined_key(epoch, self.worker_id), HOLDS + str(parent.epoch).encode() if parent else JOINED)
        try:
            store.wait([start_key(epoch)], self.timeout)
        except dist.DistStoreError as exc:
            raise SyncFailed(
                "the learner did not start the epoch in time", epoch=epoch, phase="join"
            ) from exc
        if store.get(start_key(epoch)) != START_GO:
            raise SyncFailed("the learner aborted the epoch: members were missing", epoch=epoch, phase="join")
        size = announcement.world_size
        try:
            if parent is not None and store.check([shrink_key(epoch)]):
                parent_epoch, excluded = decode_shrink(store.get(shrink_key(epoch)))
                if parent_epoch == parent.epoch:
                    self._group = EpochGroup(
                        store, epoch, rank, size, self.backend, self.timeout, parent=parent, excluded=excluded
                    )
                    return store, self._group
            own = local_address_towards(*address)  # listen where the learner reaches us, only
            self._group = EpochGroup(store, epoch, rank, size, self.backend, self.timeout, address=own)
        except RuntimeError as exc:
            raise SyncFailed(f"forming the group failed: {exc}", epoch=epoch, phase="connect") from exc
        return store, self._group

    def _receive_buckets(
        self, group: EpochGroup, announcement: WeightAnnouncement
    ) -> tuple[dict[str, Tensor], str]:
        sizes = announcement.bucket_sizes()
        buckets = self._bucket_buffers(sizes, group.device)
        # Every receive is posted up front (gloo runs them in order on its own threads), so hashing an
        # arrived bucket overlaps receiving the next ones.
        works = [
            group.broadcast(bucket) if size else None for bucket, size in zip(buckets, sizes, strict=True)
        ]
        checksum = checksum_of_bytes(_bytes_as_they_arrive(group, works, buckets, announcement))
        return unpack(buckets, announcement.manifest), checksum

    def _bucket_buffers(self, sizes: list[int], device: torch.device) -> list[Tensor]:
        held = [(bucket.numel(), bucket.device) for bucket in self._buckets]
        if self.reuse_buffers and held == [(size, device) for size in sizes]:
            return self._buckets
        buckets = [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]
        self._buckets = buckets if self.reuse_buffers else []
        return buckets


def _bytes_as_they_arrive(
    group: EpochGroup, works: list[Any], buckets: list[Tensor], announcement: WeightAnnouncement
) -> Iterator[memoryview]:
    """Each tensor's bytes in manifest order, waiting for buckets in bucket order as they are needed.

    Waiting in bucket order keeps each wait's timeout about one bucket long: every earlier bucket has
    already arrived when a wait starts. A GPU bucket is copied to the host once, not tensor by tensor.
    """
    arrived = 0
    host: tuple[int, Tensor] = (-1, buckets[0])
    for spec in announcement.manifest:
        while arrived <= spec.bucket:
            if works[arrived] is not None:
                group.wait(works[arrived])
            arrived += 1
        if host[0] != spec.bucket:
            host = (spec.bucket, buckets[spec.bucket].cpu())
        yield raw_bytes(tensor_view(host[1], spec))
    for work in works[arrived:]:
        if work is not None:
            group.wait(work)
