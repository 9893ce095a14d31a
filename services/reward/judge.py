"""An LLM judge (issue 49): a served model behind an OpenAI-compatible `/v1/chat/completions` scores a
completion against a rubric, as verl's GenRM, prime-rl's and NeMo-RL's judges do.

One item: the rubric (`reward.judge.rubric`) is filled with the question, the reference answer (when there
is one) and the completion, sent as one user message, and the judge's reply is parsed into a score in
[0, 1] (`reward.judge.parse`): the last number in the reply on the rubric's scale, the first of the
labels it names, or the last `\\boxed{}` (a number or a label). The reply is kept as the result's detail.
An item's status says what happened, never a silent 0 that trains as "wrong":

- `correct` / `incorrect`: parsed; `correct` when the score reaches `reward.judge.pass_score`;
- `unparseable`: the judge answered, and the reply holds no score (the reply is the detail);
- `timeout`: no answer within the item's deadline (`reward.judge.deadline_s`), retries included;
- `error`: the endpoint refused (4xx other than 429), or kept failing (429, 5xx, no connection) past
  `reward.judge.retries` (with backoff, within the deadline).

Calls run concurrently (`reward.judge.concurrency` at once, on threads: a judge call is I/O), and a
content-addressed cache (the rubric as filled, the model and the sampling) judges the same item once.
What judging spent (calls, cache hits, tokens, items by status, seconds) comes back with each batch's
results (`JudgeUsage`: the worker sums it for the live page) and is summed here for Prometheus.
The API key is read from a file or an environment variable when the judge is made, sent as a bearer
token, and never logged, stored in a result, or written anywhere.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sparkrl.proto.reward import JudgeUsage, RewardItem, RewardResult
from sparkrl.services.common.settings.reward import JudgeSettings
from sparkrl.services.common.tasks.answers import last_boxed

log = logging.getLogger("sparkrl.reward.judge")


MAX_DETAIL = 2000
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class JudgeKeyError(ValueError):
    """The judge's API key is configured but cannot be read."""


def read_key(settings: JudgeSettings) -> str | None:
    """The API key from `api_key_file` or the variable `api_key_env`; None when neither is set."""
    if settings.api_key_file is not None:
        try:
            key = Path(settings.api_key_file).read_text().strip()
        except OSError as exc:
            raise JudgeKeyError(f"reward.judge.api_key_file cannot be read: {exc.strerror}") from None
        if not key:
            raise JudgeKeyError("reward.judge.api_key_file is empty")
        return key
    if settings.api_key_env is not None:
        key = os.environ.get(settings.api_key_env, "").strip()
        if not key:
            raise JudgeKeyError(f"reward.judge.api_key_env names {settings.api_key_env}, which is not set")
        return key
    return None


def fill_rubric(rubric: str, item: RewardItem) -> str:
    """The rubric with `{question}`, `{reference}` and `{completion}` filled (by replacement: a brace in a
    completion is text, never a format field)."""
    question = str((item.task_data or {}).get("question", ""))
    return (
        rubric.replace("{question}", question)
        .replace("{reference}", item.answer or "(none)")
        .replace("{completion}", item.completion)
    )


def parse_reply(reply: str, settings: JudgeSettings) -> float | None:
    """The score in [0, 1] the reply gives, or None (unparseable)."""
    if settings.parse == "boxed":
        inner = last_boxed(reply)
        return None if inner is None else _value(inner.strip(), settings)
    if settings.parse == "labels":
        return _label(reply, settings)
    numbers = NUMBER.findall(reply)
    return _scaled(float(numbers[-1]), settings) if numbers else None


def _value(text: str, settings: JudgeSettings) -> float | None:
    if NUMBER.fullmatch(text):
        return _scaled(float(text), settings)
    return _label(text, settings)


def _label(text: str, settings: JudgeSettings) -> float | None:
    """The score of the label that comes first in `text` (whole words, any case)."""
    found = [
        (match.start(), score)
        for label, score in settings.labels.items()
        if (match := re.search(rf"\b{re.escape(label)}\b", text, re.IGNORECASE))
    ]
    return min(found)[1] if found else None


def _scaled(value: float, settings: JudgeSettings) -> float | None:
    low, high = settings.score_range
    if not math.isfinite(value) or not low <= value <= high:
        return None
    return (value - low) / (high - low)


@dataclass(frozen=True)
class Verdict:
    status: str
    score: float
    detail: str


@dataclass
class _Spent:
    """One item's calls (retries included) and the tokens their answers reported."""

    calls: int = 0
    tokens: int = 0


