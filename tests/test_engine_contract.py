"""The engine contract, checked on every engine: torch, and vLLM (its CPU build here, run by `make test`
in .venv-vllm: `-m vllm`; the CUDA build where there is a GPU).

Reference numbers come from the Hugging Face model on CPU (what the torch engine runs), teacher-forced on
the engine's own completions, never from the engine under test.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from _tiny import tiny_model_dir  # noqa: F401  (pytest fixture)
from transformers import PreTrainedModel

from sparkrl.proto import Completion
from sparkrl.services.common.modeling import load_model
from sparkrl.services.common.settings import SamplingSettings, TorchEngineSettings, VllmEngineSettings
from sparkrl.services.common.weight_sync import weights_checksum
from sparkrl.services.rollout.engine import Engine, Interrupts, make_completion
from sparkrl.services.rollout.engines import make_engine

VLLM_HERE = importlib.util.find_spec("vllm") is not None
NO_VLLM = "vLLM is not in this interpreter: `make test` runs these in .venv-vllm (`make vllm-env`)"


def require_vllm() -> None:
    """Skip where vLLM is not installed; fail instead under `make test`, which must run them."""
    if not VLLM_HERE:
        if os.environ.get("SPARKRL_REQUIRE_VLLM"):
            pytest.fail(NO_VLLM, pytrace=False)
        pytest.skip(NO_VLLM)


ENGINES = [
    pytest.param("torch", id="torch"),
    pytest.param("vllm", id="vllm", marks=[pytest.mark.vllm, pytest.mark.slow]),
]
# Same float32 weights. The torch engine runs the reference model itself. vLLM's CPU kernels (oneDNN
# GEMMs, its own attention and fused RMSNorm) sum in other orders. Measured here (24-token completions,
# top-20): ≤ 1e-5 on the trained model, ≤ 1.9e-4 on the noised weights of the load test (activations ~10x
# larger, then / 0.7), so 5e-4; a real mismatch (raw instead of processed log-probs at T=0.7, a missed
# temperature, stale weights) is ≥ 1e-2. Its GPU kernels (TF32, bf16 accumulation) need 1e-2.
TOLERANCE = {"torch": 1e-4, "vllm": 5e-4 if not torch.cuda.is_available() else 1e-2}
PROMPTS = ["Use 3 7 to make 21.\n", "Use 8 2 6 to make 40.\n", "Use 1 9 to make 10.\n"]


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[Engine]:  # noqa: F811
    if request.param == "torch":
        settings: TorchEngineSettings | VllmEngineSettings = TorchEngineSettings()
    else:
        require_vllm()
        settings = VllmEngineSettings(dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3)
    engine = make_engine(tiny_model_dir, settings)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> PreTrainedModel:  # noqa: F811
    return load_model(tiny_model_dir, "float32", "cpu")


def kind(engine: Engine) -> str:
    return "torch" if type(engine).__name__ == "TorchEngine" else "vllm"


def prompt_ids(engine: Engine) -> list[list[int]]:
    return [engine.tokenizer(text)["input_ids"] for text in PROMPTS]


@torch.no_grad()
def assert_logprobs_match(
    model: PreTrainedModel, prompts: list[list[int]], groups: list[list[Completion]], T: float, atol: float
) -> None:
    """Each completion's log-probs and top-k equal log_softmax(model(prompt + completion) / T)."""
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            ids = torch.tensor([prompt + c.token_ids.tolist()])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / T, dim=-1)
            sampled = logp.gather(1, torch.from_numpy(c.token_ids).long()[:, None]).squeeze(1)
            np.testing.assert_allclose(c.logprobs, sampled.numpy(), atol=atol)
            K = c.topk_ids.shape[1]
            np.testing.assert_allclose(c.topk_logprobs, logp.topk(K).values.numpy(), atol=atol)
            at_ids = logp.gather(1, torch.from_numpy(c.topk_ids).long())
            np.testing.assert_allclose(c.topk_logprobs, at_ids.numpy(), atol=atol)


