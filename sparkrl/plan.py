"""The plan of `sparkrl up`: which processes, on which ports, each with its resolved settings file.

`plan_stack` decides everything and touches no file; `write_configs` writes `RUN_DIR/config/` (one file
per service, which alone reproduces it: only its role's part of the tree, `roles.py`), the control token
(`RUN_DIR/control-token`, mode 0600) and the run's folders. The launcher then spawns each service from
its file.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from sparkrl.ports import free_ports
from sparkrl.run_lock import LOCK_FILE
from sparkrl.services.common.ownership import RUN_ID_FILE
from sparkrl.services.common.settings import BusSettings, SparkSettings, write_resolved
from sparkrl.services.common.settings.roles import (
    ControlConfig,
    EnvConfig,
    EvaluatorConfig,
    LearnerConfig,
    PromptsConfig,
    RewardConfig,
    RoleConfig,
    RolloutConfig,
)
from sparkrl.services.common.settings.servers import SHIPPED_ENVIRONMENTS
from sparkrl.torchrun import torchrun_command

Role = Literal["redis", "judge", "control", "reward", "env", "learner", "rollout", "prompts", "evaluator"]
# Shutdown, tier by tier: producers stop before what they feed (the feeder and workers before the learner,
# workers before the reward and environment services they call); the control service, which only reads
# and writes Redis, goes with those, before Redis, which everyone talks to and goes last. The evaluator
# stops with the learner: it evaluates the last version the learner wrote, then scores through the reward
# service.
STOP_TIERS: tuple[tuple[Role, ...], ...] = (
    ("prompts", "rollout"),
    ("learner", "evaluator"),
    ("reward", "control", "env"),
    ("redis", "judge"),
)
TOKEN_FILE = "control-token"


# What an earlier run leaves in its directory: a second run there would mix its rows, checkpoints and
# weight numbering into those.
RUN_MARKS = ("metrics.jsonl", "checkpoints", "trained_groups.jsonl", "weights.jsonl", "eval.jsonl")


def earlier_run(run_dir: Path) -> list[str]:
    """What of an earlier run `run_dir` holds (none: a fresh directory)."""
    return [name for name in RUN_MARKS if (run_dir / name).exists()]


def prepare_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """One run per directory: an earlier run is continued (`resume`), removed first (`overwrite`), or the
    start is refused with what to do (ValueError) before anything is spawned. A live run never gets here:
    `sparkrl up` holds the directory's lock first (`run_lock.py`), and `overwrite` keeps that lock."""
    held = earlier_run(run_dir)
    if not held or resume:
        return
    if not overwrite:
        raise ValueError(
            f"{run_dir} holds an earlier run ({', '.join(held)}): continue it with --resume, start over "
            "with --overwrite (deletes that directory), or give another --run-dir"
        )
    for child in run_dir.iterdir():
        if child.name == LOCK_FILE:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


@dataclass(frozen=True)
class ServiceSpec:
    """One process of the stack: the command that starts it from its written config, and its log."""

    name: str  # `reward`, `worker-0`, ...: file names and reports use it
    role: Role
    command: tuple[str, ...]
    config_path: Path
    config: RoleConfig | str  # its role's part of the resolved tree, or (redis) the literal redis.conf text
    log_path: Path
    env: tuple[tuple[str, str], ...] = ()  # set in its environment (CUDA_VISIBLE_DEVICES)
    ready: tuple[Literal["ping", "healthz", "health"], str] | None = None  # its probe and where; None: none


