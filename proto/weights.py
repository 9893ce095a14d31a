"""Weight-sync announcements: what the learner is about to broadcast, and how to join the broadcast.

Writer: the learner, in Redis, before each broadcast. Readers: rollout workers (to allocate buckets,
join the process group and verify what they received) and the controller's weight-sync monitor.
The broadcast sends `num_buckets` flat byte buffers in bucket order; tensor `i` lives in bucket
`manifest[i].bucket` at byte `manifest[i].offset`.
"""

import hashlib
import hmac
import math
from collections.abc import Iterable
from typing import Literal

from pydantic import Field, NonNegativeInt, model_validator

from sparkrl.proto.base import WireModel
from sparkrl.proto.errors import FieldError

WEIGHTS_SCHEMA_VERSION = 2  # 2: `incarnation` and `sequence` (a replayed announcement is refused)

WeightDtype = Literal[
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
    "int64", "int32", "int16", "int8", "uint8", "bool",
]  # fmt: skip

# Bytes per element of each dtype, spelled as torch spells them (without `torch.`), so that neither
# side needs torch to size a bucket.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip

# The weights checksum is a tree, so that it is computed on every core and each tensor is verified as it
# lands: a tensor's bytes are cut into `CHUNK_BYTES` leaves, each hashed; a tensor's digest is the hash of
# its length and its leaves' digests; the version's checksum is the hash of the tensors' digests in
# manifest order. It does not depend on how the tensors are packed into buckets, so an engine computes it
# over the tensors it holds. The leaf hash is SHA-256 (cryptographic; x86's SHA extensions run it at
# several GB/s a core), the announcement stays HMAC-signed, and each `TensorSpec.digest` is in it.
CHECKSUM_ALGORITHM = "sha256-tree-4MiB"
CHUNK_BYTES = 4 << 20
Bytes = bytes | bytearray | memoryview


def leaf_digest(chunk: Bytes) -> bytes:
    return hashlib.sha256(chunk).digest()


def _tensor_node(nbytes: int, leaves: Iterable[bytes]) -> bytes:
    node = hashlib.sha256(b"sparkrl-tensor\0" + nbytes.to_bytes(8, "little"))
    for leaf in leaves:
        node.update(leaf)
    return node.digest()


def chunks(data: Bytes) -> list[memoryview]:
    """The leaves of a tensor's bytes: `CHUNK_BYTES` each, the last one shorter (none when empty)."""
    view = memoryview(data).cast("B")
    return [view[i : i + CHUNK_BYTES] for i in range(0, len(view), CHUNK_BYTES)]


def tensor_digest(data: Bytes, leaf_digests: Iterable[bytes] | None = None) -> bytes:
    """One tensor's digest (its raw bytes: contiguous, native little-endian, no padding); `leaf_digests`:
    its leaves' digests when hashed already (in parallel, `ParallelHasher`)."""
    view = memoryview(data).cast("B")
    leaves = leaf_digests if leaf_digests is not None else (leaf_digest(c) for c in chunks(view))
    return _tensor_node(len(view), leaves)


def root_checksum(tensor_digests: Iterable[bytes]) -> str:
    """The version's checksum from its tensors' digests, in manifest order; lowercase hex."""
    root = hashlib.sha256(b"sparkrl-weights\0")
    for digest in tensor_digests:
        root.update(digest)
    return root.hexdigest()


def weights_checksum(tensor_bytes: Iterable[Bytes]) -> str:
    """The announcement's checksum over each tensor's raw bytes in manifest order, on this thread (the
    weight-sync side hashes on several: `weight_sync.hashing`)."""
    return root_checksum(tensor_digest(data) for data in tensor_bytes)


# A delta version's (`WeightAnnouncement.delta_base`) sparse tensors travel as two: positions and values.
DELTA_INDEX = "#delta.index"
DELTA_VALUES = "#delta.values"


class TensorSpec(WireModel):
    """One parameter in the broadcast. Writer: learner. Reader: rollout worker (unpacks the buckets)."""

    name: str = Field(
        min_length=1,
        description="Parameter name as in the model's state dict (e.g. "
        "`model.layers.0.mlp.up_proj.weight`). Writer: learner. Reader: rollout worker (loads it into its "
        "engine by this name).",
    )
    dtype: WeightDtype = Field(
        description="Element type, torch's name without `torch.`. Writer: learner. Reader: rollout worker."
    )
    shape: list[NonNegativeInt] = Field(
        description="Dimensions; [] for a scalar. Writer: learner. Reader: rollout worker."
    )
    numel: int = Field(
        ge=0,
        description="Number of elements, the product of `shape`. Writer: learner. Reader: rollout worker.",
    )
    bucket: int = Field(
        ge=0,
        description="Index of the bucket that carries the tensor, in [0, num_buckets). Writer: learner. "
        "Reader: rollout worker.",
    )
    offset: int = Field(
        ge=0,
        description="Byte offset of the tensor's first element in its bucket. Writer: learner. Reader: "
        "rollout worker.",
    )
    digest: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="The tensor's digest in the weights checksum's tree (`tensor_digest`, hex): a receiver "
        "verifies each tensor as its bucket lands and names the one that differs. Writer: learner. Reader: "
        "rollout worker. None: not given (checked through the version's checksum only).",
    )

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_ITEMSIZE[self.dtype]

    @model_validator(mode="after")
    def _check(self) -> "TensorSpec":
        if math.prod(self.shape) != self.numel:
            raise FieldError("numel", f"{self.numel} is not the product of shape {self.shape}")
        return self


