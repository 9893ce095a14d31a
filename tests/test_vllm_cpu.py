"""vLLM's CPU build as a rollout engine, for real (`make test` runs this module in .venv-vllm: `-m vllm`).

One in-process engine serves the module (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, eager, 1 thread), on a tied-
embedding variant of the tiny model (the untied one is the engine contract's). The learner's side is the
real `WeightSender` over gloo; the references are the Hugging Face model, teacher-forced.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _tiny import tiny_model_dir  # noqa: F401  (pytest fixture)
from test_engine_contract import TOLERANCE, require_vllm
from transformers import AutoModelForCausalLM, PreTrainedModel

from sparkrl.services.common.modeling import load_model
from sparkrl.services.common.settings import SamplingSettings, VllmEngineSettings, WeightSyncSettings
from sparkrl.services.common.weight_sync import (
    LoadedInPlace,
    SyncFailed,
    WeightSender,
    distinct_tensors,
    weights_checksum,
)
from sparkrl.services.rollout.engine import WeightLoadFailed, WeightsDoNotFit
from sparkrl.services.rollout.engines import make_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = "Use 3 7 to make 21.\n"
SETTINGS = VllmEngineSettings(device="cpu", dtype="float32", threads=1, kv_cache_gib=0.25)


@pytest.fixture(scope="module")
def tied_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """The tiny model with `tie_word_embeddings`: its checkpoint has no lm_head.weight, and vLLM's loader
    skips the learner's (the case that leaves a stale head when a reload misses it)."""
    source = load_model(tiny_model_dir)
    config = source.config
    config.tie_word_embeddings = True
    tied = AutoModelForCausalLM.from_config(config)
    tied.load_state_dict(
        {k: v for k, v in source.state_dict().items() if k != "lm_head.weight"}, strict=False
    )
    out = tmp_path_factory.mktemp("tied")
    tied.save_pretrained(out, safe_serialization=True)
    for file in tiny_model_dir.glob("*token*"):
        (out / file.name).write_bytes(file.read_bytes())
    return out


@pytest.fixture(scope="module")
def engine(tied_model_dir: Path) -> Iterator[Any]:
    require_vllm()
    engine = make_engine(tied_model_dir, SETTINGS)
    yield engine
    engine.close()


def reference(path: Path, state: dict[str, torch.Tensor] | None = None) -> PreTrainedModel:
    model = load_model(path)
    if state is not None:  # a tied head's values come with its embedding's (sent once, under that name)
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert set(missing) <= {"lm_head.weight"} and not unexpected
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def engine_state(engine: Any, path: Path) -> dict[str, torch.Tensor] | None:
    """The version the engine holds (None: the checkpoint's), as a state dict for the reference."""
    return dict(engine._serving) if engine._serving is not None else None


