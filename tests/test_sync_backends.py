"""The nccl4py and vllm_nccl weight-sync backends, on CPU: what can run without a GPU or the library.

The libraries are stood in for at their seam only (nccl4py's communicator by a shrinkable gloo group,
vLLM's transfer group and engine by recording fakes); the protocol around them is the real one: the
learner's TCPStore, the join step, the shrink plan, the transfer plan, the acknowledgements, SyncFailed.
The same contract on real GPUs is `tests/test_weight_sync_gpu.py` and the vLLM engine contract.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist

from sparkrl.proto import WeightAnnouncement
from sparkrl.services.common.weight_sync import (
    SyncFailed,
    WeightReceiver,
    WeightSender,
    vllm_native,
    weights_checksum,
)
from sparkrl.services.common.weight_sync import group as group_module
from sparkrl.services.common.weight_sync import sender as sender_module
from sparkrl.services.common.weight_sync.group import (
    HOLDS,
    JOINED,
    BackendUnavailable,
    NotAMember,
    _C10dGroup,
    _new_c10d,
    decode_shrink,
    encode_shrink,
    require_backend,
    shrink_key,
    shrink_plan,
)
from sparkrl.services.common.weight_sync.vllm_native import TransferPlan, plan_for, update_info
from sparkrl.services.rollout.vllm_transfer import VllmNativeReceiver

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


def test_a_backend_that_cannot_run_here_says_what_to_install() -> None:
    if importlib.util.find_spec("nccl") is None:
        with pytest.raises(BackendUnavailable, match=r"nccl4py\[cu12\].*or set sync.backend=nccl"):
            require_backend("nccl4py")
        with pytest.raises(BackendUnavailable, match="nccl4py"):
            WeightSender(backend="nccl4py")  # at construction, not at the first sync
        with pytest.raises(BackendUnavailable, match="nccl4py"):
            WeightReceiver("w", backend="nccl4py")
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(BackendUnavailable, match=r"vLLM must import in the learner's environment"):
            WeightSender(backend="vllm_nccl")
    if not dist.is_nccl_available():
        with pytest.raises(BackendUnavailable, match="CUDA build of torch"):
            require_backend("nccl")
    with pytest.raises(ValueError, match="VllmNativeReceiver"):
        WeightReceiver("w", backend="vllm_nccl")
    require_backend("gloo")


# ── shrinking an epoch's group: nccl4py's seam, stood in for by gloo ──────────────────────────────────


class _ShrinkableGloo:
    """A transport with nccl4py's `shrink`: the shrunk group is a new gloo group under the parent's keys,
    so the test sees the sender and receivers agree on it (ranks, size) without a new epoch's rendezvous."""

    shrinks: ClassVar[list[tuple[int, list[int]]]] = []  # (rank that shrank, the parent ranks it excluded)

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, prefix: str) -> None:
        self.store, self.rank, self.size, self.timeout, self.prefix = store, rank, size, timeout, prefix
        pg = _new_c10d(dist.PrefixStore(prefix, store), rank, size, "gloo", timeout, "127.0.0.1")
        self._inner = _C10dGroup(pg, timeout)

    def broadcast(self, bucket: torch.Tensor) -> Any:
        return self._inner.broadcast(bucket)

    def wait(self, work: Any, timeout: timedelta) -> None:
        self._inner.wait(work, timeout)

    def abort(self) -> None:
        self._inner.abort()

    def shrink(self, excluded: Sequence[int], rank: int) -> _ShrinkableGloo:
        _ShrinkableGloo.shrinks.append((rank, list(excluded)))
        size = self.size - len(excluded)
        return _ShrinkableGloo(self.store, rank, size, self.timeout, self.prefix + "shrunk/")


def test_members_leaving_a_healthy_epoch_shrink_its_group(monkeypatch: pytest.MonkeyPatch) -> None:
    def transport(
        store: dist.Store, rank: int, size: int, backend: str, timeout: timedelta, address: str
    ) -> Any:
        return _ShrinkableGloo(store, rank, size, timeout, "fresh/")

    monkeypatch.setattr(group_module, "_new_transport", transport)
    _ShrinkableGloo.shrinks = []
    receivers = {m: WeightReceiver(m, timeout_s=TIMEOUT_S) for m in "abc"}
    with WeightSender(timeout_s=TIMEOUT_S, bucket_bytes=BUCKET_BYTES) as sender:
        try:
            for version, epoch, members in ((1, 1, "abc"), (2, 2, "ac"), (3, 3, "acb")):
                state = _state(version)
                announcement = sender.announce(state, version=version, epoch=epoch, members=list(members))
                running = _receive_all(receivers, members, announcement)
                report = sender.broadcast(state, announcement)
                assert report.members == tuple(members)
                for member, (thread, out) in running.items():
                    received = _outcome(thread, out)
                    assert weights_checksum(received.items()) == announcement.checksum, member
                shrunk = sender._store.check([shrink_key(epoch)])
                # Epoch 2 only drops b: derived from epoch 1's group (b was rank 2); epoch 3 adds b back:
                # a new rendezvous.
                assert shrunk == (epoch == 2)
                if epoch == 2:
                    assert decode_shrink(sender._store.get(shrink_key(2))) == (1, [2])
                    assert sorted(_ShrinkableGloo.shrinks) == [(0, [2]), (1, [2]), (2, [2])]
        finally:
            for receiver in receivers.values():
                receiver.close()


