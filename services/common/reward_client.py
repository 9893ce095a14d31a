"""HTTP client of the reward service: one batch call per group, retried with backoff within a deadline.

It lives in `common` because the rollout worker calls it and services never import one another. A
reward service that died (and that `sparkrl up` is restarting) is waited for, in growing pauses capped at
`backoff_max_s`, but never longer than `deadline_s` in all: then `RewardServiceError`, and the worker
leaves that batch's prompts to be reclaimed instead of hanging on it. Once the worker's `stop` is set,
a failed call is not retried: a stop is not held for the deadline.
"""

from __future__ import annotations

import logging
import random
import threading
import time

import httpx

from sparkrl.proto.reward import JudgeUsage, RewardItem, RewardRequest, RewardResponse, RewardResult

log = logging.getLogger("sparkrl.reward_client")


class RewardServiceError(RuntimeError):
    """The reward service refused the request (4xx) or stayed unreachable through every retry."""


class RewardClient:
    """`score(items)` → one `RewardResult` per item, in order; `judged`: what the LLM judge spent on this
    client's items so far (None while it scored none), for the worker's heartbeat."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 60.0,
        retries: int = 5,
        backoff_s: float = 0.5,
        deadline_s: float | None = None,
        backoff_max_s: float = 8.0,
        stop: threading.Event | None = None,
    ) -> None:
        """`timeout_s`: one call; `deadline_s`: a whole `score`, retries included (None: retries only);
        `stop`: the service's stop event, which ends the retrying."""
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.deadline_s = deadline_s
        self.stop = stop
        self._http = httpx.Client(timeout=timeout_s)
        self.judged: JudgeUsage | None = None

    def score(self, items: list[RewardItem], item_timeout_s: float | None = None) -> list[RewardResult]:
        request = RewardRequest(items=items, timeout_s=item_timeout_s)
        body = request.model_dump_json()
        started = time.monotonic()
        for attempt in range(self.retries + 1):
            # A call never outlasts the deadline either: a hung service costs the deadline, not more.
            left = self._left(started)
            try:
                reply = self._http.post(
                    f"{self.url}/score",
                    content=body,
                    headers={"content-type": "application/json"},
                    timeout=self.timeout_s if left is None else max(min(self.timeout_s, left), 0.1),
                )
            except httpx.TransportError as exc:
                self._wait_or_raise(attempt, started, f"cannot reach {self.url}: {exc}")
                continue
            if reply.status_code >= 500:
                reason = f"{self.url} answered {reply.status_code}: {reply.text[:300]}"
                self._wait_or_raise(attempt, started, reason)
                continue
            if reply.status_code != 200:
                # A 4xx will not get better by retrying: the request itself is wrong.
                raise RewardServiceError(
                    f"{self.url}/score refused the batch ({reply.status_code}): {reply.text}"
                )
            response = RewardResponse.model_validate_json(reply.content)
            if len(response.results) != len(items):
                raise RewardServiceError(f"asked for {len(items)} scores, got {len(response.results)}")
            if response.judge is not None:
                self.judged = response.judge if self.judged is None else self.judged.plus(response.judge)
            return response.results
        raise AssertionError("unreachable: the loop returns or raises")

    def healthy(self) -> bool:
        try:
            return self._http.get(f"{self.url}/healthz", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    def _left(self, started: float) -> float | None:
        return None if self.deadline_s is None else self.deadline_s - (time.monotonic() - started)

    def _wait_or_raise(self, attempt: int, started: float, reason: str) -> None:
        if attempt >= self.retries:
            raise RewardServiceError(f"gave up after {self.retries + 1} attempts: {reason}")
        delay = min(self.backoff_s * 2**attempt, self.backoff_max_s) * (1 + random.random() / 2)
        left = self._left(started)
        if left is not None and delay >= left:
            waited = time.monotonic() - started
            raise RewardServiceError(
                f"gave up after {waited:.0f}s and {attempt + 1} attempts (deadline {self.deadline_s:g}s): "
                f"{reason}"
            )
        stopped = RewardServiceError(f"stopping, so not retrying: {reason}")
        if self.stop is not None and self.stop.is_set():
            raise stopped
        log.warning("reward call failed (%s); retrying in %.1fs", reason, delay)
        if self.stop is None:
            time.sleep(delay)
        elif self.stop.wait(delay):  # a stop during the pause ends it
            raise stopped

    def close(self) -> None:
        self._http.close()
