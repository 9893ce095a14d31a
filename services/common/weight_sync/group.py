"""One epoch's broadcast group, the rendezvous keys both sides write, and the errors they raise.

The learner hosts a `TCPStore`; every key below lives in it. A group epoch is one membership: rank 0 is
the learner, ranks 1..N are the members in announced order. A process group is never re-formed under the
same epoch (gloo's own rendezvous keys stay in the store under the epoch's prefix and would be reused),
so any change of membership, and any failure, moves to a new epoch.

The transport behind an epoch is one small class per backend with the same three calls (`broadcast`,
`wait`, `abort`): torch's ProcessGroupGloo / ProcessGroupNCCL here (`_C10dGroup`), an nccl4py
communicator in `nccl4py_group.py`. Only nccl4py can `shrink`: a new epoch that only drops members of a
healthy one is derived from it (see `shrink_plan`), every other change forms the group afresh.
`vllm_nccl` is not an `EpochGroup` at all: vLLM's own weight-transfer engine moves the tensors
(`vllm_native.py`); it shares the keys, the join step and the acknowledgements.
"""

import importlib.util
import os
import socket
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

# The common base of ProcessGroupGloo and ProcessGroupNCCL; torch exports it only from its C module.
from torch._C._distributed_c10d import Backend as C10dBackend

Backend = Literal["gloo", "nccl", "nccl4py", "vllm_nccl"]
GPU_BACKENDS = ("nccl", "nccl4py", "vllm_nccl")
Phase = Literal["join", "connect", "transfer", "verify"]

START_GO = b"go"
START_ABORT = b"abort"
ACK_OK = b"ok"
JOINED = b"1"  # a joined key's value, or HOLDS + epoch: the member holds that epoch's group, shrinkable
HOLDS = b"holds "


class BackendUnavailable(RuntimeError):
    """The configured `sync.backend` cannot run in this interpreter; the message names the fix."""


class SyncFailed(RuntimeError):
    """A weight sync did not complete. The group of `epoch` is gone; the next sync needs a new epoch.

    `phase` is where it failed: `join` (members never wrote their joined key), `connect` (forming the
    process group), `transfer` (a bucket broadcast failed or timed out), `verify` (checksum mismatch or
    no acknowledgement). `missing` names the members to drop from the next epoch when they are known:
    the ones that never joined, or never acknowledged (a member blocked behind a hung one may be among
    them). Empty when the failure cannot be pinned on a member.
    """

    reason: str
    epoch: int
    phase: Phase
    missing: list[str]

    def __init__(self, message: str, *, epoch: int, phase: Phase, missing: Sequence[str] = ()) -> None:
        detail = f"; missing: {', '.join(missing)}" if missing else ""
        super().__init__(f"weight sync failed in epoch {epoch} ({phase}): {message}{detail}")
        self.reason = message
        self.epoch = epoch
        self.phase = phase
        self.missing = list(missing)

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only fields: the default exception pickling would call __init__ with the message alone.
        rebuild = partial(type(self), self.reason, epoch=self.epoch, phase=self.phase, missing=self.missing)
        return (rebuild, ())


class NotAMember(SyncFailed):
    """This worker is not in the epoch's member list: it must not join (it waits for a later epoch)."""


def joined_key(epoch: int, member: str) -> str:
    """Written by a member (JOINED, or HOLDS + the epoch whose shrinkable group it holds) before it forms
    the epoch's group; read by the learner."""
    return f"epoch/{epoch}/joined/{member}"


def shrink_key(epoch: int) -> str:
    """Written by the learner before START_GO when `epoch` is formed by shrinking an earlier epoch's group:
    b"<parent epoch> <excluded parent ranks, comma-separated>". Absent: form the group afresh."""
    return f"epoch/{epoch}/shrink"


def start_key(epoch: int) -> str:
    """Written by the learner: START_GO once every member joined, START_ABORT when some never did."""
    return f"epoch/{epoch}/start"


