"""The weight-sync contract of `tests/test_weight_sync.py` on the GPU backends: torch's NCCL and nccl4py.

Same learner (this process) and spawned worker processes (`test_weight_sync.Worker`), same assertions:
every member gets exactly the announced tensors, the group is reused within an epoch, a forged checksum
is refused by everyone, a hung member costs the timeout (not a hang) and is named at the next join, and
the next epoch goes on without it. nccl4py also shrinks a healthy epoch's communicator when members only
leave. NCCL takes one GPU per rank, so each test needs learner + members GPUs; all skip, saying why,
where the GPUs or the library are missing.
"""

from __future__ import annotations

import importlib.util
import signal
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
from test_weight_sync import Worker, _assert_same, _state_dict

from sparkrl.services.common.weight_sync import SyncFailed, WeightSender
from sparkrl.services.common.weight_sync.nccl4py_group import shrink_key

LEARNER_TIMEOUT_S = 10.0  # forming an NCCL communicator takes seconds; a failure surfaces within this
MARGIN_S = 10.0
BUCKET_BYTES = 4096


def _skip_reason(backend: str, ranks: int) -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.device_count() < ranks:
        have = torch.cuda.device_count()
        return f"needs {ranks} GPUs (NCCL takes one per rank: learner and members), this machine has {have}"
    if backend == "nccl" and not torch.distributed.is_nccl_available():
        return "this torch has no NCCL"
    if backend == "nccl4py" and importlib.util.find_spec("nccl") is None:
        return "nccl4py is not installed (pip install 'nccl4py[cu12]')"
    return None


def _backends(ranks: int, only: tuple[str, ...] = ("nccl", "nccl4py")) -> list[Any]:
    params = []
    for backend in only:
        reason = _skip_reason(backend, ranks)
        marks = [pytest.mark.gpu, pytest.mark.skipif(reason is not None, reason=str(reason))]
        params.append(pytest.param(backend, id=backend, marks=marks))
    return params


@pytest.fixture
def gpu_workers() -> Iterator[Any]:
    """Worker processes on GPUs 1, 2, …; the learner is on GPU 0. Killed after the test."""
    started: list[Worker] = []

    def spawn(backend: str, *worker_ids: str) -> list[Worker]:
        workers = [Worker(backend, device=i + 1) for i in range(len(worker_ids))]  # type: ignore[arg-type]
        for worker, worker_id in zip(workers, worker_ids, strict=True):
            worker.bind(worker_id, reuse_buffers=False)
        started.extend(workers)
        return workers

    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    try:
        yield spawn
    finally:
        for worker in started:
            worker.stop()


def _sender(backend: str) -> WeightSender:
    return WeightSender(backend=backend, timeout_s=LEARNER_TIMEOUT_S, bucket_bytes=BUCKET_BYTES)  # type: ignore[arg-type]


def _sync_ok(sender: WeightSender, version: int, epoch: int, workers: list[Worker]) -> None:
    state = _state_dict(seed=version)
    members = [w.worker_id for w in workers]
    announcement = sender.announce(state, version=version, epoch=epoch, members=members)
    for worker in workers:
        worker.receive(announcement)
    report = sender.broadcast(state, announcement)
    assert report.members == tuple(w.worker_id for w in workers) and report.gbps > 0
    for worker in workers:
        status, received = worker.result(timeout_s=60)
        assert status == "ok"
        _assert_same(received, state)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", _backends(ranks=3))
def test_receivers_get_equal_tensors_reuse_the_group_and_refuse_a_forged_checksum(
    gpu_workers: Any, backend: str
) -> None:
    workers = gpu_workers(backend, "a", "b")
    with _sender(backend) as sender:
        _sync_ok(sender, 1, epoch=1, workers=workers)
        _sync_ok(sender, 2, epoch=1, workers=workers)  # same epoch: the communicator is reused
        state = _state_dict(seed=3)
        announcement = sender.announce(state, version=3, epoch=1, members=["a", "b"])
        forged = announcement.model_copy(update={"checksum": "0" * 64})
        for worker in workers:
            worker.receive(forged)
        with pytest.raises(SyncFailed) as failure:
            sender.broadcast(state, forged)
        assert (failure.value.phase, sorted(failure.value.missing)) == ("verify", ["a", "b"])
        assert [worker.result(timeout_s=60) for worker in workers] == [("SyncFailed", "verify")] * 2


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", _backends(ranks=3))
def test_a_hung_member_costs_the_timeout_and_is_named_at_the_next_join(
    gpu_workers: Any, backend: str
) -> None:
    a, b = gpu_workers(backend, "a", "b")
    with _sender(backend) as sender:
        _sync_ok(sender, 1, epoch=1, workers=[a, b])
        b.signal(signal.SIGSTOP)  # alive, connections open, never answers
        state = _state_dict(seed=2)
        announcement = sender.announce(state, version=2, epoch=1, members=["a", "b"])
        a.receive(announcement)
        started = time.monotonic()
        with pytest.raises(SyncFailed):
            sender.broadcast(state, announcement)
        assert time.monotonic() - started < LEARNER_TIMEOUT_S + MARGIN_S
        assert a.result(timeout_s=60)[0] in {"ok", "SyncFailed"}

        announcement = sender.announce(state, version=2, epoch=2, members=["a", "b"])
        a.receive(announcement)
        with pytest.raises(SyncFailed) as failure:
            sender.broadcast(state, announcement)
        assert (failure.value.phase, failure.value.missing) == ("join", ["b"])
        assert a.result(timeout_s=60) == ("SyncFailed", "join")
        _sync_ok(sender, 3, epoch=3, workers=[a])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", _backends(ranks=3))
def test_a_member_leaving_a_healthy_epoch(gpu_workers: Any, backend: str) -> None:
    """nccl4py derives the next epoch's communicator by ncclCommShrink (no new rendezvous); torch's NCCL
    forms a new group. Either way the remaining member gets the next version."""
    a, b = gpu_workers(backend, "a", "b")
    with _sender(backend) as sender:
        _sync_ok(sender, 1, epoch=1, workers=[a, b])
        _sync_ok(sender, 2, epoch=2, workers=[a])
        # The learner's plan, as the members read it from its store: derive epoch 2's from epoch 1's.
        store = torch.distributed.TCPStore("127.0.0.1", sender.port, timeout=timedelta(seconds=5))
        assert store.check([shrink_key(2)]) == (backend == "nccl4py")
        _sync_ok(sender, 3, epoch=3, workers=[a, b])  # b comes back: a new communicator