class Judge:
    """`judge(items)`: each item judged (or found in the cache), concurrently; results in order, and what
    judging them spent. `score(items)`: the results only (the reward service's served-scorer shape)."""

    def __init__(self, settings: JudgeSettings) -> None:
        if settings.url is None:
            raise ValueError("reward.judge.url is not set: name the judge's OpenAI-compatible endpoint")
        self.settings = settings
        key = read_key(settings)
        self.http = httpx.Client(headers={"Authorization": f"Bearer {key}"} if key else {})
        self.url = settings.url.rstrip("/") + "/chat/completions"
        self.calls = ThreadPoolExecutor(max_workers=settings.concurrency, thread_name_prefix="judge")
        self.cache: OrderedDict[str, Verdict] = OrderedDict()
        self.lock = threading.Lock()
        self.spent = JudgeUsage()  # since it was made: Prometheus reads it (snapshot)

    def judge(self, items: list[RewardItem]) -> tuple[list[RewardResult], JudgeUsage]:
        done = list(self.calls.map(self._one, items))
        usage = JudgeUsage()
        for result, spent, cached in done:
            usage = usage.plus(
                JudgeUsage(
                    items={result.status: 1},
                    calls=spent.calls,
                    cache_hits=int(cached),
                    tokens=spent.tokens,
                    seconds=result.elapsed_s,
                )
            )
        with self.lock:
            self.spent = self.spent.plus(usage)
        return [result for result, _, _ in done], usage

    def score(self, items: list[RewardItem]) -> list[RewardResult]:
        return self.judge(items)[0]

    def snapshot(self) -> JudgeUsage:
        """What it has spent since it was made."""
        with self.lock:
            return self.spent

    def close(self) -> None:
        self.calls.shutdown(wait=False, cancel_futures=True)
        self.http.close()

    def _one(self, item: RewardItem) -> tuple[RewardResult, _Spent, bool]:
        """The item's result, what judging it spent, and whether the cache answered."""
        started = time.monotonic()
        prompt = fill_rubric(self.settings.rubric, item)
        key = self._key(prompt)
        spent = _Spent()
        with self.lock:
            cached = self.cache.get(key)
            if cached is not None:
                self.cache.move_to_end(key)
        verdict = cached or self._judged(prompt, spent)
        if cached is None and verdict.status in ("correct", "incorrect", "unparseable"):
            with self.lock:  # an answer is kept; a failure is tried again next time
                self.cache[key] = verdict
                while len(self.cache) > self.settings.cache_items:
                    self.cache.popitem(last=False)
        result = RewardResult(
            score=verdict.score,
            status=verdict.status,  # type: ignore[arg-type]
            detail=verdict.detail[:MAX_DETAIL],
            elapsed_s=time.monotonic() - started,
        )
        return result, spent, cached is not None

    def _key(self, prompt: str) -> str:
        s = self.settings
        what = f"{s.model}\n{s.temperature}\n{s.max_tokens}\n{prompt}"
        return hashlib.blake2b(what.encode(), digest_size=16).hexdigest()

    def _judged(self, prompt: str, spent: _Spent) -> Verdict:
        """One judge call, retried on 429/5xx/no connection with backoff, within the item's deadline."""
        s = self.settings
        deadline = time.monotonic() + s.deadline_s
        body = {
            "model": s.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": s.temperature,
            "max_tokens": s.max_tokens,
        }
        why = ""
        for attempt in range(s.retries + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if attempt:
                pause = min(s.backoff_s * 2 ** (attempt - 1), left)
                time.sleep(pause)
                left = deadline - time.monotonic()
                if left <= 0:
                    break
            spent.calls += 1
            try:
                response = self.http.post(self.url, json=body, timeout=left)
            except httpx.TimeoutException:
                why = f"no answer within reward.judge.deadline_s ({s.deadline_s:g}s)"
                continue
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code == 200:
                return self._verdict(response, spent)
            why = f"HTTP {response.status_code}: {response.text[:300]}"
            if response.status_code != 429 and response.status_code < 500:
                return Verdict("error", 0.0, f"the judge refused the request: {why}")
        timed_out = time.monotonic() >= deadline
        said = (
            f"past reward.judge.deadline_s ({s.deadline_s:g}s)" if timed_out else f"after {s.retries} retries"
        )
        return Verdict("timeout" if timed_out else "error", 0.0, f"the judge did not answer {said}: {why}")

    def _verdict(self, response: httpx.Response, spent: _Spent) -> Verdict:
        try:
            data: Any = response.json()
            reply = str(data["choices"][0]["message"]["content"] or "")
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            return Verdict("unparseable", 0.0, f"not a chat completion ({exc}): {response.text[:300]}")
        usage = data.get("usage")
        tokens = usage.get("total_tokens") if isinstance(usage, dict) else None
        spent.tokens += tokens if isinstance(tokens, int) and tokens > 0 else 0  # a server may not say
        score = parse_reply(reply, self.settings)
        if score is None:
            return Verdict("unparseable", 0.0, f"no score in the judge's reply: {reply}")
        status = "correct" if score >= self.settings.pass_score else "incorrect"
        return Verdict(status, score, f"judge: {reply}")
