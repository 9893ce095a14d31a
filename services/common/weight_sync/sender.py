"""The learner's side: host the rendezvous store, announce a version, broadcast it in buckets."""

import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from sparkrl.proto import WeightAnnouncement
from sparkrl.services.common.weight_sync.group import (
    ACK_OK,
    START_ABORT,
    START_GO,
    Backend,
    EpochGroup,
    SyncFailed,
    ack_key,
    connect_store,
    joined_key,
    missing_keys,
    start_key,
)
from sparkrl.services.common.weight_sync.manifest import (
    bucket_sizes,
    build_manifest,
    pack_into,
    specs_by_bucket,
    weights_checksum,
    zero_copy_bucket,
)


@dataclass(frozen=True)
class SyncReport:
    """One completed broadcast, every member verified. Feeds the `sync/` metrics."""

    version: int
    epoch: int
    members: tuple[str, ...]
    bytes: int
    num_buckets: int
    group_seconds: float  # join + forming the process group; about 0 when the epoch's group was reused
    transfer_seconds: float  # first bucket sent → last bucket delivered
    seconds: float  # whole call: group + transfer + waiting for every member's checksum acknowledgement

    @property
    def gbps(self) -> float:
        """Transfer throughput, GB/s (1e9 bytes): what the process group achieved."""
        return self.bytes / self.transfer_seconds / 1e9 if self.transfer_seconds > 0 else 0.0