def ack_key(epoch: int, version: int, member: str) -> str:
    """Written by a member after it verified `version`: ACK_OK or b"bad <checksum it computed>"."""
    return f"epoch/{epoch}/ack/{version}/{member}"


def learner_still_there(store: dist.TCPStore, epoch: int) -> bool:
    """Whether the learner behind `store` is the one that started `epoch`: a restarted learner has a new
    store, so the old connection errors, or the epoch was never started in it."""
    try:
        return store.check([start_key(epoch)])
    except RuntimeError:
        return False


def connect_store(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A worker's connection to the learner's store (`host_store`). `timeout` bounds every store wait."""
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)


def host_store(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """The learner's store, listening on `host` only (port 0: a free one). TCPStore alone would listen on
    every interface; handed a socket already bound, it listens on that one."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(128)
    bound = listener.getsockname()[1]
    # The store takes the descriptor over (and closes it with itself): Python must let go of it, or its
    # socket object would close the number again later, when it may belong to another connection.
    fd = listener.detach()
    return dist.TCPStore(
        host, bound, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=fd
    )


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to `host` (no packet sent): where its gloo device listens."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


def missing_keys(store: dist.Store, keys: dict[str, str], timeout: timedelta) -> list[str]:
    """Waits up to `timeout` for every key; returns the names whose key never appeared."""
    try:
        store.wait(list(keys.values()), timeout)
        return []
    except dist.DistStoreError:
        return [name for name, key in keys.items() if not store.check([key])]


def bucket_device(backend: Backend) -> torch.device:
    """Where buckets live: host memory for gloo, the current GPU for NCCL (torch's or nccl4py's)."""
    gpu = backend in GPU_BACKENDS
    return torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")


def require_backend(backend: Backend) -> None:
    """Raises BackendUnavailable, naming the fix, when `backend` cannot run here: called when a sender
    or receiver is built, so a missing library fails at start-up and not at the first sync."""
    if backend == "nccl4py":
        from sparkrl.services.common.weight_sync.nccl4py_group import require_nccl4py

        require_nccl4py()
    elif backend == "nccl" and not dist.is_nccl_available():
        raise BackendUnavailable(
            "sync.backend=nccl needs a CUDA build of torch (this one has no NCCL): use gloo"
        )
    elif backend == "vllm_nccl" and importlib.util.find_spec("vllm") is None:
        raise BackendUnavailable(
            "sync.backend=vllm_nccl sends through vLLM's NCCL weight transfer, so vLLM must import in "
            "the learner's environment too: pip install 'vllm>=0.32' there, or set sync.backend=nccl"
        )


def shrink_plan(
    parent_epoch: int, parent_members: Sequence[str], members: Sequence[str], joined: Mapping[str, bytes]
) -> list[int] | None:
    """The parent's ranks to exclude when the new epoch's group can be shrunk from the parent's, else None.

    Possible when the new members are the parent's minus some, in the parent's order (NCCL keeps the
    order of the ranks that stay, so rank i + 1 is still members[i]), and every one of them reported
    (its joined value) that it holds the parent's group.
    """
    held = HOLDS + str(parent_epoch).encode()
    remaining = [m for m in parent_members if m in members]
    if not members or remaining != list(members) or any(joined.get(m) != held for m in members):
        return None
    excluded = [rank + 1 for rank, member in enumerate(parent_members) if member not in members]
    return excluded or None  # same members: the epoch changed for another reason, start afresh


def encode_shrink(parent_epoch: int, excluded: Sequence[int]) -> bytes:
    """The `shrink_key` value."""
    return f"{parent_epoch} {','.join(map(str, excluded))}".encode()


def decode_shrink(value: bytes) -> tuple[int, list[int]]:
    """(parent epoch, excluded parent ranks) from a `shrink_key` value."""
    parent, excluded = value.decode().split(" ")
    return int(parent), [int(rank) for rank in excluded.split(",")]


@contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


def _new_c10d(
    store: dist.Store, rank: int, size: int, backend: Backend, timeout: timedelta, address: str
) -> C10dBackend:
    if backend == "gloo":
        # Bound to `address`: by default gloo listens on whatever the hostname resolves to.
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        options._timeout = timeout
        # Blocks until all `size` ranks connected, or raises after `timeout`.
        return dist.ProcessGroupGloo(store, rank, size, options)
    from torch.distributed import ProcessGroupNCCL  # present only in CUDA builds of torch

    options = ProcessGroupNCCL.Options(is_high_priority_stream=False)
    options._timeout = timeout
    # By default NCCL's watchdog tears the whole process down when a collective times out; a hung worker
    # must cost the learner one failed sync, not its life. Read once, in this constructor.
    with _env("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0"):
        return ProcessGroupNCCL(store, rank, size, options)


class _C10dGroup:
    """torch.distributed's ProcessGroupGloo / ProcessGroupNCCL behind the transport calls."""

    _pg: C10dBackend
    timeout: timedelta

    def __init__(self, pg: C10dBackend, timeout: timedelta) -> None:
        self._pg, self.timeout = pg, timeout

    def broadcast(self, bucket: Tensor) -> dist.Work:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        # The per-collective timeout is what turns a hung peer into an error instead of a hang.
        options.timeout = self.timeout
        return self._pg.broadcast([bucket], options)

    def wait(self, work: dist.Work, timeout: timedelta) -> None:
        # With a timeout, NCCL's wait blocks the CPU thread (not only the stream) and raises when it
        # expires; gloo's op has already failed by then through its own timeout.
        work.wait(timeout)

    def abort(self) -> None:
        self._pg.abort()


def _new_transport(
    store: dist.Store, rank: int, size: int, backend: Backend, timeout: timedelta, address: str
) -> Any:
    """The epoch's transport: `_C10dGroup` or `Nccl4pyGroup` (same calls)."""
    if backend == "nccl4py":
        from sparkrl.services.common.weight_sync.nccl4py_group import Nccl4pyGroup

        return Nccl4pyGroup.connect(store, rank, size, timeout)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend} has no broadcast group of its own")
    return _C10dGroup(_new_c10d(store, rank, size, backend, timeout, address), timeout)