@dataclass(frozen=True)
class StackPlan:
    """Everything `sparkrl up` will start, in start order, with the planned ports in `settings`."""

    run_dir: Path
    settings: SparkSettings
    services: tuple[ServiceSpec, ...]
    private_redis: bool
    control_token: str | None = None  # written to RUN_DIR/control-token; None: the user's own token file
    resume: bool = False  # go on with the run directory's checkpoint, journal and private Redis data

    @property
    def page_url(self) -> str:
        return self.settings.control.url + "/"

    @property
    def token_path(self) -> Path:
        given = self.settings.control.token_file
        return Path(given) if given else self.run_dir / TOKEN_FILE


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def _resolve_root(
    cfg: SparkSettings, private_redis: bool, run_dir: Path, ports: list[int], resume: bool
) -> SparkSettings:
    """The root tree with the launch decided: absolute run dir, the run's id, private Redis URL, free
    ports.

    A port the user set (preset, environment, `--set`, or a resolved file) is kept; one left at its
    default is replaced by a free loopback port, so two runs on one machine never collide.
    """
    redis_port, reward_port, sync_port, control_port, learner_metrics = ports
    root = cfg.model_copy(deep=True)
    root.run_dir = str(run_dir)
    if root.rollout.python is not None and os.sep in root.rollout.python:
        # Absolute, so the resolved file works from any directory; abspath, not resolve(): a venv's
        # python is a symlink to the base interpreter, which knows none of the venv's packages.
        root.rollout.python = os.path.abspath(root.rollout.python)
    if Path(root.model).is_dir():
        # Absolute, as run_dir: a Ray actor starts in the directory `ray start` ran in on its node, not in
        # the driver's, so a relative path would name another directory there.
        root.model = os.path.abspath(root.model)
    if root.bus.run_id is None:  # the run's identity on the bus: a resume is the same run
        known = run_dir / RUN_ID_FILE
        resumed = known.read_text().strip() if known.is_file() and resume else ""
        root.bus.run_id = resumed or secrets.token_hex(8)
    if private_redis:
        # Its own password too: nothing else on the machine can read or write the run's bus.
        host = _client_host(root.bus.host)
        root.bus.url = f"redis://:{secrets.token_urlsafe(24)}@{host}:{redis_port}/0"
    if root.sync.secret is None:
        root.sync.secret = secrets.token_hex(32)  # signs the weight announcements
    if "port" not in cfg.reward.model_fields_set or cfg.reward.port == 0:
        root.reward.port = reward_port
    # The launcher runs the reward and control services itself: clients call exactly where they bind.
    root.reward.url = f"http://{_client_host(root.reward.host)}:{root.reward.port}"
    if "port" not in cfg.control.model_fields_set or cfg.control.port == 0:
        root.control.port = control_port
    if root.env.enabled:  # the workers call the service the launcher starts
        if "port" not in cfg.env.model_fields_set or cfg.env.port == 0:
            root.env.port = free_ports(1)[0]
        root.rollout.agent.url = f"http://{_client_host(root.env.host)}:{root.env.port}"
        played = root.rollout.agent.environment
        if played not in SHIPPED_ENVIRONMENTS and played not in root.env.custom_environments:
            root.env.custom_environments = [*root.env.custom_environments, played]  # yours, served
    root.control.url = f"http://{_client_host(root.control.host)}:{root.control.port}"
    judge = root.reward.judge
    if judge.serve is not None:  # a local judge: the launcher serves it, the reward service calls it
        if "serve_port" not in cfg.reward.judge.model_fields_set:
            judge.serve_port = free_ports(1)[0]
        judge.serve, judge.serve_python = os.path.abspath(judge.serve), os.path.abspath(judge.serve_python)
        judge.url = f"http://127.0.0.1:{judge.serve_port}/v1"
    if "port" not in cfg.sync.model_fields_set:
        root.sync.port = sync_port
    if "http_port" not in cfg.sync.model_fields_set:
        root.sync.http_port = 0  # any free one: workers learn the address from the signed announcement
    if root.learner.metrics.port == 0:
        root.learner.metrics.port = learner_metrics
    return root


def _plan_token(cfg: SparkSettings, run_dir: Path) -> tuple[str | None, SparkSettings]:
    """The token to write to RUN_DIR/control-token (None: the user's own file), and the tree without it:
    a secret never goes into a config file, only the path of the 0600 file that holds it."""
    root = cfg.model_copy(deep=True)
    if cfg.control.token is not None:
        token: str | None = cfg.control.token.get_secret_value()
    elif cfg.control.token_file:
        return None, root
    else:
        existing = run_dir / TOKEN_FILE  # a resumed or restarted run keeps its token: scripts go on working
        token = existing.read_text().strip() if existing.is_file() else ""
        token = token or secrets.token_urlsafe(24)
    root.control.token = None
    root.control.token_file = str(run_dir / TOKEN_FILE)
    return token, root


REDIS_IDLE_TIMEOUT_S = 20
REDIS_MAX_CLIENTS = 10_000


