"""The README's commands after "Two commands", run as printed in fresh shells (issue 36, item 2): a shell
with nothing but PATH=/usr/bin:/bin and HOME, as a new terminal has after `make demo`, where `sparkrl`
used to be "command not found" because nothing said `source .venv/bin/activate`.

The commands are read from the README itself, so a command added there without a way to run it here fails
this test. `make demo` runs for real (into runs/demo, as printed) and the steering commands run against it
while it is live; `sparkrl eval runs/demo` after it. `make test` is not run (it runs this suite), nor the
one line whose arguments are placeholders (DIR, FILE). Slow: one real demo run (a few minutes here).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import RedisServer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
ACTIVATE = "source .venv/bin/activate"
README_REDIS_PORT = 6380  # the Redis the README's `sparkrl prompts` example names


def readme_commands() -> list[str]:
    """Every command line of the README's bash blocks from "## Two commands" on: continuation lines
    joined, trailing comments dropped."""
    text = (ROOT / "README.md").read_text()
    text = text[text.index("## Two commands") :]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line:
                commands.append(" ".join(line.split()))
    return commands


def fresh_shell(command: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}
    return subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _said(done: subprocess.CompletedProcess[str]) -> str:
    return done.stdout + done.stderr


def _wait_for_first_step(demo: subprocess.Popen[str], started: float, timeout_s: float = 600) -> None:
    """Until this demo (not an earlier run left in runs/demo) has a step and holds its lock."""
    metrics = ROOT / "runs" / "demo" / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s

    def stepped() -> bool:
        return metrics.is_file() and metrics.stat().st_size > 0 and metrics.stat().st_mtime >= started

    while not (stepped() and (metrics.parent / "run.lock").exists()):
        assert demo.poll() is None, "make demo ended before its first step"
        assert time.monotonic() < deadline, "make demo had no step after 10 min"
        time.sleep(0.5)


def test_the_readme_commands_work_in_a_fresh_shell_as_printed(tmp_path: Path) -> None:
    commands = readme_commands()
    assert commands[:3] == ["make test", "make demo", ACTIVATE], commands[:3]
    steering = [c for c in commands if re.match(r"sparkrl (status|set|pause|report|dead)\b", c)]
    placeholders = [c for c in commands if re.search(r"\b(DIR|FILE)\b", c)]
    check = [c for c in commands if c.startswith("sparkrl check")]
    prompts = [c for c in commands if c.startswith("sparkrl prompts")]
    handled = ["make test", "make demo", ACTIVATE, *steering, *placeholders, *check, *prompts]
    assert sorted(commands) == sorted(handled), (
        f"README commands this test does not run: {set(commands) - set(handled)}"
    )

    # Why the README says to activate: a fresh shell has no `sparkrl`.
    assert fresh_shell("sparkrl --version").returncode == 127

    # A fresh checkout has no runs/demo; an earlier run's would answer `sparkrl status` with its own
    # (dead) control address until `make demo` overwrites it.
    shutil.rmtree(ROOT / "runs" / "demo", ignore_errors=True)
    started = time.time()
    demo = subprocess.Popen(
        ["bash", "-c", "make demo"],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for_first_step(demo, started)
        for command in steering:  # in another terminal, while it runs
            done = fresh_shell(f"{ACTIVATE} && {command}")
            print(f"$ {command}\n{_said(done)}")
            assert done.returncode == 0, (command, _said(done))
            if command.startswith("sparkrl pause"):
                resumed = fresh_shell(f"{ACTIVATE} && sparkrl resume --run-dir runs/demo")  # "resume … alike"
                assert resumed.returncode == 0, _said(resumed)
        output, _ = demo.communicate(timeout=900)
    finally:
        demo.kill()
    print(f"$ make demo\n{output}")
    assert demo.returncode == 0 and "learner finished" in output, output[-3000:]

    done = fresh_shell(f"{ACTIVATE} && sparkrl eval runs/demo")  # "Then `sparkrl eval runs/demo` scores it"
    print(f"$ sparkrl eval runs/demo\n{_said(done)}")
    assert done.returncode == 0 and "pass@1" in done.stdout, _said(done)

    for (
        command
    ) in check:  # paper: a 7B model and a data set this machine does not have, said in one line each
        done = fresh_shell(f"{ACTIVATE} && {command}")
        assert done.returncode == 2 and "nothing was started" in done.stderr, _said(done)

    _the_prompts_example(prompts, tmp_path)


def _the_prompts_example(prompts: list[str], tmp_path: Path) -> None:
    """The README's MATH-500 feed, into a private redis-server on the port it names (when it is free)."""
    if not (ROOT.parent / "shared" / "data" / "math-eval").is_dir():
        pytest.skip(
            "the README's `sparkrl prompts` reads ../shared/data/math-eval/, not beside this checkout"
        )
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not on PATH; run `make test`, which installs it")
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", README_REDIS_PORT)) == 0:
            pytest.skip(f"port {README_REDIS_PORT} (the README's Redis) is taken here")
    server = RedisServer(tmp_path)
    server.port = README_REDIS_PORT
    try:
        server.start()
    except RuntimeError as exc:
        pytest.skip(f"port {README_REDIS_PORT} (the README's Redis) is not free here: {exc}")
    try:
        for command in prompts:
            done = fresh_shell(f"{ACTIVATE} && {command}")
            assert done.returncode == 0 and "feeding" in done.stderr, _said(done)
    finally:
        server.stop()
