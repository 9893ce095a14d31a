"""The byte layout of a weight broadcast: manifest, buckets, and the one weights checksum.

A state dict travels as a few flat `uint8` buckets. The manifest (a list of `TensorSpec`, in the state
dict's order) says where each tensor lives: bucket index and byte offset. Tensors are packed in order;
a bucket closes when the next tensor would end past `bucket_bytes`, so a tensor larger than a bucket
travels alone. Offsets are aligned to `ALIGN` bytes because a `uint8` slice can be viewed as a wider
dtype only at an offset that is a multiple of that dtype's size.

Packing in order makes manifest order (bucket, offset) order, so a receiver can checksum bucket by
bucket while later buckets are still arriving.

A tensor shared under several names (a tied output layer: `lm_head.weight` is `model.embed_tokens.weight`)
is sent once, under its first name in state-dict order (`distinct_tensors`): the canonical tied name, the
one Hugging Face checkpoints store and every engine's loader knows. The checksum is over what is sent.
"""

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from sparkrl.proto import DTYPE_ITEMSIZE, TensorSpec
from sparkrl.services.common.weight_sync.hashing import shared_hasher

ALIGN = 64  # bytes: a multiple of every dtype's size, and of a cache line


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 → "bfloat16": the manifest's spelling. Raises for dtypes the wire does not carry."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_ITEMSIZE:
        raise ValueError(f"dtype {name} cannot be broadcast; supported: {sorted(DTYPE_ITEMSIZE)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a manifest names: "bfloat16" → torch.bfloat16."""
    return getattr(torch, name)


def _identity(tensor: Tensor) -> object:
    """What two names of one tensor share: the memory they view (a meta tensor has none: the object)."""
    if tensor.device.type == "meta" or not tensor.numel():
        return id(tensor)
    storage = tensor.untyped_storage().data_ptr()
    return (tensor.device, storage, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))


