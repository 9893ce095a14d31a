"""services/common/sandbox.py: code a model wrote, run as hostile (issue 48's Python tool). Each
guarantee is tried from inside by code that breaks it: a loop, a sleep, a memory and a fork bomb, a
large file, a connection to a listening socket of this test, writes outside its folder, a child that
leaves its process group, the caller's environment, another call's files."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path

import pytest

from sparkrl.services.common.sandbox import SandboxLimits, _zombie, run_python

ROOT_ONLY = pytest.mark.skipif(
    os.geteuid() != 0, reason="uid, mount and network namespaces of a call need root (CI runs as root)"
)


def test_code_runs_reads_stdin_and_an_error_is_a_status() -> None:
    done = run_python("import math, sys\nprint(math.factorial(10), sys.stdin.read().upper())", stdin="hi")
    assert (done.status, done.exit_code, done.stdout, done.truncated) == ("ok", 0, "3628800 HI\n", False)
    failed = run_python("1 / 0")
    assert failed.status == "error" and failed.exit_code == 1
    assert 'File "main.py", line 1' in failed.stderr and "ZeroDivisionError" in failed.stderr


def test_cpu_and_wall_limits_end_the_call() -> None:
    spun = run_python("while True:\n    pass", SandboxLimits(cpu_s=1, wall_s=10))
    assert spun.status == "cpu_limit" and spun.seconds < 5
    slept = run_python("import time\ntime.sleep(60)", SandboxLimits(wall_s=1))
    assert slept.status == "timeout" and 0.9 < slept.seconds < 5


def test_memory_file_size_and_output_are_bounded(tmp_path: Path) -> None:
    big = run_python("x = bytearray(10 << 30)", SandboxLimits(memory_mb=128))  # 10 GB
    assert big.status == "error" and "MemoryError" in big.stderr
    wrote = run_python("open('big', 'wb').write(b'x' * (4 << 20))", SandboxLimits(file_mb=1))
    assert wrote.status == "error" and "File too large" in wrote.stderr
    loud = run_python("print('y' * 100_000)", SandboxLimits(output_bytes=1000))
    assert loud.status == "ok" and loud.truncated and len(loud.stdout) == 1000
    # 100 MB of output: the stream is a file, cut at file_mb; the caller reads output_bytes of it.
    flood = run_python("for _ in range(100):\n    print('z' * (1 << 20))", SandboxLimits(output_bytes=1000))
    assert flood.status == "error" and flood.truncated and "File too large" in flood.stderr
    assert flood.stdout == "z" * 1000 and flood.seconds < 5


def test_the_callers_environment_is_not_there(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARKRL_SYNC__SECRET", "hunter2")
    shown = run_python("import os\nprint(sorted(os.environ), os.environ.get('SPARKRL_SYNC__SECRET'))")
    assert shown.stdout == "['HOME', 'LANG', 'PATH', 'TMPDIR'] None\n"


@ROOT_ONLY
def test_no_network_even_to_this_machine() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        server.settimeout(0.5)
        tried = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
        with pytest.raises(TimeoutError):
            server.accept()
    assert (
        tried.status == "error" and "Network is unreachable" in tried.stderr and tried.network == "namespace"
    )


@ROOT_ONLY
def test_it_writes_only_its_own_folder_which_goes_with_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp_path.chmod(0o777)  # writable by anyone: only the call's own uid and mounts keep it out
    scratches = tmp_path / "scratches"  # this test's calls make their scratch here (others run beside it)
    scratches.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratches))
    marker = f"sparkrl-sandbox-test-{os.getpid()}"
    code = (
        "import os\n"
        f"open('/tmp/{marker}', 'w').write('x')\n"  # its own /tmp: the scratch
        "print(sorted(os.listdir('.')), os.getcwd())\n"
        "for path in ['/var/tmp/x', '/root/x']:\n"
        "    open(path, 'w').write('x')\n"  # an empty tmpfs; then refused
    )
    done = run_python(code)
    assert done.stdout == f"{sorted([marker, 'main.py', 'stdin'])} /tmp\n"
    assert done.status == "error" and "Permission denied: '/root/x'" in done.stderr
    assert not Path("/tmp", marker).exists() and not Path("/var/tmp/x").exists()
    assert not list(scratches.iterdir())  # the scratch is gone
    outside = run_python(f"open('{tmp_path}/x', 'w').write('x')")
    assert outside.status == "error" and not (tmp_path / "x").exists()  # a bind mount hides the host /tmp
    # Another call sees none of the first one's files.
    assert run_python(f"import os\nprint(os.path.exists('/tmp/{marker}'))").stdout == "False\n"


@ROOT_ONLY
def test_processes_are_capped_and_none_outlives_the_call() -> None:
    bomb = run_python(
        "import os, time\n"
        "made = 0\n"
        "try:\n"
        "    for _ in range(200):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(60)\n"
        "            os._exit(0)\n"
        "        made += 1\n"
        "except OSError as exc:\n"
        "    print(made, type(exc).__name__)\n",
        SandboxLimits(processes=8, wall_s=5),
    )
    made, error = bomb.stdout.split()
    assert int(made) < 8 and error == "BlockingIOError"
    # A child that leaves the process group (setsid) and sleeps on: killed with the call.
    escaped = run_python(
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    time.sleep(120)\n"
        "    os._exit(0)\n"
        "print(os.getuid())\n"
    )
    uid = int(escaped.stdout)
    time.sleep(0.2)
    alive = [p for p in os.listdir("/proc") if p.isdigit() and _uid(p) == uid and not _zombie(int(p))]
    assert escaped.status == "ok" and uid != 0 and alive == []


def _uid(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


@ROOT_ONLY
def test_it_runs_under_the_services_umask() -> None:
    """`sparkrl up` and its services run with umask 077 (their files 0600): the call's own uid must still
    read its program, or every call of a worker's Python tool fails before the code runs."""
    before = os.umask(0o077)
    try:
        done = run_python("print(6 * 7)")
    finally:
        os.umask(before)
    assert (done.status, done.stdout) == ("ok", "42\n"), done.stderr
