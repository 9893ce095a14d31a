"""`sync.backend: vllm_nccl`, the rollout worker's side: the learner's tensors go straight into vLLM.

The learner's half and the keys are in `services/common/weight_sync/vllm_native.py`. Here:

- `NativeTransferExtension`, mixed into the vLLM GPU workers (through `SparkrlWorkerExtension`):
  `sparkrl_receive_native` receives one version through the worker's own `weight_transfer_engine`
  (vLLM's `NCCLWeightTransferEngine`, built from `weight_transfer_config`), loading each tensor with
  the model's `load_weights` (Hugging Face names: it fuses and shards) and hashing it on the way in, so
  the checksum is of what this worker loaded, in manifest order, with the algorithm of
  `sparkrl.proto.weights_checksum` (blake2b-256 over each tensor's raw bytes).
- `VllmNativeReceiver`, the `WeightReceiver` of a worker whose engine receives itself: same join step
  and acknowledgements, then `init_weight_transfer_engine` (a new epoch: the plan's rank offset) and the
  receive, each a `collective_rpc` bounded by `sync.timeout_s`. Every engine worker must report the
  announced checksum, or the version is refused (acknowledged bad).

A `collective_rpc` that timed out leaves vLLM's workers inside NCCL until their peer goes away (vLLM's
communicator is a blocking one): this worker's receive fails in `timeout_s`, and the learner leaves it out
of later broadcasts once its loop stops making progress (`sync.progress_timeout_s`).
"""

from __future__ import annotations

import hashlib
import inspect
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from sparkrl.proto import WeightAnnouncement
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
from sparkrl.services.common.weight_sync.manifest import raw_bytes
from sparkrl.services.common.weight_sync.vllm_native import TransferPlan, plan_key, ranks_key, update_info

if TYPE_CHECKING:
    from sparkrl.services.rollout.vllm_engine import VllmEngine


def hashing_loader(load: Any, digest: Any) -> Any:
    """A `load_weights(weights)` callback that feeds each tensor's bytes to `digest`, then loads them."""

    def load_weights(weights: list[tuple[str, torch.Tensor]]) -> None:
        for _, tensor in weights:
            digest.update(raw_bytes(tensor))  # a device-to-host copy: the checksum is of these bytes
        load(weights=weights)

    return load_weights


class NativeTransferExtension:
    """vLLM GPU-worker methods for the native transfer, called through `LLM.collective_rpc`."""

    model_runner: Any
    weight_transfer_engine: Any  # vLLM's NCCLWeightTransferEngine, None without weight_transfer_config

    def sparkrl_worker_count(self) -> int:
        """1 from each GPU worker: `collective_rpc` answers once per worker, so the answers count them."""
        return 1

    def sparkrl_receive_native(self, update_info: dict[str, Any]) -> str:
        """Receives one version from the learner, loads it, returns the blake2b-256 hex of what it loaded."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            raise RuntimeError("vLLM was started without weight_transfer_config: no native transfer")
        if "load_weights" not in inspect.signature(engine.receive_weights).parameters:
            raise RuntimeError(
                "this vLLM's receive_weights takes no load_weights callback (needed to verify the checksum): "
                "use vLLM 0.16+ with receive_weights(update_info, load_weights), or sync.backend=nccl"
            )
        digest = hashlib.blake2b(digest_size=32)
        load = hashing_loader(self.model_runner.model.load_weights, digest)
        engine.receive_weights(engine.parse_update_info(update_info), load_weights=load)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the next generate step must not read weights still being copied
        return digest.hexdigest()


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
            checksums = self._rpc("sparkrl_receive_native", update_info=update_info(announcement))
            bad = sorted({c for c in checksums if c != announcement.checksum})
            ack = f"bad {bad[0]}".encode() if bad else ACK_OK
            store.set(ack_key(epoch, announcement.version, self.worker_id), ack)
        except SyncFailed:
            self._fail(epoch)
            raise
        except Exception as exc:  # vLLM's RPC errors and timeouts, store errors
            self._fail(epoch)
            raise SyncFailed(str(exc), epoch=epoch, phase="transfer") from exc
        if bad:
            self._fail(epoch)
            # Loaded already: the engine reports the bytes it holds, under the version it had (the worker
            # catches up from the snapshot next).
            self.engine.weights_arrived(self.engine.policy_version, bad[0])
            raise SyncFailed(f"checksum mismatch: the engine loaded {bad[0]}", epoch=epoch, phase="verify")
        self.engine.weights_arrived(announcement.version, announcement.checksum)

    def close(self) -> None:
        """Drops the store connection; the engine's transfer group is replaced by the next epoch's."""
        self._store, self._held = None, None

    def _fail(self, epoch: int) -> None:
        self.failed_epoch = epoch
        self.close()

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
            # The worker method behind LLM.init_weight_transfer_engine, called with a deadline.
            self._rpc("init_weight_transfer_engine", init_info=plan.init_info(self.worker_id))
        except Exception as exc:
            raise SyncFailed(
                f"joining vLLM's transfer group failed: {exc}", epoch=epoch, phase="connect"
            ) from exc
        self._store, self._held = store, (address, epoch)
        return store
