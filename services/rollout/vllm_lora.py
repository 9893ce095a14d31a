"""A LoRA run's versions served by vLLM's own LoRA (`rollout.engine.max_lora_rank`): no merge, no reload.

Each adapter version is written as a peft adapter in a folder of the engine's own (`lora_A`, `lora_B`
with the scaling already folded in, so `lora_alpha` = r), added to vLLM under a new adapter id
(`LLMEngine.add_lora`: loaded now, so a bad adapter fails the sync, not the next batch), and every
request of the next batches names it. The previous adapter is removed once the new one is in: a worker
takes versions between batches, so one adapter serves at a time. vLLM's prefix cache keys on the adapter
id, so no cached block of an older version is reused. Such an engine takes adapter versions only: vLLM's
reload in place does not reach the layers its LoRA wraps (`load_weights` refuses a whole version, and
`sparkrl check` says so before a run starts).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor

from sparkrl.services.rollout.engine import WeightLoadFailed
from sparkrl.services.rollout.install import LORA_A, LORA_B, adapted_layers


class AdapterSlots:
    """The adapter vLLM serves now (`current`, a LoRARequest), and the folders it was read from."""

    max_rank: int
    root: Path  # the engine's own folder; every adapter lies in root/<id>
    current: Any  # vllm.lora.request.LoRARequest | None: None serves the base (or a whole version)
    _next_id: int

    def __init__(self, max_rank: int) -> None:
        self.max_rank = max_rank
        self.root = Path(tempfile.mkdtemp(prefix="sparkrl-lora-"))
        self.current, self._next_id = None, 1

    def put(self, llm: Any, adapter: Mapping[str, Tensor], version: int) -> None:
        """Serve `adapter` from now on; raises WeightLoadFailed (the current one still serving)."""
        from vllm.lora.request import LoRARequest

        layers = adapted_layers(adapter)
        rank = int(adapter[layers[0] + LORA_A].shape[0])
        if rank > self.max_rank:
            raise WeightLoadFailed(
                f"the adapter's rank {rank} exceeds rollout.engine.max_lora_rank={self.max_rank}: raise it "
                "to learner.lora.r, or unset it to merge adapters into the base"
            )
        lora_id = self._next_id
        self._next_id += 1
        folder = self.root / str(lora_id)  # an int of ours: never a name from the wire
        folder.mkdir()
        tensors = {}
        for layer in layers:
            tensors[f"base_model.model.{layer}.lora_A.weight"] = adapter[layer + LORA_A].contiguous()
            tensors[f"base_model.model.{layer}.lora_B.weight"] = adapter[layer + LORA_B].contiguous()
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": rank,
            "lora_alpha": rank,  # B carries alpha / r already: vLLM's scaling must be 1
            "target_modules": sorted({layer.rsplit(".", 1)[-1] for layer in layers}),
            "bias": "none",
        }
        (folder / "adapter_config.json").write_text(json.dumps(config))
        request = LoRARequest(f"sparkrl-{version}-{lora_id}", lora_id, str(folder))
        try:
            added = llm.llm_engine.add_lora(request)
        except Exception as exc:  # vLLM's loader: shapes, names, dtypes
            shutil.rmtree(folder, ignore_errors=True)
            raise WeightLoadFailed(f"vLLM did not take the adapter of version {version}: {exc}") from exc
        if not added:
            shutil.rmtree(folder, ignore_errors=True)
            raise WeightLoadFailed(f"vLLM did not take the adapter of version {version}")
        previous, self.current = self.current, request
        if previous is not None:
            self._drop(llm, previous)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def _drop(self, llm: Any, request: Any) -> None:
        llm.llm_engine.remove_lora(request.lora_int_id)
        shutil.rmtree(request.lora_path, ignore_errors=True)
