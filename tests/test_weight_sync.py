"""Weight sync between real processes: a learner (this process) and receivers (spawned processes).

Every peer is a separate process with its own `torch.distributed` group; the learner's timeouts are a
few seconds so the failure tests (dead peer, hung peer, missing member) stay short, and each test has a
hard pytest timeout. Worker processes are killed in the fixture's teardown whatever happens.
"""

import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import Tensor

from sparkrl.proto import WeightAnnouncement
from sparkrl.proto import weights_checksum as checksum_of_bytes
from sparkrl.proto.weights import CHUNK_BYTES, chunks, root_checksum, tensor_digest
from sparkrl.services.common.weight_sync import (
    ALIGN,
    Backend,
    Received,
    SyncFailed,
    WeightReceiver,
    WeightSender,
    bucket_sizes,
    build_manifest,
    pack,
    unpack,
    weights_checksum,
)
from sparkrl.services.common.weight_sync.hashing import ParallelHasher
from sparkrl.services.common.weight_sync.rendezvous import joined_key
from sparkrl.services.common.weight_sync.sealed_store import SealedStore

LEARNER_TIMEOUT_S = 2.0  # how long a failure may take to surface on the learner
WORKER_TIMEOUT_S = 4.0  # longer than the learner's: a worker should hear of a failure from the learner
MARGIN_S = 2.0  # scheduling slack on two shared cores
BUCKET_BYTES = 4096