class WeightAnnouncement(WireModel):
    """A new policy version is about to be broadcast. Writer: learner. Readers: rollout workers, monitor.

    Invariants: tensor names are unique; each bucket index in [0, num_buckets) is used; tensors of a
    bucket do not overlap; a bucket ends within `bucket_bytes` unless it holds one tensor only (a tensor
    larger than a bucket travels alone); `total_bytes` is the sum of the tensors' sizes.
    """

    schema_version: Literal[2] = Field(
        default=WEIGHTS_SCHEMA_VERSION, description="Wire version; readers reject others."
    )
    incarnation: int = Field(
        ge=0,
        description="The learner process that announced it: its start time, ns since the epoch, so a "
        "restarted learner's is larger. Writer: learner. Reader: rollout worker (follows a newer "
        "incarnation, also back to an older version after a resume; refuses an older one, a replay).",
    )
    sequence: int = Field(
        ge=0,
        description="Announcements this incarnation made before this one (0, 1, 2, … also when a version is "
        "announced again for a new group epoch). Writer: learner. Reader: rollout worker (refuses one older "
        "than the newest it saw from the same incarnation: a replayed announcement is never followed).",
    )
    version: int = Field(
        ge=0,
        description="Policy version of these weights (the learner's optimizer steps so far). Writer: "
        "learner. Reader: rollout worker (tags the tokens it samples with them).",
    )
    manifest: list[TensorSpec] = Field(
        min_length=1,
        description="Every tensor sent, in checksum order. Writer: learner. Reader: rollout worker.",
    )
    total_bytes: int = Field(
        ge=0,
        description="Sum of the tensors' sizes, bytes. Writer: learner. Readers: rollout worker, monitor "
        "(bandwidth).",
    )
    bucket_bytes: int = Field(
        gt=0,
        description="Bucket capacity, bytes. Writer: learner. Reader: rollout worker (allocates receive "
        "buffers).",
    )
    num_buckets: int = Field(
        ge=1,
        description="Number of broadcasts that carry the weights. Writer: learner. Reader: rollout worker.",
    )
    checksum: str = Field(
        pattern=r"^[0-9a-f]{64}$",
        description="The weights checksum (`CHECKSUM_ALGORITHM`, hex): the root of the tree over the "
        "tensors' raw bytes in manifest order (see `weights_checksum`); with `delta_base`, of the whole "
        "version the delta makes. Writer: learner. Reader: rollout worker (verifies what it received, "
        "reports it in its status).",
    )
    group_epoch: int = Field(
        ge=0,
        description="Generation of the broadcast process group; it increases whenever the group is "
        "re-formed (a worker left or joined). Writer: learner. Reader: rollout worker (re-joins when it "
        "changes).",
    )
    rendezvous_host: str = Field(
        min_length=1,
        description="Host of the learner's TCPStore for this group epoch. Writer: learner. Reader: rollout "
        "worker.",
    )
    rendezvous_port: int = Field(
        ge=1, le=65535, description="Port of that TCPStore. Writer: learner. Reader: rollout worker."
    )
    world_size: int = Field(
        ge=1,
        description="Ranks in the broadcast group: the learner (rank 0) plus the workers admitted to this "
        "epoch. Writer: learner. Reader: rollout worker.",
    )
    members: list[str] = Field(
        default_factory=list,
        description="Worker ids admitted to this epoch, in rank order: worker `members[i]` is rank i + 1. "
        "Writer: learner. Reader: rollout worker (a worker not listed waits for a later epoch; it may load "
        "`snapshot_path` meanwhile).",
    )
    backend: Literal["gloo", "nccl", "nccl4py", "vllm_nccl"] = Field(
        description="Transport of the group (`sync.backend`): `gloo` on CPU; on GPU `nccl` (torch's "
        "ProcessGroupNCCL), `nccl4py` (an NVIDIA nccl4py communicator) or `vllm_nccl` (vLLM's own "
        "NCCL weight-transfer engine, into the workers' vLLM). Writer: learner. Reader: rollout worker."
    )
    delta_base: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="Set when the version travels as a delta (`sync.delta`) against the version of this "
        "checksum, which every member holds: the manifest then holds, per tensor that changed, either "
        "`<name>` whole (dense) or `<name>` + `DELTA_INDEX` (int32 or int64 flat positions) and `<name>` + "
        "`DELTA_VALUES` (the new elements there); a tensor not named is unchanged. `checksum` is then the "
        "whole version's, which a worker checks after applying the delta (each sent tensor's own digest is "
        "in its spec). A worker whose weights are another version refuses it. None: the manifest is the "
        "version. Writer: learner. Reader: rollout worker.",
    )
    adapter_base: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="Set when the version is a LoRA adapter alone (`learner.lora.sync: adapter`): the "
        "manifest holds, sorted by name, per adapted layer `<layer>`, `<layer>.lora_A` (r × in) and "
        "`<layer>.lora_B` (out × r, already scaled by alpha / r), which a worker merges into the base as "
        "`<layer>.weight` = W0 + lora_B · lora_A. The value is the checksum (`weights_checksum`) of those "
        "base weights W0 in float32, layers sorted by name: a worker whose base differs refuses the "
        "version. None: the manifest is the whole model. Writer: learner. Reader: rollout worker.",
    )
    snapshot_path: str | None = Field(
        default=None,
        description="Where a worker that joins late loads the latest weights from (a directory of "
        "safetensors shards). Writer: learner. Reader: rollout worker. None when no snapshot was written "
        "yet.",
    )
    files_url: str | None = Field(
        default=None,
        description="Base URL of the learner's weight files (`/snapshot`, `/model`): how a worker that "
        "cannot see the learner's disk (a container, a pod, another host) catches up and gets the model; "
        "`/snapshot` holds this version when `snapshot_path` is set. "
        "Writer: learner. Reader: rollout worker (verifies what it downloads against `checksum` and "
        "`model_sha256`). None when the learner serves none.",
    )
    model_sha256: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="sha256 of the learner's model-directory listing (file → bytes, sha256; canonical "
        "JSON) at `files_url`/model. Writer: learner. Reader: a worker fetching the model.",
    )
    created_at: float = Field(
        ge=0,
        description="Unix time (s) of the announcement. Writer: learner. Readers: rollout worker, monitor "
        "(sync latency).",
    )
    signature: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="HMAC-SHA256 (hex) of every other field's JSON under the run's shared secret "
        "(`sync.secret`), so that what a worker follows (the store address, the snapshot path, the "
        "checksum) comes from the learner. Writer: learner. Reader: rollout worker (refuses a bad one). "
        "None when no secret is configured.",
    )

    def bucket_sizes(self) -> list[int]:
        """Bytes to receive per bucket: the end of its last tensor."""
        sizes = [0] * self.num_buckets
        for spec in self.manifest:
            sizes[spec.bucket] = max(sizes[spec.bucket], spec.offset + spec.nbytes)
        return sizes

    @model_validator(mode="after")
    def _check(self) -> "WeightAnnouncement":
        if self.world_size != len(self.members) + 1:
            raise FieldError(
                "world_size", f"{self.world_size} is not 1 (learner) + {len(self.members)} members"
            )
        if len(set(self.members)) != len(self.members):
            raise FieldError("members", "a worker id appears more than once")
        names = [spec.name for spec in self.manifest]
        if len(set(names)) != len(names):
            duplicate = next(name for name in names if names.count(name) > 1)
            raise FieldError("manifest", f"tensor name {duplicate!r} appears more than once")
        if sum(spec.nbytes for spec in self.manifest) != self.total_bytes:
            raise FieldError("total_bytes", f"{self.total_bytes} is not the manifest's sum of tensor sizes")
        by_bucket: dict[int, list[tuple[int, int]]] = {}
        for i, spec in enumerate(self.manifest):
            if spec.bucket >= self.num_buckets:
                raise FieldError(
                    f"manifest[{i}].bucket", f"{spec.bucket} is not below num_buckets={self.num_buckets}"
                )
            by_bucket.setdefault(spec.bucket, []).append((spec.offset, i))
        for bucket in range(self.num_buckets):
            self._check_bucket(bucket, sorted(by_bucket.get(bucket, [])))
        return self

    def _check_bucket(self, bucket: int, members: list[tuple[int, int]]) -> None:
        if not members:
            raise FieldError("num_buckets", f"bucket {bucket} carries no tensor")
        end = 0
        for offset, i in members:
            if offset < end:
                raise FieldError(f"manifest[{i}].offset", f"overlaps the previous tensor of bucket {bucket}")
            end = offset + self.manifest[i].nbytes
        if end > self.bucket_bytes and len(members) > 1:
            raise FieldError(
                "bucket_bytes", f"bucket {bucket} holds {len(members)} tensors and ends at byte {end}"
            )


def _mac(announcement: WeightAnnouncement, secret: str) -> str:
    payload = announcement.model_dump_json(exclude={"signature"}).encode()
    return hmac.new(secret.encode(), payload, hashlib.sha256).hexdigest()


def sign_announcement(announcement: WeightAnnouncement, secret: str) -> WeightAnnouncement:
    """The announcement with its `signature` (learner side)."""
    return announcement.model_copy(update={"signature": _mac(announcement, secret)})


def announcement_verifies(announcement: WeightAnnouncement, secret: str) -> bool:
    """Whether `signature` is the secret's MAC of the rest (worker side; constant-time compare)."""
    return announcement.signature is not None and hmac.compare_digest(
        announcement.signature, _mac(announcement, secret)
    )
