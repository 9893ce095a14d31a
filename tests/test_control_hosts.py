"""The control service answers only to its own names (DNS rebinding could otherwise read its open routes):
a request whose Host header is another name gets 400 naming `control.allowed_hosts`. Over real HTTP, the
service served as its `main` serves it; and the names the deploy files reach it by are accepted."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
import yaml
from conftest import free_port

from sparkrl.services.common import asgi_server
from sparkrl.services.common.settings import BusSettings, ControlSettings
from sparkrl.services.control.app import create_app
from sparkrl.services.control.hosts import HostCheck, host_of, own_names

TOKEN = "hosts-test-token"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def control(bus_settings: BusSettings) -> Iterator[str]:
    """The control service on a loopback port, reached by its clients as `control` (its url, as under
    compose), and by any name under example.org."""
    port = free_port()
    cfg = ControlSettings(
        token=TOKEN, port=port, url="http://control:8200", allowed_hosts=[".example.org", "ops.internal"]
    )
    server = uvicorn.Server(
        asgi_server.config(create_app(cfg, bus_settings), "127.0.0.1", port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def _status(url: str, path: str, host: str, method: str = "GET") -> httpx.Response:
    headers = {"Host": host, "Authorization": f"Bearer {TOKEN}"}
    return httpx.request(method, url + path, headers=headers, timeout=10)


@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "evil.example:8200",
        "control.evil.example",
        "example.org.evil.example",
        "notexample.org",
        "",
    ],
)
def test_a_request_by_another_name_is_a_400_naming_the_setting(control: str, host: str) -> None:
    for method, path in [
        ("GET", "/api/v1/status"),
        ("GET", "/healthz"),
        ("GET", "/"),
        ("POST", "/api/v1/pause"),
    ]:
        answer = _status(control, path, host, method)
        assert answer.status_code == 400, (method, path, answer.text)
        assert "control.allowed_hosts" in answer.json()["detail"]


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",  # the bound host, with or without its port
        "127.0.0.1:{port}",
        "localhost:{port}",
        "LocalHost",
        "[::1]:{port}",  # any address: a rebinding goes through a name, never an address
        "10.1.2.3:8200",  # a pod's address (a kubelet probe, a Prometheus scrape by pod IP)
        "control:8200",  # the host of control.url
        "control.",
        "example.org",  # `.example.org`: the domain and every name under it
        "a.b.example.org:443",
        "ops.internal",
    ],
)
def test_the_service_answers_to_its_own_names(control: str, host: str) -> None:
    port = control.rsplit(":", 1)[1]
    answer = _status(control, "/healthz", host.format(port=port))
    assert answer.status_code == 200, answer.text


def test_the_names_it_knows_without_being_told() -> None:
    bound_everywhere = ControlSettings(host="0.0.0.0", url="http://control:8200")
    assert own_names(bound_everywhere) == {"localhost", "control", socket.gethostname().lower()}
    assert own_names(ControlSettings(host="ctl.lan", url="http://127.0.0.1:8200")) == {
        "localhost",
        "ctl.lan",
        "127.0.0.1",
    }
    assert HostCheck(lambda *a: None, own_names(ControlSettings()), ["*"]).accepts("anything.at.all")  # type: ignore[arg-type]
    assert [host_of(h) for h in ("a:1", "a", "[::1]:80", "::1", "[fe80::1]")] == [
        "a",
        "a",
        "::1",
        "::1",
        "fe80::1",
    ]


def _checks(control_section: dict[str, object]) -> HostCheck:
    cfg = ControlSettings.model_validate(control_section)
    return HostCheck(lambda *a: None, own_names(cfg), cfg.allowed_hosts)  # type: ignore[arg-type]


@pytest.mark.parametrize("preset", ["deploy/k8s/base/sparkrl.yaml", "deploy/k8s/overlays/gpu/sparkrl.yaml"])
def test_kubernetes_reaches_it_by_its_service_names(preset: str) -> None:
    check = _checks(yaml.safe_load((ROOT / preset).read_text())["control"])
    names = [
        "control:8200",
        "control.sparkrl:8200",
        "control.sparkrl.svc",
        "control.sparkrl.svc.cluster.local",
    ]
    assert all(check.accepts(host_of(name)) for name in names)
    assert check.accepts("localhost") and check.accepts("10.244.0.7")  # a port-forward, a probe
    assert not check.accepts("control.sparkrl.svc.evil.example")


def test_compose_reaches_it_by_its_service_name() -> None:
    wiring = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["x-sparkrl"]["environment"]
    check = _checks({"host": wiring["SPARKRL_CONTROL__HOST"], "url": wiring["SPARKRL_CONTROL__URL"]})
    assert check.accepts("control") and check.accepts("127.0.0.1")  # the network's name, the published port
