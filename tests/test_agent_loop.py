"""services/rollout/agent_loop.py: multi-turn episodes on the torch engine with a family's chat template
(issue 48). Each model token the stream keeps has the log-prob the model gives it, teacher-forced over
the exact stream (the engine contract's tolerance); environment turns are what the template writes between
turns, tokenized alone; limits end an episode with a named status; tool calls are answered in the loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _families import FAMILIES, build_family, build_tokenizer

from sparkrl.services.common.environments import LocalSession
from sparkrl.services.common.modeling import load_model
from sparkrl.services.common.settings import SamplingSettings, TorchEngineSettings
from sparkrl.services.common.tools import Calculator
from sparkrl.services.rollout.agent_loop import EpisodeLimits, run_episodes
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
