"""An LM head in float32 (`learner.fp32_lm_head`): the output projection's matmul in float32 on a model
whose weights (`learner.dtype: bfloat16`) or matmuls (`learner.autocast`) are bf16.

ScaleRL (Khatri et al., "The Art of Scaling Reinforcement Learning Compute for LLMs", arXiv 2510.13786)
found FP32 precision at the LM head to raise the asymptotic pass rate, not only stability: the logits'
rounding is what makes the learner's log-probs differ from the generator's most. Without it the learner
upcasts the logits after a bf16 matmul (logprobs.py), which keeps softmax's sums exact but not the
logits. NeMo-RL and others call the switch `fp32_lm_head` (SGLang `enable_fp32_lm_head`).

The head is replaced by `Fp32Head`, which holds the projection's own parameters (the same Parameter
objects: a tied embedding stays tied, the state dict's names and dtypes stay `lm_head.weight` in the
model's dtype, so checkpoints and the weights broadcast to the workers are unchanged) and computes
x·Wᵀ in float32 outside autocast; the gradient flows back to the bf16 weight through the cast. As a
module of its own whose parameters are its own, ZeRO-3 gathers them around its forward as it did around
the Linear's. The learner's only: the rollout engines sample with their own head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel


class Fp32Head(nn.Module):
    """A Linear's parameters, applied in float32: logits [..., V] float32 from hidden states [..., H]."""

    in_features: int
    out_features: int

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: shared with a tied input embedding
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        # Outside autocast, which would cast the operands back to bf16 for the matmul.
        with torch.autocast(x.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias)


def install_fp32_head(model: PreTrainedModel) -> PreTrainedModel:
    """`model` with its output projection in float32 (its weights unchanged); ValueError naming the fix
    when the model's head is not a plain projection."""
    head = model.get_output_embeddings()
    if isinstance(head, Fp32Head):
        return model
    if type(head) is not nn.Linear:
        raise ValueError(
            f"learner.fp32_lm_head: {type(model).__name__}'s output embedding is a {type(head).__name__}, "
            "not a plain Linear projection this can run in float32; set learner.fp32_lm_head false"
        )
    model.set_output_embeddings(Fp32Head(head))
    return model
