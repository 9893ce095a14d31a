"""A received version into the engine: a whole model as it comes; a LoRA adapter merged into the base.

A version announced with `adapter_base` (the learner's `learner.lora.sync: adapter`) holds, per adapted
layer, `<layer>.lora_A` (r × in) and `<layer>.lora_B` (out × r, alpha / r folded in). The worker keeps
the base weights of those layers as it loaded them (read once from its model directory, in float32, and
checked against the announced `adapter_base` checksum: an adapter merged into another base would sample
from a model nobody trained), merges

    <layer>.weight = W0 + lora_B · lora_A        (float32, cast to the engine's dtype as it loads)

and loads the merged layers; an engine that loads whole versions only (vLLM) gets the base's other
tensors with them. An engine that serves adapters itself (vLLM with `rollout.engine.max_lora_rank`,
vllm_lora.py) gets the adapter as it came, once its base is checked. The engine then holds the
adapter's version: `checksum()` is the adapter's, the one the learner announced and checks the fleet
against; for a whole version it is the engine's own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import Tensor

from sparkrl.services.common.model_tensors import checkpoint_state_dict
from sparkrl.services.common.weight_sync import weights_checksum
from sparkrl.services.rollout.engine import Engine, WeightLoadFailed

log = logging.getLogger("sparkrl.rollout")

LORA_A, LORA_B = ".lora_A", ".lora_B"


class VersionInstaller:
    """Loads versions into one engine; remembers whether it holds an adapter's (and which)."""

    engine: Engine
    model_dir: Path
    adapter: str | None  # checksum of the adapter version the engine holds merged; None: a whole version
    _base: dict[str, Tensor] | None  # the model's own tensors as loaded (adapted layers' in float32)
    _base_checked: set[str]  # adapter_base checksums this base was found to have

    def __init__(self, engine: Engine, model_dir: str | Path) -> None:
        self.engine, self.model_dir = engine, Path(model_dir)
        self.adapter, self._base, self._base_checked = None, None, set()

    def install(
        self,
        tensors: Mapping[str, Tensor],
        version: int,
        adapter_base: str | None,
        checksum: str | None = None,
    ) -> None:
        """Load `version`: `tensors` as they are, or (`adapter_base` set) the adapter they are, merged.
        `checksum`: the announced one, for an engine that checks what it loaded against it (vLLM) — a
        whole version's only. Raises WeightLoadFailed (the engine keeps what it held) or the engine's
        KeyError / ValueError."""
        if adapter_base is None:
            load(self.engine, tensors.items(), version, checksum)
            self.adapter = None
            return
        if self.engine.serves_adapters:  # vLLM's own LoRA: checked against the base, served as it is
            self._base_for(adapted_layers(tensors), adapter_base)
            self._base = None  # nothing to merge into: the base is not kept
            self.engine.load_adapter(tensors, version)
        else:
            merged = self.merged(tensors, adapter_base)
            load(self.engine, merged.items(), version, None)
        self.adapter = weights_checksum(sorted(tensors.items()))  # names' order: the learner's manifest

    def checksum(self) -> str:
        """Of the version held, comparable with its announcement's `checksum`."""
        return self.adapter if self.adapter is not None else self.engine.weights_checksum()

    def merged(self, adapter: Mapping[str, Tensor], adapter_base: str) -> dict[str, Tensor]:
        """The weights to load for `adapter`: each adapted layer's W0 + B A, and (for an engine that loads
        whole versions) every other tensor of the base."""
        layers = adapted_layers(adapter)
        base = self._base_for(layers, adapter_base)
        out: dict[str, Tensor] = dict(base) if self.engine.whole_versions else {}
        for layer in layers:
            w0 = base[f"{layer}.weight"]
            a, b = adapter[layer + LORA_A].float(), adapter[layer + LORA_B].float()
            if b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(w0.shape):
                raise ValueError(
                    f"adapter of {layer}: lora_B {list(b.shape)} · lora_A {list(a.shape)} does not fit its "
                    f"weight {list(w0.shape)}"
                )
            out[f"{layer}.weight"] = torch.addmm(w0, b, a)
        return out

    def _base_for(self, layers: list[str], adapter_base: str) -> dict[str, Tensor]:
        """The base as loaded, its adapted layers in float32; checked once per announced base checksum."""
        if self._base is None and adapter_base in self._base_checked and self.engine.serves_adapters:
            return {}  # checked already; an engine serving adapters needs no base to merge into
        if self._base is None:
            self._base = dict(checkpoint_state_dict(self.model_dir))
        missing = [layer for layer in layers if f"{layer}.weight" not in self._base]
        if missing:
            raise WeightLoadFailed(f"the adapter names layers the model does not have (first: {missing[0]})")
        for layer in layers:
            self._base[f"{layer}.weight"] = self._base[f"{layer}.weight"].float()
        if adapter_base not in self._base_checked:
            got = weights_checksum((layer, self._base[f"{layer}.weight"]) for layer in layers)
            if got != adapter_base:
                raise WeightLoadFailed(
                    f"this worker's base model ({self.model_dir}) is not the learner's: its adapted layers' "
                    f"checksum is {got[:12]}…, the learner's {adapter_base[:12]}…; start the worker on the "
                    "model the learner trains"
                )
            self._base_checked.add(adapter_base)
        if not self.engine.whole_versions:  # keep only what merging needs
            self._base = {f"{layer}.weight": self._base[f"{layer}.weight"] for layer in layers}
        return self._base


def adapted_layers(adapter: Mapping[str, Tensor]) -> list[str]:
    """The layers an adapter version adapts, in their names' order; raises ValueError when a part is
    missing."""
    layers = sorted(name.removesuffix(LORA_A) for name in adapter if name.endswith(LORA_A))
    odd = [n for n in adapter if not (n.endswith(LORA_A) or n.endswith(LORA_B))]
    unpaired = [layer for layer in layers if layer + LORA_B not in adapter]
    if odd or unpaired or 2 * len(layers) != len(adapter) or not layers:
        raise ValueError(
            f"not an adapter version: names must pair <layer>{LORA_A} with <layer>{LORA_B} "
            f"(odd: {odd[:3]}, unpaired: {unpaired[:3]})"
        )
    return layers


def load(engine: Engine, tensors: Iterable[tuple[str, Tensor]], version: int, checksum: str | None) -> None:
    """`engine.load_weights`, with the announced checksum for an engine that takes one (vLLM)."""
    if checksum is not None and engine.whole_versions:
        engine.load_weights(tensors, version, checksum=checksum)  # type: ignore[call-arg]
    else:
        engine.load_weights(tensors, version)
