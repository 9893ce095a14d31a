"""The nccl4py and vllm_nccl weight-sync backends, on CPU: what can run without a GPU or the library.

The libraries are stood in for at their seam only (nccl4py's communicator by a shrinkable gloo group,
vLLM's trainer end and engine by recording fakes); the transports and the contract around them are the
real ones: the learner's TCPStore, the join step, the shrink plan, the transfer plan, the
acknowledgements, SyncFailed.
The same contract on real GPUs is `tests/test_weight_sync_gpu.py` and the vLLM engine contract.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, ClassVar, get_args

import pytest
import torch
import torch.distributed as dist

from sparkrl.proto import WeightAnnouncement
from sparkrl.services.common.settings import WeightSyncSettings
from sparkrl.services.common.settings.sync import SyncBackend
from sparkrl.services.common.weight_sync import (
    BackendUnavailable,
    LoadedInPlace,
    NotAMember,
    SyncFailed,
    Transport,
    WeightReceiver,
    WeightSender,
    make_transport,
    nccl4py_group,
    vllm_native,
    weights_checksum,
)
from sparkrl.services.common.weight_sync.nccl4py_group import HOLDS, decode_shrink, encode_shrink, shrink_plan
from sparkrl.services.common.weight_sync.rendezvous import JOINED
from sparkrl.services.common.weight_sync.torch_groups import gloo_group
from sparkrl.services.common.weight_sync.vllm_native import TransferPlan, plan_for, update_info
from sparkrl.services.rollout.install import VersionInstaller
from sparkrl.services.rollout.vllm_transfer import receiver_for

TIMEOUT_S = 10.0
BUCKET_BYTES = 4096


def _state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(16, 8, generator=generator),
        "big.weight": torch.randn(40, 40, generator=generator),  # larger than a bucket
        "norm.weight": torch.randn(8, generator=generator).to(torch.bfloat16),
        "step": torch.tensor(seed, dtype=torch.int64),
    }


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Runs `fn` on a thread; the list gets its result or the exception it raised."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # the test asserts on it
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _receive_all(
    receivers: dict[str, Any], members: Sequence[str], announcement: WeightAnnouncement
) -> dict[str, tuple[threading.Thread, list[Any]]]:
    """Each member's receiver takes the announcement on its own thread (the Redis step)."""
    return {m: _in_thread(lambda m=m: receivers[m].receive(announcement)) for m in members}


def _outcome(thread: threading.Thread, out: list[Any]) -> Any:
    thread.join(TIMEOUT_S * 2)
    assert not thread.is_alive() and out, "the receiver hung"
    return out[0]


# ── the shrink plan ───────────────────────────────────────────────────────────────────────────────────


def test_a_shrink_is_planned_only_when_every_member_holds_the_parent_and_keeps_its_order() -> None:
    held = {m: HOLDS + b"4" for m in "abcd"}
    # Parent ranks: a=1, b=2, c=3, d=4. Dropping b and d: exclude ranks 2 and 4; a, c become ranks 1, 2.
    assert shrink_plan(4, "abcd", "ac", held) == [2, 4]
    assert shrink_plan(4, "abcd", "ca", held) is None  # order changed: ranks would not line up
    assert shrink_plan(4, "abcd", "ace", held | {"e": JOINED}) is None  # a newcomer: a new rendezvous
    assert shrink_plan(4, "abcd", "ac", held | {"c": JOINED}) is None  # c lost the parent's group
    assert shrink_plan(4, "abcd", "ac", held | {"c": HOLDS + b"3"}) is None  # c holds another epoch
    assert shrink_plan(4, "abcd", "abcd", held) is None  # nothing to drop
    assert decode_shrink(encode_shrink(4, [2, 4])) == (4, [2, 4])


def test_every_backend_the_settings_name_has_its_transport() -> None:
    """`sync.backend`'s names and the transports are one list: each name makes a transport announcing that
    name, or says what is missing here."""
    for backend in get_args(SyncBackend):
        try:
            transport = make_transport(backend)
        except BackendUnavailable as exc:
            assert "sync.backend" in str(exc)
            continue
        assert isinstance(transport, Transport) and transport.name == backend


