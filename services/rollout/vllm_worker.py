"""What runs inside vLLM's worker (the engine process, or ours with `in_process`): the worker extension
sparkrl calls through `LLM.collective_rpc`, and the weight-transfer engine it registers with vLLM.

Every weight update, on CPU and GPU alike, is one session of vLLM's own weight-update API, called on
the worker: `start_weight_update` → `update_weights(update_info)` (once per bucket) →
`finish_weight_update`, on the engine `WeightTransferConfig(backend="sparkrl")` names: ours
(`SparkrlTransferEngine`, registered with `WeightTransferEngineFactory.register_engine`; vLLM ships none
for CPU). Only the transport differs:

- `{"tensors": [...]}`: the rollout worker process hands them over (it received them from the learner
  over gloo or NCCL, or read a snapshot);
- `{"names", "dtype_names", "shapes"}`: vLLM's NCCL receive, the learner broadcasting straight into the
  engine's GPU memory (`sync.backend: vllm_nccl`, after `init_weight_transfer_engine`).

Both load through vLLM's layerwise reload (`initialize_layerwise_reload` at start, the model's
`load_weights` per tensor, `finalize_layerwise_reload` at finish): each layer is rebuilt in checkpoint
format, loaded, and processed again (fused, quantized, or on CPU pre-packed for oneDNN, which empties the
layer's `weight`: a plain `model.load_weights` into a live CPU model fails on that empty tensor, and can
leave the model half-updated).

The checksum a worker reports is the weights checksum's tree over the bytes of each tensor as vLLM's
loader takes it, in order (`sparkrl.proto.weights_checksum`'s algorithm, leaves on every core), taken
here, in the engine's process, after the transport. vLLM's parameters cannot be hashed back into the
learner's layout (fused q/k/v and gate/up, padded vocabularies, CPU weights pre-packed into kernel
handles), so a session also reports what it can check of vLLM's own state: every parameter of the model
was reloaded, and the parameters vLLM keeps as given (norms, unpadded embeddings) read back equal to the
bytes that went in.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from sparkrl.proto.weights import root_checksum
from sparkrl.services.common.weight_sync.hashing import shared_hasher
from sparkrl.services.common.weight_sync.manifest import raw_bytes, tied_aliases

log = logging.getLogger("sparkrl.rollout.vllm")

TRANSFER_BACKEND = "sparkrl"  # our engine's name in vLLM's WeightTransferEngineFactory
Wire = tuple[str, str, list[int], bytes]  # (name, dtype name, shape, raw bytes): a tensor across processes


def encode_tensor(name: str, tensor: torch.Tensor) -> Wire:
    """A tensor as msgpack carries it between processes (vLLM's RPC turns a bare tensor into nested lists)."""
    return name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), bytes(raw_bytes(tensor))


def decode_tensor(item: tuple[str, torch.Tensor] | Wire | list[Any]) -> tuple[str, torch.Tensor]:
    if len(item) == 2:
        name, tensor = item
        return str(name), tensor  # type: ignore[return-value]
    name, dtype, shape, data = item
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return str(name), flat.view(getattr(torch, dtype)).reshape(shape)


@dataclass
class UpdateReport:
    """One session's outcome on one worker; `collective_rpc("sparkrl_update_report")` returns it as a dict."""

    checksum: str | None  # of what the loader took, in order; None: no session finished
    tensors: int = 0
    problems: list[str] = field(default_factory=list)  # empty: vLLM holds every tensor given
    read_back: int = 0  # tensors compared with what vLLM holds after processing (the others are packed)


