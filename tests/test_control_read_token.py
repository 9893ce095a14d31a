"""`control.read_token`: a read-only token. When set, the read routes (status, workers, metrics, weights,
events, evals, the OpenAPI page) answer 401 without a token and 403 with a wrong one; the read token and
the control token both read; only the control token steers."""

from __future__ import annotations

import httpx
from test_control_api import MUTATING, TOKEN, Server

from sparkrl.services.common.settings import BusSettings, ControlSettings
from sparkrl.services.control.app import create_app

READ_TOKEN = "viewer-token"
READS = ("/api/v1/status", "/api/v1/workers", "/api/v1/weights", "/api/v1/metrics", "/api/v1/evals")


def test_read_routes_need_the_read_token_when_it_is_set(bus_settings: BusSettings) -> None:
    cfg = ControlSettings(token=TOKEN, read_token=READ_TOKEN)
    with Server(create_app(cfg, bus_settings)) as server:
        for path in READS:
            assert httpx.get(server.url + path).status_code == 401, path
            assert httpx.get(server.url + path, headers={"Authorization": "Bearer nope"}).status_code == 403
            for token in (READ_TOKEN, TOKEN):
                answer = httpx.get(server.url + path, headers={"Authorization": f"Bearer {token}"})
                assert answer.status_code == 200, (path, answer.text)
        events = httpx.get(server.url + "/api/v1/events", params={"timeout_s": 0.5})
        assert events.status_code == 401
        viewer = {"Authorization": f"Bearer {READ_TOKEN}"}
        for method, path, body in MUTATING:  # a viewer cannot steer
            assert httpx.request(method, server.url + path, json=body, headers=viewer).status_code == 403
        schema = httpx.get(server.url + "/openapi.json")
        assert schema.status_code == 401
        schema = httpx.get(server.url + "/openapi.json", headers=viewer)
        assert schema.status_code == 200 and "/api/v1/status" in schema.json()["paths"]
        assert httpx.get(server.url + "/docs").status_code == 404  # a browser page could not send the token
        assert httpx.get(server.url + "/healthz").status_code == 200  # probes stay open
        assert httpx.get(server.url + "/metrics").status_code == 200  # Prometheus scrapes without a token


def test_without_a_read_token_reads_stay_open(bus_settings: BusSettings) -> None:
    with Server(create_app(ControlSettings(token=TOKEN), bus_settings)) as server:
        assert httpx.get(server.url + "/api/v1/status").status_code == 200
        assert httpx.get(server.url + "/openapi.json").status_code == 200
        assert httpx.get(server.url + "/docs").status_code == 200
