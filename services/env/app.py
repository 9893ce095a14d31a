"""The environment service (`sparkrl env`, docs/agents.md): episodes' environments held between the calls
of the rollout workers that play them, so that environments heavier than a worker should carry (a
sandbox farm, a browser, a simulator) run apart and scale apart.

One process: FastAPI's thread pool runs each call, every episode behind its own lock (a worker drives an
episode one turn at a time). The episodes are the same as in a worker's process: each is an
`environments.LocalSession`. Bounded everywhere: at most `env.max_episodes` held (429 beyond: the worker
retries), an episode idle for `env.episode_idle_s` forgotten, an environment's method past
`env.call_timeout_s` answered as an error (the episode dropped), request bodies capped.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as CallTimeout
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Path
from fastapi.responses import JSONResponse

from sparkrl.proto.environment import (
    EPISODE_ID_PATTERN,
    EpisodeEnded,
    EpisodeReply,
    EpisodeStart,
    EpisodeStarted,
    EpisodeTurn,
)
from sparkrl.services.common import asgi_server
from sparkrl.services.common.environments import (
    ENVIRONMENTS,
    LocalSession,
    check_environment,
    make_environment,
)
from sparkrl.services.common.http import AsciiJSON, BodyLimit, install_validation_handler
from sparkrl.services.common.settings.servers import EnvServiceSettings

log = logging.getLogger("sparkrl.env")
T = TypeVar("T")
EpisodeId = Path(pattern=EPISODE_ID_PATTERN)


@dataclass
class Held:
    session: LocalSession
    lock: threading.Lock = field(default_factory=threading.Lock)
    touched: float = field(default_factory=time.monotonic)


class Episodes:
    """The episodes held, by id: opened, looked up (touching them), forgotten when ended or idle."""

    def __init__(self, settings: EnvServiceSettings) -> None:
        self.settings = settings
        self.held: dict[str, Held] = {}
        self.lock = threading.Lock()
        self.calls = ThreadPoolExecutor(max_workers=64, thread_name_prefix="env-call")

    def call(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` within env.call_timeout_s (the environment's own code); raises CallTimeout."""
        return self.calls.submit(fn, *args).result(timeout=self.settings.call_timeout_s)

    def add(self, session: LocalSession) -> str | None:
        """The new episode's id; None when env.max_episodes are held."""
        with self.lock:
            self.reap()
            if len(self.held) >= self.settings.max_episodes:
                return None
            episode_id = uuid.uuid4().hex
            self.held[episode_id] = Held(session)
            return episode_id

    def get(self, episode_id: str) -> Held | None:
        with self.lock:
            held = self.held.get(episode_id)
            if held is not None:
                held.touched = time.monotonic()
            return held

    def drop(self, episode_id: str) -> None:
        with self.lock:
            self.held.pop(episode_id, None)

    def reap(self) -> None:
        """Forget the episodes idle past env.episode_idle_s (caller holds the lock)."""
        cutoff = time.monotonic() - self.settings.episode_idle_s
        for episode_id in [k for k, h in self.held.items() if h.touched < cutoff]:
            del self.held[episode_id]
            log.info("episode %s forgotten: idle for over %.0fs", episode_id, self.settings.episode_idle_s)


def create_app(settings: EnvServiceSettings) -> FastAPI:
    episodes = Episodes(settings)
    served = served_environments(settings)
    app = FastAPI(title="sparkrl environment service", default_response_class=AsciiJSON)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes, setting="env.max_request_bytes")
    install_validation_handler(app)
    app.state.episodes, app.state.served = episodes, served

    @app.post("/episodes", response_model=EpisodeStarted)
    def start(request: EpisodeStart) -> EpisodeStarted | JSONResponse:
        """A new episode of `environment` on `prompt`; 422 when the environment refuses the prompt."""
        if request.environment not in served:
            known = ", ".join(served)
            return AsciiJSON({"detail": f"unknown environment {request.environment!r}: {known}"}, 422)
        session = LocalSession(make_environment(request.environment))
        try:
            started = episodes.call(session.start, request.prompt)
        except CallTimeout:
            return AsciiJSON(
                {"detail": f"reset ran past env.call_timeout_s ({settings.call_timeout_s}s)"}, 422
            )
        except Exception as exc:  # the environment's reset, on this prompt: refused, with why
            return AsciiJSON({"detail": f"reset: {type(exc).__name__}: {exc}"[:2000]}, 422)
        episode_id = episodes.add(session)
        if episode_id is None:
            return AsciiJSON({"detail": f"env.max_episodes ({settings.max_episodes}) are held"}, 429)
        return started.model_copy(update={"episode_id": episode_id})

    @app.post("/episodes/{episode_id}/turns", response_model=EpisodeReply)
    def turn(request: EpisodeTurn, episode_id: str = EpisodeId) -> EpisodeReply | JSONResponse:
        """The environment's answer to the model's turn."""
        held = episodes.get(episode_id)
        if held is None:
            return _unknown(episode_id)
        with held.lock:
            return _timed(episodes, episode_id, held.session.turn, request.text, EpisodeReply(messages=None))

    @app.delete("/episodes/{episode_id}", response_model=EpisodeEnded)
    def end(episode_id: str = EpisodeId) -> EpisodeEnded | JSONResponse:
        """The episode's reward; the episode is forgotten."""
        held = episodes.get(episode_id)
        if held is None:
            return _unknown(episode_id)
        with held.lock:
            ended = _timed(episodes, episode_id, held.session.end, None, EpisodeEnded(reward=None))
        episodes.drop(episode_id)
        return ended

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {"ok": True, "episodes": len(episodes.held), "environments": served}

    return app


def _timed(episodes: Episodes, episode_id: str, method: Any, argument: Any, failed: T) -> T:
    """`method(argument)` (or `method()`), or `failed` with the timeout as its error (the episode dropped)."""
    try:
        return episodes.call(method, *([] if argument is None else [argument]))
    except CallTimeout:
        episodes.drop(episode_id)
        limit = episodes.settings.call_timeout_s
        return failed.model_copy(update={"error": f"ran past env.call_timeout_s ({limit}s)"})  # type: ignore[attr-defined]


def _unknown(episode_id: str) -> JSONResponse:
    return AsciiJSON(
        {"detail": f"no episode {episode_id}: it ended, or was idle past env.episode_idle_s"}, 404
    )


def served_environments(settings: EnvServiceSettings) -> list[str]:
    """The shipped environments and `env.custom_environments`, each checked to load (a ValueError that
    names the fix when one does not: the service does not start)."""
    for name in settings.custom_environments:
        check_environment(name)
    return sorted(ENVIRONMENTS) + [n for n in settings.custom_environments if n not in ENVIRONMENTS]


def main(settings: EnvServiceSettings) -> None:
    """Serve until SIGTERM/SIGINT."""
    try:
        app = create_app(settings)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    config = asgi_server.config(app, settings.host, settings.port, log_level="info", access_log=False)
    log.info(
        "environment service on %s:%d: %s",
        settings.host,
        settings.port,
        ", ".join(app.state.served),
    )
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:
        log.info("environment service interrupted")
