"""`learner.fp32_lm_head` (services/learner/fp32_head.py): the output projection's matmul in float32 on a
bf16 model, against hand-computed values; the weights, names and ties it keeps; the chunked log-prob pass
through it; its refusal of a head it cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from torch import nn
from torch.testing import assert_close

from sparkrl.services.common.settings import LearnerSettings
from sparkrl.services.learner.fp32_head import Fp32Head, install_fp32_head


def test_the_head_sums_in_float32_where_bf16_rounds() -> None:
    # h = [1, 2⁻⁹, 2⁻⁹] and a row of ones, all exact in bf16: h·w = 1 + 2⁻⁸ = 1.00390625. bf16 has 8
    # significant bits, its spacing at 1 is 2⁻⁷: a bf16 result is a tie between 1 and 1 + 2⁻⁷, rounded
    # to even, 1.0. In float32 it is exact.
    linear = nn.Linear(3, 1, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.fill_(1.0)
    h = torch.tensor([[1.0, 2.0**-9, 2.0**-9]], dtype=torch.bfloat16)
    assert linear(h).item() == 1.0
    head = Fp32Head(linear)
    out = head(h)
    assert out.dtype == torch.float32 and out.item() == 1.00390625
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast would cast the operands back to bf16
        assert head(h.float()).item() == 1.00390625
        assert linear(h.float()).item() == 1.0
    out.sum().backward()  # the gradient reaches the bf16 weight: d(h·w)/dw = h
    assert linear.weight.grad is not None and linear.weight.grad.dtype == torch.bfloat16
    assert_close(linear.weight.grad.float(), h.float())


def test_install_keeps_the_weights_their_names_and_a_tie() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    install_fp32_head(model)
    assert isinstance(model.lm_head, Fp32Head) and model.get_output_embeddings() is model.lm_head
    assert model.lm_head.weight is model.get_input_embeddings().weight  # still tied
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert after["lm_head.weight"].dtype == torch.bfloat16
    logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.dtype == torch.float32
    assert install_fp32_head(model) is model and isinstance(model.lm_head, Fp32Head)  # once is enough


def test_a_head_that_is_not_a_plain_projection_is_refused() -> None:
    class Odd(nn.Module):
        def get_output_embeddings(self) -> nn.Module:
            return nn.Sequential(nn.Linear(2, 2))

    with pytest.raises(ValueError, match=r"not a plain Linear.*set learner\.fp32_lm_head false"):
        install_fp32_head(Odd())  # type: ignore[arg-type]
    assert LearnerSettings().fp32_lm_head is False  # off by default


def test_the_learners_log_probs_through_the_float32_head(tiny_model_dir: Path) -> None:  # noqa: F811
    """The chunked log-prob pass under bf16 autocast: with the head in float32 its log-probs are the
    float32 projection of the (autocast) hidden states, without it the bf16 one's."""
    import torch.nn.functional as F

    from sparkrl.proto.testing import random_group
    from sparkrl.services.learner import logprobs
    from sparkrl.services.learner.batch import collate, samples_from_groups
    from sparkrl.services.learner.trainer import learner_model

    rng = __import__("numpy").random.default_rng(1)
    group = random_group(rng, n=2, T=5, k=4, vocab_size=260)
    mb = collate(samples_from_groups([group]), pad_id=0)
    lc = LearnerSettings(fp32_lm_head=True, autocast="bfloat16")
    model = learner_model(str(tiny_model_dir), lc)
    assert isinstance(model.lm_head, Fp32Head)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = logprobs.token_logp_and_entropy(model, mb, entropy_grad=False)
        hidden = logprobs.final_hidden(model, mb)
    weight = model.lm_head.weight.float()
    logits = F.linear(hidden.states.float(), weight) / hidden.temperature  # [N, V] in float32
    expected = logits.log_softmax(-1).gather(-1, hidden.targets[:, None])[:, 0]
    assert_close(logp[mb.mask], expected)
    plain = learner_model(str(tiny_model_dir), LearnerSettings(autocast="bfloat16"))  # bf16 matmul, upcast
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        rounded, _ = logprobs.token_logp_and_entropy(plain, mb, entropy_grad=False)
    assert (rounded[mb.mask] - expected).abs().max() > 1e-4  # what the float32 head takes away
