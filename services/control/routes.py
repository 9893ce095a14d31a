"""The control service's routes, by who may call them: the service's own (page, health, Prometheus), the
reads (`read`: the read token where reads are protected) and the commands (`write`: the control token).
Each group is a router `app.py` includes; every route reads the telemetry or writes a command, nothing
else."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, Query, Request
from fastapi.responses import FileResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from sparkrl.proto import (
    CheckpointCommand,
    CheckpointRequest,
    CommandResponse,
    CommandTimeout,
    ControlBody,
    EvalsPage,
    HyperparameterPatch,
    MetricsPage,
    PauseCommand,
    PauseRequest,
    ResumeCommand,
    SetHparamsCommand,
    StatusView,
    StopCommand,
    StopRequest,
    WeightsPage,
    WorkersView,
)
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.http import AsciiJSON, error_entries
from sparkrl.services.common.settings import ControlSettings
from sparkrl.services.common.telemetry import Telemetry
from sparkrl.services.control.commands import Commander, NoTarget, Rejected, ShuttingDown, TimedOut
from sparkrl.services.control.events import event_stream, parse_cursor
from sparkrl.services.control.views import status_view, workers_view

STATIC_DIR = Path(__file__).parent / "static"
ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"description": "No bearer token."},
    403: {"description": "Wrong bearer token."},
    409: {"description": "Nothing live could apply the command (nothing was sent)."},
    503: {"description": "Redis is unreachable, or the control service is shutting down."},
    504: {"model": CommandTimeout, "description": "Not every target answered in control.command_timeout_s."},
}


def service_routes(telemetry: Telemetry, registry: CollectorRegistry) -> APIRouter:
    """The page, the health check and Prometheus: open to all (the page asks for the token itself)."""
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    def page() -> FileResponse:
        """The live page (static; it asks for the token once and calls the API)."""
        return FileResponse(STATIC_DIR / "index.html")

    @router.get("/healthz", tags=["service"])
    def healthz() -> dict[str, Any]:
        """200 while Redis answers (503 otherwise, through the bus error handler)."""
        return {"status": "ok", "learner_alive": Telemetry.learner_alive(telemetry.learner())}

    @router.get("/metrics", tags=["service"], response_class=Response)
    def metrics() -> Response:
        """Prometheus: the fleet's view (`sparkrl_fleet_*`) and `sparkrl_control_commands_total`."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router


def read_routes(telemetry: Telemetry, bus: RedisBus, read: list[Any]) -> APIRouter:
    """What the fleet is doing: status, workers, the sync history, step rows, evaluations."""
    router = APIRouter()

    @router.get("/api/v1/status", dependencies=read, responses=ERRORS, tags=["read"])
    def status() -> StatusView:
        """Learner state, step, version, last loss / reward / entropy, tokens/s, hyperparameters."""
        return status_view(telemetry, bus)

    @router.get("/api/v1/workers", dependencies=read, responses=ERRORS, tags=["read"])
    def workers() -> WorkersView:
        """Per worker: version held, lag, last sync seconds and bytes, failures, heartbeat age, speed."""
        return workers_view(telemetry)

    @router.get("/api/v1/weights", dependencies=read, responses=ERRORS, tags=["read"])
    def weights(
        offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0, limit: Annotated[int, Query(ge=1, le=500)] = 50
    ) -> WeightsPage:
        """The weight-sync history, newest first, paged."""
        items, total = telemetry.syncs(offset, limit)
        return WeightsPage(total=total, offset=offset, limit=limit, items=items)

    @router.get("/api/v1/metrics", dependencies=read, responses=ERRORS, tags=["read"])
    def step_rows(
        since: Annotated[int, Query(ge=0, description="Rows with a step above this.")] = 0,
        limit: Annotated[int, Query(ge=1, le=5000)] = 1000,
    ) -> MetricsPage:
        """Step rows after `since`, oldest first (pass `last_step` back as `since` to page on)."""
        rows = telemetry.steps(since, limit)
        return MetricsPage(since=since, rows=rows, last_step=rows[-1].step if rows else since)

    @router.get("/api/v1/evals", dependencies=read, responses=ERRORS, tags=["read"])
    def eval_records(limit: Annotated[int, Query(ge=1, le=5000)] = 200) -> EvalsPage:
        """The in-training evaluator's held-out records (set `eval.every`), oldest first."""
        return EvalsPage(items=telemetry.evals(limit))

    return router


