"""The HTTP services' settings: the `control` and `env` sections and a service's own /metrics
endpoint; re-exported by `settings.py`."""

from __future__ import annotations

import re

from pydantic import Field, SecretStr, field_validator

from sparkrl.services.common.settings.section import Section

# The environments that ship (services/common/environments.py registers them; a test holds the two equal),
# those of them that keep a reward of their own (`get_reward`), and the form of a user's own environment.
SHIPPED_ENVIRONMENTS = ("calculator", "python", "countdown_retry", "lookup")
KEEPS_REWARD = frozenset({"countdown_retry"})
IMPORT_PATH = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*")


def environment_name(name: str) -> str:
    """`name` if it is a shipped environment or a `package.module:Class` import path; else what is."""
    if name not in SHIPPED_ENVIRONMENTS and not IMPORT_PATH.fullmatch(name):
        raise ValueError(
            f"environment {name!r} is neither a shipped one ({', '.join(SHIPPED_ENVIRONMENTS)}) nor an "
            "import path of your own class, `package.module:Class`"
        )
    return name


class EnvServiceSettings(Section):
    """The environment service (`sparkrl env`, docs/agents.md): episodes' environments over HTTP."""

    enabled: bool = Field(
        False,
        description="`sparkrl up` starts the environment service and points its workers at it "
        "(rollout.agent.url); false: environments run in each worker's process, or in a service started "
        "elsewhere that rollout.agent.url names.",
    )
    host: str = Field("127.0.0.1", description="Interface the service binds.")
    port: int = Field(8300, ge=0, le=65535, description="Port the service binds (0: any free port).")
    max_episodes: int = Field(
        1024, ge=1, le=1_000_000, description="Episodes held at once; a start beyond it gets 429 (retried)."
    )
    episode_idle_s: float = Field(
        600.0, gt=0, description="An episode not called for this long is forgotten (its worker is gone)."
    )
    call_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="The longest an environment's own method (reset, a turn's tools or respond, get_reward) "
        "may run; past it the call answers an error and the episode is dropped.",
    )
    max_request_bytes: int = Field(1 << 20, ge=1024, description="Larger request bodies get 413.")
    custom_environments: list[str] = Field(
        default_factory=list,
        description="Your own environments the service also plays, as `package.module:Class` import paths "
        "(a request names one of these or a shipped environment; nothing a request says is imported). "
        "`sparkrl up` adds rollout.agent.environment when it is one.",
    )

    @field_validator("custom_environments")
    @classmethod
    def _import_paths(cls, names: list[str]) -> list[str]:
        return [environment_name(name) for name in names]


class MetricsEndpoint(Section):
    """A service's own HTTP endpoint for `GET /metrics` (Prometheus) and `GET /healthz`."""

    host: str = Field("127.0.0.1", description="Interface it binds.")
    port: int = Field(
        0, ge=0, le=65535, description="Port it binds; 0: off (`sparkrl up` picks a free one for each)."
    )


class LearnerMetricsEndpoint(MetricsEndpoint):
    """The learner's endpoint: it ends the run by itself, so at its end it waits for one last scrape."""

    final_scrape_s: float = Field(
        10.0,
        ge=0,
        le=300,
        description="At the run's end, when something scrapes /metrics (Prometheus: two scrapes or more), "
        "wait for one more, so the dashboard holds the last step and broadcast: up to twice the interval "
        "between scrapes, at most this long (0: no wait).",
    )


class ControlSettings(Section):
    """The control service: REST API, live page, the fleet's Prometheus view; and how clients reach it."""

    host: str = Field("127.0.0.1", description="Interface the service binds.")
    port: int = Field(8200, ge=0, le=65535, description="Port the service binds.")
    url: str = Field("http://127.0.0.1:8200", description="Base URL clients (CLI, scripts) call.")
    allowed_hosts: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Names the service answers to besides its own: `host`, the host of `url`, localhost, "
        "this machine's name when `host` is every interface, and any IP address. A request whose Host "
        "header names another gets 400, so a web page cannot read the service through DNS rebinding. "
        "`.example.com` matches that domain and every name under it; `*` turns the check off.",
    )
    token: SecretStr | None = Field(
        None,
        description="Bearer token of the mutating routes (env SPARKRL_CONTROL__TOKEN); None: read from "
        "`token_file`. The service refuses to start with neither.",
    )
    token_file: str | None = Field(
        None, description="File holding the token (`sparkrl up` writes RUN_DIR/control-token, mode 0600)."
    )
    protect_reads: bool = Field(False, description="Require the token on the read routes and the page too.")
    read_token: SecretStr | None = Field(
        None,
        description="A read-only token (env SPARKRL_CONTROL__READ_TOKEN): when set, the read routes and the "
        "page require it or the control token, so viewers can watch without the power to steer.",
    )
    command_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="How long a command waits for every target's outcome before it answers 504, seconds.",
    )
    heartbeat_s: float = Field(
        1.0, gt=0, le=60, description="How often the server-sent event stream polls Redis, seconds."
    )
    redis_wait_s: float = Field(
        2.0,
        gt=0,
        le=60,
        description="How long a request waits for Redis to come back before it answers 503 (`/metrics`: "
        "`sparkrl_fleet_up 0`), seconds; at most `bus.reconnect_max_s`. Short, so a probe, a scrape or the "
        "page is answered within its own timeout while Redis is down.",
    )
    max_body_bytes: int = Field(
        65536,
        ge=1024,
        le=1 << 20,
        description="Larger request bodies get 413 before anything reads or parses them (from "
        "Content-Length, or counted as a chunked upload arrives). A command's body is a few hundred bytes; "
        "at most 1 MiB, so parsing any body accepted stays short on the event loop every request shares.",
    )
