"""What a request can cost the control service, over real HTTP (uvicorn on a loopback port, a private
redis-server): a body over `control.max_body_bytes` is refused from its headers or as it arrives, a
command without the token is refused before its body is read, a 422 never echoes the input, and live
values are strict JSON numbers with bounds that mean something.

Times are printed (`pytest -s`), never asserted: `bench/control_limits.py` measures them against the
service in its own process."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import clean_env
from test_control_api import TOKEN, Server

from sparkrl.client import ClientError, parse_assignments
from sparkrl.services.common.settings import BusSettings, ControlSettings
from sparkrl.services.control.app import create_app

BIG = 20 << 20
LIMIT = "the limit is 65536 bytes (control.max_body_bytes)"
PATCH = "/api/v1/hyperparameters"


@pytest.fixture
def server(bus_settings: BusSettings) -> Iterator[Server]:
    cfg = ControlSettings(token=TOKEN, command_timeout_s=2.0)
    assert cfg.max_body_bytes == 65536  # the default these tests are written for
    with Server(create_app(cfg, bus_settings)) as server:
        yield server


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


def _big_json() -> bytes:
    """20 MB of valid JSON for the route: what used to be parsed, validated and echoed whole."""
    return json.dumps({"lr": 1e-5, "beta": "x" * BIG}).encode()


def _chunks(body: bytes, size: int = 65536) -> Iterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start : start + size]


def _raw(port: int, head: str, body: bytes = b"") -> tuple[int, bytes]:
    """Send `head` (request line and headers) and `body` (which may be less than the headers announce),
    then read the answer: (status, the answer). A socket of our own, because a client library sends the
    whole body before it reads; here a server that waited for the rest would never answer (timeout)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        answer = b""
        while not _complete(answer):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    return int(answer.split(b" ", 2)[1]), answer


def _complete(answer: bytes) -> bool:
    """Whether `answer` holds the headers and as much body as they declare."""
    head, found, body = answer.partition(b"\r\n\r\n")
    if not found:
        return False
    lengths = [
        line.split(b":")[1] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")
    ]
    return len(body) >= int(lengths[0]) if lengths else True


def _head(method: str, path: str, headers: dict[str, str]) -> str:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    return "\r\n".join(lines + [f"{k}: {v}" for k, v in headers.items()]) + "\r\n\r\n"


def test_a_20_mb_body_is_refused_with_and_without_the_token(server: Server) -> None:
    body = _big_json()
    for headers in (_auth(), {}):
        started = time.perf_counter()
        declared = httpx.patch(server.url + PATCH, content=body, headers=headers, timeout=30)
        took = time.perf_counter() - started
        assert declared.status_code == 413, declared.text
        assert LIMIT in declared.json()["detail"] and len(declared.content) < 200
        print(
            f"20 MB with Content-Length, token={bool(headers)}: 413 in {took * 1000:.1f} ms (upload included)"
        )
    # Chunked, no Content-Length: counted as it arrives with the token; without one, not read at all.
    for headers, code in ((_auth(), 413), ({}, 401)):
        started = time.perf_counter()
        chunked = httpx.patch(server.url + PATCH, content=_chunks(body), headers=headers, timeout=30)
        took = time.perf_counter() - started
        assert chunked.status_code == code, chunked.text
        print(f"20 MB chunked, token={bool(headers)}: {code} in {took * 1000:.1f} ms (upload included)")
    counted = httpx.patch(server.url + PATCH, content=_chunks(body), headers=_auth(), timeout=30)
    assert "over 65536 bytes" in counted.json()["detail"]


def test_the_refusal_comes_from_the_headers_and_the_first_64_kb(server: Server) -> None:
    """A declared 20 MB is answered before a byte of it is sent; a chunked one once the cap is passed,
    with the rest of it never sent. Each answer is short."""
    for headers in (_auth(), {}):
        status, answer = _raw(server.port, _head("PATCH", PATCH, headers | {"Content-Length": str(BIG)}))
        assert status == 413 and LIMIT.encode() in answer and len(answer) < 400
    chunk = b"10000\r\n" + b" " * 65536 + b"\r\n"  # 64 KiB in chunked framing
    head = _head("PATCH", PATCH, _auth() | {"Transfer-Encoding": "chunked"})
    status, answer = _raw(server.port, head, chunk * 2)
    assert status == 413 and b"over 65536 bytes" in answer


def test_a_command_without_the_token_is_refused_before_its_body_is_read(server: Server) -> None:
    """Headers that announce a body, and no body: a server that read it would wait for it. `Expect:
    100-continue` is answered with `100 Continue` only once the app reads the body, so the answer is the
    refusal itself."""
    for method, path in (("PATCH", PATCH), ("POST", "/api/v1/pause"), ("POST", "/api/v1/checkpoint")):
        for headers, code in (
            ({}, 401),
            ({"Authorization": "Bearer wrong"}, 403),
            ({"Authorization": "Basic eDp5"}, 401),
        ):
            for length in ({"Content-Length": "60000"}, {"Transfer-Encoding": "chunked"}):
                head = _head(method, path, headers | length | {"Expect": "100-continue"})
                status, answer = _raw(server.port, head)
                assert status == code and answer.startswith(f"HTTP/1.1 {code}".encode()), answer[:200]
        _, answer = _raw(server.port, _head(method, path, {"Content-Length": "9"}))
        assert b"www-authenticate: Bearer" in answer
    # With the token the same request is read: the body arrives and is answered on its merits.
    status, answer = _raw(server.port, _head("PATCH", PATCH, _auth() | {"Content-Length": "2"}), b"{}")
    assert status == 422 and b"at least one" in answer


