"""LoRA on the learner (`learner.lora`): the base frozen, a low-rank adapter trained in its place.

peft's LoRA layers are put into the model itself (`inject_adapter_in_model`: the model keeps its class,
forward and `logits_to_keep`), so DeepSpeed, the log-probs and every loss see the same module as without
LoRA; only the adapter's parameters require a gradient, and the optimizer holds only them
(`trainer.build_engine`). A LoRA layer computes

    y = x W0ᵀ + (alpha / r) · (x Aᵀ) Bᵀ        (A: r × in, B: out × r, B = 0 at the start)

A version sent to the workers is the adapter alone (`learner.lora.sync: adapter`, `adapter_tensors`):
per layer `<layer>.lora_A` = A and `<layer>.lora_B` = (alpha / r) · B, announced with the checksum of
the base weights they apply to (`base_checksum`), and each worker merges W = W0 + lora_B · lora_A into
the base it loaded (services/rollout/install.py). With `sync: merged` the merged model travels, under
the base's own names (`merged_state_dict`), as it does for the checkpoints' Hugging Face export
(`from_pretrained` works on it as without LoRA). A checkpoint also keeps the adapter alone in peft's
format (`save_adapter`: `PeftModel.from_pretrained(base, path)` loads it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from sparkrl.services.common.weight_sync import distinct_tensors

if TYPE_CHECKING:
    from sparkrl.services.common.settings import LoraSettings

log = logging.getLogger("sparkrl.learner")

ADAPTER = "default"  # peft's adapter name; one adapter per learner
BASE_LAYER = ".base_layer."  # where peft moves a wrapped layer's own weights
LORA_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.")


def install_lora(model: torch.nn.Module, lc: LoraSettings) -> torch.nn.Module:
    """Put LoRA layers into `model` (in place) and freeze everything else; returns the model."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as exc:  # the learner's image does not need peft unless LoRA is asked for
        raise RuntimeError(
            "learner.lora.r > 0 needs peft: pip install 'sparkrl[lora]' (or set learner.lora.r=0)"
        ) from exc
    config = LoraConfig(
        r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout, target_modules=lc.target_modules, bias="none"
    )
    model = inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(any(part in name for part in LORA_PARTS))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    if trained == 0:
        raise ValueError(f"learner.lora.target_modules {lc.target_modules!r} matched no layer of the model")
    log.info("learner.lora: rank %d, alpha %g, %d of %d parameters trained", lc.r, lc.alpha, trained, total)
    model.sparkrl_lora = config  # type: ignore[assignment]  # what save_adapter writes as adapter_config
    # Adapter-only sync: the checksum of the base the workers must merge into, taken now while the model is
    # whole on every rank (ZeRO-3 partitions it later); the base is frozen, so it holds for the whole run.
    model.sparkrl_lora_base = base_checksum(model) if lc.sync == "adapter" else None  # type: ignore[assignment]
    return model


def adapted_linears(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The LoRA layers whose update is a plain B A on a Linear's weight, by name; raises ValueError (naming
    the fix) for any other kind (an embedding, Conv1D's fan_in_fan_out, DoRA): those travel merged only."""
    from peft.tuners.lora.layer import Linear

    layers = {name: m for name, m in lora_layers(module).items() if ADAPTER in m.lora_A}
    for name, layer in layers.items():
        dora = bool(getattr(layer, "use_dora", {}).get(ADAPTER, False))
        if not isinstance(layer, Linear) or getattr(layer, "fan_in_fan_out", False) or dora:
            raise ValueError(
                f"learner.lora.sync=adapter sends plain Linear adapters only; {name} is a "
                f"{type(layer).__name__}{' with DoRA' if dora else ''}: set learner.lora.sync=merged, or "
                "narrow learner.lora.target_modules"
            )
    return layers


@torch.no_grad()
def base_checksum(module: torch.nn.Module) -> str:
    """`weights_checksum` of the adapted layers' base weights in float32, in their names' order (that of
    `adapter_tensors`, and of a snapshot file's): what a worker checks its own base against before merging
    an adapter into it."""
    from sparkrl.services.common.weight_sync import weights_checksum

    layers = adapted_linears(module)
    return weights_checksum((n, layers[n].base_layer.weight.detach().float()) for n in sorted(layers))


@torch.no_grad()
def adapter_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The version the workers receive under `sync: adapter`: per adapted layer, `<layer>.lora_A` (r × in)
    and `<layer>.lora_B` (out × r) with the scaling alpha / r folded in, CPU copies (call under ZeRO-3's
    gather). In the names' order: the manifest's is then a snapshot file's too, so a worker loading either
    computes the same checksum."""
    out: dict[str, torch.Tensor] = {}
    for name, layer in adapted_linears(module).items():
        out[f"{name}.lora_A"] = layer.lora_A[ADAPTER].weight.detach().to("cpu", copy=True)
        scaled = layer.lora_B[ADAPTER].weight.detach().to("cpu", copy=True) * layer.scaling[ADAPTER]
        out[f"{name}.lora_B"] = scaled.contiguous()
    return dict(sorted(out.items()))


def adapter_base(module: torch.nn.Module) -> str | None:
    """The base checksum announced with each version when only the adapter travels; None otherwise."""
    return getattr(module, "sparkrl_lora_base", None)


def is_lora(module: torch.nn.Module) -> bool:
    return getattr(module, "sparkrl_lora", None) is not None


def lora_layers(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The LoRA layers of `module` by their name in it."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in module.named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def merged_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the weights as the model without LoRA names them, each LoRA layer's weight merged
    (W0 + scaling · B A), each tied tensor once (`distinct_tensors`). The module is not changed (call
    under ZeRO-3's gather)."""
    layers = lora_layers(module)
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in distinct_tensors(module.state_dict()).items():  # a tied head: its embedding's name
        if any(part in name for part in LORA_PARTS):
            continue
        owner, wrapped, leaf = name.rpartition(BASE_LAYER)
        if not wrapped:  # a layer LoRA left alone
            merged[name] = tensor.detach().to("cpu", copy=True)
            continue
        value = tensor.detach().to("cpu", dtype=torch.float32, copy=True)
        if leaf == "weight" and owner in layers and ADAPTER in layers[owner].lora_A:
            value += layers[owner].get_delta_weight(ADAPTER).detach().to("cpu", torch.float32)
        merged[f"{owner}.{leaf}"] = value.to(tensor.dtype)
    return merged


@torch.no_grad()
def adapter_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names (`base_model.model.<layer>.lora_A.weight`)."""
    out = {}
    for name, tensor in module.state_dict().items():
        if any(part in name for part in LORA_PARTS):
            out["base_model.model." + name.replace(f".{ADAPTER}.", ".")] = (
                tensor.detach().to("cpu").contiguous()
            )
    return out


def save_adapter(module: torch.nn.Module, out: Path, base_model: str | None = None) -> None:
    """The adapter alone in peft's format: adapter_config.json and adapter_model.safetensors."""
    config = module.sparkrl_lora  # type: ignore[attr-defined]
    out.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state_dict(module), str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    fields = config.to_dict()
    fields["base_model_name_or_path"] = base_model
    (out / "adapter_config.json").write_text(json.dumps(_jsonable(fields), indent=2, sort_keys=True))


def _jsonable(value: object) -> object:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_jsonable(v) for v in (sorted(value) if isinstance(value, set) else value)]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)
