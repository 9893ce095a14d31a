"""services/rollout/agent_loop.py: multi-turn episodes on the torch engine with a family's chat template
(issue 48). Each model token the stream keeps has the log-prob the model gives it, teacher-forced over
the exact stream (the engine contract's tolerance); environment turns are what the template writes between
turns, tokenized alone; limits end an episode with a named status; tool calls are answered in the loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from _families import FAMILIES, build_family, build_tokenizer

from sparkrl.services.common.environments import LocalSession
from sparkrl.services.common.modeling import load_model
from sparkrl.services.common.settings import SamplingSettings, TorchEngineSettings
from sparkrl.services.common.tools import Calculator
from sparkrl.services.rollout.agent_loop import EpisodeLimits, Turns, run_episodes
from sparkrl.services.rollout.episode import environment_turn
from sparkrl.services.rollout.torch_engine import TorchEngine

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4  # the torch engine's in tests/test_engine_contract.py


class Talker:
    """A user who answers twice, then is satisfied."""

    def __init__(self) -> None:
        self.heard: list[str] = []

    def respond(self, text: str) -> str | None:
        self.heard.append(text)
        return None if len(self.heard) > 2 else f"Say more ({len(self.heard)})."

    def get_reward(self) -> float:
        return float(len(self.heard))


class Broken(Talker):
    def respond(self, text: str) -> str | None:
        raise KeyError("the environment's bug")


@pytest.fixture(scope="module")
def engine() -> TorchEngine:
    model_dir = build_family("qwen2", ROOT / ".cache" / "families")
    engine = TorchEngine(model_dir, TorchEngineSettings(threads=1))
    yield engine
    engine.close()


def test_every_model_token_has_the_log_prob_of_the_exact_stream(engine: TorchEngine) -> None:
    tokenizer = engine.tokenizer
    prompts = [[{"role": "user", "content": f"Tell me about {n}."}] for n in range(4)]
    talkers = [Talker() for _ in prompts]
    sampling = SamplingSettings(max_new_tokens=6, seed=3)
    runs = run_episodes(
        engine, [LocalSession(t) for t in talkers], prompts, sampling, EpisodeLimits(max_turns=5)
    )
    model = load_model(ROOT / ".cache" / "families" / "qwen2").eval()
    for run, talker in zip(runs, talkers, strict=True):
        episode = run.episode
        assert run.status == "done" and episode.turns == 3 and run.reward == 3.0
        first_turn = episode.token_ids[: episode.is_model.index(False)]
        assert talker.heard[0] == tokenizer.decode(first_turn, skip_special_tokens=True)  # what it heard
        ids = torch.tensor([episode.context])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        start = len(episode.prompt_ids)
        wire = episode.completion(tokenizer.decode(episode.token_ids))
        model_mask = wire.model_token_mask()
        positions = [start + i for i, mine in enumerate(model_mask) if mine]
        forced = logp[[p - 1 for p in positions], [episode.context[p] for p in positions]]
        sampled = torch.from_numpy(wire.logprobs[model_mask])
        assert len(positions) == episode.model_tokens == wire.model_tokens == len(sampled)
        assert float((forced - sampled).abs().max()) < TOLERANCE
        # The environment's turns: exactly what the template writes between the turns, tokenized alone.
        env = wire.token_ids[~model_mask].tolist()
        assert env and not wire.logprobs[~model_mask].any() and len(wire.environment_spans) == 2
        assert "Say more (1)." in tokenizer.decode(env) and "Say more (2)." in tokenizer.decode(env)


def test_limits_end_an_episode_with_a_named_status(engine: TorchEngine) -> None:
    prompts = [[{"role": "user", "content": "Hi."}]]
    sampling = SamplingSettings(max_new_tokens=6, seed=4)
    turns = run_episodes(engine, [LocalSession(Talker())], prompts, sampling, EpisodeLimits(max_turns=2))
    assert turns[0].status == "max_turns" and turns[0].episode.turns == 2
    tokens = run_episodes(engine, [LocalSession(Talker())], prompts, sampling, EpisodeLimits(max_tokens=30))
    assert tokens[0].status == "max_tokens" and len(tokens[0].episode.context) < 30


def test_tool_calls_are_answered_and_counted_by_status() -> None:
    tokenizer = build_tokenizer(FAMILIES["qwen2"])
    session = LocalSession(Calculator())
    text = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
        '<tool_call>{"name": "search", "arguments": {}}</tool_call><tool_call>oops</tool_call>'
    )
    answer = session.turn(text)
    assert answer.messages is not None and answer.error is None
    reply = [m.model_dump() for m in answer.messages]
    assert [m["role"] for m in reply] == ["tool"] * 3 and reply[0]["content"] == "42"
    assert answer.tool_calls == {"ok": 1, "unknown_tool": 1, "malformed": 1}
    done = session.turn("The answer is 42.")  # no call, no `respond`: the model has answered
    assert done.messages is None and done.error is None and session.end().reward is None
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert environment_turn(tokenizer, [{"role": "user", "content": "q"}], reply, stop) is not None


def test_an_environment_that_raises_ends_its_episode_named(engine: TorchEngine) -> None:
    prompts = [[{"role": "user", "content": "Hi."}]] * 2
    sampling = SamplingSettings(max_new_tokens=4, seed=4)
    runs = run_episodes(engine, [LocalSession(Broken()), LocalSession(Talker())], prompts, sampling)
    assert runs[0].status == "environment_error" and "KeyError" in (runs[0].error or "")
    assert runs[1].status == "done" and runs[1].error is None and runs[1].reward == 3.0


# A template that rewrites the history (as Qwen3's drops earlier think blocks): an assistant turn that is
# not the last is written as "[answered]", so no turn extends the stream exactly.
REWRITING = (
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and not loop.last %}[answered]{% else %}{{ m.content }}{% endif -%}"
    "<|im_end|>\n{% endfor -%}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)


def test_an_episode_the_template_cannot_extend_is_split_into_exact_samples(engine: TorchEngine) -> None:
    """Each split starts a sample whose context is the whole history re-rendered after the prompt (the
    environment's tokens: context); every model token of every sample has the log-prob the model gives it
    in that sample's own context; the episode's turns are all there, in order."""
    tokenizer = engine.tokenizer
    prompts = [[{"role": "user", "content": f"Tell me about {n}."}] for n in range(2)]
    sampling = SamplingSettings(max_new_tokens=6, seed=3)
    turns = Turns(tokenizer, True, {"chat_template": REWRITING})
    runs = run_episodes(engine, [LocalSession(Talker()) for _ in prompts], prompts, sampling, turns=turns)
    model = load_model(ROOT / ".cache" / "families" / "qwen2").eval()
    for run in runs:
        episode = run.episode
        assert run.status == "done" and episode.turns == 3 and episode.splits == 2
        samples = run.completions(tokenizer)
        assert [len(s.model_turns()) for s in samples] == [1, 1, 1]
        for index, sample in enumerate(samples):
            mine = sample.model_token_mask()
            assert bool(index) == (not mine[0])  # a later sample opens with the re-rendered history
            context = episode.prompt_ids + sample.token_ids.tolist()
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([context])).logits[0].float(), -1)
            at = len(episode.prompt_ids) + np.flatnonzero(mine)
            forced = logp[at - 1, torch.tensor(context)[at]]
            assert float((forced - torch.from_numpy(sample.logprobs[mine])).abs().max()) < TOLERANCE
            assert not sample.logprobs[~mine].any()
        said = tokenizer.decode(samples[2].token_ids[~samples[2].model_token_mask()].tolist())
        assert said.count("[answered]") == 2 and "Say more (2)." in said
    # Where even the re-rendered history does not start with the prompt, the episode ends, named.
    odd = Turns(
        tokenizer, True, {"chat_template": REWRITING.replace("<|im_start|>{{ m.role }}", "{{ m.role }}")}
    )
    ended = run_episodes(engine, [LocalSession(Talker())], prompts[:1], sampling, turns=odd)
    assert ended[0].status == "no_exact_continuation" and ended[0].episode.splits == 0


def test_a_version_taken_between_turns_samples_the_next_turns_and_their_tokens_say_so(
    engine: TorchEngine,
) -> None:
    """`between_turns` (the worker's sync with `weight_updates: in_flight`): weights loaded there sample the
    later turns; each model token carries the version that sampled it, the environment's the version of the
    turn before them, and every token's log-prob is the one its own weights give it."""
    model = load_model(ROOT / ".cache" / "families" / "qwen2").eval()
    original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    noised = {name: t + 0.05 * torch.randn_like(t) for name, t in original.items()}
    loads: list[int] = []

    def between_turns() -> None:
        if not loads:
            engine.load_weights(noised.items(), version=7)
        loads.append(engine.policy_version)

    prompts = [[{"role": "user", "content": "Tell me about 1."}]]
    sampling = SamplingSettings(max_new_tokens=6, seed=5)
    try:
        (run,) = run_episodes(
            engine, [LocalSession(Talker())], prompts, sampling, between_turns=between_turns
        )
    finally:
        engine.load_weights(original.items(), version=0)
    assert run.status == "done" and run.episode.turns == 3 and loads == [7, 7]  # after turns 1 and 2
    wire = run.completion(engine.tokenizer)
    mine, turns = wire.model_token_mask(), [p for p in run.episode.pieces if not isinstance(p, list)]
    assert [set(t.policy_versions.tolist()) for t in turns] == [{0}, {7}, {7}]
    first_env = int(np.flatnonzero(~mine)[0])
    assert wire.policy_versions[first_env] == 0  # the environment's turn after the first: version 0's
    at = len(run.episode.prompt_ids) + np.flatnonzero(mine)
    context = torch.tensor([run.episode.context])
    for weights, version in ((original, 0), (noised, 7)):
        model.load_state_dict(weights)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=context).logits[0].float(), -1)
        sampled_here = wire.policy_versions[mine] == version
        forced = logp[at - 1, context[0, at]][torch.from_numpy(sampled_here)]
        assert float((forced - torch.from_numpy(wire.logprobs[mine][sampled_here])).abs().max()) < TOLERANCE
