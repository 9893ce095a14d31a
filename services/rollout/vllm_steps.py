"""vLLM's engine stepped by hand: the batch as one request per sample (`LLMEngine.add_request`), decoded a
step at a time (`LLMEngine.step`), with `Interrupts.poll()` between two steps. What `VllmEngine.generate`
runs when a batch may take a version mid-generation, be stopped, or continue saved samples.

Facts of vLLM (0.32; v1/engine/llm_engine.py, parallel_sampling.py, output_processor.py,
v1/core/sched/scheduler.py) this relies on:

- A request of `n` samples fans out into n children, child j seeded `seed + j`; one request per sample
  seeded `seed + i * n + j` samples exactly what `LLM.generate` would, and prefix caching still shares the
  prompt's blocks between them.
- `RequestOutputKind.DELTA`: each step's output holds only the tokens (and their log-prob entries) that
  step sampled; the last one carries the finish reason. A request's output names it by the id given to
  `add_request` (vLLM appends its own suffix internally); `abort_request` takes those ids.
- In-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) `step()` schedules and runs exactly one forward pass, so
  every token it returns was sampled by the weights held when it was called: a version installed by
  `poll()` tags every later token. A spawned engine core steps on its own, so there the boundary is not
  known: `rollout.weight_updates: in_flight` needs the engine in-process (refused otherwise).
- `reset_prefix_cache(reset_running_requests=True)` preempts the running requests: vLLM runs each one's
  prompt and tokens so far again before its next token (kv_cache `recompute`). Without it, a reset fails
  while requests hold blocks (kv_cache `keep`: the engine drops the cache once the batch is over).

A continued sample is a request whose prompt is the original prompt followed by the sample's tokens so far,
with the budget left; its tokens, log-probs and versions are kept as they were. A stop string that begins
in the kept tokens and ends in the new ones is not seen (vLLM matches stop strings in generated text).
"""

from __future__ import annotations

import itertools
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
from transformers import PreTrainedTokenizerBase

from sparkrl.proto import Completion
from sparkrl.services.common.settings import SamplingSettings
from sparkrl.services.rollout.engine import Interrupts, Prefixes, cut_short, finished, make_completion


class SteppedEngine(Protocol):
    """What the step loop needs of `VllmEngine` (named here, not imported: the engine imports this)."""

    llm: Any  # vllm.LLM
    policy_version: int

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    def sampling_params(self, sampling: SamplingSettings, seed: int | None, max_tokens: int) -> Any: ...

    def adapter_request(self) -> Any: ...

    def mid_batch(self, kv_cache: Literal["keep", "recompute"] | None) -> AbstractContextManager[None]: ...


_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
_batches = itertools.count()


def position_entries(
    token: int, entries: dict[int, Any], k: int, t: int
) -> tuple[float, list[int], list[float]]:
    """One position's (sampled token's log-prob, top-k ids, top-k log-probs) from vLLM's entries (the top-k
    and the sampled token: k or k + 1), sorted by value, not by vLLM's rank: the extra sampled entry falls
    off the end."""
    if token not in entries:
        raise RuntimeError(f"vLLM reported no log-prob for the sampled token {token} at position {t}")
    best = sorted(entries.items(), key=lambda item: item[1].logprob, reverse=True)[:k]
    if len(best) < k:
        raise RuntimeError(f"vLLM returned {len(best)} log-probs at position {t}, expected {k}")
    return entries[token].logprob, [token_id for token_id, _ in best], [entry.logprob for _, entry in best]


