"""The worker's side of the contract: join the announced epoch, receive over its link, verify, acknowledge.
The same for every backend; the transport moves the bytes (`transport.py`)."""

from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

from torch import Tensor

from sparkrl.proto import WeightAnnouncement
from sparkrl.services.common.weight_sync.backends import make_transport
from sparkrl.services.common.weight_sync.delta import DeltaBase, DeltaError
from sparkrl.services.common.weight_sync.errors import EpochOver, NotAMember, SyncFailed
from sparkrl.services.common.weight_sync.manifest import weights_checksum
from sparkrl.services.common.weight_sync.rendezvous import (
    ACK_OK,
    START_GO,
    ack_key,
    connect_store,
    epoch_over,
    joined_key,
    learner_still_there,
    start_key,
)
from sparkrl.services.common.weight_sync.sealed_store import SealedStore
from sparkrl.services.common.weight_sync.transport import (
    Backend,
    Delivery,
    LoadedInPlace,
    Received,
    Rendezvous,
    Transport,
)

Install = Callable[[dict[str, Tensor], WeightAnnouncement], str]
"""Loads a verified version into the engine; returns the checksum of what the engine now holds."""

Address = tuple[str, int]  # the learner's store


class WeightReceiver:
    """Receives announced versions; keeps the epoch's link between versions.

    `timeout_s` bounds every wait (the learner starting the epoch, forming the link, each bucket), so a
    dead or hung learner costs one failed `receive`, never a hang. Any failure drops the link and the
    store connection, so the next epoch starts clean.

    What it writes into the learner's store is sealed with `secret`, and what it reads there (the start,
    the learner's current record, a transport's plan) must verify (`sealed_store.py`).
    """

    worker_id: str
    backend: Backend
    transport: Transport  # not joined: forms each epoch's link
    timeout: timedelta
    install: Install | None
    failed_epoch: int | None  # the last epoch a receive failed in: dead, the learner forms a new one
    _secret: str | None
    _store: SealedStore | None
    _address: Address | None
    _link: Transport | None

    def __init__(
        self,
        worker_id: str,
        *,
        backend: Backend = "gloo",
        timeout_s: float = 60.0,
        reuse_buffers: bool = False,
        install: Install | None = None,
        transport: Transport | None = None,
        secret: str | None = None,
        delta: bool = False,
    ) -> None:
        """`delta`: `sync.delta`, keep a CPU copy of the version held, to apply the next as a delta
        (delta.py) — a version sent as a delta against another one is refused. `secret`: `sync.secret`,
        which seals the values of the learner's store (None: a seal anyone can make). `reuse_buffers`:
        receive every version into the same buckets (`buckets.Buffers`): the tensors `receive` returned
        are overwritten by the next `receive`, even one that fails. `transport`: one made already
        (`make_transport`: vLLM's own transfer needs the engine); else `backend`'s. Raises
        BackendUnavailable (naming the fix) when the backend cannot run here.

        `install`: a version that arrives as tensors is loaded by it before the acknowledgement, which
        then is of the checksum `install` returns (a vLLM engine's, of what it loaded); `receive` returns
        `LoadedInPlace`."""
        self.transport = transport or make_transport(backend, reuse_buffers=reuse_buffers)
        self.backend = self.transport.name
        self.worker_id = worker_id
        self.timeout = timedelta(seconds=timeout_s)
        self.install = install
        self.failed_epoch = None
        self._secret = secret
        self._store, self._address, self._link = None, None, None
        self.delta = DeltaBase() if delta else None

    @property
    def held_epoch(self) -> int | None:
        """The epoch whose link this receiver holds (it received a version in it), or None."""
        return self._link.epoch if self._link is not None else None

    def receive(self, announcement: WeightAnnouncement) -> Delivery:
        """The announced version, checksum verified: `Received` (its tensors, in manifest order, views into
        the received buckets: on the CPU for gloo, the current GPU for NCCL), or `LoadedInPlace` (the
        engine holds it already: vLLM's own transfer, or `install`).

        `announcement.members` lists the epoch in rank order (rank i + 1 = members[i]). Raises NotAMember
        (joining nothing) when this worker is not listed, EpochOver (at once) when the epoch can no longer
        be joined, SyncFailed on any failure.
        """
        epoch, members = announcement.group_epoch, announcement.members
        if self.worker_id not in members:
            self.close()  # excluded: whatever link this worker held is not the learner's any more
            raise NotAMember(f"{self.worker_id} is not a member", epoch=epoch, phase="join")
        if announcement.world_size != len(members) + 1 or announcement.backend != self.backend:
            raise ValueError(
                f"announcement (world_size {announcement.world_size}, {announcement.backend}) does not fit "
                f"{len(members)} members on {self.backend}"
            )
        try:
            store, link = self._connection(announcement)
            received = self._whole(link.receive(announcement), announcement)
            delivery = self._installed(received, announcement)
            refused = _refused(delivery, announcement)
            # The learner waits for one acknowledgement per member; a refusal is acknowledged too, so the
            # learner learns it now rather than at its timeout.
            ack = ACK_OK if refused is None else f"bad {delivery.checksum}".encode()
            store.set(ack_key(epoch, announcement.version, self.worker_id), ack)
        except SyncFailed:
            self._fail(epoch)
            raise
        except RuntimeError as exc:  # the transport's errors and timeouts, store errors
            self._fail(epoch)
            raise SyncFailed(str(exc), epoch=epoch, phase="transfer") from exc
        except BaseException:  # a link left with receives posted must never be reused
            self._fail(epoch)
            raise
        if refused is not None:
            self._fail(epoch)
            if isinstance(delivery, LoadedInPlace) and delivery.undo is not None:
                delivery.undo()  # after the acknowledgement: the learner need not wait for the reload
            raise SyncFailed(refused, epoch=epoch, phase="verify")
        if self.delta is not None and isinstance(received, Received):  # the next delta's base
            if announcement.delta_base is None:  # a whole version: views into the buckets, copied
                self.delta.keep(received.tensors, announcement.checksum)
            else:  # the delta was applied to the base itself, now verified
                self.delta.checksum = announcement.checksum
        return delivery

    def close(self) -> None:
        """Drops the link and the store connection."""
        if self._link is not None:
            self._link.abort()
        self._store, self._address, self._link = None, None, None

    def __enter__(self) -> "WeightReceiver":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _fail(self, epoch: int) -> None:
        self.failed_epoch = epoch
        self.close()

    def _whole(self, delivery: Delivery, announcement: WeightAnnouncement) -> Delivery:
        """A delta (`announcement.delta_base`) applied to the version held, with the whole version's
        checksum; anything else as it came."""
        base = announcement.delta_base
        if base is None or not isinstance(delivery, Received) or delivery.problem is not None:
            return delivery
        held = self.delta.checksum if self.delta is not None else None
        if self.delta is None or self.delta.tensors is None or held != base:
            why = "sync.delta is off here" if self.delta is None else f"this worker holds {held or 'no copy'}"
            return replace(delivery, problem=f"a delta against {base[:12]}…, and {why}")
        try:
            tensors = self.delta.apply(delivery.tensors, announcement.checksum)
        except DeltaError as exc:
            return replace(delivery, problem=f"the delta does not apply: {exc}")
        return Received(tensors, weights_checksum(tensors.items()))

    def _installed(self, delivery: Delivery, announcement: WeightAnnouncement) -> Delivery:
        """With `install`, verified tensors go into the engine: the engine's checksum is what counts."""
        if self.install is None or not isinstance(delivery, Received):
            return delivery
        if delivery.checksum != announcement.checksum:
            return delivery
        return LoadedInPlace(self.install(delivery.tensors, announcement))

    def _connection(self, announcement: WeightAnnouncement) -> tuple[SealedStore, Transport]:
        """The store and the epoch's link: the ones held when they still fit, else joined afresh."""
        epoch, members = announcement.group_epoch, tuple(announcement.members)
        address = (announcement.rendezvous_host, announcement.rendezvous_port)
        link, store = self._link, self._store
        if link is not None and store is not None and store.incarnation == announcement.incarnation:
            if (self._address, link.epoch, link.members) == (address, epoch, members):
                if learner_still_there(store, epoch):
                    return store, link
        # A healthy link of a transport that shrinks, from the same learner, may be derived into this
        # epoch's (if the learner says so once the epoch starts); any other is closed now.
        held = link if link is not None and link.shrinks and self._address == address else None
        if held is not None:
            self._link = None  # out of close()'s reach: aborted below, once shrunk from or not
        self.close()
        try:
            return self._join(announcement, address, held)
        finally:
            if held is not None:
                held.abort()  # shrunk from, or not: this epoch never uses it

    def _join(
        self, announcement: WeightAnnouncement, address: Address, held: Transport | None
    ) -> tuple[SealedStore, Transport]:
        epoch, members = announcement.group_epoch, tuple(announcement.members)
        try:
            raw = connect_store(*address, self.timeout)
        except RuntimeError as exc:
            raise SyncFailed(f"cannot reach the learner's store: {exc}", epoch=epoch, phase="join") from exc
        store = SealedStore(raw, self._secret, announcement.incarnation)
        self._store, self._address = store, address
        over = epoch_over(store, epoch)
        if over is not None:  # waiting for it would cost the whole timeout, and hold the learner's next epoch
            raise EpochOver(over, epoch=epoch, phase="join")
        rank = members.index(self.worker_id) + 1
        rendezvous = Rendezvous(store, epoch, rank, members, *address, self.timeout, held)
        # Joined key last: the learner reads these keys to name the members that never showed up, and
        # their values (the transport's offer) to plan the link.
        store.set(joined_key(epoch, self.worker_id), self.transport.offer(rendezvous))
        start = store.wait({"start": start_key(epoch)}, self.timeout).get("start")
        if start is None:
            raise SyncFailed("the learner did not start the epoch in time", epoch=epoch, phase="join")
        if start != START_GO:
            raise SyncFailed("the learner aborted the epoch: members were missing", epoch=epoch, phase="join")
        try:
            self._link = self.transport.join(rendezvous)
        except RuntimeError as exc:
            raise SyncFailed(f"forming the group failed: {exc}", epoch=epoch, phase="connect") from exc
        return store, self._link


def _refused(delivery: Delivery, announcement: WeightAnnouncement) -> str | None:
    """Why the delivered version is not the announced one, or None."""
    if isinstance(delivery, LoadedInPlace) and delivery.problem is not None:
        return f"the engine did not take the version ({delivery.problem}); it holds {delivery.checksum}"
    if isinstance(delivery, Received) and delivery.problem is not None:
        return delivery.problem
    if delivery.checksum != announcement.checksum:
        return f"checksum mismatch: got {delivery.checksum}"
    return None
