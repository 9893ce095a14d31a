"""Weight sync: the learner broadcasts each policy version to the rollout fleet over its own process group.

Not the default process group (the learner's DeepSpeed owns that): a `ProcessGroupGloo` (CPU) or
`ProcessGroupNCCL` (GPU) per *group epoch*, on a `TCPStore` the learner hosts. This package never touches
Redis; the caller moves the `WeightAnnouncement` through the bus.

Protocol for one version (rank 0 = learner, rank i + 1 = members[i]):

1. Learner: `announcement = sender.announce(state_dict, version=, epoch=, members=)` (manifest, checksum,
   store address), then publishes it in Redis, then calls `sender.broadcast(state_dict, announcement,
   members)`.
2. Worker, on reading it between generation steps: `receiver.receive(announcement, members)`. A worker
   not in `members` raises NotAMember and touches nothing.
3. New epoch only: each member writes `epoch/{E}/joined/{member}`, then waits for `epoch/{E}/start`. The
   learner waits up to the timeout for every joined key; if some never appear it writes `start=abort`
   and raises SyncFailed(phase="join", missing=[those]); else it writes `start=go` and every rank forms
   the group (gloo/NCCL rendezvous under `epoch/{E}/group/`). Same epoch: the group is reused.
4. The learner broadcasts the buckets in order (two in flight); every worker has posted all its receives
   and hashes each bucket as it arrives.
5. Each worker writes `epoch/{E}/ack/{version}/{member}` = `ok` or `bad <checksum>`; the learner waits
   for all of them (then deletes them) and returns a SyncReport, or raises SyncFailed(phase="verify").

`WeightAnnouncement.members` lists the epoch's workers in rank order (rank i + 1 = members[i]).

Any failure kills the epoch on both sides; the learner's caller drops `SyncFailed.missing` and
announces the next version with a higher epoch, whose join step pins down who is really gone.

Backends (`sync.backend`, announced as `WeightAnnouncement.backend`): `gloo` and `nccl` (torch's process
groups), `nccl4py` (an NVIDIA nccl4py communicator, non-blocking and polled against the timeout; an epoch
that only loses members of a healthy one is shrunk from it: `nccl4py_group.py`), and `vllm_nccl` (vLLM's
own NCCL weight-transfer engine receives into the workers' vLLM: `vllm_native.py` here, the engine's side
in `services/rollout/vllm_transfer.py`). A backend that cannot run in this interpreter raises
BackendUnavailable, naming the fix, when the sender or receiver is built.
"""

from sparkrl.services.common.weight_sync.group import Backend, BackendUnavailable, NotAMember, SyncFailed
from sparkrl.services.common.weight_sync.manifest import (
    ALIGN,
    bucket_sizes,
    build_manifest,
    pack,
    unpack,
    weights_checksum,
)
from sparkrl.services.common.weight_sync.receiver import WeightReceiver
from sparkrl.services.common.weight_sync.sender import SyncReport, WeightSender

__all__ = [
    "ALIGN",
    "Backend",
    "BackendUnavailable",
    "NotAMember",
    "SyncFailed",
    "SyncReport",
    "WeightReceiver",
    "WeightSender",
    "bucket_sizes",
    "build_manifest",
    "pack",
    "unpack",
    "weights_checksum",
]
