"""Delta weight sync (`sync.delta`, issue 50 item 4): a version sent as what changed since the one every
member holds is applied bit-exactly; after 100 versions every worker holds exactly what a whole broadcast
would have given it, including one that missed versions and one that joined late (each gets a whole
version first); a delta against weights a worker does not hold is refused, never applied."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_weight_sync import (  # noqa: F401  (fixtures)
    BUCKET_BYTES,
    WORKER_TIMEOUT_S,
    spawn_workers,
    worker_pool,
)
from torch import Tensor

from sparkrl.proto.weights import DELTA_INDEX, DELTA_VALUES
from sparkrl.services.common.weight_sync import Received, WeightReceiver, WeightSender, weights_checksum
from sparkrl.services.common.weight_sync.delta import (
    DeltaBase,
    DeltaError,
    apply_delta,
    changed_fraction,
    delta_tensors,
)


def _bits_equal(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        a, b = got[name].reshape(-1), tensor.reshape(-1)
        if a.dtype.is_floating_point:
            width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
            a, b = a.view(width), b.view(width)
        assert torch.equal(a, b), name


def _state(seed: int = 0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "layers.0.weight": torch.randn(48, 32, generator=g).to(torch.bfloat16),
        "norm.weight": torch.randn(32, generator=g),  # float32
        "step": torch.tensor(seed, dtype=torch.int64),
        "mask": torch.rand(7, generator=g) > 0.5,
        "empty": torch.empty(0, 3),
    }


def _step(state: dict[str, Tensor], version: int) -> dict[str, Tensor]:
    """The next version: ~2% of the bf16 elements moved (an RL step's share), the float32 norm all of it
    every tenth version, the counter each time."""
    g = torch.Generator().manual_seed(1000 + version)
    new = {name: t.clone() for name, t in state.items()}
    for name in ("embed.weight", "layers.0.weight"):
        flat = new[name].reshape(-1)
        where = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 50)]
        flat[where] = (flat[where].float() + torch.randn(where.numel(), generator=g)).to(torch.bfloat16)
    if version % 10 == 0:
        new["norm.weight"] = new["norm.weight"] + 1e-3 * torch.randn(32, generator=g)
    new["step"] = torch.tensor(version, dtype=torch.int64)
    return new


def test_a_delta_applies_bit_exactly_and_sends_each_tensor_the_cheaper_way() -> None:
    base = _state()
    new = _step(base, 10)
    wire = delta_tensors(base, new)
    assert f"embed.weight{DELTA_INDEX}" in wire and wire[f"embed.weight{DELTA_INDEX}"].dtype == torch.int32
    assert wire[f"embed.weight{DELTA_VALUES}"].dtype == torch.bfloat16
    assert "norm.weight" in wire  # every element moved: whole is smaller than positions + values
    assert "mask" not in wire and "empty" not in wire  # unchanged: not sent
    _bits_equal(apply_delta(base, wire), new)
    assert weights_checksum(apply_delta(base, wire).items()) == weights_checksum(new.items())
    sent = sum(t.numel() * t.element_size() for t in wire.values())
    assert sent < sum(t.numel() * t.element_size() for t in new.values()) / 4
    assert 0 < changed_fraction(base, new) < 0.1
    # In float32 an optimizer step moves nearly every element: the delta is the tensors whole. (In bf16
    # the same small step moves none of them: 1e-6 is below the rounding.)
    full = {name: (t.float() if t.is_floating_point() else t) for name, t in base.items()}
    moved = {name: (t + 1e-6 * t.sign() if t.is_floating_point() else t) for name, t in full.items()}
    assert changed_fraction(full, moved) > 0.9
    assert set(delta_tensors(full, moved)) == {"embed.weight", "layers.0.weight", "norm.weight"}
    assert (
        changed_fraction(base, {n: (t + 1e-6 if t.is_floating_point() else t) for n, t in base.items()})
        < 0.05
    )
    nothing = delta_tensors(base, base)  # nothing changed: one tensor whole (a manifest is never empty)
    assert list(nothing) == ["embed.weight"]


def test_a_delta_that_does_not_fit_the_weights_held_is_refused() -> None:
    base = _state()
    wire = delta_tensors(base, _step(base, 1))
    with pytest.raises(DeltaError, match="do not have"):
        apply_delta({"other": torch.zeros(3)}, wire)
    bad = dict(wire) | {f"embed.weight{DELTA_INDEX}": torch.tensor([10**6], dtype=torch.int32)}
    bad[f"embed.weight{DELTA_VALUES}"] = torch.zeros(1, dtype=torch.bfloat16)
    kept = DeltaBase()
    kept.keep(base, "c" * 64)
    with pytest.raises(DeltaError, match="outside"):
        kept.apply(bad, "d" * 64)
    _bits_equal(kept.tensors or {}, base)  # every check before any write: a refused delta changes nothing
    assert kept.checksum is None  # and the copy is trusted for nothing until a version is verified again
    kept.keep(base, "c" * 64)
    moved = kept.apply(wire, "d" * 64)  # in place: the held copy is the new version now
    _bits_equal(moved, apply_delta(base, wire))
    assert moved["embed.weight"] is kept.tensors["embed.weight"]  # type: ignore[index]
    receiver = WeightReceiver("w", delta=True)
    try:
        receiver.delta.keep(base, weights_checksum(base.items()))  # type: ignore[union-attr]
        with WeightSender(bucket_bytes=BUCKET_BYTES, delta=True) as sender:
            first = sender.announce(base, version=1, epoch=1, members=["w"])
            sender._synced = (1, ("w",), first.checksum)  # as if every member had acknowledged it
            nxt = sender.announce(_step(base, 2), version=2, epoch=1, members=["w"])
        assert nxt.delta_base == first.checksum
        other = nxt.model_copy(update={"delta_base": "ab" * 32})
        got = receiver._whole(Received(dict(wire), "0" * 64), other)
        assert isinstance(got, Received) and got.problem and "this worker holds" in got.problem
    finally:
        receiver.close()


@pytest.mark.timeout(120)
def test_100_versions_by_delta_equal_whole_broadcasts_with_a_worker_that_missed_some_and_one_late(
    spawn_workers: Any,  # noqa: F811
) -> None:
    a, b, c = spawn_workers("a", "b", "c", delta=True)
    state = _state()
    kinds: list[str] = []
    with WeightSender(timeout_s=WORKER_TIMEOUT_S, bucket_bytes=BUCKET_BYTES, delta=True) as sender:
        epoch, members = 0, None
        for version in range(1, 101):
            state = _step(state, version)
            workers = [a] + ([b] if not 30 <= version < 40 else []) + ([c] if version >= 60 else [])
            ids = tuple(w.worker_id for w in workers)
            if ids != members:  # membership changed: a new epoch, and the first version in it whole
                epoch, members = epoch + 1, ids
            announcement = sender.announce(state, version=version, epoch=epoch, members=list(ids))
            kinds.append("delta" if announcement.delta_base else "whole")
            for worker in workers:
                worker.receive(announcement)
            sender.broadcast(state, announcement)
            for worker in workers:
                status, received = worker.result()
                assert status == "ok", (version, worker.worker_id, worker.failure)
                _bits_equal(received, state)
    # Whole: the first version, and each time the members changed (b left, b came back, c joined).
    assert [v + 1 for v, kind in enumerate(kinds) if kind == "whole"] == [1, 30, 40, 60]