def test_a_backend_that_cannot_run_here_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("nccl") is None:
        with pytest.raises(BackendUnavailable, match=r"nccl4py\[cu12\].*or set sync.backend=nccl"):
            make_transport("nccl4py")
        with pytest.raises(BackendUnavailable, match="nccl4py"):
            WeightSender(backend="nccl4py")  # at construction, not at the first sync
        with pytest.raises(BackendUnavailable, match="nccl4py"):
            WeightReceiver("w", backend="nccl4py")
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(BackendUnavailable, match=r"vLLM must import in the learner's environment"):
            WeightSender(backend="vllm_nccl")
    if not dist.is_nccl_available():
        with pytest.raises(BackendUnavailable, match="CUDA build of torch"):
            WeightSender(backend="nccl")
    make_transport("gloo")
    # vLLM's own transfer receives into the engine: a receiver without one says where to get it.
    monkeypatch.setattr(vllm_native, "require_vllm", lambda: None)
    receiver = WeightReceiver("w", backend="vllm_nccl", timeout_s=TIMEOUT_S)
    with WeightSender(backend="vllm_nccl", timeout_s=TIMEOUT_S) as sender:
        announcement = sender.announce(_state(1), version=1, epoch=1, members=["w"])
        with pytest.raises(ValueError, match="receiver_for"):
            receiver.receive(announcement)


# ── shrinking an epoch's group: nccl4py's seam, stood in for by gloo ──────────────────────────────────


class _GlooCommunicator:
    """nccl4py's communicator (`Nccl4pyGroup`) stood in for by gloo: `connect` forms a gloo group under the
    epoch's keys, `shrink` a new one under the parent's (no new epoch rendezvous), so the test sees the
    learner and the members agree on it (ranks, size)."""

    shrinks: ClassVar[list[tuple[int, list[int]]]] = []  # (rank that shrank, the parent ranks it excluded)

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, prefix: str) -> None:
        self.store, self.rank, self.size, self.timeout, self.prefix = store, rank, size, timeout, prefix
        self._group = gloo_group(dist.PrefixStore(prefix, store), rank, size, timeout, "127.0.0.1")
        self.device = self._group.device

    @classmethod
    def connect(cls, store: dist.Store, rank: int, size: int, timeout: timedelta) -> _GlooCommunicator:
        return cls(store, rank, size, timeout, "fresh/")

    def broadcast(self, bucket: torch.Tensor) -> Any:
        return self._group.broadcast(bucket)

    def wait(self, work: Any) -> None:
        self._group.wait(work)

    def abort(self) -> None:
        self._group.abort()

    def shrink(self, excluded: Sequence[int], rank: int) -> _GlooCommunicator:
        _GlooCommunicator.shrinks.append((rank, list(excluded)))
        size = self.size - len(excluded)
        return _GlooCommunicator(self.store, rank, size, self.timeout, self.prefix + "shrunk/")


def test_members_leaving_a_healthy_epoch_shrink_its_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real nccl4py transport and contract; only the communicator is gloo's."""
    monkeypatch.setattr(nccl4py_group, "require_nccl4py", lambda: None)
    monkeypatch.setattr(nccl4py_group, "Nccl4pyGroup", _GlooCommunicator)
    _GlooCommunicator.shrinks = []
    receivers = {m: WeightReceiver(m, backend="nccl4py", timeout_s=TIMEOUT_S) for m in "abc"}
    with WeightSender(backend="nccl4py", timeout_s=TIMEOUT_S, bucket_bytes=BUCKET_BYTES) as sender:
        try:
            for version, epoch, members in ((1, 1, "abc"), (2, 2, "ac"), (3, 3, "acb")):
                shrunk_before = len(_GlooCommunicator.shrinks)
                state = _state(version)
                announcement = sender.announce(state, version=version, epoch=epoch, members=list(members))
                running = _receive_all(receivers, members, announcement)
                report = sender.broadcast(state, announcement)
                assert report.members == tuple(members)
                for member, (thread, out) in running.items():
                    received = _outcome(thread, out)
                    assert weights_checksum(received.tensors.items()) == announcement.checksum, member
                shrunk = _GlooCommunicator.shrinks[shrunk_before:]
                # Epoch 2 only drops b (rank 2 of epoch 1): every remaining rank derives its communicator
                # from epoch 1's, a and c becoming ranks 1 and 2. Epoch 3 adds b back: a new rendezvous.
                assert sorted(shrunk) == ([(0, [2]), (1, [2]), (2, [2])] if epoch == 2 else [])
        finally:
            for receiver in receivers.values():
                receiver.close()
    assert decode_shrink(encode_shrink(4, [2, 4])) == (4, [2, 4])


