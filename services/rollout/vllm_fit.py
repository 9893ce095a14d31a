"""Whether a model family fits vLLM as sparkrl drives it: the learner's tensors vLLM's loader refuses by
name (`unfit_reason`: the worker ends with the reason, no restart could help), and a family vLLM's CPU
build cannot update in place (`cpu_update_problem`: `sparkrl check` says it before start, the worker at its
own start); and the stop tokens vLLM is asked for so that it ends a completion exactly where the torch
engine does (`stop_params`)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# vLLM's loaders (`AutoWeightsLoader`) on a name the model has no module or parameter for.
_NO_SUCH_NAME = re.compile(r"[Tt]here is no module or parameter named '([^']+)' in (\w+)")


def unfit_reason(exc: BaseException, names: list[str]) -> str | None:
    """The WeightsDoNotFit message when vLLM's loader refused one of `names` (the tensors sent), else None
    (another failure: the version is undone and the worker goes on)."""
    found = _NO_SUCH_NAME.search(str(exc))
    if found is not None:
        module, model = found.groups()  # vLLM names the module or parameter: the tensor is under it
        name = next((n for n in names if n == module or n.startswith(module + ".")), module)
        return (
            f"vLLM's {model} has no parameter for tensor {name!r} the learner sent (its loader: there is no "
            f"module or parameter named {module!r}); this vLLM cannot update this model in place: use "
            "rollout.engine.kind torch, or a vLLM whose loader maps that name"
        )
    if isinstance(exc, KeyError) and exc.args and exc.args[0] in names:  # a loader's `params[name]`
        return f"vLLM's model has no parameter for tensor {exc.args[0]!r} the learner sent"
    return None


# config.json fields that count a mixture of experts' experts (Qwen-MoE, Mixtral, DeepSeek / GLM).
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def cpu_update_problem(config: Mapping[str, Any]) -> str | None:
    """Why vLLM's CPU build cannot take in-place updates of this model (config.json's fields), or None.

    A mixture of experts: vLLM 0.32's CPU build re-packs the experts' weights for its kernel at load, and
    its layerwise reload leaves them in the checkpoint's layout instead (measured on a tiny Qwen3-MoE:
    log-probs off by up to 4.2 nats after reloading the very same weights, 7.2 in a run; the experts'
    tensors read back unpacked; docs/models.md)."""
    experts = next((int(config[f]) for f in EXPERT_FIELDS if config.get(f)), 0)
    if experts <= 1:
        return None
    return (
        f"a mixture of experts ({experts} experts): vLLM's CPU build does not re-pack the experts after an "
        "in-place weight update (their log-probs are then wrong; docs/models.md): use rollout.engine.kind "
        "torch for this model on CPU"
    )


def stop_params(
    model_path: Path, tokenizer: PreTrainedTokenizerBase, eos_tokens: Sequence[str | int] | None
) -> tuple[list[int], bool]:
    """(stop_token_ids, ignore_eos) for vLLM's SamplingParams such that exactly `modeling.stop_token_ids`
    end a completion, as in the torch engine. vLLM stops at the tokenizer's EOS by itself and, unless
    ignore_eos, adds generation_config.json's eos ids (even with `generation_config="vllm"`, which leaves
    only the file's sampling defaults unread): by default the ids beyond the tokenizer's EOS are named, as
    before; an exact set (`rollout.eos_tokens`) is named whole with ignore_eos, so vLLM adds nothing."""
    from sparkrl.services.common.modeling import generation_eos_ids, stop_token_ids

    ids = stop_token_ids(tokenizer, generation_eos_ids(model_path), eos_tokens)
    if eos_tokens is None:
        return [i for i in ids if i != tokenizer.eos_token_id], False
    return ids, True
