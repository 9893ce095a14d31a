"""An episode's environment in an environment service (`rollout.agent.url`, `sparkrl env`): the same
session as in the worker's process (`environments.LocalSession`), its calls made over HTTP.

A prompt the environment refuses (422) raises `EnvironmentRefused` (the worker dead-letters it with the
reason); a service that cannot be reached, is full (429) or answers otherwise raises
`EnvironmentUnavailable` after the retries (the batch's prompts are left to be reclaimed, none lost).
"""

from __future__ import annotations

import time
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from sparkrl.proto import Prompt
from sparkrl.proto.environment import EpisodeEnded, EpisodeReply, EpisodeStart, EpisodeStarted, EpisodeTurn

M = TypeVar("M", bound=BaseModel)
RETRIES = 5  # a full service (429), a dropped connection: retried, at most 4 s apart
TIMEOUT_S = 120.0  # above the service's default env.call_timeout_s, so the service answers first


class EnvironmentRefused(ValueError):
    """The environment refused the prompt (its reset raised)."""


class EnvironmentUnavailable(RuntimeError):
    """The environment service could not answer."""


class RemoteSession:
    """One episode of `environment` in the service at `url`."""

    def __init__(self, http: httpx.Client, url: str, environment: str) -> None:
        self.http, self.url, self.environment = http, url.rstrip("/"), environment
        self.episode_id: str | None = None

    def start(self, prompt: Prompt) -> EpisodeStarted:
        body = EpisodeStart(environment=self.environment, prompt=prompt).model_dump(mode="json")
        started = self._call("POST", "/episodes", body, EpisodeStarted)
        self.episode_id = started.episode_id
        return started

    def turn(self, text: str) -> EpisodeReply:
        body = EpisodeTurn(text=text).model_dump(mode="json")
        return self._call("POST", f"/episodes/{self.episode_id}/turns", body, EpisodeReply)

    def end(self) -> EpisodeEnded:
        return self._call("DELETE", f"/episodes/{self.episode_id}", None, EpisodeEnded)

    def _call(self, method: str, path: str, body: dict[str, Any] | None, answer: type[M]) -> M:
        why = ""
        for attempt in range(RETRIES + 1):
            if attempt:
                time.sleep(min(0.25 * 2**attempt, 4.0))
            try:
                response = self.http.request(method, self.url + path, json=body, timeout=TIMEOUT_S)
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code == 422 and path == "/episodes":
                raise EnvironmentRefused(_detail(response))
            if response.status_code == 200:
                return answer.model_validate_json(response.content)
            why = f"HTTP {response.status_code}: {_detail(response)}"
            if response.status_code != 429 and response.status_code < 500:
                break  # a request the service will not take again: no retry helps
        raise EnvironmentUnavailable(f"{method} {self.url}{path}: {why}")


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json().get("detail", response.text))[:2000]
    except ValueError:
        return response.text[:2000]
