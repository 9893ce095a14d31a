"""The control service's live page, driven in headless Chromium during a real run: it shows the step and
the workers' versions advancing, pauses and resumes the run from its buttons, and takes a screenshot of
itself (`SPARKRL_UPDATE_SCREENSHOT=1` also writes it to `docs/control-page.png`, which the README shows).

Skipped without `/usr/bin/chromium` or the `playwright` package (never `playwright install`: the test uses
the system's Chromium).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _live import Live, live_stack  # noqa: F401  (fixture)
from _tiny import tiny_model_dir  # noqa: F401  (live_stack's own fixture: pytest looks it up here)

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

CHROMIUM = Path("/usr/bin/chromium")
# Without the background-networking flags Chromium's own connections fail on a closed network.
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "control-page.png"
STILL_S = 5.0  # how long a paused run must hold its step

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    # Before `live_stack` in the test's arguments: a skip here starts no stack.
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} is missing (Debian: apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright package is not importable (pip install playwright)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


def wait_for(page: Page, what: str, condition: Callable[[], Any], timeout_s: float) -> Any:
    """Poll `condition` (through the page, so its events keep flowing) until it is truthy."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}; #message: {message(page)!r}")
        page.wait_for_timeout(300)
    return value


def message(page: Page) -> str:
    return page.text_content("#message") or ""


def page_step(page: Page) -> int:
    text = (page.text_content("#step") or "").strip()
    assert re.fullmatch(r"\d+", text), f"#step must hold only the step number, got {text!r}"
    return int(text)


def worker_version(page: Page, worker: str) -> int:
    """The version the worker's row shows; -1 while it holds its initial weights."""
    text = (page.text_content(f"tr[data-worker={worker}] .version") or "").strip()
    return int(text) if text.isdigit() else -1


def chart_points(page: Page, chart: str) -> int:
    return int(page.get_attribute(f"#charts [data-chart={chart}]", "data-points") or 0)


def test_control_page_drives_a_live_run(browser: Browser, live_stack: Live, tmp_path: Path) -> None:  # noqa: F811
    live = live_stack
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        page.goto(live.url + "/")
        page.fill("#token", live.token)
        page.click("#save-token")
        wait_for(page, "the token to be saved", lambda: "saved" in message(page), 10)
        assert page.evaluate("localStorage.getItem('sparkrl.control.token')") == live.token

        # Live: the step and each worker's version advance.
        first = wait_for(page, "a step on the page", lambda: page_step(page), 30)
        wait_for(page, f"the step to pass {first}", lambda: page_step(page) > first, 60)
        for worker in ("worker-0", "worker-1"):
            row = page.locator(f"tr[data-worker={worker}]")
            wait_for(page, f"{worker}'s row", lambda row=row: row.count() == 1, 30)
            was = worker_version(page, worker)
            wait_for(
                page,
                f"{worker}'s version to pass {was}",
                lambda w=worker, v=was: worker_version(page, w) > v,
                90,
            )
        assert page.text_content("#state") == "training"

        # The picture for the README: training, with the charts holding a few steps.
        wait_for(page, "10 steps in the charts", lambda: chart_points(page, "reward") >= 10, 90)
        page.wait_for_timeout(1500)  # one more poll: every panel drawn from the same moment
        assert chart_points(page, "sparks") >= 10  # the exploration telemetry is drawn too
        wait_for(page, "two held-out points", lambda: chart_points(page, "heldout") >= 2, 60)
        shot = tmp_path / "control-page.png"
        page.screenshot(path=str(shot), full_page=True)
        data = shot.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{shot} is not a PNG"
        assert 20_000 < len(data) < 10_000_000, f"{shot}: {len(data)} bytes"
        if os.environ.get("SPARKRL_UPDATE_SCREENSHOT") == "1":  # refresh the README's picture on request only
            SCREENSHOT.parent.mkdir(exist_ok=True)
            SCREENSHOT.write_bytes(data)

        # Pause: the page says so, and neither it nor the API moves on.
        page.click("#pause")
        wait_for(page, "#state to say paused", lambda: page.text_content("#state") == "paused", 90)
        assert page.is_visible("#paused-badge")
        wait_for(page, "the pause's answer", lambda: "pause: applied" in message(page), 60)
        wait_for(page, "the page to catch up", lambda: page_step(page) == live.step(), 10)
        held = live.step()
        until = time.monotonic() + STILL_S
        while time.monotonic() < until:
            assert page_step(page) == held, "the page's step moved while paused"
            assert live.step() == held, "the API's step moved while paused"
            assert page.text_content("#state") == "paused"
            page.wait_for_timeout(500)
        assert (page_step(page), live.step()) == (held, held), "the step moved during the pause"

        # Resume: training again, and the step moves on.
        page.click("#resume")
        wait_for(page, "#state to say training", lambda: page.text_content("#state") == "training", 90)
        wait_for(page, f"the step to pass {held}", lambda: page_step(page) > held, 90)
        wait_for(page, "the resume's answer", lambda: "resume: applied" in message(page), 60)
        assert not page.is_visible("#paused-badge")
        assert not errors, f"errors on the page: {errors}"
    finally:
        page.close()
