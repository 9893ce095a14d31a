"""The learner's side: host the rendezvous store, announce a version, broadcast it in buckets."""

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

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
    encode_shrink,
    host_store,
    joined_key,
    missing_keys,
    require_backend,
    shrink_key,
    shrink_plan,
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

_ACK_POLL_S = 0.01  # how often the learner looks for the members' acknowledgements
_GONE_POLL_S = 0.5  # how often the learner asks whether a member it waits for is gone
CLOSE_WAIT_S = 3.0  # how long close() waits for dead epochs to be torn down

log = logging.getLogger("sparkrl.weight_sync")


@dataclass(frozen=True)
class SyncReport:
    """One completed broadcast, every member verified. Feeds the `sync/` metrics."""

    version: int
    epoch: int
    members: tuple[str, ...]
    bytes: int
    num_buckets: int
    group_seconds: float  # join + forming the process group; about 0 when the epoch's group was reused
    transfer_seconds: float  # first bucket sent → every member acknowledged and every send complete
    seconds: float  # whole call: group + transfer + waiting for every member's checksum acknowledgement

    @property
    def gbps(self) -> float:
        """Transfer throughput, GB/s (1e9 bytes): what the process group achieved."""
        return self.bytes / self.transfer_seconds / 1e9 if self.transfer_seconds > 0 else 0.0