def _state_dict(seed: int = 0) -> dict[str, Tensor]:
    """Mixed dtypes and shapes, one tensor larger than a bucket, a scalar, an empty and a strided one."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "empty": torch.empty(0, 4),  # alone in bucket 0, which is then 0 bytes: nothing to send
        "big.weight": torch.randn(40, 40, generator=generator),  # 6400 bytes > BUCKET_BYTES
        "embed.weight": torch.randn(16, 8, generator=generator),
        "norm.weight": torch.randn(8, generator=generator).to(torch.bfloat16),
        "step": torch.tensor(seed + 7, dtype=torch.int64),
        "mask": torch.rand(5, generator=generator) > 0.5,
        "head.weight": torch.randn(8, 12, generator=generator).t(),  # not contiguous
        "ids": torch.randint(-(2**40), 2**40, (9,), generator=generator, dtype=torch.int64),
    }


def _assert_same(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


# ── manifest, buckets, checksum (one process) ─────────────────────────────────────────────────────────


def test_manifest_packs_in_order_and_round_trips() -> None:
    state = _state_dict()
    manifest = build_manifest(state, BUCKET_BYTES)
    assert [spec.name for spec in manifest] == list(state)
    assert [(spec.bucket, spec.offset) for spec in manifest] == sorted((s.bucket, s.offset) for s in manifest)
    assert all(spec.offset % ALIGN == 0 for spec in manifest)
    big = next(spec for spec in manifest if spec.name == "big.weight")
    assert [spec.name for spec in manifest if spec.bucket == big.bucket] == ["big.weight"]
    sizes = bucket_sizes(manifest)
    assert (sizes[0], sizes[big.bucket]) == (0, 6400)
    assert all(size <= BUCKET_BYTES for i, size in enumerate(sizes) if i != big.bucket)

    buckets = pack(state, manifest)
    assert [bucket.numel() for bucket in buckets] == sizes
    unpacked = unpack(buckets, manifest)
    _assert_same(unpacked, state)
    # Unpacked tensors are views into the received buckets, not copies.
    norm = next(spec for spec in manifest if spec.name == "norm.weight")
    assert unpacked["norm.weight"].data_ptr() == buckets[norm.bucket].data_ptr() + norm.offset

    with WeightSender(bucket_bytes=BUCKET_BYTES) as sender:  # the manifest passes the wire contract
        announcement = sender.announce(state, version=3, epoch=1, members=["a", "b"])
    wire = WeightAnnouncement.model_validate_json(announcement.model_dump_json())
    layout = [spec.model_copy(update={"digest": None}) for spec in wire.manifest]  # with each tensor's digest
    assert wire == announcement and layout == manifest and wire.bucket_sizes() == sizes
    assert (wire.world_size, wire.rendezvous_port) == (3, sender.port)
    assert wire.checksum == weights_checksum(state.items())


def test_checksum_is_stable_and_sensitive_to_one_element() -> None:
    state = _state_dict()
    checksum = weights_checksum(state.items())
    assert len(checksum) == 64 and checksum == weights_checksum(state.items())
    # Same bytes, different memory layout or storage: same checksum (it hashes contiguous bytes).
    copies = {name: tensor.contiguous().clone() for name, tensor in state.items()}
    assert weights_checksum(copies.items()) == checksum
    # The documented algorithm: the proto's tree over each tensor's raw bytes (on one thread there, on
    # every core here), names not included.
    raw = [tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for tensor in state.values()]
    assert checksum_of_bytes(raw) == checksum
    renamed = {f"x.{name}": tensor for name, tensor in state.items()}
    assert weights_checksum(renamed.items()) == checksum

    copies["norm.weight"][3] = copies["norm.weight"][3] + 1  # one bfloat16 element
    assert weights_checksum(copies.items()) != checksum
    assert weights_checksum(reversed(state.items())) != checksum  # order matters


def test_the_checksum_tree_is_the_same_on_every_core_and_names_the_tensor_that_differs() -> None:
    """Leaves of CHUNK_BYTES hashed on a pool give the one-thread result; a tensor's digest is in its spec,
    and the root of the specs' digests is the announcement's checksum."""
    big = torch.arange(CHUNK_BYTES // 2 + 123, dtype=torch.float32)  # 2+ leaves, the last one short
    state = _state_dict() | {"big.chunked": big}
    raw = [tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for tensor in state.values()]
    assert len(chunks(raw[-1])) == 3 and chunks(raw[0]) == []  # the empty tensor has no leaf
    assert checksum_of_bytes(raw) == weights_checksum(state.items())
    for threads in (1, 2, 5):
        hasher = ParallelHasher(threads)
        try:
            assert hasher.checksum(raw) == checksum_of_bytes(raw)
            assert hasher.digests(raw) == [tensor_digest(r) for r in raw]
        finally:
            hasher.close()
    with WeightSender(bucket_bytes=BUCKET_BYTES) as sender:
        announcement = sender.announce(state, version=1, epoch=1, members=["a"])
    assert [spec.digest for spec in announcement.manifest] == [tensor_digest(r).hex() for r in raw]
    assert (
        root_checksum(bytes.fromhex(s.digest or "") for s in announcement.manifest) == announcement.checksum
    )
    # A tensor whose bytes moved within it (same length, same multiset of bytes) is another tensor.
    swapped = list(raw)
    swapped[-1] = raw[-1][CHUNK_BYTES:] + raw[-1][:CHUNK_BYTES]
    assert checksum_of_bytes(swapped) != checksum_of_bytes(raw)
    # Bytes moved across tensors (the same concatenation, other boundaries) change it too.
    assert checksum_of_bytes([raw[1] + raw[2], *raw[3:]]) != checksum_of_bytes(raw[1:])


# ── worker processes ──────────────────────────────────────────────────────────────────────────────────


def _worker_main(backend: Backend, device: int | None, commands: Any, results: Any) -> None:
    """A rollout worker's weight-sync loop. Commands: ("bind", worker_id) starts a fresh receiver (a new
    test reuses the process under a new id); ("receive", announcement JSON) is the Redis step;
    ("imports",) lists the redis modules loaded (this process imported only this file's imports)."""
    if device is not None:
        torch.cuda.set_device(device)
    results.put(("ready", os.getpid()))
    receiver: WeightReceiver | None = None
    while (command := commands.get()) is not None:
        if command[0] == "imports":
            results.put(("imports", sorted(name for name in sys.modules if name.split(".")[0] == "redis")))
            continue
        if command[0] == "bind":
            if receiver is not None:
                receiver.close()
            _, worker_id, reuse, delta = command
            receiver = WeightReceiver(
                worker_id, backend=backend, timeout_s=WORKER_TIMEOUT_S, reuse_buffers=reuse, delta=delta
            )
            continue
        assert receiver is not None
        _, announcement_json = command
        try:
            delivery = receiver.receive(WeightAnnouncement.model_validate_json(announcement_json))
            assert isinstance(delivery, Received)  # no engine here: the tensors come back
            results.put(("ok", {name: tensor.cpu().clone() for name, tensor in delivery.tensors.items()}))
        except SyncFailed as exc:
            results.put((type(exc).__name__, exc.phase, str(exc)))
    if receiver is not None:
        receiver.close()


class Worker:
    """One spawned worker process, its command/result queues, and whether a test may reuse it."""

    def __init__(self, backend: Backend = "gloo", device: int | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.backend = backend
        self.worker_id = ""
        self.commands = ctx.Queue()
        self.results = ctx.Queue()
        self.process = ctx.Process(target=_worker_main, args=(backend, device, self.commands, self.results))
        self.process.start()
        self.ready = False
        self.outstanding = 0  # receives sent minus results read
        self.harmed = False  # killed or stopped by a test
        self.failure = ""  # the last failure's message (a result is its kind and phase)

    def bind(self, worker_id: str, reuse_buffers: bool, delta: bool = False) -> None:
        if not self.ready:
            assert self.results.get(timeout=60)[0] == "ready"
            self.ready = True
        self.worker_id = worker_id
        self.commands.put(("bind", worker_id, reuse_buffers, delta))

    def receive(self, announcement: WeightAnnouncement) -> None:
        self.outstanding += 1
        self.commands.put(("receive", announcement.model_dump_json()))

    def result(self, timeout_s: float = WORKER_TIMEOUT_S + MARGIN_S) -> tuple[Any, ...]:
        result = self.results.get(timeout=timeout_s)
        self.outstanding -= 1
        if len(result) == 3:  # a failure: its kind and phase, and its message kept apart
            self.failure = result[2]
            return result[:2]
        return result

    def signal(self, signum: int) -> None:
        assert self.process.pid is not None
        self.harmed = True
        os.kill(self.process.pid, signum)

    @property
    def reusable(self) -> bool:
        return self.backend == "gloo" and not (self.harmed or self.outstanding) and self.process.is_alive()

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()  # also ends a SIGSTOPped process
        self.process.join(timeout=5)
        for queue in (self.commands, self.results):
            queue.cancel_join_thread()
            queue.close()


class WorkerPool:
    """Spawned gloo workers shared by the module's tests: starting torch in a process costs seconds."""

    IDLE = 3

    def __init__(self) -> None:
        self.idle: list[Worker] = [Worker() for _ in range(self.IDLE)]

    def take(
        self,
        worker_ids: tuple[str, ...],
        backend: Backend,
        devices: tuple[int, ...],
        reuse_buffers: bool,
        delta: bool = False,
    ) -> list[Worker]:
        if backend != "gloo":
            workers = [Worker(backend, devices[i] if devices else None) for i in range(len(worker_ids))]
        else:
            self.idle += [Worker() for _ in range(len(worker_ids) - len(self.idle))]
            workers, self.idle = self.idle[: len(worker_ids)], self.idle[len(worker_ids) :]
        for worker, worker_id in zip(workers, worker_ids, strict=True):
            worker.bind(worker_id, reuse_buffers, delta)
        return workers

    def give_back(self, workers: list[Worker]) -> None:
        for worker in workers:
            if worker.reusable:
                self.idle.append(worker)
            else:
                worker.stop()
        # Replacements start now, so they are warm by the next test.
        self.idle += [Worker() for _ in range(self.IDLE - len(self.idle))]

    def close(self) -> None:
        for worker in self.idle:
            worker.stop()


@pytest.fixture(scope="module")
def worker_pool() -> Iterator[WorkerPool]:
    pool = WorkerPool()
    yield pool
    pool.close()


@pytest.fixture
def spawn_workers(worker_pool: WorkerPool) -> Iterator[Any]:
    """Worker processes bound to the given ids; harmed or busy ones are killed after the test."""
    taken: list[Worker] = []

    def spawn(
        *worker_ids: str,
        backend: Backend = "gloo",
        devices: tuple[int, ...] = (),
        reuse: bool = False,
        delta: bool = False,
    ) -> list[Worker]:
        workers = worker_pool.take(worker_ids, backend, devices, reuse, delta)
        taken.extend(workers)
        return workers

    try:
        yield spawn
    finally:
        worker_pool.give_back(taken)


def _sync(
    sender: WeightSender, state: dict[str, Tensor], version: int, epoch: int, workers: list[Worker]
) -> tuple[WeightAnnouncement, list[str]]:
    """Announces and hands the announcement to the workers (the Redis step); the caller broadcasts."""
    members = [worker.worker_id for worker in workers]
    announcement = sender.announce(state, version=version, epoch=epoch, members=members)
    for worker in workers:
        worker.receive(announcement)
    return announcement, members


def _sync_ok(
    sender: WeightSender, state: dict[str, Tensor], version: int, epoch: int, workers: list[Worker]
) -> list[str]:
    """A whole successful sync: every worker holds exactly `state`; returns the members."""
    announcement, members = _sync(sender, state, version, epoch, workers)
    assert sender.broadcast(state, announcement).members == tuple(members)
    for worker in workers:
        status, received = worker.result()
        assert status == "ok"
        _assert_same(received, state)
    return members


def _expect_failure(
    sender: WeightSender, state: dict[str, Tensor], announcement: Any, members: Any
) -> SyncFailed:
    started = time.monotonic()
    with pytest.raises(SyncFailed) as failure:
        sender.broadcast(state, announcement)
    assert time.monotonic() - started < LEARNER_TIMEOUT_S + MARGIN_S
    return failure.value


# ── learner ↔ workers ─────────────────────────────────────────────────────────────────────────────────


@pytest.mark.timeout(60)
def test_two_receivers_get_equal_tensors_and_reuse_the_group(spawn_workers: Any) -> None:
    workers = spawn_workers("a") + spawn_workers("b", reuse=True)  # b receives into the same buckets
    with WeightSender(timeout_s=WORKER_TIMEOUT_S, bucket_bytes=BUCKET_BYTES) as sender:
        for version in (1, 2):
            state = _state_dict(seed=version)
            announcement, members = _sync(sender, state, version, epoch=1, workers=workers)
            report = sender.broadcast(state, announcement)
            assert (report.version, report.epoch, report.members) == (version, 1, ("a", "b"))
            assert report.bytes == announcement.total_bytes and report.gbps > 0
            for worker in workers:
                status, received = worker.result()
                assert status == "ok"
                _assert_same(received, state)
                assert weights_checksum(received.items()) == announcement.checksum

        # A corrupted checksum: both workers refuse the weights and the learner hears it from them.
        state = _state_dict(seed=3)
        announcement = sender.announce(state, version=3, epoch=1, members=members)
        forged = announcement.model_copy(update={"checksum": "0" * 64})
        for worker in workers:
            worker.receive(forged)
        failure = _expect_failure(sender, state, forged, members)
        assert (failure.phase, sorted(failure.missing)) == ("verify", ["a", "b"])
        assert [worker.result() for worker in workers] == [("SyncFailed", "verify")] * 2

        # A tampered bucket: the bytes that arrive are not the announced ones (one element of one tensor).
        # Every receiver hashes each tensor as its bucket lands, refuses the version and names the tensor.
        state = _state_dict(seed=4)
        announcement = sender.announce(state, version=4, epoch=2, members=members)  # a failed epoch is over
        tampered = dict(state) | {"embed.weight": state["embed.weight"].clone()}
        tampered["embed.weight"][3, 5] += 1.0
        for worker in workers:
            worker.receive(announcement)
        failure = _expect_failure(sender, tampered, announcement, members)
        assert (failure.phase, sorted(failure.missing)) == ("verify", ["a", "b"])
        for worker in workers:
            assert worker.result() == ("SyncFailed", "verify")
            assert "embed.weight is not the announced tensor" in worker.failure, worker.failure


@pytest.mark.timeout(60)
def test_dead_worker_fails_the_sync_and_the_next_epoch_goes_on_without_it(spawn_workers: Any) -> None:
    a, b, c = spawn_workers("a", "b", "c")
    with WeightSender(timeout_s=LEARNER_TIMEOUT_S, bucket_bytes=BUCKET_BYTES) as sender:
        members = _sync_ok(sender, _state_dict(seed=1), 1, epoch=1, workers=[a, b])

        a.signal(signal.SIGKILL)
        a.process.join(timeout=5)
        state = _state_dict(seed=2)
        announcement = sender.announce(state, version=2, epoch=1, members=members)
        b.receive(announcement)
        _expect_failure(sender, state, announcement, members)
        # The learner dropped the epoch; b hears it and never hangs. gloo's root may have sent b every
        # bucket before writing to the dead peer failed: then b holds the verified version-2 weights.
        status, received = b.result()
        assert status in {"ok", "SyncFailed"}
        if status == "ok":
            _assert_same(received, state)

        _sync_ok(sender, state, 2, epoch=2, workers=[b, c])  # b re-joins the new epoch either way


@pytest.mark.timeout(60)
def test_hung_worker_times_out_and_is_named_when_the_group_re_forms(spawn_workers: Any) -> None:
    a, b = spawn_workers("a", "b")
    with WeightSender(timeout_s=LEARNER_TIMEOUT_S, bucket_bytes=BUCKET_BYTES) as sender:
        state = _state_dict(seed=1)
        members = _sync_ok(sender, state, 1, epoch=1, workers=[a, b])

        b.signal(signal.SIGSTOP)  # alive, sockets open, never answers: a hung worker
        announcement = sender.announce(state, version=2, epoch=1, members=members)
        a.receive(announcement)
        _expect_failure(sender, state, announcement, members)
        assert a.result()[0] in {"ok", "SyncFailed"}  # a may have had its buckets before b stalled

        # The learner does not know who hung; re-forming with everyone pins it down at the join step.
        announcement = sender.announce(state, version=2, epoch=2, members=members)
        a.receive(announcement)
        failure = _expect_failure(sender, state, announcement, members)
        assert (failure.phase, failure.missing) == ("join", ["b"])
        assert a.result() == ("SyncFailed", "join")

        _sync_ok(sender, state, 2, epoch=3, workers=[a])


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_straggler_is_cut_off_after_the_others_acknowledged_and_they_keep_the_version(
    spawn_workers: Any,
) -> None:
    """A member that stops reading (SIGSTOP) costs the healthy ones nothing: they receive every bucket,
    acknowledge, and hold the version; the learner names the straggler `straggler_s` after their
    acknowledgements, long before its own timeout."""
    a, b = spawn_workers("a", "b")
    with WeightSender(timeout_s=30.0, bucket_bytes=BUCKET_BYTES, straggler_s=0.5) as sender:
        members = _sync_ok(sender, _state_dict(seed=1), 1, epoch=1, workers=[a, b])
        b.signal(signal.SIGSTOP)
        state = _state_dict(seed=2)  # several buckets: the big tensor is larger than one
        announcement = sender.announce(state, version=2, epoch=1, members=members)
        assert announcement.num_buckets > 1
        a.receive(announcement)
        started = time.monotonic()
        with pytest.raises(SyncFailed) as failure:
            sender.broadcast(state, announcement)
        assert time.monotonic() - started < 0.5 + MARGIN_S + 2.0  # not the 30 s timeout
        assert (failure.value.phase, failure.value.missing) == ("verify", ["b"])
        status, received = a.result()
        assert status == "ok"
        _assert_same(received, state)
        b.signal(signal.SIGCONT)


@pytest.mark.timeout(60)
def test_a_member_known_gone_is_cut_at_once_and_alone(spawn_workers: Any) -> None:
    """A member whose process died (SIGKILL) mid-epoch: as soon as the learner's liveness view says so
    (`gone`, the publisher's expired heartbeats) it is named and dropped, without waiting out the
    timeout and without blaming the live member; the next epoch carries on with that one."""
    a, b = spawn_workers("a", "b")
    with WeightSender(timeout_s=30.0, bucket_bytes=BUCKET_BYTES, straggler_s=20.0) as sender:
        members = _sync_ok(sender, _state_dict(seed=1), 1, epoch=1, workers=[a, b])
        b.signal(signal.SIGKILL)
        sender.gone = lambda waiting: {"b"} & set(waiting)
        state = _state_dict(seed=2)
        announcement = sender.announce(state, version=2, epoch=1, members=members)
        a.receive(announcement)
        started = time.monotonic()
        with pytest.raises(SyncFailed) as failure:
            sender.broadcast(state, announcement)
        assert time.monotonic() - started < 1.0 + MARGIN_S  # not the 30 s timeout, nor the straggler cut
        assert (failure.value.phase, failure.value.missing) == ("verify", ["b"])
        assert failure.value.reason.startswith("gone")
        a.result()  # its receive ended one way or the other with the epoch
        _sync_ok(sender, _state_dict(seed=3), 3, epoch=2, workers=[a])


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_non_member_never_joins_and_a_missing_or_silent_member_fails_the_epoch(spawn_workers: Any) -> None:
    a, outsider = spawn_workers("a", "outsider")
    with WeightSender(timeout_s=LEARNER_TIMEOUT_S, bucket_bytes=BUCKET_BYTES) as sender:
        state = _state_dict(seed=1)
        announcement, members = _sync(sender, state, 1, epoch=1, workers=[a])
        outsider.receive(announcement)
        assert outsider.result() == ("NotAMember", "join")
        sender.broadcast(state, announcement)
        assert a.result()[0] == "ok"

        members = ["a", "ghost"]
        announcement = sender.announce(state, version=2, epoch=2, members=members)
        a.receive(announcement)
        outsider.receive(announcement)
        failure = _expect_failure(sender, state, announcement, members)
        assert (failure.phase, failure.missing) == ("join", ["ghost"])
        assert a.result() == ("SyncFailed", "join")
        assert outsider.result() == ("NotAMember", "join")
        store = torch.distributed.TCPStore("127.0.0.1", sender.port, timeout=timedelta(seconds=5))
        assert store.check([joined_key(2, "a")]) and not store.check([joined_key(2, "outsider")])

        # A member that says it joined (sealed as a member seals it) but never connects: group formation
        # times out on both sides.
        SealedStore(store, None, sender.incarnation).set(joined_key(3, "ghost"), b"1")
        announcement = sender.announce(state, version=2, epoch=3, members=members)
        a.receive(announcement)
        assert _expect_failure(sender, state, announcement, members).phase == "connect"
        assert a.result() == ("SyncFailed", "connect")


def test_misuse_is_a_value_error() -> None:
    state = _state_dict()
    with WeightSender(timeout_s=LEARNER_TIMEOUT_S, bucket_bytes=BUCKET_BYTES) as sender:
        announcement = sender.announce(state, version=1, epoch=1, members=["a"])
        with pytest.raises(ValueError, match="world_size"):
            sender.broadcast(state, announcement.model_copy(update={"members": ["a", "b"]}))
        with pytest.raises(ValueError, match="manifest"):
            sender.broadcast(_state_dict() | {"extra": torch.zeros(2)}, announcement)
        with pytest.raises(ValueError, match="unique"):
            sender.broadcast(state, announcement.model_copy(update={"world_size": 3, "members": ["a", "a"]}))
        with pytest.raises(ValueError, match="world_size"):  # the wire model refuses it too
            WeightAnnouncement.model_validate(announcement.model_dump() | {"members": ["a", "b"]})


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="NCCL weight sync needs CUDA with at least 2 devices (learner on cuda:0, worker on cuda:1)",
)
def test_nccl_broadcast_between_two_gpus(spawn_workers: Any) -> None:
    (worker,) = spawn_workers("gpu-worker", backend="nccl", devices=(1,))
    torch.cuda.set_device(0)
    state = {name: tensor.cuda() for name, tensor in _state_dict(seed=1).items()}
    with WeightSender(backend="nccl", timeout_s=30.0, bucket_bytes=BUCKET_BYTES) as sender:
        announcement, _members = _sync(sender, state, 1, epoch=1, workers=[worker])
        report = sender.broadcast(state, announcement)
        status, received = worker.result(timeout_s=60)
    assert status == "ok" and report.members == ("gpu-worker",)
    _assert_same(received, {name: tensor.cpu() for name, tensor in state.items()})


def test_a_worker_process_never_imports_redis(spawn_workers: Any) -> None:
    (worker,) = spawn_workers("probe")
    worker.outstanding += 1
    worker.commands.put(("imports",))
    assert worker.result() == ("imports", [])