def event_routes(telemetry: Telemetry, cfg: ControlSettings, read: list[Any]) -> APIRouter:
    """The same, as it happens: a server-sent event stream (a read)."""
    router = APIRouter()

    @router.get(
        "/api/v1/events",
        dependencies=read,
        responses=ERRORS,
        tags=["read"],
        response_class=StreamingResponse,
    )
    async def events(
        request: Request,
        cursor: Annotated[
            str | None, Query(max_length=400, description="Resume after this event id.")
        ] = None,
        last_event_id: Annotated[str | None, Header(max_length=400)] = None,
        limit: Annotated[int | None, Query(ge=1, le=100_000, description="Close after this many.")] = None,
        timeout_s: Annotated[
            float | None, Query(gt=0, le=86_400, description="Close after this long.")
        ] = None,
    ) -> StreamingResponse:
        """Server-sent events: `step`, `sync`, `command` and `state` records as they happen."""
        try:
            cursors = parse_cursor(cursor or last_event_id)
        except ValueError as exc:
            return AsciiJSON({"detail": str(exc)}, status_code=422)  # type: ignore[return-value]
        stream = event_stream(telemetry, request, cursors, cfg.heartbeat_s, limit, timeout_s)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)

    return router


def command_routes(commander: Commander, counter: Counter, write: list[Any]) -> APIRouter:
    """The commands, each applied by its targets at their next step or batch boundary and answered with
    every target's outcome."""
    router = APIRouter()
    issue = _issuer(commander, counter)

    @router.post("/api/v1/pause", dependencies=write, responses=ERRORS, tags=["control"])
    def pause(body: Annotated[PauseRequest | None, Body()] = None) -> CommandResponse:
        """Stop taking trajectories (learner) and prompts (workers); nothing in flight is lost."""
        return issue(PauseCommand(command="pause", reason=body.reason if body else None))  # type: ignore[return-value]

    @router.post("/api/v1/resume", dependencies=write, responses=ERRORS, tags=["control"])
    def resume() -> CommandResponse:
        """Take work again."""
        return issue(ResumeCommand(command="resume"))  # type: ignore[return-value]

    @router.post("/api/v1/stop", dependencies=write, responses=ERRORS, tags=["control"])
    def stop(body: Annotated[StopRequest | None, Body()] = None) -> CommandResponse:
        """Finish the current step, write a final checkpoint (unless told not to), and exit; workers too."""
        return issue(StopCommand(command="stop", checkpoint=body.checkpoint if body else True))  # type: ignore[return-value]

    @router.post("/api/v1/checkpoint", dependencies=write, responses=ERRORS, tags=["control"])
    def checkpoint(body: Annotated[CheckpointRequest | None, Body()] = None) -> CommandResponse:
        """Write a checkpoint at the next step boundary; the answer names its path."""
        return issue(CheckpointCommand(command="checkpoint", tag=body.tag if body else None))  # type: ignore[return-value]

    @router.patch("/api/v1/hyperparameters", dependencies=write, responses=ERRORS, tags=["control"])
    def hyperparameters(patch: HyperparameterPatch) -> CommandResponse:
        """Change hyperparameters from the next step (learner) or batch (workers); bounds checked first."""
        return issue(SetHparamsCommand(command="set_hparams", values=patch.values()))  # type: ignore[return-value]

    return router


def _issuer(commander: Commander, counter: Counter) -> Callable[[ControlBody], CommandResponse | AsciiJSON]:
    """Send a command and wait for its answers; an outcome that is not an answer is its HTTP error, and
    every outcome is counted by command and code."""

    def issue(body: ControlBody) -> CommandResponse | AsciiJSON:
        try:
            response: CommandResponse | AsciiJSON = commander.issue(body)
            code = 200
        except NoTarget as exc:
            response, code = AsciiJSON({"detail": str(exc)}, status_code=409), 409
        except Rejected as exc:
            detail = error_entries([p.as_error() for p in exc.problems])
            response, code = AsciiJSON({"detail": detail}, status_code=422), 422
        except ShuttingDown as exc:
            response, code = AsciiJSON({"detail": str(exc)}, status_code=503), 503
        except TimedOut as exc:
            body_504 = CommandTimeout(
                detail=str(exc), command_id=exc.command_id, waiting_for=exc.waiting_for, results=exc.results
            )
            response, code = AsciiJSON(body_504.model_dump(mode="json"), status_code=504), 504
        counter.labels(body.command, str(code)).inc()
        return response

    return issue