def tied_aliases(named_tensors: Iterable[tuple[str, Tensor]]) -> dict[str, str]:
    """Each later name of a tensor seen earlier under another → that first name (`lm_head.weight` →
    `model.embed_tokens.weight` in a tied model's state dict). Meta tensors are told apart by object, so
    pass `state_dict(keep_vars=True)` for a model on the meta device."""
    first: dict[object, str] = {}
    aliases: dict[str, str] = {}
    held = []  # every tensor stays alive until the end: a freed one's memory could be the next one's
    for name, tensor in named_tensors:
        held.append(tensor)
        canonical = first.setdefault(_identity(tensor), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


def distinct_tensors(named_tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`named_tensors` with every tied alias left out (`tied_aliases`): what a weight broadcast sends, a
    snapshot holds and the checksum covers, each tensor once under its first name."""
    aliases = tied_aliases(named_tensors.items())
    return {name: tensor for name, tensor in named_tensors.items() if name not in aliases}


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def build_manifest(named_tensors: Mapping[str, Tensor], bucket_bytes: int) -> list[TensorSpec]:
    """Where each tensor travels: specs in the mapping's order, packed into buckets of ≤ `bucket_bytes`."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be at least {ALIGN}, got {bucket_bytes}")
    specs: list[TensorSpec] = []
    bucket, end, in_bucket = 0, 0, 0
    for name, tensor in named_tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        offset = _aligned(end)
        if in_bucket and offset + nbytes > bucket_bytes:
            bucket, offset, in_bucket = bucket + 1, 0, 0
        specs.append(
            TensorSpec(
                name=name,
                dtype=dtype_name(tensor.dtype),
                shape=list(tensor.shape),
                numel=tensor.numel(),
                bucket=bucket,
                offset=offset,
            )
        )
        end, in_bucket = offset + nbytes, in_bucket + 1
    return specs


def bucket_sizes(manifest: Sequence[TensorSpec]) -> list[int]:
    """Bytes per bucket: where its last tensor ends."""
    sizes = [0] * (max((spec.bucket for spec in manifest), default=-1) + 1)
    for spec in manifest:
        sizes[spec.bucket] = max(sizes[spec.bucket], spec.offset + spec.nbytes)
    return sizes


def tensor_bytes(tensor: Tensor) -> Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy); 0-d tensors are flattened first."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def specs_by_bucket(manifest: Sequence[TensorSpec]) -> list[list[TensorSpec]]:
    """The manifest split per bucket, each list in manifest order."""
    groups: list[list[TensorSpec]] = [[] for _ in bucket_sizes(manifest)]
    for spec in manifest:
        groups[spec.bucket].append(spec)
    return groups


def pack_into(bucket: Tensor, specs: Sequence[TensorSpec], named_tensors: Mapping[str, Tensor]) -> Tensor:
    """Copies the bucket's tensors into `bucket` (uint8, on any device); returns the used prefix."""
    size = max(spec.offset + spec.nbytes for spec in specs)
    for spec in specs:
        target = bucket[spec.offset : spec.offset + spec.nbytes]
        source = named_tensors[spec.name].detach()
        if target.device.type == source.device.type == "cpu" and source.is_contiguous():
            # A plain memcpy: torch's copy_ splits even an 8 MB copy over its intra-op threads, and on a
            # busy host waiting for them made packing ten times slower than one memcpy.
            np.copyto(target.numpy(), tensor_bytes(source).numpy())
        else:
            # One pass does the device transfer and gathers a non-contiguous source.
            target.view(torch_dtype(spec.dtype)).view(spec.shape).copy_(source)
    return bucket[:size]


def zero_copy_bucket(
    specs: Sequence[TensorSpec], named_tensors: Mapping[str, Tensor], device: torch.device
) -> Tensor | None:
    """The bucket as a view of its tensor when it holds one contiguous tensor already on `device`."""
    if len(specs) != 1 or specs[0].offset != 0:
        return None
    tensor = named_tensors[specs[0].name]
    if not tensor.is_contiguous() or tensor.device != device:
        return None
    return tensor_bytes(tensor)


def pack(named_tensors: Mapping[str, Tensor], manifest: Sequence[TensorSpec]) -> list[Tensor]:
    """Every bucket as a fresh CPU uint8 tensor (the sender streams instead; this is the whole picture)."""
    buckets = [torch.empty(size, dtype=torch.uint8) for size in bucket_sizes(manifest)]
    for bucket, specs in zip(buckets, specs_by_bucket(manifest), strict=True):
        pack_into(bucket, specs, named_tensors)
    return buckets


def tensor_view(bucket: Tensor, spec: TensorSpec) -> Tensor:
    """The spec's tensor as a view into its bucket, no copy."""
    raw = bucket[spec.offset : spec.offset + spec.nbytes]
    return raw.view(torch_dtype(spec.dtype)).view(spec.shape)


def unpack(buckets: Sequence[Tensor], manifest: Sequence[TensorSpec]) -> dict[str, Tensor]:
    """The state dict back, in manifest order; every tensor is a view into its bucket."""
    return {spec.name: tensor_view(buckets[spec.bucket], spec) for spec in manifest}


def raw_bytes(tensor: Tensor) -> memoryview:
    """A tensor's bytes in C order on the CPU: a view when it is already contiguous there, else a copy."""
    flat = tensor.detach().to("cpu").contiguous()
    return memoryview(tensor_bytes(flat).numpy())


def weights_checksum(named_tensors: Iterable[tuple[str, Tensor]]) -> str:
    """The weights checksum everyone computes: `weights_checksum(state_dict.items())`, on every core.

    The tree of `sparkrl.proto.weights` (`CHECKSUM_ALGORITHM`) over each tensor's raw contiguous CPU bytes
    (native little-endian, C order, no padding), in the iteration order. Names, dtypes and shapes are not
    hashed: the manifest carries those and a receiver checks them by construction; hashing bytes alone lets
    an engine whose parameter names differ from the learner's still report the same checksum for the same
    bytes. Order matters: iterate in manifest order (`state_dict()` / `named_parameters()` order on the
    learner).
    """
    return shared_hasher().checksum(raw_bytes(tensor) for _, tensor in named_tensors)


def tensor_digests(named_tensors: Iterable[tuple[str, Tensor]]) -> list[bytes]:
    """Each tensor's digest in the checksum's tree, in order (`root_checksum` of them is the checksum)."""
    return shared_hasher().digests(raw_bytes(tensor) for _, tensor in named_tensors)
