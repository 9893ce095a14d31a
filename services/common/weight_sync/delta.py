"""Delta weight sync (`sync.delta`, issue 50 item 4): a version sent as what changed since the one every
member holds, as verl, SkyRL, slime, NeMo-RL and AReaL now do.

Changed means changed bits: each tensor is compared with the base as integers of its width, so a bf16
element that rounds to the same value is unchanged, and applying a delta is exact (bit-equal to sending
the version whole; the receiver checks the whole version's checksum after applying it). A tensor travels

- not at all, when nothing in it changed;
- as positions + values (`<name>#delta.index`, int32 below 2³¹ elements else int64, and
  `<name>#delta.values`), when that is smaller than the tensor;
- whole (`<name>`), when it is not: in float32 nearly every element moves every step.

The wire tensors are an ordinary state dict for the manifest, the buckets and the per-tensor digests.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from sparkrl.proto.weights import DELTA_INDEX, DELTA_VALUES

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaError(ValueError):
    """A delta that does not apply to the weights held (another base, another layout)."""


def _bits(tensor: Tensor) -> Tensor:
    """The tensor's elements as integers of their width (bit patterns), flat."""
    flat = tensor.detach().reshape(-1)
    return flat.view(_BITS[flat.element_size()])  # a bool is a byte


def same_layout(base: Mapping[str, Tensor], new: Mapping[str, Tensor]) -> bool:
    """Whether `new` has `base`'s names, in order, with their dtypes and shapes (a delta needs it)."""
    return list(base) == list(new) and all(
        base[name].dtype == new[name].dtype and base[name].shape == new[name].shape for name in new
    )


def changed_positions(base: Tensor, new: Tensor) -> Tensor:
    """Flat positions whose bits differ (int64, ascending)."""
    return torch.nonzero(_bits(base) != _bits(new.to(base.device)), as_tuple=False).reshape(-1)


def delta_tensors(base: Mapping[str, Tensor], new: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """What to send so that a holder of `base` makes `new` (same layout: `same_layout`), in `new`'s order.
    At least one tensor (the manifest is never empty): with nothing changed, the first one whole."""
    wire: dict[str, Tensor] = {}
    for name, tensor in new.items():
        held = base[name]
        positions = changed_positions(held, tensor)
        count = positions.numel()
        if count == 0:
            continue
        index_dtype = torch.int32 if tensor.numel() < 2**31 else torch.int64
        sparse_bytes = count * (torch.empty(0, dtype=index_dtype).element_size() + tensor.element_size())
        if sparse_bytes >= tensor.numel() * tensor.element_size():
            wire[name] = tensor
            continue
        wire[name + DELTA_INDEX] = positions.to(index_dtype)
        wire[name + DELTA_VALUES] = tensor.detach().reshape(-1).to(held.device)[positions]
    if not wire:
        first = next(iter(new))
        wire[first] = new[first]
    return wire


def apply_delta(
    base: Mapping[str, Tensor], wire: Mapping[str, Tensor], in_place: bool = False
) -> dict[str, Tensor]:
    """The version `wire` makes from `base`: new tensors, or with `in_place` `base`'s own tensors
    written over (only the changed elements: the cheap way to move a held copy on). Raises DeltaError
    when the wire names a tensor the base lacks, or positions and values that do not fit it."""
    known = set(base) | {n + DELTA_INDEX for n in base} | {n + DELTA_VALUES for n in base}
    unknown = sorted(set(wire) - known)
    if unknown:
        raise DeltaError(f"the delta names tensors the weights held do not have: {unknown[:3]}")
    for name, held in base.items():  # every check before any write: a refused delta changes nothing
        if name + DELTA_INDEX in wire:
            _check_sparse(name, held, wire[name + DELTA_INDEX], wire.get(name + DELTA_VALUES))
        elif name in wire and (wire[name].dtype != held.dtype or wire[name].shape != held.shape):
            raise DeltaError(f"{name}: sent whole with another dtype or shape than the one held")
    full: dict[str, Tensor] = {}
    for name, held in base.items():
        if name in wire:
            full[name] = held.copy_(wire[name]) if in_place else wire[name]
        elif name + DELTA_INDEX in wire:
            out = held if in_place else held.detach().clone()
            positions = wire[name + DELTA_INDEX].to(device=out.device, dtype=torch.int64)
            out.reshape(-1)[positions] = wire[name + DELTA_VALUES].to(out.device)
            full[name] = out
        else:
            full[name] = held
    return full


def _check_sparse(name: str, held: Tensor, positions: Tensor, values: Tensor | None) -> None:
    if values is None or values.numel() != positions.numel() or values.dtype != held.dtype:
        raise DeltaError(f"{name}: the delta's positions and values do not match")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= held.numel()):
        raise DeltaError(f"{name}: a delta position lies outside its {held.numel()} elements")


def changed_fraction(base: Mapping[str, Tensor], new: Mapping[str, Tensor]) -> float:
    """Elements whose bits changed, over all elements (what a delta's size follows)."""
    changed = sum(changed_positions(base[n], t).numel() for n, t in new.items())
    return changed / max(sum(t.numel() for t in new.values()), 1)


class DeltaBase:
    """One side's base: the whole version it last sent (the learner) or took (a worker), a CPU copy of its
    own, and its checksum. The learner sends the next version as a delta against it when every member
    holds it. A copy is moved on by writing the changed elements into it (`apply_delta(in_place=True)`),
    not copied again, so keeping it costs what the delta costs."""

    def __init__(self) -> None:
        self.tensors: dict[str, Tensor] | None = None
        self.checksum: str | None = None

    def keep(self, tensors: Mapping[str, Tensor], checksum: str) -> None:
        """A copy of `tensors` (a receiver's are views into buckets the next version overwrites) as the
        base."""
        self.tensors = {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}
        self.checksum = checksum

    def apply(self, wire: Mapping[str, Tensor], checksum: str) -> dict[str, Tensor]:
        """The base moved on by the delta `wire`, in place: the new version (this base's tensors), of
        `checksum` as announced — until the caller has verified it, the base is trusted for nothing."""
        if self.tensors is None:
            raise DeltaError("no version is held to apply a delta to")
        self.checksum = None  # written over now: the caller says what it holds once it is verified
        return apply_delta(self.tensors, wire, in_place=True)

    def wire_for(
        self, new: Mapping[str, Tensor], checksum: str, held: list[str | None]
    ) -> tuple[Mapping[str, Tensor], str | None]:
        """What to send of `new` (of `checksum`) to members holding `held`, and the base it is a delta
        against (None: `new` whole, as for a member on another version, or a first version); `new`
        becomes the base."""
        if self.tensors is None or not same_layout(self.tensors, new):
            self.keep(new, checksum)
            return new, None
        base = self.checksum if held and all(h == self.checksum for h in held) else None
        wire = delta_tensors(self.tensors, new)
        apply_delta(self.tensors, wire, in_place=True)  # the base is `new` now, at the delta's cost
        self.checksum = checksum
        return (wire, base) if base is not None else (new, None)
