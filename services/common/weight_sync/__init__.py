"""Weight sync: the learner sends each policy version to the rollout fleet, over a link of its own per epoch.

Two layers. The *contract* (announce → join → send → verify → acknowledge) is the same for every backend
and written once: the learner's side in `sender.py`, the worker's in `receiver.py`, meeting in the keys of a
`TCPStore` the learner hosts (`rendezvous.py`), every value sealed with `sync.secret` (`sealed_store.py`).
The *transport* (`transport.py`: join / send / receive / abort) moves the bytes, one implementation per
`sync.backend` (`backends.make_transport`): `gloo` and
`nccl` (torch's process groups, `torch_groups.py`), `nccl4py` (an NVIDIA nccl4py communicator, non-blocking
and polled against the timeout, shrunk when members only leave: `nccl4py_group.py`), `vllm_nccl` (vLLM's
own NCCL weight-transfer engine, straight into the workers' vLLM: `vllm_native.py`). The first three move
the manifest's buckets (`buckets.py`, `manifest.py`). This package never touches Redis; the caller moves
the `WeightAnnouncement` through the bus (`rendezvous.ANNOUNCEMENT_KEY`).

Protocol for one version (rank 0 = learner, rank i + 1 = members[i]):

1. Learner: `announcement = sender.announce(state_dict, version=, epoch=, members=)` (manifest, checksum,
   store address), publishes it in Redis, records it as current in its store (`sender.published`), then
   calls `sender.broadcast(state_dict, announcement)`.
2. Worker, on reading it between generation steps: `receiver.receive(announcement)`. A worker not in
   `members` raises NotAMember and touches nothing. One whose epoch is over (the store's current record
   is of a later epoch or another learner, or the epoch started without it: a replayed or late
   announcement) raises EpochOver at once, before joining.
3. New epoch only: each member writes `epoch/{E}/joined/{member}` (its transport's offer), then waits for
   `epoch/{E}/start`. The learner waits up to the timeout for every joined key; if some never appear it
   writes `start=abort` and raises SyncFailed(phase="join", missing=[those]); else its transport plans the
   link, it writes `start=go`, and every rank joins the link. Same epoch: the link is reused.
4. The learner sends; every member receives, hashing the bytes as they arrive (or its engine does).
5. Each member writes `epoch/{E}/ack/{version}/{member}` = `ok` or `bad <checksum>`; the learner waits
   for all of them (a straggler gets `straggler_s` once others answered; a member known gone is cut at
   once), then deletes them and returns a SyncReport, or raises SyncFailed(phase="verify").

Any failure kills the epoch on both sides; the learner's caller drops `SyncFailed.missing` and announces
the next version with a higher epoch, whose join step pins down who is really gone. A backend that cannot
run in this interpreter raises BackendUnavailable, naming the fix, when the sender or receiver is built.
"""

from sparkrl.services.common.weight_sync.backends import make_transport
from sparkrl.services.common.weight_sync.errors import (
    BackendUnavailable,
    EpochOver,
    NotAMember,
    SyncFailed,
)
from sparkrl.services.common.weight_sync.manifest import (
    ALIGN,
    bucket_sizes,
    build_manifest,
    distinct_tensors,
    pack,
    tied_aliases,
    unpack,
    weights_checksum,
)
from sparkrl.services.common.weight_sync.receiver import WeightReceiver
from sparkrl.services.common.weight_sync.rendezvous import ANNOUNCEMENT_KEY
from sparkrl.services.common.weight_sync.sender import SyncReport, WeightSender
from sparkrl.services.common.weight_sync.transport import (
    Backend,
    Delivery,
    LoadedInPlace,
    Received,
    Transport,
)

__all__ = [
    "ALIGN",
    "ANNOUNCEMENT_KEY",
    "Backend",
    "BackendUnavailable",
    "Delivery",
    "EpochOver",
    "LoadedInPlace",
    "NotAMember",
    "Received",
    "SyncFailed",
    "SyncReport",
    "Transport",
    "WeightReceiver",
    "WeightSender",
    "bucket_sizes",
    "build_manifest",
    "distinct_tensors",
    "make_transport",
    "pack",
    "tied_aliases",
    "unpack",
    "weights_checksum",
]