@dataclass
class Sample:
    """One sample of the batch as it grows: the prefix it continues, then what vLLM sampled after it."""

    prefix: Completion | None
    k: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None
    stop_string: str | None = None

    def extend(self, output: Any, version: int) -> None:
        """A step's delta (a `CompletionOutput` of DELTA kind), every token sampled by `version`."""
        for token, entries in zip(output.token_ids, output.logprobs or [], strict=True):
            logprob, ids, values = position_entries(token, entries, self.k, len(self.tokens))
            self.tokens.append(token)
            self.logprobs.append(logprob)
            self.topk_ids.append(ids)
            self.topk_logprobs.append(values)
            self.versions.append(version)
        if output.finish_reason is not None:
            self.finish = _FINISH_REASONS.get(output.finish_reason, "abort")
            self.stop_string = output.stop_reason if isinstance(output.stop_reason, str) else None

    def completion(self, engine: SteppedEngine) -> Completion:
        """The sample whole: the prefix's arrays, then the new ones; the text decoded from every token."""
        p, k = self.prefix, self.k
        ids = np.asarray(self.tokens, dtype=np.int32)
        logprobs = np.asarray(self.logprobs, dtype=np.float32)
        topk_ids = np.asarray(self.topk_ids, dtype=np.int32).reshape(-1, k)
        topk_logprobs = np.asarray(self.topk_logprobs, dtype=np.float32).reshape(-1, k)
        versions = np.asarray(self.versions, dtype=np.int32)
        if p is not None:
            ids, logprobs = np.concatenate([p.token_ids, ids]), np.concatenate([p.logprobs, logprobs])
            topk_ids = np.concatenate([p.topk_ids, topk_ids])
            topk_logprobs = np.concatenate([p.topk_logprobs, topk_logprobs])
            versions = np.concatenate([p.policy_versions, versions])
        text = engine.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
        if self.stop_string is not None and self.stop_string in text:  # kept out of the text, as vLLM does
            text = text[: text.find(self.stop_string)]
        return make_completion(ids, logprobs, topk_ids, topk_logprobs, versions, text, self.finish or "abort")


def stepped_generate(
    engine: SteppedEngine,
    prompts: list[list[int]],
    sampling: SamplingSettings,
    prefixes: Prefixes | None,
    interrupts: Interrupts | None,
) -> list[list[Completion]]:
    """`VllmEngine.generate` a step at a time (see the module's docstring); `prefixes` and `interrupts` as
    the engine contract says."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    llm_engine, n, k = engine.llm.llm_engine, sampling.n, sampling.topk_logprobs
    batch = f"sparkrl-{next(_batches)}"
    out: list[list[Completion | None]] = [[None] * n for _ in prompts]
    samples: dict[str, tuple[int, int, Sample]] = {}
    lora = engine.adapter_request()
    try:
        for i, prompt in enumerate(prompts):
            for j in range(n):
                prefix = prefixes[i][j] if prefixes is not None else None
                if finished(prefix):
                    out[i][j] = prefix
                    continue
                held = [] if prefix is None else prefix.token_ids.tolist()
                seed = None if sampling.seed is None else sampling.seed + i * n + j
                params = engine.sampling_params(sampling, seed, sampling.max_new_tokens - len(held))
                params.output_kind = RequestOutputKind.DELTA
                request_id = f"{batch}-{i}-{j}"
                samples[request_id] = (i, j, Sample(prefix, k))
                prompt_ids = TokensPrompt(prompt_token_ids=list(prompt) + held)
                llm_engine.add_request(request_id, prompt_ids, params, lora_request=lora)
        with engine.mid_batch(None if interrupts is None else interrupts.kv_cache):
            while llm_engine.has_unfinished_requests():
                version = engine.policy_version  # the weights this step runs with (in-process)
                for output in llm_engine.step():
                    samples[output.request_id][2].extend(output.outputs[0], version)
                if interrupts is None or not llm_engine.has_unfinished_requests():
                    continue
                if interrupts.poll():  # stopped: the rows not finished come back cut short
                    llm_engine.abort_request(_unfinished(samples))
                    break
    except BaseException:  # nothing of this batch may stay in the engine for the next one to meet
        llm_engine.abort_request(_unfinished(samples))
        raise
    for i, j, sample in samples.values():
        out[i][j] = (
            sample.completion(engine) if sample.tokens or sample.finish else cut_short(sample.prefix, k)
        )
    return [[c if c is not None else cut_short(None, k) for c in group] for group in out]


def _unfinished(samples: dict[str, tuple[int, int, Sample]]) -> list[str]:
    return [request_id for request_id, (_, _, sample) in samples.items() if sample.finish is None]