# ── vLLM's native transfer: the learner's group and the worker's engine stood in for ──────────────────


class _FakeNativeGroup:
    """VllmNativeGroup's surface; records the plan the sender made. The transfer itself is the fake
    engine's: it 'loads' what the learner holds."""

    plans: ClassVar[list[TransferPlan]] = []
    aborted: ClassVar[list[int]] = []  # the epochs whose group the sender aborted

    def __init__(self, plan: TransferPlan, epoch: int, timeout: timedelta) -> None:
        self.epoch = epoch
        _FakeNativeGroup.plans.append(plan)

    def send(self, named_tensors: Any, announcement: WeightAnnouncement) -> str:
        return "sent"

    def wait(self, work: str) -> None:
        assert work == "sent"

    def abort(self) -> None:
        _FakeNativeGroup.aborted.append(self.epoch)


class _FakeEngine:
    """A VllmEngine as VllmNativeReceiver uses it: `llm.collective_rpc` over `workers` GPU workers, each
    running vLLM's weight-update session (`start_weight_update` → `update_weights` → `finish_weight_update`)
    and reporting what it loaded (`sparkrl_update_report`, vllm_worker.py)."""

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


def test_vllm_native_transfer_keeps_the_announce_join_verify_contract(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sender_module, "require_backend", lambda backend: None)  # no vLLM here
    monkeypatch.setattr(vllm_native, "VllmNativeGroup", _FakeNativeGroup)
    _FakeNativeGroup.plans, _FakeNativeGroup.aborted = [], []
    current: dict[str, str] = {}
    engines = {"a": _FakeEngine(2, lambda: current["checksum"]), "b": _FakeEngine(1, lambda: current["b"])}
    receivers = {m: VllmNativeReceiver(m, engine, timeout_s=TIMEOUT_S) for m, engine in engines.items()}  # type: ignore[arg-type]
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
                assert [_outcome(*running[m]) for m in "ab"] == [None, None]  # the engine holds them
                assert engines["a"].arrived[-1] == (version, announcement.checksum)
                continue
            with pytest.raises(SyncFailed) as failure:
                sender.broadcast(state, announcement)
            assert (failure.value.phase, failure.value.missing) == ("verify", ["b"])
            assert _outcome(*running["a"]) is None
            b_failure = _outcome(*running["b"])
            assert isinstance(b_failure, SyncFailed) and b_failure.phase == "verify"
            # The refused version was never adopted: b's engine reloads a whole version over it.
            assert engines["b"].arrived[-1][0] == 2 and engines["b"].failed == ["f" * 64]
    # Epoch 1's group was torn down when epoch 2 replaced it, epoch 2's when its verify failed.
    assert sorted(_FakeNativeGroup.aborted) == [1, 2]
    # One plan per epoch: a's two engine workers are NCCL ranks 1-2, b's one is rank 3; version 2 reused
    # epoch 1's transfer group (no second init).
    assert [p.rank_offset for p in _FakeNativeGroup.plans] == [{"a": 1, "b": 3}] * 2
    assert {p.world_size for p in _FakeNativeGroup.plans} == {4}
    assert [info["rank_offset"] for info in engines["a"].init_infos] == [1, 1]
    assert len(engines["b"].init_infos) == 2 and engines["b"].init_infos[0]["world_size"] == 4
    outsider = VllmNativeReceiver("c", _FakeEngine(1, lambda: ""), timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
    with pytest.raises(NotAMember):
        outsider.receive(announcement)


def test_a_failed_native_receive_is_undone_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's NCCL receive raises midway: the session is finalized (the worker had ended it: its finish
    error is not the one reported), the engine reloads a whole version, the learner's verify names it."""
    monkeypatch.setattr(sender_module, "require_backend", lambda backend: None)
    monkeypatch.setattr(vllm_native, "VllmNativeGroup", _FakeNativeGroup)
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
    receiver = VllmNativeReceiver("a", engine, timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
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
