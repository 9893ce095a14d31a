"""The environment service (`sparkrl env`, issue 48): a real process on a free port, over real HTTP.

Served episodes are the same episodes as in the worker's process (the tiny model, a seed, countdown_retry:
the same tokens, environment spans, rewards and endings); what is wrong gets a 4xx that says what, a
refused prompt comes back to the worker as a refusal with the reason, a full service 429s until an
episode ends, and a service that is gone is `EnvironmentUnavailable` (the batch reclaimed), never a
refusal that would dead-letter good prompts."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import clean_env, free_port

from sparkrl.processes import answers_healthz
from sparkrl.proto import Prompt, group_id_for
from sparkrl.services.common.modeling import load_model
from sparkrl.services.common.settings import BusSettings, PromptFormat, SamplingSettings, TorchEngineSettings
from sparkrl.services.common.settings.rollout import AgentSettings
from sparkrl.services.rollout.agent_loop import play
from sparkrl.services.rollout.remote_env import EnvironmentUnavailable, RemoteSession
from sparkrl.services.rollout.torch_engine import TorchEngine

ROOT = Path(__file__).resolve().parents[1]
MAX_EPISODES = 16


@pytest.fixture(scope="module")
def service() -> Iterator[str]:
    port = free_port()
    command = [sys.executable, "-m", "sparkrl.cli", "env", "--set", f"env.port={port}"]
    command += ["--set", f"env.max_episodes={MAX_EPISODES}"]
    process = subprocess.Popen(
        command, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while not answers_healthz(url, timeout_s=2):
            if process.poll() is not None or time.monotonic() > deadline:
                out = process.stdout.read().decode(errors="replace") if process.stdout else ""
                pytest.fail(f"sparkrl env did not come up (exit {process.poll()}):\n{out[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        assert process.wait(timeout=30) is not None


def _prompts() -> list[Prompt]:
    prompts = [
        Prompt(
            prompt_id=f"served/{i}@0",
            task="countdown",
            text=f"Use {3 + i} 7 8 to make {18 + i}.\n",
            task_data={"numbers": [3 + i, 7, 8], "target": 18 + i},
        )
        for i in range(3)
    ]
    return [*prompts, Prompt(prompt_id="served/bad@0", task="countdown", text="no numbers\n")]


def test_served_episodes_are_the_in_process_episodes(service: str, tiny_model_dir: Path) -> None:  # noqa: F811
    engine = TorchEngine(tiny_model_dir, TorchEngineSettings(threads=1))
    agent = AgentSettings(environment="countdown_retry", max_turns=3, reward="environment")
    sampling = SamplingSettings(n=3, max_new_tokens=12, seed=11, topk_logprobs=4)
    try:
        here, refused_here = play(engine, _prompts(), sampling, agent, PromptFormat())
        with httpx.Client() as http:

            def remote() -> RemoteSession:
                return RemoteSession(http, service, "countdown_retry")

            there, refused_there = play(engine, _prompts(), sampling, agent, PromptFormat(), remote)
        tokenizer = engine.tokenizer
    finally:
        engine.close()
    assert list(refused_here) == list(refused_there) == [3]
    assert "needs task_data numbers and target" in refused_there[3]  # the service's reason, passed on
    runs_here = [run for group in here for run in group]
    runs_there = [run for group in there for run in group]
    assert len(runs_here) == len(runs_there) == 9 and any(run.episode.turns > 1 for run in runs_there)
    for mine, served in zip(runs_here, runs_there, strict=True):
        a, b = mine.completion(tokenizer), served.completion(tokenizer)
        assert a.token_ids.tolist() == b.token_ids.tolist()
        assert a.environment_spans == b.environment_spans
        assert (mine.status, mine.reward, mine.episode.turns) == (
            served.status,
            served.reward,
            served.episode.turns,
        )
    assert httpx.get(service + "/healthz").json()["episodes"] == 0  # every episode was ended


def test_what_is_wrong_gets_a_4xx_that_says_what(service: str) -> None:
    prompt = _prompts()[0].model_dump(mode="json")
    unknown = httpx.post(service + "/episodes", json={"environment": "shell", "prompt": prompt})
    assert unknown.status_code == 422 and "unknown environment 'shell'" in unknown.json()["detail"]
    refused = httpx.post(service + "/episodes", json={"environment": "countdown_retry", "prompt": {"x": 1}})
    assert refused.status_code == 422
    missing = httpx.post(service + f"/episodes/{'0' * 32}/turns", json={"text": "1+2"})
    assert missing.status_code == 404 and "no episode" in missing.json()["detail"]
    not_an_id = httpx.post(service + "/episodes/..%2f..%2fetc/turns", json={"text": "1+2"})
    assert not_an_id.status_code in (404, 422)
    big = httpx.post(
        service + "/episodes", content=b"x" * (2 << 20), headers={"content-type": "application/json"}
    )
    assert big.status_code == 413


def test_a_full_service_says_so_until_an_episode_ends(service: str) -> None:
    body = {"environment": "calculator", "prompt": _prompts()[0].model_dump(mode="json")}
    ids = []
    for _ in range(MAX_EPISODES):
        started = httpx.post(service + "/episodes", json=body)
        assert started.status_code == 200
        ids.append(started.json()["episode_id"])
    full = httpx.post(service + "/episodes", json=body)
    assert full.status_code == 429 and f"env.max_episodes ({MAX_EPISODES})" in full.json()["detail"]
    reply = httpx.post(
        service + f"/episodes/{ids[0]}/turns",
        json={"text": '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'},
    ).json()
    assert reply["messages"] == [{"role": "tool", "content": "42"}] and reply["tool_calls"] == {"ok": 1}
    ended = httpx.delete(service + f"/episodes/{ids[0]}").json()
    assert (ended["reward"], ended["error"]) == (None, None)  # a calculator keeps no reward
    again = httpx.post(service + "/episodes", json=body)
    assert again.status_code == 200
    for episode_id in [*ids[1:], again.json()["episode_id"]]:
        httpx.delete(service + f"/episodes/{episode_id}")


def test_a_service_that_is_gone_is_unavailable_not_a_refusal() -> None:
    with httpx.Client() as http:
        session = RemoteSession(http, f"http://127.0.0.1:{free_port()}", "countdown_retry")
        with pytest.raises(EnvironmentUnavailable, match="ConnectError"):
            session.start(_prompts()[0])


def test_a_stopped_workers_episodes_are_played_on_by_the_next_from_where_they_were(
    service: str,
    tiny_model_dir: Path,  # noqa: F811
    bus_settings: BusSettings,
) -> None:
    """Issue 48 item 4, partial rollouts across turns: worker-0 stops after the first turn of its episodes
    (served: their environments live on in the service); it saves them and releases the prompts; worker-1
    takes the prompts, plays the same episodes on (the service's episodes, their tries counted on) to their
    ends, token-exact over the whole stream, and the record is deleted once the groups are published."""
    from sparkrl.proto import decode_message
    from sparkrl.services.common.bus import RedisBus
    from sparkrl.services.common.feeder import feed_prompts
    from sparkrl.services.common.settings.rollout import PartialSettings
    from sparkrl.services.rollout.batch import PromptBatch
    from sparkrl.services.rollout.episode_handover import EpisodeHandover, episodes_key

    agent = AgentSettings(environment="countdown_retry", url=service, max_turns=3, reward="environment")
    sampling = SamplingSettings(n=3, max_new_tokens=10, topk_logprobs=4, seed=7)
    prompts = _prompts()[:2]
    with RedisBus(bus_settings.model_copy(update={"claim_idle_ms": 60_000})) as bus:
        assert feed_prompts(bus, prompts).published == 2
        entries = bus.read_decoded("prompts", "worker-0", 2, lambda raw: decode_message(raw, Prompt), 0)
        engine = TorchEngine(tiny_model_dir, TorchEngineSettings(threads=1))
        try:
            ids = [engine.tokenizer(p.text)["input_ids"] for _, p in entries]
            batch = PromptBatch([e for e, _ in entries], [p for _, p in entries], ids)
            first = EpisodeHandover(bus, PartialSettings(enabled=True), agent, "worker-0")
            with httpx.Client() as http:
                remote = lambda: RemoteSession(http, service, "countdown_retry")  # noqa: E731
                episodes, _ = play(
                    engine, batch.prompts, sampling, agent, PromptFormat(), remote, lambda: True
                )
            assert all(run.episode.turns == 1 for group in episodes for run in group)
            running = [run for group in episodes for run in group if run.status == "running"]
            assert running, "every episode ended at its first turn: nothing to hand over"
            first.hand_over(batch, episodes)
            assert bus.get_values([episodes_key(group_id_for(p.prompt_id)) for p in prompts]) != [None, None]

            again = bus.read("prompts", "worker-1", 10, block_ms=0)  # released: taken at once
            assert sorted(e.entry_id for e in again) == sorted(e.entry_id for e in batch.entries)
            later = PromptBatch(sorted(again, key=lambda e: [p.prompt_id for p in prompts].index(e.item_id)),
                                batch.prompts, batch.token_ids)  # fmt: skip
            second = EpisodeHandover(bus, PartialSettings(enabled=True), agent, "worker-1")
            with httpx.Client() as http:
                resumed, found = second.take(later, sampling.n, http)
                assert sorted(resumed.runs) == [0, 1] and len(found) == 2
                remote = lambda: RemoteSession(http, service, "countdown_retry")  # noqa: E731
                done, refused = play(
                    engine, later.prompts, sampling, agent, PromptFormat(), remote, None, resumed
                )
            model = load_model(tiny_model_dir).eval()
        finally:
            engine.close()
        assert not refused
        for group, before in zip(done, episodes, strict=True):
            for run, was in zip(group, before, strict=True):
                assert run.status in ("done", "max_turns") and run.reward is not None
                assert run.episode.token_ids[: len(was.episode.token_ids)] == was.episode.token_ids
                if was.status == "running":  # the service's episode went on: its tries counted on
                    assert run.episode.turns > 1 and run.reward == score(run.answer, run.messages)
                wire = run.completion(engine.tokenizer)
                mine = wire.model_token_mask()
                context = torch.tensor([run.episode.context])
                with torch.no_grad():
                    logp = torch.log_softmax(model(input_ids=context).logits[0], -1)
                at = len(run.episode.prompt_ids) + np.flatnonzero(mine)
                forced = logp[at - 1, context[0, at]]
                assert float((forced - torch.from_numpy(wire.logprobs[mine])).abs().max()) < 1e-4
        second.published({group_id_for(p.prompt_id) for p in prompts} & found)
        assert bus.get_values([episodes_key(group_id_for(p.prompt_id)) for p in prompts]) == [None, None]


def score(answer: str, messages: list[dict[str, object]]) -> float:
    """countdown_retry's reward for an episode whose last answer is `answer`: 1 when it is right."""
    from sparkrl.services.common.tasks.countdown import score_countdown

    numbers = [int(n) for n in str(messages[0]["content"]).split(" to make ")[0].split()[1:]]
    target = int(str(messages[0]["content"]).split(" to make ")[1].rstrip(".\n"))
    return score_countdown(answer, numbers, target)[0]