def redis_max_memory(root: SparkSettings) -> int:
    """Bytes the private Redis may hold (`bus.redis_max_memory_mb`, or twice what the streams' bounds
    hold, 1 GiB at least): past it writes are refused, never evicted (`noeviction`: an evicted trained
    mark or dedup key would train or feed a group twice), and the services wait as for an outage."""
    bus, sampling = root.bus, root.rollout.sampling
    if bus.redis_max_memory_mb is not None:
        return bus.redis_max_memory_mb * 2**20
    token_bytes = 16 + 8 * sampling.topk_logprobs  # id, log-prob, version, mask; the top-k ids and log-probs
    group = sampling.n * sampling.max_new_tokens * token_bytes + 64 * 1024  # its prompt and metadata
    streams = bus.trajectory_maxlen * group + bus.prompt_maxlen * 4096 + bus.dead_letter_maxlen * 64 * 1024
    telemetry = 4 * bus.telemetry_maxlen * 4096
    return max(2**30, 2 * (streams + telemetry))


def _redis_conf(bus: BusSettings, data_dir: Path, max_memory: int) -> str:
    parts = urlsplit(bus.url)
    port, password = parts.port, parts.password
    # The run's own bus, on bus.host only (loopback by default). Append-only file in the run directory: a
    # crash or `--resume` finds the streams, acknowledgements, dedup and trained marks exactly as they
    # were, so nothing is fed or trained twice. Redis writes the file before it replies, so a killed Redis
    # loses nothing; fsync on every write (`bus.aof_fsync: always`) adds the machine's power loss, at a
    # disk flush per command.
    return (
        f'port {port}\nbind {bus.host}\nsave ""\nappendonly yes\nappendfsync {bus.aof_fsync}\n'
        f"daemonize no\ndir {data_dir}\nmaxmemory {max_memory}\nmaxmemory-policy noeviction\n"
        # Connections that never authenticate (a flood filling the client slots) are closed once idle for
        # REDIS_IDLE_TIMEOUT_S, well inside the wait of the run's services, which then get back in; theirs
        # that idle as long reconnect on their next call.
        f"timeout {REDIS_IDLE_TIMEOUT_S}\ntcp-keepalive 15\nmaxclients {REDIS_MAX_CLIENTS}\n"
        + (f"requirepass {password}\n" if password else "")
    )


def _service(
    run_dir: Path,
    name: str,
    role: Role,
    config: RoleConfig | str,
    *extra: str,
    python: str | None = None,
    gpus: list[int] | None = None,
) -> ServiceSpec:
    if role == "redis":
        config_path = run_dir / "config" / "redis.conf"
        # Through its keeper, which stops it only once the run's other services are gone (redis_keeper.py).
        server = shutil.which("redis-server") or "redis-server"
        command: tuple[str, ...] = (sys.executable, "-m", "sparkrl.redis_keeper", server, str(config_path))
    else:
        config_path = run_dir / "config" / f"{name}.yaml"
        command = (python or sys.executable, "-m", "sparkrl.cli", role, "--preset", str(config_path), *extra)
        if isinstance(config, LearnerConfig) and config.learner.ranks > 1:
            command = torchrun_command(config.learner.ranks, command)
    env = (("CUDA_VISIBLE_DEVICES", ",".join(map(str, gpus))),) if gpus else ()
    ready = _probe(config)
    return ServiceSpec(name, role, command, config_path, config, run_dir / "logs" / f"{name}.log", env, ready)


def _local_judge(root: SparkSettings, run_dir: Path) -> ServiceSpec:
    """`vllm serve` of `reward.judge.serve` on loopback, from `serve_python` (vLLM's own command line, as
    its `vllm` script runs it); its config file is the command line, its probe vLLM's GET /health."""
    judge = root.reward.judge
    command = (
        judge.serve_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(judge.serve),
        "--served-model-name", judge.model, "--host", "127.0.0.1", "--port", str(judge.serve_port),
        *judge.serve_args,
    )  # fmt: skip
    ready = ("health", f"http://127.0.0.1:{judge.serve_port}")
    config_path, log_path = run_dir / "config" / "judge.args", run_dir / "logs" / "judge.log"
    return ServiceSpec("judge", "judge", command, config_path, shlex.join(command), log_path, ready=ready)


def _probe(config: RoleConfig | str) -> tuple[Literal["ping", "healthz"], str] | None:
    """How the launcher knows a service is up: Redis answers PING (see plan_stack: its URL is the root
    settings'), reward and control GET /healthz (the others have no probe: they retry what they need)."""
    if isinstance(config, RewardConfig):
        return ("healthz", config.reward.url)
    if isinstance(config, ControlConfig):
        return ("healthz", config.control.url)
    if isinstance(config, EnvConfig):
        return ("healthz", f"http://{_client_host(config.env.host)}:{config.env.port}")
    return None