_ABORT_THREAD = "abort-epoch"


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
    straggler_s: float
    _store: dist.TCPStore
    _group: Any  # EpochGroup, or a VllmNativeGroup (sync.backend vllm_nccl); None between epochs
    _aborting: list[threading.Thread]  # dead epochs being torn down (see _drop_group)
    _members: tuple[str, ...]
    _epoch: int
    _staging: list[Tensor]
    incarnation: int  # carried by every announcement, with `_sequence`: what makes a replay detectable
    _sequence: int

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        backend: Backend = "gloo",
        timeout_s: float = 60.0,
        bucket_bytes: int = 64 << 20,
        straggler_s: float = 5.0,
    ) -> None:
        """`host` is the address workers reach the store at; port 0 picks a free one (see `port`).
        `straggler_s`: once a member has acknowledged, how much longer the others get. Raises
        BackendUnavailable (naming the fix) when `backend`'s library or device is not here."""
        require_backend(backend)
        self.host = host
        self.straggler_s = straggler_s
        # Members known to be gone (the caller's liveness view, e.g. expired heartbeats): a dead member is
        # cut as soon as that is known, not after `timeout`, and the live ones are not blamed with it.
        self.gone: Callable[[Sequence[str]], set[str]] = lambda members: set()
        self.backend = backend
        self.timeout = timedelta(seconds=timeout_s)
        self.bucket_bytes = bucket_bytes
        self._store = host_store(host, port, self.timeout)
        self.port = self._store.port
        self._group = None
        self._members = ()
        self._aborting = []
        self._epoch = -1
        self._staging = []
        self.incarnation = time.time_ns()  # a restarted learner's is larger: workers follow it back
        self._sequence = -1

    def announce(
        self,
        named_tensors: Mapping[str, Tensor],
        *,
        version: int,
        epoch: int,
        members: Sequence[str],
        snapshot_path: str | None = None,
    ) -> WeightAnnouncement:
        """The announcement to publish (in Redis) before `broadcast`: manifest, checksum, rendezvous, and
        this sender's incarnation and the announcement's sequence number (its freshness).

        Hashes every tensor (a device-to-host copy for GPU tensors), so call it once per version.
        """
        manifest = build_manifest(named_tensors, self.bucket_bytes)
        self._sequence += 1
        return WeightAnnouncement(
            incarnation=self.incarnation,
            sequence=self._sequence,
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
        in_flight: deque[Any] = deque()
        group: Any = None
        try:
            group = self._group_for(epoch, members)
            group_done = time.perf_counter()
            in_flight.extend(self._send(group, named_tensors, announcement))
            # Acknowledgements first: a member that stopped reading must not hold up the healthy ones.
            self._await_acks(epoch, announcement.version, members)
            for work in in_flight:
                group.wait(work)
            transfer_done = time.perf_counter()
        except SyncFailed:
            group = None  # the traceback keeps this frame: it must not hold the group (see _drop_group)
            self._drop_group(in_flight)
            raise
        except RuntimeError as exc:  # gloo/NCCL errors and timeouts, store errors
            group = None
            self._drop_group(in_flight)
            raise SyncFailed(str(exc), epoch=epoch, phase="transfer") from exc
        except BaseException:  # a group left mid-broadcast must never be reused
            group = None
            self._drop_group(in_flight)
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

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Aborts the current group and waits a little (`wait_s`) for earlier epochs' aborts. A dead
        epoch with a member that stopped reading (SIGSTOP) waits out the whole timeout in gloo's
        destructor: that teardown is left to the process exit rather than held up for. The store lives as
        long as this object."""
        self._drop_group()
        deadline = time.monotonic() + min(wait_s, self.timeout.total_seconds())
        for thread in self._aborting:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._aborting = [t for t in self._aborting if t.is_alive()]
        if self._aborting:
            log.info("leaving %d dead weight-sync epochs to be torn down at exit", len(self._aborting))

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

    def _group_for(self, epoch: int, members: tuple[str, ...]) -> Any:
        if self._group is not None and self._group.epoch == epoch:
            return self._group
        # A healthy nccl4py group may be shrunk into the new epoch's; any other is torn down now.
        parent, parent_members = self._group, self._members
        self._group, self._members = None, ()
        if parent is not None and not getattr(parent, "can_shrink", False):
            self._retire(parent)
            parent = None
        self._epoch = epoch
        form: Callable[[], Any] | None = None
        try:
            # Members write their joined key before they block in the group's rendezvous, so the keys say
            # exactly who never showed up; START_ABORT then releases the ones that did.
            keys = {m: joined_key(epoch, m) for m in members}
            missing = missing_keys(self._store, keys, self.timeout)
            if missing:
                self._store.set(start_key(epoch), START_ABORT)
                raise SyncFailed("members did not join in time", epoch=epoch, phase="join", missing=missing)
            form = self._prepare(epoch, members, keys, parent, parent_members)
            self._store.set(start_key(epoch), START_GO)
            try:
                self._group = form()
            except RuntimeError as exc:
                raise SyncFailed(f"forming the group failed: {exc}", epoch=epoch, phase="connect") from exc
        finally:
            if parent is not None:
                self._retire(parent)  # shrunk from, or not: the new epoch never uses it
            parent = form = None  # a traceback keeps this frame: it must not keep the parent alive
        self._members = members
        return self._group

    def _prepare(
        self,
        epoch: int,
        members: tuple[str, ...],
        keys: dict[str, str],
        parent: EpochGroup | None,
        parent_members: tuple[str, ...],
    ) -> Callable[[], Any]:
        """Writes what the members read once the epoch starts, and returns how rank 0 then forms the group:
        vLLM's transfer group (its plan of NCCL ranks), a shrink of the parent's group, or a new one."""
        size = len(members) + 1
        if self.backend == "vllm_nccl":
            from sparkrl.services.common.weight_sync.vllm_native import VllmNativeGroup, write_plan

            plan = write_plan(self._store, epoch, members, self.host)
            return lambda: VllmNativeGroup(plan, epoch, self.timeout)
        if parent is not None:
            joined = dict(zip(members, self._store.multi_get(list(keys.values())), strict=True))
            excluded = shrink_plan(parent.epoch, parent_members, members, joined)
            if excluded is not None:
                self._store.set(shrink_key(epoch), encode_shrink(parent.epoch, excluded))
                return lambda: EpochGroup(
                    self._store, epoch, 0, size, self.backend, self.timeout, parent=parent, excluded=excluded
                )
        return lambda: EpochGroup(self._store, epoch, 0, size, self.backend, self.timeout, address=self.host)

    def _send(
        self, group: Any, named_tensors: Mapping[str, Tensor], announcement: WeightAnnouncement
    ) -> deque[Any]:
        """Post the buckets; returns the works still in flight.

        gloo: every bucket at once (each packed into its own buffer), so a member that stops reading holds
        up nobody else: the healthy members receive everything and acknowledge while its sends wait.
        NCCL (torch's or nccl4py's): two in flight, packing the next while the current one goes out (a
        collective moves at the pace of its slowest rank anyway). vllm_nccl: vLLM's engine takes the
        tensors themselves, in manifest order, as one transfer.
        """
        if not isinstance(group, EpochGroup):
            return deque([group.send(named_tensors, announcement)])
        in_flight: deque[Any] = deque()
        staged = 0
        all_at_once = self.backend == "gloo"
        for specs, size in zip(
            specs_by_bucket(announcement.manifest), announcement.bucket_sizes(), strict=True
        ):
            if size == 0:
                continue  # only empty tensors; receivers skip it too
            if len(in_flight) == 2 and not all_at_once:
                # The oldest send must finish before its staging buffer can be packed again.
                group.wait(in_flight.popleft())
            bucket = zero_copy_bucket(specs, named_tensors, group.device)
            if bucket is None:
                slot = staged if all_at_once else staged % 2
                bucket = pack_into(self._staging_buffer(slot, size, group.device), specs, named_tensors)
                staged += 1
            in_flight.append(group.broadcast(bucket))
        return in_flight

    def _staging_buffer(self, slot: int, size: int, device: torch.device) -> Tensor:
        while len(self._staging) <= slot:
            self._staging.append(torch.empty(0, dtype=torch.uint8, device=device))
        if self._staging[slot].numel() < size or self._staging[slot].device != device:
            self._staging[slot] = torch.empty(max(size, self.bucket_bytes), dtype=torch.uint8, device=device)
        return self._staging[slot]

    def _await_acks(self, epoch: int, version: int, members: tuple[str, ...]) -> None:
        """Every member's checksum acknowledgement, within `timeout`; and once some have answered, the
        rest get `straggler_s` more: a member that hangs is named and dropped in seconds, not minutes."""
        keys = {member: ack_key(epoch, version, member) for member in members}
        deadline = time.monotonic() + self.timeout.total_seconds()
        cut: float | None = None  # set when the first acknowledgement arrives
        waiting = dict(keys)
        look = time.monotonic() + _GONE_POLL_S
        while waiting:
            answered = [m for m, key in waiting.items() if self._store.check([key])]
            for member in answered:
                del waiting[member]
            now = time.monotonic()
            if waiting and now >= look:
                look = now + _GONE_POLL_S
                dead = sorted(self.gone(tuple(waiting)) & set(waiting))
                if dead:
                    why = "gone (its heartbeat expired)"
                    raise SyncFailed(why, epoch=epoch, phase="verify", missing=dead)
            if answered and cut is None:
                cut = now + self.straggler_s
            if waiting and now >= min(deadline, cut if cut is not None else deadline):
                missing = sorted(waiting)
                why = "no acknowledgement in time" if len(missing) == len(members) else "stragglers cut off"
                raise SyncFailed(why, epoch=epoch, phase="verify", missing=missing)
            if waiting:
                time.sleep(_ACK_POLL_S)
        values = self._store.multi_get(list(keys.values()))
        for key in keys.values():
            self._store.delete_key(key)  # one key per member and version: do not let the store grow
        bad = [member for member, value in zip(members, values, strict=True) if value != ACK_OK]
        if bad:
            raise SyncFailed("checksum mismatch", epoch=epoch, phase="verify", missing=bad)

    def _drop_group(self, in_flight: deque[Any] | None = None) -> None:
        """Abort the epoch's group off this thread. gloo's abort, and the destructors of the group and of a
        send still queued to a member that stopped reading, wait out the timeout: the thread must own the
        last references (no local here holds the group; the caller's deque is emptied, its local cleared),
        so they wait there and the next epoch starts now."""
        if self._group is None and not in_flight:
            return
        held = [self._group, list(in_flight or ())]
        self._group, self._members = None, ()
        if in_flight is not None:
            in_flight.clear()
        self._abort_off_thread(held)

    def _retire(self, group: Any) -> None:
        """Abort a group this sender no longer uses (the one shrunk from, or not shrinkable), off thread."""
        self._abort_off_thread([group, []])

    def _abort_off_thread(self, held: list) -> None:  # type: ignore[type-arg]
        thread = threading.Thread(target=_abort, args=(held,), name=_ABORT_THREAD, daemon=True)
        thread.start()
        self._aborting = [t for t in self._aborting if t.is_alive()] + [thread]


def epochs_tearing_down() -> int:
    """Dead epochs whose teardown still runs on its thread (see `WeightSender.close`). A process that
    finalizes its interpreter meanwhile is aborted by gloo's threads ("terminate called without an active
    exception"): its entry point exits with `os._exit` instead, once everything is written."""
    return sum(1 for t in threading.enumerate() if t.name == _ABORT_THREAD and t.is_alive())


def _abort(held: list) -> None:  # type: ignore[type-arg]
    """Runs on its own thread with the only references to a dead epoch's group and works."""
    group, works = held.pop(0), held.pop(0)
    if group is not None:
        group.abort()
    works.clear()
    del group  # the group's destructor (which may wait out the timeout) runs here, not on the caller's
