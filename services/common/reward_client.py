"""HTTP client of the reward service: one batch call per group, retried with backoff.

It lives in `common` because the rollout worker calls it and services never import one another.
"""

from __future__ import annotations

import logging
import random
import time

import httpx

from sparkrl.proto.reward import RewardItem, RewardRequest, RewardResponse, RewardResult

log = logging.getLogger("sparkrl.reward_client")


class RewardServiceError(RuntimeError):
    """The reward service refused the request (4xx) or stayed unreachable through every retry."""


class RewardClient:
    """`score(items)` → one `RewardResult` per item, in order."""

    def __init__(self, url: str, timeout_s: float = 60.0, retries: int = 5, backoff_s: float = 0.5) -> None:
        self.url = url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self._http = httpx.Client(timeout=timeout_s)

    def score(self, items: list[RewardItem], item_timeout_s: float | None = None) -> list[RewardResult]:
        request = RewardRequest(items=items, timeout_s=item_timeout_s)
        body = request.model_dump_json()
        for attempt in range(self.retries + 1):
            try:
                reply = self._http.post(
                    f"{self.url}/score", content=body, headers={"content-type": "application/json"}
                )
            except httpx.TransportError as exc:
                self._wait_or_raise(attempt, f"cannot reach {self.url}: {exc}")
                continue
            if reply.status_code >= 500:
                self._wait_or_raise(attempt, f"{self.url} answered {reply.status_code}: {reply.text[:300]}")
                continue
            if reply.status_code != 200:
                # A 4xx will not get better by retrying: the request itself is wrong.
                raise RewardServiceError(
                    f"{self.url}/score refused the batch ({reply.status_code}): {reply.text}"
                )
            results = RewardResponse.model_validate_json(reply.content).results
            if len(results) != len(items):
                raise RewardServiceError(f"asked for {len(items)} scores, got {len(results)}")
            return results
        raise AssertionError("unreachable: the loop returns or raises")

    def healthy(self) -> bool:
        try:
            return self._http.get(f"{self.url}/healthz", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    def _wait_or_raise(self, attempt: int, reason: str) -> None:
        if attempt >= self.retries:
            raise RewardServiceError(f"gave up after {self.retries + 1} attempts: {reason}")
        delay = self.backoff_s * 2**attempt * (1 + random.random() / 2)
        log.warning("reward call failed (%s); retrying in %.1fs", reason, delay)
        time.sleep(delay)

    def close(self) -> None:
        self._http.close()
