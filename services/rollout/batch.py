"""A batch's way to groups: pull prompts (dead-lettering the ones that cannot be taken), then, once the
engine has sampled their completions, score them into GRPO groups. The worker's loop (`worker.py`)
strings these together."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from sparkrl.proto import (
    Completion,
    Prompt,
    RewardItem,
    RewardResult,
    SamplingParams,
    TrajectoryGroup,
    decode_message,
    group_id_for,
)
from sparkrl.proto.reward import UNSCORED
from sparkrl.services.common.bus import Entry, RedisBus
from sparkrl.services.common.modeling import render_prompt
from sparkrl.services.common.prompt_limits import PromptLimits
from sparkrl.services.common.reward_client import RewardClient
from sparkrl.services.common.settings import PromptFormat, RolloutSettings, SamplingSettings
from sparkrl.services.rollout.agent_loop import EpisodeRun
from sparkrl.services.rollout.engine import Engine
from sparkrl.services.rollout.shaping import overlong_penalty


@dataclass
class PromptBatch:
    """Prompts taken from the stream together, with their entries (for ack) and token ids."""

    entries: list[Entry]
    prompts: list[Prompt]
    token_ids: list[list[int]]

    def subset(self, indices: list[int]) -> PromptBatch:
        return PromptBatch(
            *([getattr(self, f)[i] for i in indices] for f in ("entries", "prompts", "token_ids"))
        )

    def sampling(self, sampling: SamplingSettings) -> SamplingSettings:
        """The sampling this batch is generated with. With `rollout.sampling.seed`, the engine's seed is
        derived from it and the batch's prompt ids: a run is reproducible, yet no two batches draw the
        same random numbers. (The seed itself for every call, as before, made every batch draw the same
        numbers: at a fork the same samples took the rare token step after step, and a rare token rose
        under GRPO where, sampled afresh, it fell.) Without a seed, as given."""
        if sampling.seed is None:
            return sampling
        ids = "\n".join(p.prompt_id for p in self.prompts)
        digest = hashlib.blake2b(f"{sampling.seed}\n{ids}".encode(), digest_size=7).digest()
        return sampling.model_copy(update={"seed": int.from_bytes(digest, "big")})


def pull_prompts(
    bus: RedisBus,
    engine: Engine,
    worker_id: str,
    count: int,
    limits: PromptLimits | None = None,
    *,
    fmt: PromptFormat,
) -> PromptBatch | None:
    """Up to `count` prompts, rendered in `fmt` (`modeling.render_prompt`: chat template, its variables,
    system prompt); malformed ones go to the dead-letter stream with the reason. A prompt over
    `limits` is dead-lettered (`overlong: drop`, the reason says how long) or keeps its last
    `max_tokens` tokens (`truncate`: the question's end, where the instruction usually is). Characters
    are bounded before the tokenizer sees a prompt, so a huge one costs no memory."""
    limits = limits or PromptLimits()
    decoded = bus.read_decoded("prompts", worker_id, count, lambda raw: decode_message(raw, Prompt))
    if not decoded:
        return None
    batch = PromptBatch([], [], [])
    for entry, fed in decoded:
        prompt, why = limits.screen(fed)
        if prompt is None:
            bus.dead_letter("prompts", entry, why or "over the prompt limit")
            continue
        try:
            ids = render_prompt(engine.tokenizer, prompt.messages or prompt.text, fmt)
        except Exception as exc:  # this prompt's text or messages, which the tokenizer or template refuses
            bus.dead_letter(
                "prompts", entry, f"the tokenizer refuses the prompt: {type(exc).__name__}: {exc}"
            )
            continue
        if not ids:
            bus.dead_letter("prompts", entry, "the prompt has no tokens")
            continue
        why = limits.over_tokens(len(ids))
        if why is not None:
            bus.dead_letter("prompts", entry, why)
            continue
        if limits.max_tokens is not None:
            ids = ids[-limits.max_tokens :]  # `truncate`: the question's end
        batch.entries.append(entry)
        batch.prompts.append(prompt)
        batch.token_ids.append(ids)
    return batch if batch.prompts else None


def score_groups(
    reward: RewardClient,
    engine: Engine,
    batch: PromptBatch,
    completions: list[list[Completion]],
    cfg: RolloutSettings,
    worker_id: str,
    episodes: list[list[EpisodeRun]] | None = None,
) -> list[TrajectoryGroup]:
    """One scored group per prompt of `batch`, from its completions (one list per prompt, in order): every
    completion of every group scored in one batched HTTP call, retried inside the client; with
    `rollout.overlong_buffer`, each reward is the score plus its over-long penalty (shaping.py). Episodes
    (`rollout.agent`, in the completions' order): the verifier reads the model's last turn, and
    `rollout.agent.reward` says whether its score, the environment's reward or their sum trains."""
    created_at = time.time()
    answers = [[c.text for c in group] for group in completions]
    if episodes is not None:
        answers = [[run.answer for run in runs] for runs in episodes]
    items = [
        RewardItem(task=prompt.task, completion=text, answer=prompt.answer, task_data=prompt.task_data)
        for prompt, texts in zip(batch.prompts, answers, strict=True)
        for text in texts
    ]
    scored = episode_results(reward.score(items), episodes, cfg.agent.reward)
    if episodes is not None:  # an episode split into samples: each trains with the episode's reward
        runs = [run for group in episodes for run in group]
        scored = [r for r, run in zip(scored, runs, strict=True) for _ in run.episode.trained_samples]
    results = iter(scored)
    scored_at = time.time()
    sampling = SamplingParams(
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        max_new_tokens=cfg.sampling.max_new_tokens,
    )
    groups = []
    buffer = cfg.overlong_buffer
    for prompt, prompt_ids, group in zip(batch.prompts, batch.token_ids, completions, strict=True):
        details = [next(results) for _ in group]
        penalties = [overlong_penalty(c.num_tokens, sampling.max_new_tokens, buffer) for c in group]
        groups.append(
            TrajectoryGroup.of_made_completions(
                group_id=group_id_for(prompt.prompt_id),
                prompt=prompt,
                prompt_token_ids=prompt_ids,
                completions=group,
                rewards=group_rewards(details, penalties),
                reward_details=details,
                overlong_penalties=penalties if buffer.len is not None else None,
                task=prompt.task,
                producer=worker_id,
                vocab_size=engine.vocab_size,
                topk=cfg.sampling.topk_logprobs,
                sampling=sampling,
                created_at=created_at,
                scored_at=scored_at,
                published_at=scored_at,  # set again as each is published
            )
        )
    return groups


def group_rewards(details: list[RewardResult], penalties: list[float]) -> list[float]:
    """Each completion's reward: its score plus its over-long penalty, but a completion whose scoring
    failed (`UNSCORED`: timeout, error, unparseable — a judge down, a verifier killed) says nothing of the
    completion: it gets the mean reward of the group's scored ones, so its advantage is 0 and it moves
    neither the group's mean nor the policy. Every one failed: all 0, a group without signal. Its status
    stays in `reward_details` (counted per step, shown in samples.jsonl): named, never a silent 0."""
    rewards = [d.score + penalty for d, penalty in zip(details, penalties, strict=True)]
    scored = [r for r, d in zip(rewards, details, strict=True) if d.status not in UNSCORED]
    neutral = sum(scored) / len(scored) if scored else 0.0
    return [r if d.status not in UNSCORED else neutral for r, d in zip(rewards, details, strict=True)]


def episode_results(
    verdicts: list[RewardResult], episodes: list[list[EpisodeRun]] | None, mode: str
) -> list[RewardResult]:
    """The verifier's verdicts, or for episodes what `rollout.agent.reward` trains: the verdict, the
    environment's reward (its status `correct` at ≥ 1), or their sum (the verdict's status)."""
    if episodes is None or mode == "verifier":
        return verdicts
    runs = [run for group in episodes for run in group]
    results = []
    for verdict, run in zip(verdicts, runs, strict=True):
        got = float(run.reward or 0.0)
        if run.error is not None:  # the environment failed: named, never a silent zero
            detail = f"environment error: {run.error}"[:2000]
            results.append(RewardResult(score=0.0, status="error", detail=detail, elapsed_s=0.0))
        elif mode == "environment":
            status = "correct" if got >= 1.0 else "incorrect"
            detail = f"environment reward {got:g} (episode {run.status}); verifier: {verdict.status}"
            results.append(RewardResult(score=got, status=status, detail=detail[:2000], elapsed_s=0.0))
        else:
            detail = f"{verdict.detail}; + environment reward {got:g}"[:2000]
            results.append(verdict.model_copy(update={"score": verdict.score + got, "detail": detail}))
    return results
