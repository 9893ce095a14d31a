"""The control service: REST control endpoints, the live page, and the fleet's Prometheus view.

Stateless: everything it shows it reads from the telemetry channel in Redis, and every command it
writes to the control stream, so it keeps working while the learner restarts and runs as its own
container. Mutating routes need the bearer token; reads too with `control.protect_reads`, or the read-only
`control.read_token` (either token then reads).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import uvicorn
from fastapi import Body, Depends, FastAPI, Header, Query, Request
from fastapi.responses import FileResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

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
from sparkrl.services.common.bus import BusError, RedisBus
from sparkrl.services.common.http import AsciiJSON, install_validation_handler
from sparkrl.services.common.settings import BusSettings, ControlSettings, SparkSettings
from sparkrl.services.common.telemetry import Telemetry
from sparkrl.services.control.auth import TokenCheck, resolve_token
from sparkrl.services.control.commands import Commander, NoTarget, Rejected, ShuttingDown, TimedOut
from sparkrl.services.control.events import event_stream, parse_cursor
from sparkrl.services.control.fleet import fleet_registry
from sparkrl.services.control.views import status_view, workers_view

log = logging.getLogger("sparkrl.control")

STATIC_DIR = Path(__file__).parent / "static"
_GRACEFUL_SHUTDOWN_S = 3
_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"description": "No bearer token."},
    403: {"description": "Wrong bearer token."},
    409: {"description": "Nothing live could apply the command (nothing was sent)."},
    503: {"description": "Redis is unreachable, or the control service is shutting down."},
    504: {"model": CommandTimeout, "description": "Not every target answered in control.command_timeout_s."},
}


def create_app(cfg: ControlSettings, bus_cfg: BusSettings) -> FastAPI:
    """The app over its own bus connection; raises ValueError when no token is configured."""
    token = resolve_token(cfg)
    bus = RedisBus(bus_cfg)
    telemetry = Telemetry(bus)
    commander = Commander(bus, telemetry, cfg.command_timeout_s)
    registry, commands_counter = fleet_registry(telemetry, bus)
    read_token = cfg.read_token.get_secret_value() if cfg.read_token is not None else None
    readers = (token, read_token) if read_token else (token,)
    protected = cfg.protect_reads or bool(read_token)
    read = [Depends(TokenCheck(*readers, required=protected))]
    write = [Depends(TokenCheck(token))]
    app = FastAPI(
        title="sparkrl control",
        version="1",
        description="Steer a running sparkrl job and watch its fleet. Mutating routes need "
        "`Authorization: Bearer <token>` (RUN_DIR/control-token under `sparkrl up`).",
        default_response_class=AsciiJSON,
        **({"docs_url": None, "redoc_url": None, "openapi_url": None} if protected else {}),
    )
    _errors(app)
    if protected:
        _schema_behind_the_token(app, read)
    app.state.stopping = commander.stopping  # set by the server on SIGTERM/SIGINT (`main`)

    def run(body: ControlBody) -> CommandResponse | AsciiJSON:
        try:
            response: CommandResponse | AsciiJSON = commander.issue(body)
            code = 200
        except NoTarget as exc:
            response, code = AsciiJSON({"detail": str(exc)}, status_code=409), 409
        except Rejected as exc:
            response, code = AsciiJSON({"detail": [p.as_error() for p in exc.problems]}, status_code=422), 422
        except ShuttingDown as exc:
            response, code = AsciiJSON({"detail": str(exc)}, status_code=503), 503
        except TimedOut as exc:
            body_504 = CommandTimeout(
                detail=str(exc), command_id=exc.command_id, waiting_for=exc.waiting_for, results=exc.results
            )
            response, code = AsciiJSON(body_504.model_dump(mode="json"), status_code=504), 504
        commands_counter.labels(body.command, str(code)).inc()
        return response

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        """The live page (static; it asks for the token once and calls the API)."""
        return FileResponse(STATIC_DIR / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/healthz", tags=["service"])
    def healthz() -> dict[str, Any]:
        """200 while Redis answers (503 otherwise, through the bus error handler)."""
        return {"status": "ok", "learner_alive": Telemetry.learner_alive(telemetry.learner())}

    @app.get("/metrics", tags=["service"], response_class=Response)
    def metrics() -> Response:
        """Prometheus: the fleet's view (`sparkrl_fleet_*`) and `sparkrl_control_commands_total`."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/v1/status", dependencies=read, responses=_ERRORS, tags=["read"])
    def status() -> StatusView:
        """Learner state, step, version, last loss / reward / entropy, tokens/s, hyperparameters."""
        return status_view(telemetry, bus)

    @app.get("/api/v1/workers", dependencies=read, responses=_ERRORS, tags=["read"])
    def workers() -> WorkersView:
        """Per worker: version held, lag, last sync seconds and bytes, failures, heartbeat age, speed."""
        return workers_view(telemetry)

    @app.get("/api/v1/weights", dependencies=read, responses=_ERRORS, tags=["read"])
    def weights(
        offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0, limit: Annotated[int, Query(ge=1, le=500)] = 50
    ) -> WeightsPage:
        """The weight-sync history, newest first, paged."""
        items, total = telemetry.syncs(offset, limit)
        return WeightsPage(total=total, offset=offset, limit=limit, items=items)

    @app.get("/api/v1/metrics", dependencies=read, responses=_ERRORS, tags=["read"])
    def step_rows(
        since: Annotated[int, Query(ge=0, description="Rows with a step above this.")] = 0,
        limit: Annotated[int, Query(ge=1, le=5000)] = 1000,
    ) -> MetricsPage:
        """Step rows after `since`, oldest first (pass `last_step` back as `since` to page on)."""
        rows = telemetry.steps(since, limit)
        return MetricsPage(since=since, rows=rows, last_step=rows[-1].step if rows else since)

    @app.get("/api/v1/evals", dependencies=read, responses=_ERRORS, tags=["read"])
    def eval_records(limit: Annotated[int, Query(ge=1, le=5000)] = 200) -> EvalsPage:
        """The in-training evaluator's held-out records (set `eval.every`), oldest first."""
        return EvalsPage(items=telemetry.evals(limit))

    @app.get(
        "/api/v1/events",
        dependencies=read,
        responses=_ERRORS,
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

    @app.post("/api/v1/pause", dependencies=write, responses=_ERRORS, tags=["control"])
    def pause(body: Annotated[PauseRequest | None, Body()] = None) -> CommandResponse:
        """Stop taking trajectories (learner) and prompts (workers); nothing in flight is lost."""
        return run(PauseCommand(command="pause", reason=body.reason if body else None))  # type: ignore[return-value]

    @app.post("/api/v1/resume", dependencies=write, responses=_ERRORS, tags=["control"])
    def resume() -> CommandResponse:
        """Take work again."""
        return run(ResumeCommand(command="resume"))  # type: ignore[return-value]

    @app.post("/api/v1/stop", dependencies=write, responses=_ERRORS, tags=["control"])
    def stop(body: Annotated[StopRequest | None, Body()] = None) -> CommandResponse:
        """Finish the current step, write a final checkpoint (unless told not to), and exit; workers too."""
        return run(StopCommand(command="stop", checkpoint=body.checkpoint if body else True))  # type: ignore[return-value]

    @app.post("/api/v1/checkpoint", dependencies=write, responses=_ERRORS, tags=["control"])
    def checkpoint(body: Annotated[CheckpointRequest | None, Body()] = None) -> CommandResponse:
        """Write a checkpoint at the next step boundary; the answer names its path."""
        return run(CheckpointCommand(command="checkpoint", tag=body.tag if body else None))  # type: ignore[return-value]

    @app.patch("/api/v1/hyperparameters", dependencies=write, responses=_ERRORS, tags=["control"])
    def hyperparameters(patch: HyperparameterPatch) -> CommandResponse:
        """Change hyperparameters from the next step (learner) or batch (workers); bounds checked first."""
        return run(SetHparamsCommand(command="set_hparams", values=patch.values()))  # type: ignore[return-value]

    return app


def _schema_behind_the_token(app: FastAPI, read: list[Any]) -> None:
    """With protected reads the OpenAPI schema is a read like the others; no /docs page (a browser does not
    send the bearer token the schema then needs)."""

    @app.get("/openapi.json", dependencies=read, include_in_schema=False)
    def openapi() -> dict[str, Any]:
        return app.openapi()


def _errors(app: FastAPI) -> None:
    install_validation_handler(app)

    @app.exception_handler(BusError)
    async def redis_down(_: Request, exc: BusError) -> AsciiJSON:
        return AsciiJSON({"detail": f"the telemetry store is unreachable: {exc}"}, status_code=503)


def main(cfg: SparkSettings) -> None:
    """Serve until SIGTERM/SIGINT (uvicorn's graceful shutdown)."""
    app = create_app(cfg.control, cfg.bus)
    log.info("control service on http://%s:%d/ (API /api/v1, docs /docs)", cfg.control.host, cfg.control.port)
    config = uvicorn.Config(
        app,
        host=cfg.control.host,
        port=cfg.control.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
    )
    try:
        _Server(config, app.state.stopping).run()
    except KeyboardInterrupt:
        log.info("control service interrupted")


class _Server(uvicorn.Server):
    """uvicorn's server, which on a stop signal first tells the commands still waiting for answers: each
    answers 503 with what was sent (within a wait slice), instead of being cancelled into a 500 when the
    graceful shutdown runs out."""

    def __init__(self, config: uvicorn.Config, stopping: threading.Event) -> None:
        super().__init__(config)
        self.stopping = stopping

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.stopping.set()
        super().handle_exit(sig, frame)
