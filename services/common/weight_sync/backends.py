"""The one place a backend's name picks its transport (`sync.backend`, `WeightAnnouncement.backend`)."""

from sparkrl.services.common.weight_sync.buckets import Buffers
from sparkrl.services.common.weight_sync.nccl4py_group import Nccl4pyTransport
from sparkrl.services.common.weight_sync.torch_groups import GlooTransport, TorchNcclTransport
from sparkrl.services.common.weight_sync.transport import Backend, Transport
from sparkrl.services.common.weight_sync.vllm_native import EngineWorkers, VllmNcclTransport

BUCKETED = {"gloo": GlooTransport, "nccl": TorchNcclTransport, "nccl4py": Nccl4pyTransport}


def make_transport(
    backend: Backend, *, reuse_buffers: bool = False, engine: EngineWorkers | None = None
) -> Transport:
    """`backend`'s transport, not yet joined; BackendUnavailable (naming the fix) when it cannot run here.

    `reuse_buffers`: a member receives every version into the same buckets (see `buckets.Buffers`).
    `engine`: the vLLM engine a member's `vllm_nccl` receive loads into (vLLM's own transfer; the learner
    gives none). The other backends hand the tensors to the caller, which loads them.
    """
    if backend == "vllm_nccl":
        return VllmNcclTransport(engine)
    return BUCKETED[backend](Buffers(reuse_received=reuse_buffers))