class WeightSender:
    """Hosts the rendezvous `TCPStore` and broadcasts each policy version to the epoch's members.

    `timeout_s` bounds every wait: members joining an epoch (so it must cover a worker's longest gap
    between generation steps), forming the group, each bucket (so it must exceed twice the time of the
    largest bucket: two are in flight), and the members' acknowledgements (members hash buckets as they
    arrive, but blake2b runs at ~0.5-1 GB/s on one core, slower than the wire: the wait must cover the
    hashing backlog, about total_bytes / hash rate - transfer time). A dead member fails the sync fast,
    a hung one after `timeout_s`; never later. One thread drives a sender.
    """

    host: str
    port: int
    backend: Backend
    timeout: timedelta
    bucket_bytes: int
    _store: dist.TCPStore
    _group: EpochGroup | None
    _members: tuple[str, ...]
    _epoch: int
    _staging: list[Tensor]

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        backend: Backend = "gloo",
        timeout_s: float = 60.0,
        bucket_bytes: int = 64 << 20,
    ) -> None:
        """`host` is the address workers reach the store at; port 0 picks a free one (see `port`)."""
        self.host = host
        self.backend = backend
        self.timeout = timedelta(seconds=timeout_s)
        self.bucket_bytes = bucket_bytes
        self._store = connect_store(host, port, self.timeout, is_master=True)
        self.port = self._store.port
        self._group = None
        self._members = ()
        self._epoch = -1
        self._staging = []

    def announce(
        self,
        named_tensors: Mapping[str, Tensor],
        *,
        version: int,
        epoch: int,
        members: Sequence[str],
        snapshot_path: str | None = None,
    ) -> WeightAnnouncement:
        """The announcement to publish (in Redis) before `broadcast`: manifest, checksum, rendezvous.

        Hashes every tensor (a device-to-host copy for GPU tensors), so call it once per version.
        """
        manifest = build_manifest(named_tensors, self.bucket_bytes)
        return WeightAnnouncement(
            version=version,
            manifest=manifest,
            total_bytes=sum(spec.nbytes for spec in manifest),
            bucket_bytes=self.bucket_bytes,
            num_buckets=len(bucket_sizes(manifest)),
            checksum=weights_checksum((spec.name, named_tensors[spec.name]) for spec in manifest),
            group_epoch=epoch,
            rendezvous_host=self.host,
            rendezvous_port=self.port,
            world_size=len(members) + 1,
            members=list(members),
            backend=self.backend,
            snapshot_path=snapshot_path,
            created_at=time.time(),
        )

    def broadcast(self, named_tensors: Mapping[str, Tensor], announcement: WeightAnnouncement) -> SyncReport:
        """Sends `named_tensors` as announced to `announcement.members` (rank i + 1 = members[i]) and waits
        for each member's checksum acknowledgement.

        A new `announcement.group_epoch` forms a new group (members must join it); the current one reuses
        the group. Raises SyncFailed on any failure, after which this epoch is dead: the caller drops
        `error.missing` and announces again with a higher epoch. Raises ValueError on misuse.
        """
        members = tuple(announcement.members)
        self._check(named_tensors, announcement, members)
        epoch = announcement.group_epoch
        started = time.perf_counter()
        try:
            group = self._group_for(epoch, members)
            group_done = time.perf_counter()
            self._send(group, named_tensors, announcement)
            transfer_done = time.perf_counter()
            self._await_acks(epoch, announcement.version, members)
        except SyncFailed:
            self._drop_group()
            raise
        except RuntimeError as exc:  # gloo/NCCL errors and timeouts, store errors
            self._drop_group()
            raise SyncFailed(str(exc), epoch=epoch, phase="transfer") from exc
        except BaseException:  # a group left mid-broadcast must never be reused
            self._drop_group()
            raise
        return SyncReport(
            version=announcement.version,
            epoch=epoch,
            members=members,
            bytes=announcement.total_bytes,
            num_buckets=announcement.num_buckets,
            group_seconds=group_done - started,
            transfer_seconds=transfer_done - group_done,
            seconds=time.perf_counter() - started,
        )

    def close(self) -> None:
        """Aborts the current group. The store lives as long as this object (workers may still read it)."""
        self._drop_group()

    def __enter__(self) -> "WeightSender":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check(
        self, named_tensors: Mapping[str, Tensor], announcement: WeightAnnouncement, members: tuple[str, ...]
    ) -> None:
        if not members or len(set(members)) != len(members):
            raise ValueError(f"members must be non-empty and unique, got {list(members)}")
        if announcement.world_size != len(members) + 1:
            raise ValueError(f"world_size {announcement.world_size} does not fit {len(members)} members")
        if announcement.backend != self.backend:
            raise ValueError(f"announced backend {announcement.backend}, this sender uses {self.backend}")
        if build_manifest(named_tensors, announcement.bucket_bytes) != announcement.manifest:
            raise ValueError("named_tensors do not match the announcement's manifest")
        epoch = announcement.group_epoch
        if self._group is not None and self._group.epoch == epoch:
            if members != self._members:
                raise ValueError(f"epoch {epoch} has members {list(self._members)}; new members, new epoch")
        elif epoch <= self._epoch:
            raise ValueError(f"epoch {epoch} was used already (last {self._epoch}); re-form with a higher")

    def _group_for(self, epoch: int, members: tuple[str, ...]) -> EpochGroup:
        if self._group is not None and self._group.epoch == epoch:
            return self._group
        self._drop_group()
        self._epoch = epoch
        # Members write their joined key before they block in the group's rendezvous, so the keys say
        # exactly who never showed up; START_ABORT then releases the ones that did.
        missing = missing_keys(self._store, {m: joined_key(epoch, m) for m in members}, self.timeout)
        if missing:
            self._store.set(start_key(epoch), START_ABORT)
            raise SyncFailed("members did not join in time", epoch=epoch, phase="join", missing=missing)
        self._store.set(start_key(epoch), START_GO)
        try:
            self._group = EpochGroup(self._store, epoch, 0, len(members) + 1, self.backend, self.timeout)
        except RuntimeError as exc:
            raise SyncFailed(f"forming the group failed: {exc}", epoch=epoch, phase="connect") from exc
        self._members = members
        return self._group

    def _send(
        self, group: EpochGroup, named_tensors: Mapping[str, Tensor], announcement: WeightAnnouncement
    ) -> None:
        """Two buckets in flight: packing the next overlaps sending the current one."""
        in_flight: deque[dist.Work] = deque()
        staged = 0
        for specs, size in zip(
            specs_by_bucket(announcement.manifest), announcement.bucket_sizes(), strict=True
        ):
            if size == 0:
                continue  # only empty tensors; receivers skip it too
            if len(in_flight) == 2:
                # The oldest send must finish before its staging buffer can be packed again.
                group.wait(in_flight.popleft())
            bucket = zero_copy_bucket(specs, named_tensors, group.device)
            if bucket is None:
                bucket = pack_into(self._staging_buffer(staged % 2, size, group.device), specs, named_tensors)
                staged += 1
            in_flight.append(group.broadcast(bucket))
        for work in in_flight:
            group.wait(work)

    def _staging_buffer(self, slot: int, size: int, device: torch.device) -> Tensor:
        while len(self._staging) <= slot:
            self._staging.append(torch.empty(0, dtype=torch.uint8, device=device))
        if self._staging[slot].numel() < size or self._staging[slot].device != device:
            self._staging[slot] = torch.empty(max(size, self.bucket_bytes), dtype=torch.uint8, device=device)
        return self._staging[slot]

    def _await_acks(self, epoch: int, version: int, members: tuple[str, ...]) -> None:
        keys = {member: ack_key(epoch, version, member) for member in members}
        missing = missing_keys(self._store, keys, self.timeout)
        if missing:
            raise SyncFailed("no acknowledgement in time", epoch=epoch, phase="verify", missing=missing)
        values = self._store.multi_get(list(keys.values()))
        for key in keys.values():
            self._store.delete_key(key)  # one key per member and version: do not let the store grow
        bad = [member for member, value in zip(members, values, strict=True) if value != ACK_OK]
        if bad:
            raise SyncFailed("checksum mismatch", epoch=epoch, phase="verify", missing=bad)

    def _drop_group(self) -> None:
        if self._group is not None:
            self._group.abort()
        self._group = None
        self._members = ()
