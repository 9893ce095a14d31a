"""The control service against oversized bodies: how soon a 20 MB body is refused (with and without the
token, declared or chunked), and what 20 MB uploads in flight cost the other requests. Starts a private
redis-server and `sparkrl control` in its own process on loopback ports; prints one line per figure
(median and worst of --repeat).

    .venv/bin/python bench/control_limits.py --repeat 5

"answer" times start when the headers are sent and end when the whole answer is in, on a socket that
sends no more body than the service needs to decide; "upload" times are httpx's whole call, the 20 MB
upload included (the service keeps the connection and discards the rest of a refused body).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
from bus_bench import start_private_redis

TOKEN = "bench-token"
BIG = 20 << 20
PATCH = "/api/v1/hyperparameters"


def start_control(redis_url: str) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKRL_")}
    env["SPARKRL_CONTROL__TOKEN"] = TOKEN
    sets = [f"control.port={port}", f"bus.url={redis_url}"]
    command = [sys.executable, "-m", "sparkrl.cli", "control", *(a for s in sets for a in ("--set", s))]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz").status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.05)
    proc.terminate()
    raise SystemExit("the control service did not answer /healthz within 60 s")


def answer_s(port: int, headers: dict[str, str], body: bytes = b"") -> tuple[float, int]:
    """Send the headers and `body` (less than announced, possibly), time the whole answer."""
    lines = [f"PATCH {PATCH} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    head = "\r\n".join(lines + [f"{k}: {v}" for k, v in headers.items()]) + "\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        started = time.perf_counter()
        sock.sendall(head.encode() + body)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            answer += sock.recv(65536)
        took = time.perf_counter() - started
    return took, int(answer.split(b" ", 2)[1])


def upload_s(url: str, headers: dict[str, str], content: object) -> tuple[float, int]:
    started = time.perf_counter()
    response = httpx.patch(url + PATCH, content=content, headers=headers, timeout=60)  # type: ignore[arg-type]
    return time.perf_counter() - started, response.status_code


def report(name: str, repeat: int, measure: Callable[[], tuple[float, int]]) -> None:
    runs = [measure() for _ in range(repeat)]
    times = [t * 1000 for t, _ in runs]
    codes = sorted({code for _, code in runs})
    print(f"{name}: {codes} median {statistics.median(times):.1f} ms, worst {max(times):.1f} ms")


def uploader(url: str, seconds: float) -> None:
    """20 MB chunked uploads, with the token and without, one after the other for `seconds`."""
    body = b"x" * BIG
    chunks = [body[i : i + 65536] for i in range(0, BIG, 65536)]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for headers in ({"Authorization": f"Bearer {TOKEN}"}, {}):
            httpx.patch(url + PATCH, content=iter(chunks), headers=headers, timeout=60)


def burner(_: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sum(range(10_000))


def healthz_ms(url: str, count: int) -> list[float]:
    times = []
    with httpx.Client(base_url=url) as client:
        for _ in range(count):
            started = time.perf_counter()
            client.get("/healthz").raise_for_status()
            times.append((time.perf_counter() - started) * 1000)
    return times


def run(url: str, repeat: int) -> None:
    port = int(url.rsplit(":", 1)[1])
    auth = {"Authorization": f"Bearer {TOKEN}"}
    chunk = b"10000\r\n" + b" " * 65536 + b"\r\n"
    for token, headers in (("token", auth), ("no token", {})):
        declared = headers | {"Content-Length": str(BIG)}
        report(f"answer, 20 MB declared, {token}", repeat, lambda h=declared: answer_s(port, h))
    chunked = {"Transfer-Encoding": "chunked"}
    report("answer, 20 MB chunked, token", repeat, lambda: answer_s(port, auth | chunked, chunk * 2))
    report("answer, 20 MB chunked, no token", repeat, lambda: answer_s(port, chunked))
    body = b"x" * BIG
    pieces = [body[i : i + 65536] for i in range(0, BIG, 65536)]
    for token, headers in (("token", auth), ("no token", {})):
        report(f"upload, 20 MB declared, {token}", repeat, lambda h=headers: upload_s(url, h, body))
        report(f"upload, 20 MB chunked, {token}", repeat, lambda h=headers: upload_s(url, h, iter(pieces)))
    many = ("{" + ",".join(f'"k{i}":0' for i in range(6000)) + "}").encode()[:65000]
    many = many[: many.rindex(b",")] + b"}"
    report(f"422, {len(many)} bytes of unknown keys", repeat, lambda: upload_s(url, auth, many))
    # Two processes of 20 MB uploads, against two that only burn CPU: on a small machine the uploads
    # cost the other requests what any two busy processes would, if the service itself does not stall.
    loads = {"idle": None, "two 20 MB upload loops": uploader, "two CPU-bound processes": burner}
    for name, target in loads.items():
        others = [
            multiprocessing.Process(target=target, args=(url, 3.0 * repeat)) for _ in range(2 * bool(target))
        ]
        for process in others:
            process.start()
        time.sleep(0.5 if others else 0)
        times = healthz_ms(url, 50 * repeat)
        for process in others:
            process.join()
        p99 = statistics.quantiles(times, n=100)[98]
        print(f"/healthz, {name}: median {statistics.median(times):.1f} ms, p99 {p99:.1f} ms, n={len(times)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    redis_proc, redis_url = start_private_redis()
    control_proc = None
    try:
        control_proc, url = start_control(redis_url)
        run(url, args.repeat)
    finally:
        for proc in (control_proc, redis_proc):
            if proc is not None:
                proc.terminate()
                proc.wait(10)


if __name__ == "__main__":
    main()
