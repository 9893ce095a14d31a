"""Which engine a rollout config names: the one place that imports the engines, so the base (`engine.py`)
imports neither and the vLLM one is imported only when asked for."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from sparkrl.services.common.settings import EngineSettings, TorchEngineSettings, VllmEngineSettings
from sparkrl.services.rollout.engine import Engine


def make_engine(
    model_path: str | Path,
    settings: EngineSettings,
    *,
    native_transfer: bool = False,
    eos_tokens: Sequence[str | int] | None = None,
) -> Engine:
    """The engine its settings' type names; vLLM is imported only when asked for. `native_transfer`:
    the weights arrive through vLLM's own transfer engine (`sync.backend: vllm_nccl`; vLLM only).
    `eos_tokens`: `rollout.eos_tokens`, the tokens that end a completion (None: the model's own)."""
    if isinstance(settings, TorchEngineSettings):
        if native_transfer:
            raise ValueError("sync.backend=vllm_nccl loads weights into vLLM: set rollout.engine.kind=vllm")
        from sparkrl.services.rollout.torch_engine import TorchEngine

        return TorchEngine(model_path, settings, eos_tokens=eos_tokens)
    if isinstance(settings, VllmEngineSettings):
        # Lazy: vLLM lives in its own environment (rollout.python); the main one never imports it.
        from sparkrl.services.rollout.vllm_engine import VllmEngine

        return VllmEngine(model_path, settings, native_transfer=native_transfer, eos_tokens=eos_tokens)
    raise TypeError(f"no engine for settings of type {type(settings).__name__}")
