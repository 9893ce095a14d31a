"""The learner's side of the contract: host the store, announce a version, send it, wait for every member's
checksum acknowledgement. The same for every backend; the transport moves the bytes (`transport.py`)."""

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

from torch import Tensor

from sparkrl.proto import WeightAnnouncement
from sparkrl.proto.weights import root_checksum
from sparkrl.services.common.weight_sync.backends import make_transport
from sparkrl.services.common.weight_sync.delta import DeltaBase
from sparkrl.services.common.weight_sync.errors import SyncFailed
from sparkrl.services.common.weight_sync.manifest import bucket_sizes, build_manifest, tensor_digests
from sparkrl.services.common.weight_sync.rendezvous import (
    ACK_OK,
    CURRENT_KEY,
    START_ABORT,
    START_GO,
    Current,
    ack_key,
    host_store,
    joined_key,
    start_key,
)
from sparkrl.services.common.weight_sync.sealed_store import SealedStore
from sparkrl.services.common.weight_sync.transport import Backend, Rendezvous, Sending, Transport

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
    """Hosts the rendezvous `TCPStore` and sends each policy version to the epoch's members.

    `timeout_s` bounds every wait: members joining an epoch (so it must cover a worker's longest gap
    between generation steps), forming the link, each bucket (so it must exceed twice the time of the
    largest bucket: two are in flight), and the members' acknowledgements (members hash buckets as they
    arrive, on every core (`hashing.py`), but that may still be slower than the wire: the wait must cover
    the hashing backlog, about total_bytes / hash rate - transfer time). A dead member fails the sync fast,
    a hung one after `timeout_s`; never later. One thread drives a sender.

    Every value in the store is sealed with `secret` (`sealed_store.py`): a member's joined key or
    acknowledgement that does not verify is refused (logged, counted in `refused_writes`) and waited past.
    """

    host: str
    port: int
    backend: Backend
    transport: Transport  # not joined: forms each epoch's link
    timeout: timedelta
    bucket_bytes: int
    straggler_s: float
    gone: Callable[[Sequence[str]], set[str]]
    incarnation: int  # carried by every announcement, with `_sequence`: what makes a replay detectable
    _sequence: int
    _store: SealedStore
    _link: Transport | None  # the current epoch's; None between epochs
    _epoch: int  # the newest epoch started (joined or failed): never started again
    _aborting: list[threading.Thread]  # dead epochs being torn down (see _drop_link)

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        backend: Backend = "gloo",
        timeout_s: float = 60.0,
        bucket_bytes: int = 64 << 20,
        straggler_s: float = 5.0,
        transport: Transport | None = None,
        secret: str | None = None,
        delta: bool = False,
    ) -> None:
        """`host` is the address workers reach the store at; port 0 picks a free one (see `port`).
        `secret`: `sync.secret`, which seals the store's values (None: a seal anyone can make).
        `straggler_s`: once a member has acknowledged, how much longer the others get. `transport`: one
        made already (else `backend`'s). Raises BackendUnavailable (naming the fix) when the backend's
        library or device is not here. `delta`: `sync.delta` (send what changed, delta.py)."""
        self.transport = transport or make_transport(backend)
        self.backend = self.transport.name
        self.host = host
        self.straggler_s = straggler_s
        # Members known to be gone (the caller's liveness view: expired heartbeats, a worker that said it is
        # stopping): a dead member is cut as soon as that is known, not after `timeout`, and the live ones
        # are not blamed with it.
        self.gone = lambda members: set()
        self.timeout = timedelta(seconds=timeout_s)
        self.bucket_bytes = bucket_bytes
        self.incarnation = time.time_ns()  # a restarted learner's is larger: workers follow it back
        store = host_store(host, port, self.timeout)
        self.port = store.port
        self._store = SealedStore(store, secret, self.incarnation)
        self._link = None
        self._aborting = []
        self._epoch = -1
        self._sequence = -1
        # sync.delta: the last version announced, which the next is a delta against (delta.py)
        self.delta = DeltaBase() if delta else None
        self._wire: tuple[int, Mapping[str, Tensor]] = (-1, {})  # what the newest announcement sends
        # (epoch, members, checksum) of the last broadcast every member acknowledged: what they hold
        self._synced: tuple[int, tuple[str, ...], str] | None = None

    @property
    def refused_writes(self) -> int:
        """Values refused in the store so far (their seal did not verify): forged, or a worker whose
        `sync.secret` differs."""
        return self._store.refused

    def announce(
        self,
        named_tensors: Mapping[str, Tensor],
        *,
        version: int,
        epoch: int,
        members: Sequence[str],
        snapshot_path: str | None = None,
        adapter_base: str | None = None,
    ) -> WeightAnnouncement:
        """The announcement to publish (in Redis) before `broadcast`: manifest, checksum, rendezvous, and
        this sender's incarnation and the announcement's sequence number (its freshness). `adapter_base`:
        the tensors are a LoRA adapter for the base of that checksum (`WeightAnnouncement.adapter_base`).
        With `delta`, the version goes as a delta against the last one announced when every member
        acknowledged that one in this epoch (`WeightAnnouncement.delta_base`); else whole.

        Hashes every tensor on every core (a device-to-host copy for GPU tensors; each tensor's digest goes
        into its spec, for receivers to verify it as it lands), so call it once per version.
        """
        digests = tensor_digests(named_tensors.items())
        checksum, wire, base = root_checksum(digests), named_tensors, None
        if self.delta is not None:  # sync.delta: what changed, when every member holds the last version
            synced = self._synced == (epoch, tuple(members), self.delta.checksum)  # all hold the base
            held = [self.delta.checksum if synced else None] * len(members)
            wire, base = self.delta.wire_for(named_tensors, checksum, held)
            if base is not None:
                digests = tensor_digests(wire.items())
        manifest = build_manifest(wire, self.bucket_bytes)
        manifest = [
            spec.model_copy(update={"digest": d.hex()}) for spec, d in zip(manifest, digests, strict=True)
        ]
        self._sequence += 1
        self._wire = (self._sequence, wire)
        return WeightAnnouncement(
            incarnation=self.incarnation,
            sequence=self._sequence,
            version=version,
            manifest=manifest,
            total_bytes=sum(spec.nbytes for spec in manifest),
            bucket_bytes=self.bucket_bytes,
            num_buckets=len(bucket_sizes(manifest)),
            checksum=checksum,
            delta_base=base,
            group_epoch=epoch,
            rendezvous_host=self.host,
            rendezvous_port=self.port,
            world_size=len(members) + 1,
            members=list(members),
            backend=self.backend,
            snapshot_path=snapshot_path,
            adapter_base=adapter_base,
            created_at=time.time(),
        )

    def published(self, announcement: WeightAnnouncement) -> None:
        """Records `announcement`, now published in Redis, as this learner's newest in its store. Workers
        check what they read in Redis against it: an older one is a replay (never followed by a worker that
        has seen nothing newer), and an older epoch is over (a joiner fails at once, not at the timeout).
        After the Redis write: a worker that reads the new one before this record still finds it current."""
        if announcement.incarnation != self.incarnation:
            raise ValueError(
                f"announcement of learner {announcement.incarnation}; this one is {self.incarnation}"
            )
        current = Current(announcement.incarnation, announcement.sequence, announcement.group_epoch)
        self._store.set(CURRENT_KEY, current.encode(), scoped=False)  # it names its learner itself

    def broadcast(self, named_tensors: Mapping[str, Tensor], announcement: WeightAnnouncement) -> SyncReport:
        """Sends `named_tensors` as announced to `announcement.members` (rank i + 1 = members[i]) and waits
        for each member's checksum acknowledgement.

        A new `announcement.group_epoch` forms a new link (members must join it); the current one reuses
        the link. Raises SyncFailed on any failure, after which this epoch is dead: the caller drops
        `error.missing` and announces again with a higher epoch. Raises ValueError on misuse.
        """
        members = tuple(announcement.members)
        if announcement.delta_base is not None:  # the delta computed when it was announced
            sequence, wire = self._wire
            if sequence != announcement.sequence:
                raise ValueError("a delta version is broadcast right after its announcement, not later")
            named_tensors = wire
        self._check(named_tensors, announcement, members)
        epoch = announcement.group_epoch
        self._synced = None  # until every member acknowledges this version
        started = time.perf_counter()
        in_flight: list[Sending] = []
        link: Transport | None = None
        try:
            link = self._link_for(epoch, members)
            linked = time.perf_counter()
            in_flight.append(link.send(named_tensors, announcement))
            # Acknowledgements first: a member that stopped reading must not hold up the healthy ones.
            self._await_acks(epoch, announcement.version, members)
            in_flight[0].wait()
            sent = time.perf_counter()
            self._synced = (epoch, members, announcement.checksum)
        except SyncFailed:
            link = None  # the traceback keeps this frame: it must not hold the link (see _drop_link)
            self._drop_link(in_flight)
            raise
        except RuntimeError as exc:  # the transport's errors and timeouts, store errors
            link = None
            self._drop_link(in_flight)
            raise SyncFailed(str(exc), epoch=epoch, phase="transfer") from exc
        except BaseException:  # a link left mid-send must never be reused
            link = None
            self._drop_link(in_flight)
            raise
        return SyncReport(
            version=announcement.version,
            epoch=epoch,
            members=members,
            bytes=announcement.total_bytes,
            num_buckets=announcement.num_buckets,
            group_seconds=linked - started,
            transfer_seconds=sent - linked,
            seconds=time.perf_counter() - started,
        )

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Aborts the current link and waits a little (`wait_s`) for earlier epochs' aborts. A dead
        epoch with a member that stopped reading (SIGSTOP) waits out the whole timeout in gloo's
        destructor: that teardown is left to the process exit rather than held up for. The store lives as
        long as this object."""
        self._drop_link()
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
        layout = [spec.model_copy(update={"digest": None}) for spec in announcement.manifest]
        if build_manifest(named_tensors, announcement.bucket_bytes) != layout:  # digests: the receivers'
            raise ValueError("named_tensors do not match the announcement's manifest")
        epoch, link = announcement.group_epoch, self._link
        if link is not None and link.epoch == epoch:
            if members != link.members:
                raise ValueError(f"epoch {epoch} has members {list(link.members)}; new members, new epoch")
        elif epoch <= self._epoch:
            raise ValueError(f"epoch {epoch} was used already (last {self._epoch}); re-form with a higher")

    def _link_for(self, epoch: int, members: tuple[str, ...]) -> Transport:
        """The epoch's link: the current one, or joined now (the join step, then the transport's own)."""
        if self._link is not None and self._link.epoch == epoch:
            return self._link
        # A healthy link of a transport that shrinks may be derived into the new epoch's; any other is
        # torn down now.
        held, self._link = self._link, None
        if held is not None and not held.shrinks:
            self._retire(held)
            held = None
        self._epoch = epoch
        rendezvous = Rendezvous(self._store, epoch, 0, members, self.host, self.port, self.timeout, held)
        try:
            # Members write their joined key before they block in the link's own rendezvous, so the keys
            # say exactly who never showed up; START_ABORT then releases the ones that did.
            joined = self._store.wait({m: joined_key(epoch, m) for m in members}, self.timeout)
            missing = [m for m in members if m not in joined]
            if missing:
                self._store.set(start_key(epoch), START_ABORT)
                raise SyncFailed("members did not join in time", epoch=epoch, phase="join", missing=missing)
            self.transport.plan(rendezvous, joined)
            self._store.set(start_key(epoch), START_GO)
            try:
                self._link = self.transport.join(rendezvous)
            except RuntimeError as exc:
                raise SyncFailed(f"forming the group failed: {exc}", epoch=epoch, phase="connect") from exc
        finally:
            if held is not None:
                self._retire(held)  # shrunk from, or not: the new epoch never uses it
            held = rendezvous = None  # a traceback keeps this frame: it must not keep the held link alive
        return self._link

    def _await_acks(self, epoch: int, version: int, members: tuple[str, ...]) -> None:
        """Every member's checksum acknowledgement, within `timeout`; and once some have answered, the
        rest get `straggler_s` more: a member that hangs is named and dropped in seconds, not minutes."""
        keys = {member: ack_key(epoch, version, member) for member in members}
        deadline = time.monotonic() + self.timeout.total_seconds()
        cut: float | None = None  # set when the first acknowledgement arrives
        waiting, acks = dict(keys), {}
        look = time.monotonic() + _GONE_POLL_S
        while waiting:
            for member, key in list(waiting.items()):
                # Only a verified acknowledgement answers: a forged one is refused, its member waited for.
                if (ack := self._store.value(key)) is not None:
                    acks[member] = ack
                    del waiting[member]
            now = time.monotonic()
            if waiting and now >= look:
                look = now + _GONE_POLL_S
                dead = sorted(self.gone(tuple(waiting)) & set(waiting))
                if dead:
                    why = "gone (stopping, or its heartbeat expired)"
                    raise SyncFailed(why, epoch=epoch, phase="verify", missing=dead)
            if acks and cut is None:
                cut = now + self.straggler_s
            if waiting and now >= min(deadline, cut if cut is not None else deadline):
                missing = sorted(waiting)
                why = "no acknowledgement in time" if len(missing) == len(members) else "stragglers cut off"
                raise SyncFailed(why, epoch=epoch, phase="verify", missing=missing)
            if waiting:
                time.sleep(_ACK_POLL_S)
        for key in keys.values():
            self._store.delete_key(key)  # one key per member and version: do not let the store grow
        bad = [member for member in members if acks[member] != ACK_OK]
        if bad:
            raise SyncFailed("checksum mismatch", epoch=epoch, phase="verify", missing=bad)

    def _drop_link(self, in_flight: list[Sending] | None = None) -> None:
        """Abort the epoch's link off this thread. gloo's abort, and the destructors of the group and of a
        send still queued to a member that stopped reading, wait out the timeout: the thread must own the
        last references (no local here holds the link; the caller's list is emptied, its local cleared),
        so they wait there and the next epoch starts now."""
        if self._link is None and not in_flight:
            return
        held = [self._link, list(in_flight or ())]
        self._link = None
        if in_flight is not None:
            in_flight.clear()
        self._abort_off_thread(held)

    def _retire(self, link: Transport) -> None:
        """Abort a link this sender no longer uses (the one shrunk from, or one that cannot), off thread."""
        self._abort_off_thread([link, []])

    def _abort_off_thread(self, held: list) -> None:  # type: ignore[type-arg]
        thread = threading.Thread(target=_abort, args=(held,), name=_ABORT_THREAD, daemon=True)
        thread.start()
        self._aborting = [t for t in self._aborting if t.is_alive()] + [thread]


def _abort(held: list) -> None:  # type: ignore[type-arg]
    """Runs on its own thread with the only references to a dead epoch's link and sends."""
    link, sends = held.pop(0), held.pop(0)
    if link is not None:
        link.abort()
    sends.clear()
    del link  # the link's destructor (which may wait out the timeout) runs here, not on the caller's