def test_groups_are_well_formed(engine: Engine) -> None:
    prompts = prompt_ids(engine)
    groups = engine.generate(prompts, SamplingSettings(n=3, max_new_tokens=10, topk_logprobs=6, seed=0))
    assert [len(group) for group in groups] == [3] * len(prompts)
    eos = engine.tokenizer.eos_token_id
    for group in groups:
        for c in group:
            assert isinstance(c, Completion) and 1 <= c.num_tokens <= 10
            assert c.topk_ids.shape == (c.num_tokens, 6)
            assert (c.policy_versions == engine.policy_version).all()
            assert (c.token_ids < engine.vocab_size).all() and (c.topk_ids < engine.vocab_size).all()
            assert (c.topk_logprobs[:, 0] >= c.logprobs - 1e-5).all()
            assert c.finish_reason == ("stop" if c.token_ids[-1] == eos else "length")
            assert c.text == engine.tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_the_temperature_distribution(
    engine: Engine, reference: PreTrainedModel, temperature: float
) -> None:
    prompts = prompt_ids(engine)
    sampling = SamplingSettings(n=2, temperature=temperature, max_new_tokens=12, topk_logprobs=5, seed=1)
    groups = engine.generate(prompts, sampling)
    assert_logprobs_match(reference, prompts, groups, temperature, TOLERANCE[kind(engine)])


def test_seed_stop_and_length(engine: Engine) -> None:
    prompts = prompt_ids(engine)
    seeded = SamplingSettings(n=4, max_new_tokens=8, seed=7)
    first, second = engine.generate(prompts, seeded), engine.generate(prompts, seeded)
    assert [[c.token_ids.tolist() for c in g] for g in first] == [
        [c.token_ids.tolist() for c in g] for g in second
    ]
    short = engine.generate(prompts, SamplingSettings(n=4, max_new_tokens=1, seed=7))
    assert all(c.num_tokens == 1 for g in short for c in g)
    stops = ["+", "-", "*", "/"]
    for group in engine.generate(prompts, SamplingSettings(n=4, max_new_tokens=12, stop=stops, seed=7)):
        for c in group:
            assert not any(stop in c.text for stop in stops)


def test_the_workers_call_with_interrupts_and_prefixes(engine: Engine) -> None:
    """The worker passes `interrupts` on every batch (`rollout.partial`) and `prefixes` for saved partial
    work: every engine takes both; one that continues no prefix (`continues_prefixes` False) refuses one."""
    prompts = prompt_ids(engine)
    sampling = SamplingSettings(n=2, max_new_tokens=8, topk_logprobs=3, seed=4)
    never = Interrupts(lambda: False)
    groups = engine.generate(prompts, sampling, prefixes=[[None, None] for _ in prompts], interrupts=never)
    assert [len(group) for group in groups] == [2] * len(prompts)
    c = groups[0][0]
    k = min(3, c.num_tokens - 1)  # its first k tokens, as a stopped worker saves them
    prefix = make_completion(c.token_ids[:k], c.logprobs[:k], c.topk_ids[:k], c.topk_logprobs[:k],
                             c.policy_versions[:k], "", "abort")  # fmt: skip
    if not engine.continues_prefixes:
        with pytest.raises(ValueError, match="continues no prefixes"):
            engine.generate(prompts[:1], sampling, prefixes=[[prefix, None]], interrupts=never)
        return
    [[continued, fresh]] = engine.generate(prompts[:1], sampling, prefixes=[[prefix, None]], interrupts=never)
    assert continued.token_ids[:k].tolist() == prefix.token_ids.tolist() and fresh.num_tokens >= 1


def test_bad_requests_fail_clearly_and_change_nothing(engine: Engine) -> None:
    """`Engine.check_request`, which both engines call before any model work."""
    good = prompt_ids(engine)[0]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([good, []], SamplingSettings(n=1))
    for bad_id in (engine.vocab_size, -1):
        with pytest.raises(ValueError, match="prompt 0 has token ids outside"):
            engine.generate([[*good, bad_id]], SamplingSettings(n=1))
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        engine.generate([good], SamplingSettings(n=1, topk_logprobs=engine.vocab_size + 1))
    [[completion]] = engine.generate([good], SamplingSettings(n=1, max_new_tokens=2))
    assert completion.policy_versions.tolist() == [engine.policy_version] * completion.num_tokens


