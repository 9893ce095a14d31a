"""`sync.backend: vllm_nccl`: vLLM's own NCCL weight-transfer engine moves the tensors, both sides.

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
worker, no pickled `collective_rpc` payload; a receive returns `LoadedInPlace`.

The contract around it is every backend's (`sender.py`, `receiver.py`); a new epoch is a new transfer
group (new port, new NCCL ranks). Keys (in the learner's TCPStore, beside those of `rendezvous.py`, and
sealed like them):

- `epoch/{E}/vllm/ranks/{member}`: written by a member before its joined key: how many GPU workers its
  engine has (tensor × pipeline parallel), each one NCCL rank of the transfer group.
- `epoch/{E}/vllm/plan`: written by the learner before START_GO: the `TransferPlan` (JSON).

Every blocking vLLM call runs with a deadline (on a thread the caller waits for, or through
`collective_rpc`'s timeout), so a member that never connects or stops reading costs one failed sync.
vLLM's communicator is a blocking one: on timeout it is aborted where vLLM's NCCL wrapper exposes
`ncclCommAbort`, else left to the process (and logged); a member's engine workers stay inside NCCL until
their peer goes away, and the learner leaves that member out once its loop stops making progress
(`sync.progress_timeout_s`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from functools import partial
from typing import Any, Protocol

import torch
from torch import Tensor

from sparkrl.proto import WeightAnnouncement
from sparkrl.services.common.weight_sync.errors import BackendUnavailable
from sparkrl.services.common.weight_sync.rendezvous import JOINED
from sparkrl.services.common.weight_sync.sealed_store import SealedStore
from sparkrl.services.common.weight_sync.transport import LoadedInPlace, Rendezvous, Transport

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


def write_plan(store: SealedStore, epoch: int, members: Sequence[str], host: str) -> TransferPlan:
    """The learner, once every member joined: reads their worker counts, picks the rendezvous port (a
    fresh one per epoch: vLLM's StatelessProcessGroup hosts its own store there) and publishes the plan.
    Raises ForgedValue when a count does not verify."""
    counts = [int(store.get(ranks_key(epoch, m))) for m in members]
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


class EngineWorkers(Protocol):
    """What a member's side needs of its rollout engine (`services/rollout/vllm_engine.VllmEngine`)."""

    llm: Any  # vllm.LLM: `collective_rpc` reaches every GPU worker of the engine

    def weights_arrived(self, version: int, checksum: str) -> None:
        """Every worker loaded `version` (of `checksum`): the engine serves it from now on."""

    def native_load_failed(self, why: str) -> None:
        """A version was not (wholly) loaded: the engine reloads the one it held."""


def require_vllm() -> None:
    """BackendUnavailable, naming the fix, when vLLM does not import here (the learner sends through it)."""
    if importlib.util.find_spec("vllm") is None:
        raise BackendUnavailable(
            "sync.backend=vllm_nccl sends through vLLM's NCCL weight transfer, so vLLM must import in "
            "the learner's environment too: pip install 'vllm>=0.32' there, or set sync.backend=nccl"
        )


class LearnerEnd:
    """The learner's rank 0 of one epoch's transfer group (`connect_trainer`)."""

    epoch: int
    comm: Any  # vllm.distributed.device_communicators.pynccl.PyNcclCommunicator; None once aborted
    device: torch.device
    stream: torch.cuda.Stream  # the sends' own: the learner's compute stream is never waited on

    def __init__(self, epoch: int, comm: Any, device: torch.device) -> None:
        self.epoch, self.comm, self.device = epoch, comm, device
        self.stream = torch.cuda.Stream(device)

    def send(self, tensors: list[Tensor]) -> None:
        """Broadcasts each tensor in order (blocking: run on a thread with a deadline)."""
        torch.cuda.set_device(self.device)
        with torch.cuda.stream(self.stream):
            for tensor in tensors:
                # NCCL sends numel elements from data_ptr(): contiguous, on this device, kept referenced
                # until enqueued (the copy is made on `stream`, the thread's current one).
                self.comm.broadcast(tensor.detach().to(self.device).contiguous(), src=0, stream=self.stream)
        self.stream.synchronize()  # only this stream: the learner's compute stream is never waited on

    def abort(self) -> None:
        """Aborts vLLM's communicator where its NCCL wrapper can (ending a send stuck on a dead peer)."""
        comm, self.comm = self.comm, None
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


def connect_trainer(plan: TransferPlan, epoch: int, timeout: timedelta) -> LearnerEnd:
    """The learner joins the transfer group as rank 0 (vLLM's `trainer_init`): blocks until every
    member's engine workers connected, at most `timeout`."""
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    device = torch.device("cuda", torch.cuda.current_device())
    init_info = {
        "master_address": plan.master_address,
        "master_port": plan.master_port,
        "world_size": plan.world_size,
    }

    def connect() -> Any:
        torch.cuda.set_device(device)  # trainer_init uses the current device
        return trainer_init(init_info)

    comm = _Call(connect, "vllm-transfer-init").join(timeout, "joining vLLM's transfer group")
    return LearnerEnd(epoch, comm, device)


class VllmNcclTransport(Transport):
    """The learner's link is its end (rank 0) of the epoch's transfer group; a member's link is its
    engine's workers in that group, each receive one weight-update session in the engine."""

    name = "vllm_nccl"
    engine: EngineWorkers | None  # a member's engine; None on the learner
    timeout: timedelta
    _end: LearnerEnd | None  # the learner's link; None on a member, before `join` or once aborted
    _workers: int | None  # the engine's GPU workers: its NCCL ranks in a transfer group (asked once)

    def __init__(
        self,
        engine: EngineWorkers | None = None,
        *,
        timeout: timedelta = timedelta(seconds=60),
        end: LearnerEnd | None = None,
        epoch: int = -1,
        members: tuple[str, ...] = (),
    ) -> None:
        """`engine`: a member's (receiving needs it); the learner gives none."""
        if epoch < 0:
            require_vllm()  # made from the settings: fail at start-up, not at the first sync
        self.engine, self.timeout, self._end = engine, timeout, end
        self.epoch, self.members, self._workers = epoch, members, None

    def offer(self, rendezvous: Rendezvous) -> bytes:
        engine = self._engine()
        if self._workers is None:
            try:
                self._workers = len(_rpc(engine, "sparkrl_worker_count", rendezvous.timeout))  # one each
            except Exception as exc:  # vLLM's RPC errors and timeouts
                raise RuntimeError(f"counting vLLM's workers failed: {exc}") from exc
        # Before the joined key: once the learner sees every joined key, every count is there.
        member = rendezvous.members[rendezvous.rank - 1]
        rendezvous.store.set(ranks_key(rendezvous.epoch, member), str(self._workers).encode())
        return JOINED

    def plan(self, rendezvous: Rendezvous, joined: Mapping[str, bytes]) -> None:
        write_plan(rendezvous.store, rendezvous.epoch, rendezvous.members, rendezvous.host)

    def join(self, rendezvous: Rendezvous) -> VllmNcclTransport:
        r = rendezvous
        plan = TransferPlan.from_json(r.store.get(plan_key(r.epoch)))
        link = {"timeout": r.timeout, "epoch": r.epoch, "members": r.members}
        if r.rank == 0:
            return VllmNcclTransport(end=connect_trainer(plan, r.epoch, r.timeout), **link)
        engine = self._engine()
        try:
            # The worker method behind the NCCL engine's init_transfer_engine, called with a deadline.
            init_info = plan.init_info(r.members[r.rank - 1])
            _rpc(engine, "init_weight_transfer_engine", r.timeout, init_info=init_info)
        except Exception as exc:  # vLLM's RPC errors and timeouts
            raise RuntimeError(f"joining vLLM's transfer group failed: {exc}") from exc
        return VllmNcclTransport(engine, **link)

    def send(self, named_tensors: Mapping[str, Tensor], announcement: WeightAnnouncement) -> _Transfer:
        """Sends every tensor in manifest order, one NCCL broadcast each, on a thread of its own."""
        end = self._end
        if end is None:
            raise ValueError("the learner sends on the link `join` returned (and not yet aborted)")
        tensors = [named_tensors[spec.name] for spec in announcement.manifest]
        return _Transfer(_Call(lambda: end.send(tensors), "vllm-transfer-send"), self.timeout)

    def receive(self, announcement: WeightAnnouncement) -> LoadedInPlace:
        """One weight-update session on every engine worker, the learner broadcasting meanwhile. The engine
        serves the version from now on when every worker reports the announced checksum; otherwise the
        delivery's `undo` reloads the version it held (a failed session is undone before this raises)."""
        engine = self._engine()
        try:
            reports = _session(engine, announcement, self.timeout)
        except Exception as exc:  # vLLM's RPC errors and timeouts
            engine.native_load_failed(str(exc))
            raise RuntimeError(str(exc)) from exc
        loaded = _loaded(reports, announcement.checksum)
        if loaded.problem is None and loaded.checksum == announcement.checksum:
            engine.weights_arrived(announcement.version, loaded.checksum)
            return loaded
        return replace(loaded, undo=partial(engine.native_load_failed, loaded.problem or loaded.checksum))

    def abort(self) -> None:
        """The learner's end is aborted; a member's transfer group is replaced by the next epoch's, when
        its engine joins that one."""
        end, self._end = self._end, None
        if end is not None:
            end.abort()

    def _engine(self) -> EngineWorkers:
        if self.engine is None:
            raise ValueError(
                "sync.backend=vllm_nccl is received by vLLM itself: a worker's receiver needs its engine "
                "(services/rollout/vllm_transfer.receiver_for)"
            )
        return self.engine


class _Transfer:
    """The learner's send in flight (`Sending`)."""

    def __init__(self, call: _Call, timeout: timedelta) -> None:
        self.call, self.timeout = call, timeout

    def wait(self) -> None:
        self.call.join(self.timeout, "sending the weights to vLLM")


def _rpc(engine: EngineWorkers, method: str, timeout: timedelta, **kwargs: Any) -> list[Any]:
    """One call on every engine worker, bounded by the timeout (vLLM raises TimeoutError past it)."""
    return list(engine.llm.collective_rpc(method, timeout=timeout.total_seconds(), kwargs=kwargs))


def _session(engine: EngineWorkers, announcement: WeightAnnouncement, timeout: timedelta) -> list[Any]:
    """start → update (vLLM's NCCL receive) → finish on every engine worker; their reports."""
    _rpc(engine, "start_weight_update", timeout)
    try:
        _rpc(engine, "update_weights", timeout, update_info=update_info(announcement))
    except Exception:
        # Finalize whatever arrived (no layer left on meta); a worker whose own update raised has ended
        # its session already, and says so: the first error is the one to report.
        with contextlib.suppress(Exception):
            _rpc(engine, "finish_weight_update", timeout)
        raise
    _rpc(engine, "finish_weight_update", timeout)
    return _rpc(engine, "sparkrl_update_report", timeout)


def _loaded(reports: list[dict[str, Any]], announced: str) -> LoadedInPlace:
    """What the engine's workers report they loaded (`vllm_worker.UpdateReport`s, one each)."""
    problems = sorted({"; ".join(r["problems"]) for r in reports if r["problems"]})
    if problems:
        return LoadedInPlace(str(reports[0]["checksum"]), problems[0])
    wrong = sorted({str(r["checksum"]) for r in reports} - {announced})
    return LoadedInPlace(wrong[0] if wrong else announced)