# ── vLLM's native transfer: the learner's group and the worker's engine stood in for ──────────────────


class _FakeLearnerEnd:
    """vllm_native.LearnerEnd's surface (vLLM's trainer_init + communicator); records the plans the
    learner joined with. The transfer itself is the fake engine's: it 'loads' what the learner holds."""

    plans: ClassVar[list[TransferPlan]] = []
    aborted: ClassVar[list[int]] = []  # the epochs whose end the learner aborted

    def __init__(self, plan: TransferPlan, epoch: int, timeout: timedelta) -> None:
        self.epoch = epoch
        _FakeLearnerEnd.plans.append(plan)

    def send(self, tensors: list[torch.Tensor]) -> None:
        assert len(tensors) == 4  # every tensor of the manifest

    def abort(self) -> None:
        _FakeLearnerEnd.aborted.append(self.epoch)


class _FakeEngine:
    """A VllmEngine as the vllm_nccl transport uses it: `llm.collective_rpc` over `workers` GPU workers,
    each running vLLM's weight-update session (`start_weight_update` → `update_weights` →
    `finish_weight_update`) and reporting what it loaded (`sparkrl_update_report`, vllm_worker.py)."""

    def __init__(self, workers: int, loaded: Callable[[], str]) -> None:
        self.workers, self.loaded = workers, loaded
        self.init_infos: list[dict[str, Any]] = []
        self.arrived: list[tuple[int, str]] = []
        self.failed: list[str] = []
        self.calls: list[str] = []
        self.policy_version = 0
        self.llm = SimpleNamespace(collective_rpc=self._rpc)

    def _rpc(
        self, method: str, timeout: float | None = None, kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        assert timeout == TIMEOUT_S  # every call is bounded
        if method == "sparkrl_worker_count":
            return [1] * self.workers
        if method == "init_weight_transfer_engine":
            self.init_infos.append(kwargs["init_info"])  # type: ignore[index]
            return [None] * self.workers
        self.calls.append(method)
        if method == "update_weights":
            names = kwargs["update_info"]["names"]  # type: ignore[index]
            assert names == ["embed.weight", "big.weight", "norm.weight", "step"]  # manifest order
        if method == "sparkrl_update_report":
            assert self.calls[-4:] == [
                "start_weight_update",
                "update_weights",
                "finish_weight_update",
                method,
            ]
            return [{"checksum": self.loaded(), "tensors": 4, "problems": [], "read_back": 0}] * self.workers
        return [None] * self.workers

    def weights_arrived(self, version: int, checksum: str) -> None:
        self.arrived.append((version, checksum))
        self.policy_version = version

    def native_load_failed(self, why: str) -> None:
        self.failed.append(why)


def _stand_in_for_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_native, "require_vllm", lambda: None)  # no vLLM here
    monkeypatch.setattr(vllm_native, "connect_trainer", _FakeLearnerEnd)
    _FakeLearnerEnd.plans, _FakeLearnerEnd.aborted = [], []


def _vllm_receiver(worker_id: str, engine: _FakeEngine) -> WeightReceiver:
    """As a worker with a vLLM engine builds it (`rollout/service.py`)."""
    settings = WeightSyncSettings(backend="vllm_nccl", timeout_s=TIMEOUT_S)
    return receiver_for(worker_id, settings, VersionInstaller(engine, "."))  # type: ignore[arg-type]


