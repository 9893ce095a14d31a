"""The reward service: `POST /score` verifies a batch of completions in a pool of verifier processes.

One process, one event loop. The loop only parses, dispatches and answers; every verification runs in
the pool (`pool.py`), which enforces each item's time limit by killing the stuck worker, so no input can
stall the loop or take the service down — but for the tasks whose verifier is registered bounded
(countdown: it checks limits on its input before any work, so it cannot run long), scored on a thread of
this process without the round trip to a verifier process (verifiers.py). Served scorers run on their own
threads: an LLM judge over HTTP (`task: judge`, judge.py) and a reward model (`task: reward_model`,
reward_model.py); a mixed task (`reward.mixes`, mixing.py) is scored by its parts. Each request has a
budget set by the server (`reward.max_request_seconds`, and per item at most `reward.max_item_timeout_s`
whatever the client asks), takes turns with the other requests, and is cancelled as soon as its client
disconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import asdict
from functools import reduce
from typing import Any, Protocol

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sparkrl.proto.reward import JudgeUsage, RewardItem, RewardRequest, RewardResponse, RewardResult
from sparkrl.services.common import asgi_server
from sparkrl.services.common.http import AsciiJSON, BodyLimit, install_validation_handler
from sparkrl.services.common.settings import RewardSettings
from sparkrl.services.common.settings.reward import JUDGE_TASK, REWARD_MODEL_TASK
from sparkrl.services.reward.judge import Judge
from sparkrl.services.reward.metrics import RewardMetrics
from sparkrl.services.reward.mixing import score_mixed
from sparkrl.services.reward.pool import VerifierPool
from sparkrl.services.reward.verifiers import (
    VerifyFn,
    bounded_tasks,
    load_custom_verifiers,
    registry,
    run_verifier,
)

log = logging.getLogger("sparkrl.reward")

# In-flight requests get this long after SIGTERM before uvicorn cancels them and the pool is closed.
_GRACEFUL_SHUTDOWN_S = 5
_DISCONNECT_POLL_S = 0.25  # how soon a client that went away stops its request's work


class Served(Protocol):
    """A scorer the service runs on its own threads: the judge, the reward model."""

    def score(self, items: list[RewardItem]) -> list[RewardResult]: ...


def served_scorers(settings: RewardSettings) -> dict[str, Served]:
    """The served scorers the settings ask for, by task. Raises ValueError naming what is wrong."""
    served: dict[str, Served] = {}
    if settings.judge.url is not None:
        served[JUDGE_TASK] = Judge(settings.judge)
    if settings.model.path is not None:
        try:
            from sparkrl.services.reward.reward_model import RewardModel
        except ImportError as exc:
            raise ValueError(
                f"reward.model needs torch and transformers ({exc}): pip install 'sparkrl[reward-model]'"
            ) from None
        served[REWARD_MODEL_TASK] = RewardModel(settings.model)
    return served


def _check_mixes(settings: RewardSettings, scored: Sequence[str]) -> None:
    """Every mix's parts are tasks the service scores, and no mix takes a verifier's name."""
    for name, mix in settings.mixes.items():
        if name in scored:
            raise ValueError(f"reward.mixes.{name}: the name of a verifier; give the mix its own")
        for part in mix.parts:
            if part.verifier not in scored:
                raise ValueError(
                    f"reward.mixes.{name}: part {part.verifier!r} is not scored here (scored: "
                    f"{', '.join(scored)}; `judge` needs reward.judge.url, `reward_model` reward.model.path)"
                )


def _unknown_tasks(request: RewardRequest, known: list[str]) -> list[dict[str, Any]]:
    """Pydantic-shaped 422 entries for items naming a task the registry lacks."""
    return [
        {
            "type": "unknown_task",
            "loc": ["body", "items", index, "task"],
            "msg": f"unknown task {item.task!r}; known tasks: {', '.join(known)}",
            "input": item.task,
        }
        for index, item in enumerate(request.items)
        if item.task not in known
    ]


def create_app(settings: RewardSettings) -> FastAPI:
    """The app and its pool (started and closed by the app's lifespan). Raises ValueError on a bad custom
    verifier, a judge key that cannot be read, a reward model that does not load or a mix of unknown parts."""
    load_custom_verifiers(settings.custom_verifiers)
    verifiers = registry()
    served = served_scorers(settings)
    _check_mixes(settings, sorted([*verifiers, *served]))
    known = sorted([*verifiers, *served, *settings.mixes])
    inline = {task: fn for task, fn in verifiers.items() if task in bounded_tasks()}
    pool = VerifierPool(settings.verifier_processes, verifiers)
    judge = served.get(JUDGE_TASK)
    metrics = RewardMetrics(pool.stats, judge.snapshot if isinstance(judge, Judge) else None)
    for task in known:  # the timeout series exist at zero from the first scrape, not from the first timeout
        metrics.timeouts.labels(task)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        pool.start()
        log.info("reward service ready: verifiers %s, %d processes", known, settings.verifier_processes)
        try:
            yield
        finally:
            pool.close()
            if isinstance(judge, Judge):
                judge.close()
            log.info("reward service stopped: verifier pool closed")

    app = FastAPI(title="sparkrl reward service", lifespan=lifespan, default_response_class=AsciiJSON)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes, setting="reward.max_request_bytes")
    install_validation_handler(app)

    @app.post("/score", response_model=RewardResponse)
    async def score(request: RewardRequest, http: Request) -> RewardResponse | JSONResponse:
        """Score every item in parallel across the pool; results come back in request order."""
        unknown = _unknown_tasks(request, known)
        if unknown:
            return AsciiJSON({"detail": unknown}, status_code=422)
        started = time.monotonic()
        deadline = started + settings.max_request_seconds
        timeout_s = min(request.timeout_s or settings.item_timeout_s, settings.max_item_timeout_s)

        judged: list[JudgeUsage] = []  # what the judge spent on each of this request's rounds

        async def score_items(items: list[RewardItem]) -> list[RewardResult] | None:
            return await _verify_all(pool, inline, served, items, http, timeout_s, deadline, judged)

        results = await score_mixed(request.items, settings.mixes, score_items)
        if results is None:
            metrics.cancelled.inc()
            return Response(status_code=499)
        metrics.observe(request.items, results, time.monotonic() - started)
        return RewardResponse(results=results, judge=reduce(JudgeUsage.plus, judged) if judged else None)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "verifiers": known, "inline": sorted(inline), "pool": asdict(pool.stats())}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _verify_all(
    pool: VerifierPool,
    inline: dict[str, VerifyFn],
    served: dict[str, Served],
    items: list[RewardItem],
    http: Request,
    timeout_s: float,
    deadline: float,
    judged: list[JudgeUsage],
) -> list[RewardResult] | None:
    """Every item's result, in order; None when the client went away first (its work is then cancelled:
    nobody waits for the answer). Items of a bounded task (`inline`) are scored on a thread of this
    process while the pool works on the rest, and a served scorer's items by it (its own threads); what
    the judge spent is appended to `judged`."""
    request_id = uuid.uuid4().hex
    pooled = [i for i, item in enumerate(items) if item.task not in inline and item.task not in served]
    futures = [
        pool.submit(
            items[i].task,
            items[i].completion,
            items[i].answer,
            items[i].task_data,
            timeout_s,
            request_id=request_id,
            deadline=deadline,
        )
        for i in pooled
    ]
    results: dict[int, RewardResult] = {}
    for task, scorer in served.items():
        mine = [i for i, item in enumerate(items) if item.task == task]
        if not mine:
            continue
        if isinstance(scorer, Judge):
            got, spent = await asyncio.to_thread(scorer.judge, [items[i] for i in mine])
            judged.append(spent)
        else:
            got = await asyncio.to_thread(scorer.score, [items[i] for i in mine])
        results.update(zip(mine, got, strict=True))
    here = [i for i, item in enumerate(items) if item.task in inline]
    if here:
        results.update(zip(here, await asyncio.to_thread(_verify_here, inline, items, here), strict=True))
    done = _all_done(futures)
    while not done.done():
        await asyncio.wait({done}, timeout=_DISCONNECT_POLL_S)
        if not done.done() and await http.is_disconnected():
            dropped = pool.cancel(request_id)
            log.info(
                "client went away: cancelled a request of %d items (%d not started)", len(futures), dropped
            )
            return None
    results.update(zip(pooled, (future.result() for future in futures), strict=True))
    return [results[i] for i in range(len(items))]


def _verify_here(
    inline: dict[str, VerifyFn], items: list[RewardItem], indices: list[int]
) -> list[RewardResult]:
    """The items `indices` of `items`, each by its bounded verifier, in this process."""
    results = []
    for i in indices:
        item = items[i]
        started = time.perf_counter()
        score, status, detail = run_verifier(inline[item.task], item.completion, item.answer, item.task_data)
        results.append(
            RewardResult(score=score, status=status, detail=detail, elapsed_s=time.perf_counter() - started)
        )
    return results


def _all_done(futures: list[Future[RewardResult]]) -> asyncio.Future[None]:
    """Done when every one of `futures` (the pool's, resolved on its slot threads) is: the event loop is
    woken once a request, not once an item — at ~1,400 items a second, a wake-up per item (an asyncio
    future wrapping each, gathered) was most of what the loop did (`bench/reward_bench.py`)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    left = len(futures)
    lock = threading.Lock()

    def settle() -> None:
        if not done.done():
            done.set_result(None)

    def one_done(_: Future[RewardResult]) -> None:
        nonlocal left
        with lock:
            left -= 1
            last = left == 0
        if last and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (shutdown): nobody waits
                loop.call_soon_threadsafe(settle)

    if not futures:
        settle()
    for future in futures:
        future.add_done_callback(one_done)  # runs at once for one already done
    return done


def main(settings: RewardSettings) -> None:
    """Serve until SIGTERM/SIGINT; uvicorn turns either into a graceful shutdown that closes the pool."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = create_app(settings)
    except ValueError as exc:  # a custom verifier, judge key, reward model or mix that does not hold
        raise SystemExit(f"reward service: {exc}") from None
    config = asgi_server.config(
        app,
        settings.host,
        settings.port,
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
    )
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:
        # uvicorn re-raises a caught SIGINT after its graceful shutdown (pool closed); exit without a trace.
        log.info("reward service interrupted")
