"""The live page before anything has happened: a worker still loading its model, or waiting for the first
broadcast while the learner starts, is said to join at the next broadcast (not flagged red), and the
held-out chart of a run without an evaluator says so instead of "waiting for steps…" forever. A real
control service over a private redis-server, the workers' own heartbeat messages, headless Chromium."""

from __future__ import annotations

import time

import pytest
from test_control_api import TOKEN, Server
from test_control_page import CHROMIUM, browser, wait_for  # noqa: F401  (fixture)

from sparkrl.proto import WorkerStatus
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import BusSettings, ControlSettings
from sparkrl.services.common.telemetry import Telemetry
from sparkrl.services.control.app import create_app

pytestmark = pytest.mark.slow


def _loading(worker_id: str) -> WorkerStatus:
    return WorkerStatus(
        worker_id=worker_id,
        engine="torch",
        state="starting",
        tokens_per_s=0.0,
        groups_published=0,
        prompts_in_flight=0,
        temperature=1.0,
        top_p=1.0,
        heartbeat_at=time.time(),
    )


def test_a_starting_run_is_not_flagged(browser, bus_settings: BusSettings) -> None:  # noqa: F811
    with (
        RedisBus(bus_settings) as bus,
        Server(create_app(ControlSettings(token=TOKEN), bus_settings)) as server,
    ):
        telemetry = Telemetry(bus)
        telemetry.put_worker(_loading("worker-0"), ttl_s=120)
        page = browser.new_page()
        try:
            page.goto(server.url + "/")
            row = page.locator("tr[data-worker=worker-0]")
            wait_for(page, "worker-0's row", lambda: row.count() == 1, 30)
            assert row.locator(".note").text_content() == "joins at the next broadcast"
            assert "flagged" not in (row.get_attribute("class") or "")
            # The charts are drawn after the tables, at the end of the same poll: waited for, not assumed.
            chart = "#charts [data-chart=heldout]"
            wait_for(
                page, "the held-out chart", lambda: page.get_attribute(chart, "data-empty") is not None, 30
            )
            assert "the evaluator runs when eval.every is set" in (
                page.get_attribute(chart, "data-empty") or ""
            )
        finally:
            page.close()
