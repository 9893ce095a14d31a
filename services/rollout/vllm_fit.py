"""Whether a model family fits vLLM as sparkrl drives it: the learner's tensors vLLM's loader refuses by
name (`unfit_reason`: the worker ends with the reason, no restart could help), and the known numeric
differences between vLLM's CPU build and the learner that a family brings (`numerics_warnings`; the
measured figures are in docs/models.md)."""

from __future__ import annotations

import re
from typing import Any

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


def numerics_warnings(config: Any, cpu: bool) -> list[str]:
    """What the worker says at start about log-probs that will differ from the learner's beyond the
    engine contract's tolerance on this family (`config`: the model's transformers config)."""
    said = []
    softcap = getattr(config, "attn_logit_softcapping", None)
    if cpu and softcap:
        said.append(
            f"this model soft-caps its attention logits (attn_logit_softcapping {softcap}): vLLM's CPU "
            "attention differs from that by up to 1e-2 in a token's log-prob (Gemma 2, docs/models.md); keep "
            "learner.old_logp_source recompute so the learner corrects it (truncated importance sampling)"
        )
    return said