class EpochGroup:
    """The broadcast group of one epoch, separate from any default group (DeepSpeed's)."""

    epoch: int
    rank: int
    size: int
    backend: Backend
    device: torch.device
    timeout: timedelta
    _transport: Any  # _C10dGroup | Nccl4pyGroup

    def __init__(
        self,
        store: dist.Store,
        epoch: int,
        rank: int,
        size: int,
        backend: Backend,
        timeout: timedelta,
        address: str = "",
        *,
        parent: "EpochGroup | None" = None,
        excluded: Sequence[int] = (),
    ) -> None:
        """`address`: the interface this rank's connections listen on (gloo); "" lets gloo choose.
        `parent`, `excluded`: form this epoch by shrinking `parent`'s group without those of its ranks
        (nccl4py; see `shrink_plan`) instead of a new rendezvous. The parent stays the caller's to abort."""
        self.epoch = epoch
        self.rank = rank
        self.size = size
        self.backend = backend
        self.device = bucket_device(backend)
        self.timeout = timeout
        if parent is not None:
            self._transport = parent._transport.shrink(excluded, rank)
        else:
            prefixed = dist.PrefixStore(f"epoch/{epoch}/group/", store)
            self._transport = _new_transport(prefixed, rank, size, backend, timeout, address)

    @property
    def can_shrink(self) -> bool:
        """Whether a later epoch that only drops members may be derived from this group."""
        return hasattr(self._transport, "shrink")

    def broadcast(self, bucket: Tensor) -> Any:
        """Starts broadcasting `bucket` from the learner (rank 0) in place; every rank calls it in order.
        Returns the work to `wait` for."""
        return self._transport.broadcast(bucket)

    def wait(self, work: Any) -> None:
        """Blocks until `work` completes; raises (a dead peer fast, a hung one after `timeout`)."""
        self._transport.wait(work, self.timeout)

    def abort(self) -> None:
        """Closes the group's connections; peers blocked in a collective with this rank fail fast."""
        self._transport.abort()