def noised(model: PreTrainedModel, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """A learner's next version: its state dict (tied names included, in its order) moved by noise."""
    generator = torch.Generator().manual_seed(seed)
    state = {n: t + scale * torch.randn(t.shape, generator=generator) for n, t in model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # still tied: one tensor, two names
    return state


@torch.no_grad()
def hf_logprobs(model: PreTrainedModel, prompt: list[int], completion: list[int]) -> np.ndarray:
    ids = torch.tensor([prompt + completion])
    logp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
    return logp.gather(1, torch.tensor(completion)[:, None]).squeeze(1).numpy()


def vllm_logprobs(engine: Any, prompt: list[int], completion: list[int]) -> np.ndarray:
    """vLLM's own log-probs of a fixed completion (teacher-forced: its prompt log-probs)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    full = prompt + completion
    [out] = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=full)], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )
    return np.array([out.prompt_logprobs[i][full[i]].logprob for i in range(len(prompt), len(full))])


def test_the_sampled_token_is_always_reported_even_outside_the_top_k(
    engine: Any, tied_model_dir: Path
) -> None:
    """k=2 of a 260-token vocabulary at T=1: many sampled tokens rank below the top 2; vLLM still reports
    each one's log-prob (`Completion.logprobs`), equal to the reference's."""
    prompt = engine.tokenizer(PROMPT)["input_ids"]
    groups = engine.generate([prompt], SamplingSettings(n=8, max_new_tokens=24, topk_logprobs=2, seed=11))
    model = reference(tied_model_dir, engine_state(engine, tied_model_dir))
    outside = 0
    for c in groups[0]:
        outside += int((~(c.topk_ids == c.token_ids[:, None]).any(axis=1)).sum())
        expected = hf_logprobs(model, prompt, c.token_ids.tolist())
        np.testing.assert_allclose(c.logprobs, expected, atol=TOLERANCE["vllm"])
    assert outside > 0, "no sampled token fell outside the top-2: the case was not exercised"


def test_a_batch_that_fails_midway_leaves_nothing_in_the_engine(engine: Any) -> None:
    """A prompt vLLM refuses when it is added (longer than the engine's context), after another's samples
    were added: the batch raises, none of its requests stays in the engine, and the next batch (the
    worker's diagnosis, one prompt at a time) runs as if nothing happened."""
    prompt = engine.tokenizer(PROMPT)["input_ids"]
    too_long = prompt * (engine.llm.llm_engine.model_config.max_model_len // len(prompt) + 1)
    sampling = SamplingSettings(n=4, max_new_tokens=8, topk_logprobs=2, seed=3)
    with pytest.raises(Exception, match="maximum context length"):  # vLLM's VLLMValidationError
        engine.generate([prompt, too_long], sampling)
    assert not engine.llm.llm_engine.has_unfinished_requests()
    [group] = engine.generate([prompt], sampling)
    assert len(group) == 4 and all(c.finish_reason in ("stop", "length") for c in group)


def _push(
    sender: WeightSender,
    receiver: Any,
    state: dict[str, torch.Tensor],
    version: int,
    adapter_base: str | None = None,
) -> Any:
    """The learner announces and broadcasts on a thread (a tied head once, as the learner publishes it);
    the worker receives (and installs) here."""
    state = distinct_tensors(state)
    announcement = sender.announce(state, version=version, epoch=1, members=["w"], adapter_base=adapter_base)
    outcome: list[Any] = []

    def broadcast() -> None:
        try:
            outcome.append(sender.broadcast(state, announcement))
        except SyncFailed as exc:
            outcome.append(exc)

    learner = threading.Thread(target=broadcast)
    learner.start()
    try:
        received: Any = receiver.receive(announcement)
    except (SyncFailed, WeightsDoNotFit) as exc:
        received = exc
    learner.join(60)
    assert outcome, "the learner's broadcast hung"
    return announcement, received, outcome[0]


def test_three_learner_versions_pushed_into_the_running_engine(engine: Any, tied_model_dir: Path) -> None:
    """gloo broadcast → verified bytes → vLLM's weight-update session → acknowledged with the checksum
    vLLM reports of what its loader took. After each version: that checksum is the learner's, and vLLM's
    log-probs of a fixed completion are Hugging Face's under the new weights (the tied head included)."""
    from sparkrl.services.rollout.install import VersionInstaller
    from sparkrl.services.rollout.vllm_transfer import receiver_for

    prompt = engine.tokenizer(PROMPT)["input_ids"]
    completion = engine.tokenizer("3*7=21")["input_ids"]
    learner_model = reference(tied_model_dir)
    sync = WeightSyncSettings(backend="gloo", timeout_s=60)
    receiver = receiver_for("w", sync, VersionInstaller(engine, engine.model_path))
    with WeightSender(backend="gloo", timeout_s=60) as sender:
        for version in (1, 2, 3):
            state = noised(learner_model, seed=version)
            learner_model.load_state_dict(state)
            announcement, received, report = _push(sender, receiver, state, version)
            # Acknowledged ok, and loaded in place already (of what vLLM's loader took).
            assert received == LoadedInPlace(announcement.checksum) and report.members == ("w",)
            assert engine.policy_version == version
            sent = distinct_tensors(state).items()  # the head is the embedding: sent once, as it
            assert engine.weights_checksum() == announcement.checksum == weights_checksum(sent)
            [session] = engine.llm.collective_rpc("sparkrl_update_report")
            assert session["problems"] == [] and session["read_back"] >= 3  # norms, embedding
            expected = hf_logprobs(learner_model, prompt, completion)
            np.testing.assert_allclose(vllm_logprobs(engine, prompt, completion), expected, atol=1e-4)
    receiver.close()


def test_lora_adapter_versions_are_merged_into_the_base_and_loaded_whole(
    engine: Any, tied_model_dir: Path
) -> None:
    """`learner.lora.sync: adapter` into vLLM: each version is the adapter alone (`<layer>.lora_A`,
    `<layer>.lora_B`, scaling folded in); the worker's installer merges it into the base it read from its
    model directory and loads the whole merged model through the weight-update session. Acknowledged
    with the adapter's checksum; vLLM's log-probs of a fixed completion are Hugging Face's under
    W0 + B A. A version for another base is refused and acknowledged bad, and vLLM keeps serving."""
    from sparkrl.services.rollout.install import VersionInstaller
    from sparkrl.services.rollout.vllm_transfer import receiver_for

    prompt = engine.tokenizer(PROMPT)["input_ids"]
    completion = engine.tokenizer("3*7=21")["input_ids"]
    base = reference(tied_model_dir)
    layers = sorted(
        name for name, m in base.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"
    )
    base_sum = weights_checksum((layer, base.get_submodule(layer).weight.float()) for layer in layers)
    sync = WeightSyncSettings(backend="gloo", timeout_s=60)
    receiver = receiver_for("w", sync, VersionInstaller(engine, engine.model_path))
    with WeightSender(backend="gloo", timeout_s=60) as sender:
        for version in (11, 12, 13):
            generator = torch.Generator().manual_seed(version)
            adapter: dict[str, torch.Tensor] = {}
            for layer in layers:
                out_features, in_features = base.get_submodule(layer).weight.shape
                adapter[f"{layer}.lora_A"] = 0.2 * torch.randn(8, in_features, generator=generator)
                adapter[f"{layer}.lora_B"] = 0.2 * torch.randn(out_features, 8, generator=generator)
            announcement, received, report = _push(sender, receiver, adapter, version, base_sum)
            assert received == LoadedInPlace(announcement.checksum) and report.members == ("w",)
            assert engine.policy_version == version
            merged = reference(tied_model_dir)
            with torch.no_grad():
                for layer in layers:
                    weight = merged.get_submodule(layer).weight
                    weight += adapter[f"{layer}.lora_B"] @ adapter[f"{layer}.lora_A"]
            expected = hf_logprobs(merged, prompt, completion)
            np.testing.assert_allclose(vllm_logprobs(engine, prompt, completion), expected, atol=1e-4)

        held = vllm_logprobs(engine, prompt, completion)
        other = {name: 2 * tensor for name, tensor in adapter.items()}
        announcement, received, _ = _push(sender, receiver, other, 14, "0" * 64)  # for another base
        assert isinstance(received, SyncFailed) and engine.policy_version == 13
        np.testing.assert_allclose(vllm_logprobs(engine, prompt, completion), held, atol=0)
    receiver.close()


def test_the_checksum_does_not_depend_on_the_order_given(engine: Any, tied_model_dir: Path) -> None:
    """A snapshot file lists its tensors alphabetically, the learner's announcement hashes them in state-dict
    order: the engine installs and hashes them in the model's order, whatever order it is given."""
    state = noised(reference(tied_model_dir, engine_state(engine, tied_model_dir)), seed=21)
    engine.load_weights(sorted(state.items()), engine.policy_version + 1)  # the tied head's alias too
    assert engine.weights_checksum() == weights_checksum(distinct_tensors(state).items())


def test_a_load_that_fails_midway_leaves_the_previous_version_serving(
    engine: Any, tied_model_dir: Path
) -> None:
    """The last layer's tensor cannot be read (it lies on the meta device): the session fails inside vLLM's
    worker after every earlier layer took the new version. The engine reloads the version it held, says so
    (WeightLoadFailed), and serves it: same version, checksum and log-probs."""
    prompt = engine.tokenizer(PROMPT)["input_ids"]
    completion = engine.tokenizer("7*3=21")["input_ids"]
    version, checksum = engine.policy_version, engine.weights_checksum()
    held = reference(tied_model_dir, engine_state(engine, tied_model_dir))
    before = vllm_logprobs(engine, prompt, completion)
    np.testing.assert_allclose(before, hf_logprobs(held, prompt, completion), atol=1e-4)

    broken = noised(held, seed=99, scale=0.5)
    last = "model.layers.1.mlp.down_proj.weight"
    broken[last] = torch.empty(broken[last].shape, device="meta")
    with pytest.raises(WeightLoadFailed, match=f"version {version + 1} was not installed") as failure:
        engine.load_weights(broken.items(), version + 1, checksum="0" * 64)
    assert failure.value.phase == "verify"
    assert (engine.policy_version, engine.weights_checksum()) == (version, checksum)
    np.testing.assert_allclose(vllm_logprobs(engine, prompt, completion), before, atol=1e-6)
    [session] = engine.llm.collective_rpc("sparkrl_update_report")
    assert session["problems"] == [] and session["checksum"] == checksum  # the restore's own session


def test_a_tensor_the_model_lacks_ends_the_worker_with_the_reason(engine: Any, tied_model_dir: Path) -> None:
    """Bytes that arrive intact but do not fit the model (a tensor it lacks: another model, or a family this
    engine cannot update): WeightsDoNotFit names the tensor and the model's class (the worker exits 78 on
    it, and `sparkrl up` ends the run instead of restarting it); the engine is untouched, and the learner's
    broadcast fails naming the worker."""
    from sparkrl.services.rollout.install import VersionInstaller
    from sparkrl.services.rollout.vllm_transfer import receiver_for

    version, checksum = engine.policy_version, engine.weights_checksum()
    state = noised(reference(tied_model_dir, engine_state(engine, tied_model_dir)), seed=7)
    state["model.extra.weight"] = torch.zeros(4)
    sync = WeightSyncSettings(backend="gloo", timeout_s=10)
    receiver = receiver_for("w", sync, VersionInstaller(engine, engine.model_path))
    with WeightSender(backend="gloo", timeout_s=10) as sender:
        _, received, outcome = _push(sender, receiver, state, version + 1)
    receiver.close()
    assert isinstance(received, WeightsDoNotFit)
    assert "'model.extra.weight', which Qwen2ForCausalLM does not have" in str(received)
    assert isinstance(outcome, SyncFailed) and outcome.missing == ["w"]
    assert (engine.policy_version, engine.weights_checksum()) == (version, checksum)


def test_the_engine_in_its_own_process(tiny_model_dir: Path) -> None:  # noqa: F811
    """`in_process: false`: vLLM's engine core and worker in spawned processes (tens of seconds to start);
    the tensors cross as raw bytes (vLLM's msgpack would make lists of them) and load as in-process."""
    require_vllm()
    engine = make_engine(tiny_model_dir, SETTINGS.model_copy(update={"in_process": False}))
    try:
        model = load_model(tiny_model_dir)
        generator = torch.Generator().manual_seed(5)
        state = {
            n: t + 0.05 * torch.randn(t.shape, generator=generator) for n, t in model.state_dict().items()
        }
        engine.load_weights(state.items(), 1)
        model.load_state_dict(state)
        assert engine.weights_checksum() == weights_checksum(state.items())
        prompt = engine.tokenizer(PROMPT)["input_ids"]
        [[c]] = engine.generate([prompt], SamplingSettings(n=1, max_new_tokens=12, topk_logprobs=4, seed=3))
        np.testing.assert_allclose(c.logprobs, hf_logprobs(model, prompt, c.token_ids.tolist()), atol=1e-4)
    finally:
        engine.close()