def test_load_weights_swaps_and_restores(engine: Engine, reference: PreTrainedModel) -> None:
    prompts = prompt_ids(engine)
    sampling = SamplingSettings(n=2, max_new_tokens=8, topk_logprobs=4, seed=2)
    original = {name: t.detach().clone() for name, t in reference.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    noisy = {name: t + 0.3 * torch.randn(t.shape, generator=generator) for name, t in original.items()}
    noisy_model = load_model(reference.name_or_path, "float32", "cpu")
    noisy_model.load_state_dict(noisy)
    version = engine.policy_version
    atol = TOLERANCE[kind(engine)]

    assert engine.weights_checksum() == weights_checksum(original.items())
    engine.load_weights(noisy.items(), version=version + 1)
    assert engine.policy_version == version + 1
    assert engine.weights_checksum() == weights_checksum(noisy.items())
    groups = engine.generate(prompts, sampling)
    assert all((c.policy_versions == version + 1).all() for g in groups for c in g)
    assert_logprobs_match(noisy_model, prompts, groups, 1.0, atol)  # the new weights really sample

    engine.load_weights(original.items(), version=version + 2)
    assert engine.weights_checksum() == weights_checksum(original.items())
    assert_logprobs_match(reference, prompts, engine.generate(prompts, sampling), 1.0, atol)


def _native_skip_reason() -> str | None:
    if not VLLM_HERE:
        return NO_VLLM
    if torch.cuda.device_count() < 2:
        return "vLLM's NCCL weight transfer needs 2 GPUs (one per NCCL rank: the learner, vLLM's worker)"
    return None


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(_native_skip_reason() is not None, reason=str(_native_skip_reason()))
def test_vllm_native_transfer_loads_and_verifies_the_announced_weights(
    tiny_model_dir: Path,  # noqa: F811
    reference: PreTrainedModel,
) -> None:
    """sync.backend vllm_nccl: the learner (GPU 1) broadcasts over vLLM's NCCL transfer group into a vLLM
    (GPU 0) whose registered engine receives in a weight-update session; it reports the announced checksum
    of what it loaded, and samples from the new weights."""
    import threading

    from sparkrl.services.common.settings import WeightSyncSettings
    from sparkrl.services.common.weight_sync import LoadedInPlace, WeightSender
    from sparkrl.services.rollout.install import VersionInstaller
    from sparkrl.services.rollout.vllm_engine import VllmEngine
    from sparkrl.services.rollout.vllm_transfer import receiver_for

    settings = VllmEngineSettings(dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3)
    engine = VllmEngine(tiny_model_dir, settings, native_transfer=True)
    generator = torch.Generator().manual_seed(3)
    noisy = {
        n: t + 0.3 * torch.randn(t.shape, generator=generator) for n, t in reference.state_dict().items()
    }
    noisy_model = load_model(reference.name_or_path, "float32", "cpu")
    noisy_model.load_state_dict(noisy)
    torch.cuda.set_device(1)
    try:
        sync = WeightSyncSettings(backend="vllm_nccl", timeout_s=120.0)
        receiver = receiver_for("native", sync, VersionInstaller(engine, tiny_model_dir))
        with WeightSender(backend="vllm_nccl", timeout_s=120.0) as sender:
            announcement = sender.announce(noisy, version=7, epoch=1, members=["native"])
            reports: list[object] = []
            send = threading.Thread(target=lambda: reports.append(sender.broadcast(noisy, announcement)))
            send.start()
            # The engine holds them already: loaded in place, of the announced checksum.
            assert receiver.receive(announcement) == LoadedInPlace(announcement.checksum)
            send.join(120)
        assert reports and engine.policy_version == 7
        assert engine.weights_checksum() == announcement.checksum == weights_checksum(noisy.items())
        prompts = prompt_ids(engine)
        groups = engine.generate(prompts, SamplingSettings(n=2, max_new_tokens=8, topk_logprobs=4, seed=2))
        assert_logprobs_match(noisy_model, prompts, groups, 1.0, TOLERANCE["vllm"])
    finally:
        engine.close()


# ── the vLLM engine's host-side logic, on CPU (vLLM itself is not imported) ─────────────────────────────


def test_vllm_engine_module_imports_without_vllm() -> None:
    from sparkrl.services.rollout import vllm_engine

    assert vllm_engine.VllmEngine.__name__ == "VllmEngine"
    if importlib.util.find_spec("vllm") is None:
        import sys

        assert "vllm" not in sys.modules


def test_vllm_output_conversion_handles_the_extra_sampled_entry() -> None:
    """vLLM's per-token dict holds the top-k and the sampled token, which may rank below k."""
    from types import SimpleNamespace

    from sparkrl.services.rollout.vllm_steps import Sample

    def entry(logprob: float, rank: int) -> SimpleNamespace:  # vllm.logprobs.Logprob's fields
        return SimpleNamespace(logprob=logprob, rank=rank)

    sample = SimpleNamespace(  # vllm.outputs.CompletionOutput's fields
        token_ids=[7, 2],
        logprobs=[
            {4: entry(-0.1, 1), 5: entry(-2.5, 2), 7: entry(-6.0, 9)},  # sampled token outside the top-2
            {5: entry(-1.2, 2), 2: entry(-0.4, 1)},  # sampled token inside, dict unordered
        ],
        text="x",
        finish_reason="stop",
        stop_reason=None,
    )
    engine = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens: "x"))

    def convert(k: int) -> Completion:
        made = Sample(None, k)
        made.extend(sample, version=5)  # one step's delta: both tokens
        return made.completion(engine)  # type: ignore[arg-type]

    c = convert(2)
    np.testing.assert_allclose(c.logprobs, [-6.0, -0.4])
    assert c.topk_ids.tolist() == [[4, 5], [2, 5]]
    np.testing.assert_allclose(c.topk_logprobs, [[-0.1, -2.5], [-0.4, -1.2]])
    assert c.policy_versions.tolist() == [5, 5] and c.finish_reason == "stop"
    with pytest.raises(RuntimeError, match="expected 3"):
        convert(3)
    sample.logprobs[1].pop(2)
    with pytest.raises(RuntimeError, match="no log-prob for the sampled token 2"):
        convert(2)