class UpdateSession:
    """One version's load into one model: hashes each tensor, loads it, remembers what to check."""

    def __init__(self, model: torch.nn.Module, tied: dict[str, str]) -> None:
        self.model = model
        self._aliases: dict[str, list[str]] = {}  # a tied tensor's name → vLLM's other names of it
        for alias, first in tied.items():
            self._aliases.setdefault(first, []).append(alias)
        self._load = model.load_weights  # the class's method: the NCCL engine's patch must not recurse
        self.digests: list[bytes] = []  # each tensor's, in order: the checksum's tree (sparkrl.proto.weights)
        self.loaded: set[str] = set()
        self.tensors = 0
        self._params = dict(model.named_parameters())  # vLLM's names; those kept as given match ours
        self._expected: dict[str, str] = {}  # name → digest of what went in, in the parameter's dtype

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads `weights`, hashing each tensor as vLLM's loader pulls it (so a tensor that cannot be read
        fails the load there, after the ones before it were loaded)."""

        def hashed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                self.digests.append(shared_hasher().submit(raw_bytes(tensor)).result())
                held = self._params.get(name)
                if held is not None and held.numel() and tuple(held.shape) == tuple(tensor.shape):
                    self._expected[name] = _digest(tensor.to(held.dtype))
                self.tensors += 1
                yield name, tensor
                # The learner sends a tied tensor once; vLLM's reload rebuilds each layer apart (a tied
                # head meanwhile its own tensor), so a head vLLM keeps takes it too (unhashed: the
                # checksum is over what the learner sent). A model with no such parameter gets none.
                yield from ((alias, tensor) for alias in self._aliases.get(name, ()))

        loaded = set(self._load(hashed()) or ())
        self.loaded |= loaded
        return loaded

    def report(self) -> UpdateReport:
        """After finalize: what vLLM did not reload, or holds other than given."""
        problems = []
        missing = sorted(set(self._params) - self.loaded)
        if missing:
            problems.append(f"{len(missing)} parameters were not reloaded (first: {missing[0]})")
        held = dict(self.model.named_parameters())
        read_back = 0
        for name, given in self._expected.items():
            if name not in held:
                problems.append(f"{name} is gone from the model")
            elif held[name].numel():  # empty: pre-packed into a kernel's own buffer, unreadable
                read_back += 1
                if _digest(held[name]) != given:
                    problems.append(f"{name} does not hold the bytes loaded into it")
        return UpdateReport(root_checksum(self.digests), self.tensors, problems, read_back)


def _digest(tensor: torch.Tensor) -> str:
    return shared_hasher().submit(raw_bytes(tensor)).result().hex()


def finish_session(model: torch.nn.Module, model_config: Any, session: UpdateSession | None) -> UpdateReport:
    """Finalize the layerwise reload (always: until then reloaded layers sit on the meta device) and report.

    A head tied to the embedding receives no tensor of its own (the loader skips `lm_head.weight`); it
    shares the embedding's parameter, whose storage the reload copies the new values into, so it reads
    them too (the tied-model test holds vLLM to that)."""
    finalize_layerwise_reload(model, model_config)
    if session is None:
        return UpdateReport(None, 0, ["no update was in progress"])
    return session.report()


@dataclass
class HostUpdateInfo(WeightTransferUpdateInfo):
    """One bucket handed over by the rollout worker process: (name, tensor) pairs in-process, `Wire`
    tuples across processes."""

    tensors: list[Any]


class SparkrlTransferEngine(NCCLWeightTransferEngine):
    """`sparkrl`: one session per version, the tensors arriving either in `update_info` (`{"tensors":
    [...]}`: received by the rollout worker over gloo/NCCL, or read from a snapshot) or through vLLM's NCCL
    engine (`{"names", "dtype_names", "shapes"}` after `init_weight_transfer_engine`: vllm_nccl). Every
    tensor passes `UpdateSession.load` on its way into the model."""

    supports_draft_weight_update = False
    session: UpdateSession | None = None
    report: UpdateReport = UpdateReport(None)

    def start_weight_update(self) -> None:
        if self.session is not None:  # the last session died between calls: close it before reloading
            finish_session(self.model, self.model_config, self.session)
        # Read while the model is whole: during a reload a tied head is a tensor of its own.
        tied = tied_aliases(self.model.named_parameters(remove_duplicate=False))
        initialize_layerwise_reload(self.model)
        self.session = UpdateSession(self.model, tied)

    def parse_update_info(self, update_dict: dict[str, Any]) -> Any:
        if "tensors" in update_dict:
            return HostUpdateInfo(**update_dict)
        return super().parse_update_info(update_dict)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        session = self.session
        if session is None:
            raise RuntimeError("update_weights outside a weight-update session")
        info = self.parse_update_info(update_info)
        try:
            if isinstance(info, HostUpdateInfo):
                session.load(decode_tensor(item) for item in info.tensors)
            else:
                # vLLM's NCCL receive calls `self.model.load_weights` (per tensor, or per unpacked chunk):
                # an instance attribute shadows the class's method for this receive only.
                self.model.load_weights = session.load
                try:
                    self.receive_weights(info)
                finally:
                    del self.model.load_weights
        except BaseException:
            # Layers still waiting for tensors sit on the meta device: finalize now, so the model runs
            # (half old, half new) until the caller reloads a whole version over it.
            self.report = finish_session(self.model, self.model_config, None)
            self.session = None
            raise
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the next forward pass must not read weights still being copied

    def finish_weight_update(self) -> None:
        self.report = finish_session(self.model, self.model_config, self.session)
        self.session = None


# On import: vLLM imports this module (worker_extension_cls) in each worker before it builds the engine.
if TRANSFER_BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, SparkrlTransferEngine)


class SparkrlWorkerExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`); called through `LLM.collective_rpc`."""

    weight_transfer_engine: Any

    def sparkrl_worker_count(self) -> int:
        """1 from each worker: `collective_rpc` answers once per worker, so the answers count them."""
        return 1

    def sparkrl_update_report(self) -> dict[str, Any]:
        """The last weight-update session's `UpdateReport`."""
        engine = self.weight_transfer_engine
        report = getattr(engine, "report", None) or UpdateReport(None, 0, ["no sparkrl transfer engine"])
        return dataclasses.asdict(report)
