"""The control service: REST control endpoints, the live page, and the fleet's Prometheus view.

Stateless: everything it shows it reads from the telemetry channel in Redis, and every command it
writes to the control stream, so it keeps working while the learner restarts and runs as its own
container. Mutating routes need the bearer token; reads too with `control.protect_reads`, or the read-only
`control.read_token` (either token then reads). A body over `control.max_body_bytes` is refused (413), and a
command without the token (401/403), before any of its body is read.
"""

from __future__ import annotations

import logging
import threading
from types import FrameType
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.staticfiles import StaticFiles

from sparkrl.services.common import asgi_server
from sparkrl.services.common.bus import BusError, RedisBus
from sparkrl.services.common.http import AsciiJSON, BodyLimit, install_validation_handler
from sparkrl.services.common.settings import BusSettings, ControlSettings
from sparkrl.services.common.settings.roles import ControlConfig
from sparkrl.services.common.telemetry import Telemetry
from sparkrl.services.control.auth import TokenCheck, resolve_token, write_gate
from sparkrl.services.control.commands import Commander
from sparkrl.services.control.fleet import fleet_registry
from sparkrl.services.control.hosts import HostCheck, own_names
from sparkrl.services.control.routes import (
    STATIC_DIR,
    command_routes,
    event_routes,
    read_routes,
    service_routes,
)

log = logging.getLogger("sparkrl.control")

_GRACEFUL_SHUTDOWN_S = 3


def create_app(cfg: ControlSettings, bus_cfg: BusSettings) -> FastAPI:
    """The app over its own bus connection; raises ValueError when no token is configured."""
    token = resolve_token(cfg)
    # A request answers within control.redis_wait_s while Redis is down, not after bus.reconnect_max_s.
    wait_s = min(bus_cfg.reconnect_max_s, cfg.redis_wait_s)
    setting = "control.redis_wait_s" if wait_s < bus_cfg.reconnect_max_s else "bus.reconnect_max_s"
    bus = RedisBus(bus_cfg.model_copy(update={"reconnect_max_s": wait_s}), reconnect_setting=setting)
    telemetry = Telemetry(bus)
    commander = Commander(bus, telemetry, cfg.command_timeout_s)
    registry, commands_counter = fleet_registry(telemetry, bus)
    read_token = cfg.read_token.get_secret_value() if cfg.read_token is not None else None
    readers = (token, read_token) if read_token else (token,)
    protected = cfg.protect_reads or bool(read_token)
    read = [Depends(TokenCheck(*readers, required=protected))]
    write_check = TokenCheck(token)
    write = [Depends(write_check)]
    app = FastAPI(
        title="sparkrl control",
        version="1",
        description="Steer a running sparkrl job and watch its fleet. Mutating routes need "
        "`Authorization: Bearer <token>` (RUN_DIR/control-token under `sparkrl up`).",
        default_response_class=AsciiJSON,
        **({"docs_url": None, "redoc_url": None, "openapi_url": None} if protected else {}),
    )
    gate = write_gate(write_check)
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes, setting="control.max_body_bytes", gate=gate)
    # Outermost: a request by a name not the service's (DNS rebinding) is refused before anything else.
    app.add_middleware(HostCheck, names=own_names(cfg), allowed=cfg.allowed_hosts)
    _errors(app)
    if protected:
        _schema_behind_the_token(app, read)
    app.state.stopping = commander.stopping  # set by the server on SIGTERM/SIGINT (`main`)
    app.include_router(service_routes(telemetry, registry))
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.include_router(read_routes(telemetry, bus, read))
    app.include_router(event_routes(telemetry, cfg, read))
    app.include_router(command_routes(commander, commands_counter, write))
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


def main(cfg: ControlConfig) -> None:
    """Serve until SIGTERM/SIGINT (uvicorn's graceful shutdown)."""
    app = create_app(cfg.control, cfg.bus)
    log.info("control service on http://%s:%d/ (API /api/v1, docs /docs)", cfg.control.host, cfg.control.port)
    config = asgi_server.config(
        app,
        cfg.control.host,
        cfg.control.port,
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