def test_vllm_native_transfer_keeps_the_announce_join_verify_contract(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _stand_in_for_vllm(monkeypatch)
    current: dict[str, str] = {}
    engines = {"a": _FakeEngine(2, lambda: current["checksum"]), "b": _FakeEngine(1, lambda: current["b"])}
    receivers = {m: _vllm_receiver(m, engine) for m, engine in engines.items()}
    with WeightSender(backend="vllm_nccl", timeout_s=TIMEOUT_S, bucket_bytes=BUCKET_BYTES) as sender:
        for version, forged in ((1, False), (2, False), (3, True)):
            state = _state(version)
            announcement = sender.announce(
                state, version=version, epoch=1 if version < 3 else 2, members=["a", "b"]
            )
            current["checksum"] = announcement.checksum
            current["b"] = "f" * 64 if forged else announcement.checksum  # b's engine loads other bytes
            running = _receive_all(receivers, "ab", announcement)
            if not forged:
                assert sender.broadcast(state, announcement).members == ("a", "b")
                # The engine holds them already: loaded in place, of the announced checksum.
                assert [_outcome(*running[m]) for m in "ab"] == [LoadedInPlace(announcement.checksum)] * 2
                assert engines["a"].arrived[-1] == (version, announcement.checksum)
                continue
            with pytest.raises(SyncFailed) as failure:
                sender.broadcast(state, announcement)
            assert (failure.value.phase, failure.value.missing) == ("verify", ["b"])
            assert isinstance(_outcome(*running["a"]), LoadedInPlace)
            b_failure = _outcome(*running["b"])
            assert isinstance(b_failure, SyncFailed) and b_failure.phase == "verify"
            # The refused version was never adopted: b's engine reloads a whole version over it.
            assert engines["b"].arrived[-1][0] == 2 and engines["b"].failed == ["f" * 64]
    # Epoch 1's end was torn down when epoch 2 replaced it, epoch 2's when its verify failed.
    assert sorted(_FakeLearnerEnd.aborted) == [1, 2]
    # One plan per epoch: a's two engine workers are NCCL ranks 1-2, b's one is rank 3; version 2 reused
    # epoch 1's transfer group (no second init).
    assert [p.rank_offset for p in _FakeLearnerEnd.plans] == [{"a": 1, "b": 3}] * 2
    assert {p.world_size for p in _FakeLearnerEnd.plans} == {4}
    assert [info["rank_offset"] for info in engines["a"].init_infos] == [1, 1]
    assert len(engines["b"].init_infos) == 2 and engines["b"].init_infos[0]["world_size"] == 4
    outsider = _vllm_receiver("c", _FakeEngine(1, lambda: ""))
    with pytest.raises(NotAMember):
        outsider.receive(announcement)


@pytest.mark.slow
def test_a_failed_native_receive_is_undone_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's NCCL receive raises midway: the session is finalized (the worker had ended it: its finish
    error is not the one reported), the engine reloads a whole version, the learner's verify names it."""
    _stand_in_for_vllm(monkeypatch)
    engine = _FakeEngine(1, lambda: "")
    rpc = engine._rpc

    def failing(method: str, timeout: float | None = None, kwargs: dict[str, Any] | None = None) -> list[Any]:
        if method == "update_weights":
            engine.calls.append(method)
            raise RuntimeError("NCCL error: remote process exited")
        if method == "finish_weight_update":
            engine.calls.append(method)
            raise RuntimeError("finish_weight_update called without a matching start_weight_update")
        return rpc(method, timeout, kwargs)

    engine.llm = SimpleNamespace(collective_rpc=failing)
    receiver = _vllm_receiver("a", engine)
    with WeightSender(backend="vllm_nccl", timeout_s=TIMEOUT_S, bucket_bytes=BUCKET_BYTES) as sender:
        announcement = sender.announce(_state(1), version=1, epoch=1, members=["a"])
        running = _receive_all({"a": receiver}, "a", announcement)
        with pytest.raises(SyncFailed) as learner_side:
            sender.broadcast(_state(1), announcement)
    failure = _outcome(*running["a"])
    assert isinstance(failure, SyncFailed) and "remote process exited" in str(failure)
    assert engine.calls[-3:] == ["start_weight_update", "update_weights", "finish_weight_update"]
    assert engine.failed == ["NCCL error: remote process exited"] and engine.arrived == []
    assert learner_side.value.missing == ["a"] and receiver.failed_epoch == 1


def test_the_transfer_plan_and_update_info() -> None:
    plan = plan_for(["a", "b", "c"], [2, 1, 4], "10.0.0.1", 41000)
    assert plan.rank_offset == {"a": 1, "b": 3, "c": 4} and plan.world_size == 8
    assert TransferPlan.from_json(plan.to_json()) == plan
    assert plan.init_info("b") == {
        "master_address": "10.0.0.1", "master_port": 41000, "rank_offset": 3, "world_size": 8,
    }  # fmt: skip
    with pytest.raises(ValueError, match="0 engine workers"):
        plan_for(["a"], [0], "h", 1)
    with WeightSender(bucket_bytes=BUCKET_BYTES) as sender:
        announcement = sender.announce(_state(1), version=1, epoch=1, members=["a"])
    info = update_info(announcement)
    assert info["names"] == list(_state(1)) and "packed" not in info  # packed is an init info field
    assert info["dtype_names"] == ["float32", "float32", "bfloat16", "int64"]
    assert info["shapes"] == [[16, 8], [40, 40], [8], []]