def test_a_422_does_not_echo_the_input(server: Server) -> None:
    long = "y" * 60_000
    for body in ({"lr": long}, {"lr": [long]}, {long: 1}, {"lr": {"a": long}}):
        refused = httpx.patch(server.url + PATCH, json=body, headers=_auth())
        assert refused.status_code == 422 and "y" * 500 not in refused.text and len(refused.content) < 1000
        assert all(set(error) == {"type", "loc", "msg"} for error in refused.json()["detail"])
    reason = httpx.post(server.url + "/api/v1/pause", json={"reason": long}, headers=_auth())
    assert reason.status_code == 422 and "y" * 500 not in reason.text
    assert reason.json()["detail"][0]["msg"] == "String should have at most 500 characters"
    # Thousands of bad keys within the cap: the first errors, then how many more.
    many = httpx.patch(server.url + PATCH, json={f"k{i}": 0 for i in range(6000)}, headers=_auth())
    detail = many.json()["detail"]
    assert many.status_code == 422 and len(detail) == 21 and len(many.content) < 4000
    assert detail[-1] == {
        "type": "too_many_errors",
        "loc": ["body"],
        "msg": "and 5980 more errors like these",
    }
    # The bound checks' own 422 (values that parsed) carries no input either.
    bound = httpx.patch(server.url + PATCH, json={"lr": 1e9}, headers=_auth())
    assert bound.status_code == 422 and set(bound.json()["detail"][0]) == {"type", "loc", "msg"}


def test_live_values_are_strict_numbers_with_a_meaningful_lr_floor(server: Server) -> None:
    def refusal(body: dict[str, object]) -> tuple[list[object], str]:
        response = httpx.patch(server.url + PATCH, json=body, headers=_auth())
        assert response.status_code == 422, response.text
        [error] = response.json()["detail"]
        return error["loc"], error["msg"]

    assert refusal({"lr": "0.001"}) == (
        ["body", "lr"],
        "Input should be a number, not a string: send it unquoted",
    )
    assert refusal({"lr": True}) == (["body", "lr"], "Input should be a number, not true or false")
    assert refusal({"max_staleness": False})[1] == "Input should be a number, not true or false"
    assert refusal({"max_staleness": 4.0})[1] == "Input should be a valid integer"
    loc, msg = refusal({"lr": 1e-320})
    assert loc == ["body", "lr"] and msg.startswith("lr must be ≥ 1e-10: Adam moves each weight by about lr")
    # A JSON integer is a number: the bound, not the type, refuses it.
    assert refusal({"lr": 1})[1].startswith("lr must be ≤ 0.1")
    # Values that pass reach the targets' check: nothing is running here, so 409 (nothing sent).
    for body in ({"lr": 1e-10}, {"temperature": 1}, {"max_staleness": 3}):
        assert httpx.patch(server.url + PATCH, json=body, headers=_auth()).status_code == 409, body


def test_sparkrl_set_sends_numbers(server: Server) -> None:
    numbers = parse_assignments(["lr=2e-6", "max_staleness=3", "top_p=1"])
    assert numbers == {"lr": 2e-6, "max_staleness": 3, "top_p": 1}  # YAML would leave `2e-6` a string
    for bad in ("lr=true", "lr=fast", "lr=nan"):
        with pytest.raises(ClientError, match="lr="):
            parse_assignments([bad])
    command = [sys.executable, "-m", "sparkrl.cli", "set", "lr=2e-6", "max_staleness=3"]
    done = subprocess.run(
        [*command, "--url", server.url, "--token", TOKEN],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    # Through the types and the bounds to the target check: no learner runs here.
    assert done.returncode == 1 and "HTTP 409" in done.stderr, done.stderr
    assert "no live learner" in done.stderr


def test_other_requests_are_answered_while_big_bodies_arrive(server: Server) -> None:
    """Uploads of 20 MB (chunked, with the token, so counted; and without it) run while /healthz, a read
    and a command are asked for; each is answered as usual."""
    body = _big_json()
    uploads: list[int] = []

    def upload(headers: dict[str, str]) -> None:
        for _ in range(3):
            response = httpx.patch(server.url + PATCH, content=_chunks(body), headers=headers, timeout=30)
            uploads.append(response.status_code)

    threads = [threading.Thread(target=upload, args=(h,)) for h in (_auth(), {})]
    for thread in threads:
        thread.start()
    latencies = []
    while any(thread.is_alive() for thread in threads):
        started = time.perf_counter()
        assert httpx.get(server.url + "/healthz").status_code == 200
        assert httpx.get(server.url + "/api/v1/status").status_code == 200
        assert httpx.patch(server.url + PATCH, json={"lr": 1e-5}, headers=_auth()).status_code == 409
        latencies.append(time.perf_counter() - started)
    for thread in threads:
        thread.join()
    assert sorted(uploads) == [401] * 3 + [413] * 3
    if latencies:
        # In-process, sharing the GIL with the uploads: bench/control_limits.py's figure is the fair one.
        worst = max(latencies) * 1000
        print(f"healthz + status + patch during the uploads: {len(latencies)} rounds, worst {worst:.0f} ms")