def test_vllm_initial_checksum_is_the_learners(tiny_model_dir: Path, reference: PreTrainedModel) -> None:  # noqa: F811
    from sparkrl.services.common.model_tensors import checkpoint_state_dict
    from sparkrl.services.rollout.vllm_engine import _buckets

    from_checkpoint = checkpoint_state_dict(tiny_model_dir)
    assert [name for name, _ in from_checkpoint] == list(reference.state_dict())
    assert weights_checksum(from_checkpoint) == weights_checksum(reference.state_dict().items())
    buckets = list(_buckets(from_checkpoint, limit=64 << 10))
    assert len(buckets) > 1 and [name for b in buckets for name, _ in b] == [n for n, _ in from_checkpoint]


def test_make_engine_rejects_unknown_settings(tiny_model_dir: Path) -> None:  # noqa: F811
    with pytest.raises(TypeError, match="no engine"):
        make_engine(tiny_model_dir, SamplingSettings())  # type: ignore[arg-type]


@torch.no_grad()
@pytest.mark.parametrize("environment", ["countdown_retry", "_code_envs:ModelCode"])
def test_multi_turn_episodes_are_the_exact_token_stream(
    engine: Engine, reference: PreTrainedModel, environment: str
) -> None:
    """Issue 48: episodes on the engine — of `countdown_retry` (a wrong answer is told so and asked again)
    and of the tests' `ModelCode` (each model turn run by the sandboxed Python tool, its output or error
    the next turn): every model token has the log-prob the reference model gives it over the episode's
    whole stream, the environment's turns between them (tokenized alone, never re-rendered); those are
    context at 0."""
    from sparkrl.proto import Prompt
    from sparkrl.services.common.settings import PromptFormat
    from sparkrl.services.common.settings.rollout import AgentSettings
    from sparkrl.services.rollout.agent_loop import play

    prompts = [
        Prompt(prompt_id=f"contract/{i}@0", task="countdown", text=text, task_data=data)
        for i, (text, data) in enumerate(
            [
                (PROMPTS[0], {"numbers": [3, 7], "target": 21}),
                (PROMPTS[1], {"numbers": [8, 2, 6], "target": 40}),
            ]
        )
    ]
    agent = AgentSettings(environment=environment, max_turns=3, reward="environment")
    sampling = SamplingSettings(n=4, max_new_tokens=10, topk_logprobs=4, seed=2)
    episodes, refused = play(engine, prompts, sampling, agent, PromptFormat())
    assert not refused
    runs = [run for group in episodes for run in group]
    assert any(run.episode.turns > 1 for run in runs), "no episode took a second turn"
    for run in runs:
        wire = run.completion(engine.tokenizer)
        mine = wire.model_token_mask()
        logp = torch.log_softmax(
            reference(input_ids=torch.tensor([run.episode.context])).logits[0].float(), -1
        )
        at = len(run.episode.prompt_ids) + np.flatnonzero(mine)
        forced = logp[at - 1, torch.tensor(run.episode.context)[at]]
        np.testing.assert_allclose(wire.logprobs[mine], forced.numpy(), atol=TOLERANCE[kind(engine)])
        assert not wire.logprobs[~mine].any()
        if environment != "countdown_retry" and run.episode.turns > 1:  # the sandbox's answer, seen
            assert engine.tokenizer.decode(wire.token_ids[~mine].tolist()).startswith("[code: ")