def plan_stack(
    cfg: SparkSettings, workers: int, private_redis: bool | None = None, resume: bool = False
) -> StackPlan:
    """Decide ports and each service's resolved settings; touches no file.

    `private_redis=None` starts a private `redis-server` exactly when no Redis URL was given; `resume`
    starts the learner from `RUN_DIR/checkpoints/latest`.
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, not {workers}: the learner trains on their groups")
    if cfg.env.enabled and cfg.rollout.agent.environment is None:
        raise ValueError(
            "env.enabled starts an environment service, but rollout.agent.environment names no environment "
            "for the workers to play: set it, or env.enabled false"
        )
    if private_redis is None:
        private_redis = "url" not in cfg.bus.model_fields_set
    run_dir = Path(cfg.run_dir).resolve()
    ports = free_ports(5 + workers)
    token, root = _plan_token(_resolve_root(cfg, private_redis, run_dir, ports[:5], resume), run_dir)
    services: list[ServiceSpec] = []
    if private_redis:
        redis_spec = _service(
            run_dir, "redis", "redis", _redis_conf(root.bus, run_dir / "redis", redis_max_memory(root))
        )
        services.append(dataclasses.replace(redis_spec, ready=("ping", root.bus.url)))
    if root.reward.judge.serve is not None:
        services.append(_local_judge(root, run_dir))
    services.append(_service(run_dir, "control", "control", ControlConfig.of(root)))
    services.append(_service(run_dir, "reward", "reward", RewardConfig.of(root)))
    if root.env.enabled:
        services.append(_service(run_dir, "env", "env", EnvConfig.of(root)))
    resume_flag = ["--resume"] if resume else []
    learner = LearnerConfig.of(root)
    services.append(_service(run_dir, "learner", "learner", learner, *resume_flag, gpus=root.learner.gpus))
    for index in range(workers):
        worker = RolloutConfig.of(root)
        worker.rollout.worker_id = f"worker-{index}"
        if worker.rollout.metrics.port == 0:
            worker.rollout.metrics.port = ports[5 + index]
        # The id is in the file (which alone reproduces the worker) and on the command line, for `ps`.
        gpus = root.rollout.gpus
        services.append(
            _service(
                run_dir,
                f"worker-{index}",
                "rollout",
                worker,
                "--worker-id",
                f"worker-{index}",
                python=root.rollout.python,
                gpus=[gpus[index % len(gpus)]] if gpus else None,
            )
        )
    if cfg.eval.every is not None:
        services.append(_service(run_dir, "evaluator", "evaluator", EvaluatorConfig.of(root)))
    # The feeder stays up: should the bus lose its data, it feeds again what was not trained yet.
    services.append(_service(run_dir, "prompts", "prompts", PromptsConfig.of(root), "--watch"))
    return StackPlan(run_dir, root, tuple(services), private_redis, token, resume)


def write_token(path: Path, token: str) -> None:
    """Write the token readable by its owner only (0600, also when the file existed with wider modes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(token + "\n")
    os.chmod(path, 0o600)


def _header(spec: ServiceSpec) -> str:
    """The comment on top of a service's file: whose it is, and that it holds only its role's part."""
    return (
        f"{spec.name}: `sparkrl {spec.role}` settings, resolved by `sparkrl up`. Only the {spec.role} "
        f"role's part of the tree\n({', '.join(type(spec.config).model_fields)}); "
        f"`sparkrl {spec.role} --preset THIS_FILE` runs it again."
    )


def write_configs(plan: StackPlan) -> None:
    """Write every service's config (`RUN_DIR/config/<service>.yaml`, `redis.conf`), the control token
    and the run's folders."""
    for spec in plan.services:
        if isinstance(spec.config, str):
            write_token(spec.config_path, spec.config.rstrip("\n"))  # redis.conf holds its password: 0600
        else:
            write_resolved(spec.config, spec.config_path, header=_header(spec))
    if plan.control_token is not None:
        write_token(plan.token_path, plan.control_token)
    if plan.settings.bus.run_id is not None:
        write_token(plan.run_dir / RUN_ID_FILE, plan.settings.bus.run_id)  # what a resume goes on as
    if plan.private_redis and not plan.resume:
        # A fresh run starts with an empty bus: an earlier run's data would mark its prompts as fed.
        shutil.rmtree(plan.run_dir / "redis", ignore_errors=True)
    for folder in ("logs", "redis", "checkpoints"):
        (plan.run_dir / folder).mkdir(parents=True, exist_ok=True)
