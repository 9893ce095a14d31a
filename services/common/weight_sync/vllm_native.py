"""`sync.backend: vllm_nccl`, the learner's side: vLLM's own NCCL weight-transfer engine moves the tensors.

vLLM (≥ 0.32, `vllm/distributed/weight_transfer/nccl_engine.py`, `nccl_common.py`) ships a trainer ↔
engine transfer: each GPU worker of the engine joins a trainer-hosted NCCL group through the worker method
`init_weight_transfer_engine(init_info)`, and a weight-update session (`start_weight_update`,
`update_weights(update_info)`, `finish_weight_update`) receives one tensor per NCCL broadcast in the
`update_info`'s order (`packed` off in the init info). The rollout worker's engine is our subclass of
vLLM's NCCL engine (`services/rollout/vllm_worker.py`), which hashes what it loads. The trainer side is
`nccl_common.trainer_init(...)` (a `PyNcclCommunicator` over vLLM's `StatelessProcessGroup`, rank 0) and
one `broadcast` per tensor. (vLLM's own trainer engine, `NCCLTrainerWeightTransferEngine`, drives the
inference side itself through a client; here each rollout worker drives its own engine, so the learner
only broadcasts.) The weights land in the engine's GPU memory directly: no host copy in the rollout
worker, no pickled `collective_rpc` payload.

Our contract around it stays the same as the other backends' (`sender.py`): the announcement (version,
manifest, checksum) goes out first; members join the epoch with their joined key; the learner then
writes the epoch's transfer plan (below) and START_GO; each member's engine hashes the tensors as they
are loaded and acknowledges ok / bad. A new epoch is a new transfer group (new port, new NCCL ranks).

Keys (in the learner's TCPStore, beside the common ones of `group.py`):

- `epoch/{E}/vllm/ranks/{member}`: written by a member before its joined key: how many GPU workers its
  engine has (tensor × pipeline parallel), each one NCCL rank of the transfer group.
- `epoch/{E}/vllm/plan`: written by the learner before START_GO: the `TransferPlan` (JSON).

Every blocking vLLM call runs on a thread the caller waits for up to the timeout, so a member that never
connects or stops reading costs one failed sync. vLLM's communicator is a blocking one: on timeout it is
aborted where vLLM's NCCL wrapper exposes `ncclCommAbort`, else left to the process (and logged).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from sparkrl.proto import WeightAnnouncement

log = logging.getLogger("sparkrl.weight_sync")


def ranks_key(epoch: int, member: str) -> str:
    """Written by a member (its engine's GPU worker count, decimal) before its joined key."""
    return f"epoch/{epoch}/vllm/ranks/{member}"


def plan_key(epoch: int) -> str:
    """Written by the learner (a TransferPlan's JSON) before START_GO."""
    return f"epoch/{epoch}/vllm/plan"


@dataclass(frozen=True)
class TransferPlan:
    """One epoch's NCCL transfer group: the learner is rank 0 and hosts its rendezvous; member m's engine
    workers are ranks rank_offset[m] .. rank_offset[m] + its worker count - 1."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: dict[str, int]

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> TransferPlan:
        return cls(**json.loads(raw))

    def init_info(self, member: str) -> dict[str, Any]:
        """The `init_info` a member's engine passes to `init_weight_transfer_engine`."""
        return {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": self.rank_offset[member],
            "world_size": self.world_size,
        }


def plan_for(members: Sequence[str], worker_counts: Sequence[int], host: str, port: int) -> TransferPlan:
    """Ranks in member order after the learner's rank 0."""
    offsets, next_rank = {}, 1
    for member, count in zip(members, worker_counts, strict=True):
        if count < 1:
            raise ValueError(f"member {member} reported {count} engine workers")
        offsets[member], next_rank = next_rank, next_rank + count
    return TransferPlan(host, port, next_rank, offsets)


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def write_plan(store: dist.Store, epoch: int, members: Sequence[str], host: str) -> TransferPlan:
    """The learner, once every member joined: reads their worker counts, picks the rendezvous port (a
    fresh one per epoch: vLLM's StatelessProcessGroup hosts its own store there) and publishes the plan."""
    counts = [int(raw) for raw in store.multi_get([ranks_key(epoch, m) for m in members])]
    plan = plan_for(members, counts, host, _free_port(host))
    store.set(plan_key(epoch), plan.to_json())
    return plan


def update_info(announcement: WeightAnnouncement) -> dict[str, Any]:
    """The `update_info` both sides agree on: every tensor of the manifest, in manifest order (the
    checksum's order), one NCCL broadcast each (the init info leaves `packed` off: the learner's send
    then runs on a stream of ours that it can wait for; vLLM's packed producer makes streams of its own)."""
    return {
        "names": [spec.name for spec in announcement.manifest],
        "dtype_names": [spec.dtype for spec in announcement.manifest],
        "shapes": [list(spec.shape) for spec in announcement.manifest],
    }


class _Call:
    """A blocking call on its own daemon thread; `join` bounds how long the caller waits for it."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self._result: list[Any] = []
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._result.append(fn())
        except BaseException as exc:  # handed to the waiting thread
            self._error.append(exc)

    def join(self, timeout: timedelta, what: str) -> Any:
        """The call's result; RuntimeError when it failed or is still running after `timeout`."""
        self._thread.join(timeout.total_seconds())
        if self._thread.is_alive():
            raise RuntimeError(f"{what} did not finish within {timeout.total_seconds():g}s")
        if self._error:
            raise RuntimeError(f"{what} failed: {self._error[0]}") from self._error[0]
        return self._result[0]


class VllmNativeGroup:
    """The learner's end (rank 0) of one epoch's vLLM transfer group; `send`, `wait`, `abort` like the
    other backends' groups, so the sender's protocol does not change."""

    epoch: int
    timeout: timedelta
    device: torch.device
    _comm: Any  # vllm.distributed.device_communicators.pynccl.PyNcclCommunicator
    _stream: torch.cuda.Stream

    def __init__(self, plan: TransferPlan, epoch: int, timeout: timedelta) -> None:
        """Joins the group: blocks until every member's engine workers connected, at most `timeout`."""
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.epoch, self.timeout = epoch, timeout
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._stream = torch.cuda.Stream(self.device)
        init_info = {
            "master_address": plan.master_address,
            "master_port": plan.master_port,
            "world_size": plan.world_size,
        }

        def connect() -> Any:
            torch.cuda.set_device(self.device)  # trainer_init uses the current device
            return trainer_init(init_info)

        self._comm = _Call(connect, "vllm-transfer-init").join(timeout, "joining vLLM's transfer group")

    def send(self, named_tensors: Mapping[str, Tensor], announcement: WeightAnnouncement) -> _Call:
        """Starts sending every tensor in manifest order; returns the transfer to `wait` for."""
        tensors = [named_tensors[spec.name] for spec in announcement.manifest]
        device, stream, comm = self.device, self._stream, self._comm

        def transfer() -> None:
            torch.cuda.set_device(device)
            with torch.cuda.stream(stream):
                for tensor in tensors:
                    # NCCL sends numel elements from data_ptr(): contiguous, on this device, kept referenced
                    # until enqueued (the copy is made on `stream`, the thread's current one).
                    comm.broadcast(tensor.detach().to(device).contiguous(), src=0, stream=stream)
            stream.synchronize()  # only this stream: the learner's compute stream is never waited on

        return _Call(transfer, "vllm-transfer-send")

    def wait(self, work: _Call) -> None:
        """Blocks until the transfer is done; raises when it failed or outlived the timeout."""
        work.join(self.timeout, "sending the weights to vLLM")

    def abort(self) -> None:
        """Aborts vLLM's communicator when its NCCL wrapper can (ending a send stuck on a dead peer)."""
        comm, self._comm = self._comm, None
        if comm is None:
            return
        library, handle = getattr(comm, "nccl", None), getattr(comm, "comm", None)
        abort = getattr(library, "ncclCommAbort", None) or getattr(
            getattr(library, "lib", None), "ncclCommAbort", None
        )
        if abort is None or handle is None:
            log.info("vLLM's NCCL wrapper has no ncclCommAbort: epoch %d's communicator is left", self.epoch)
            return
        try:
            abort(handle)
        except Exception:  # the last resort: nothing left to report it to
            log.info("aborting epoch %d's vLLM communicator failed", self.epoch, exc_info=True)
