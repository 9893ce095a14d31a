"""A service's /metrics endpoint, and the learner's last scrape: Prometheus pulls, so what the learner
changes after its last scrape (the run's last step, its last broadcast) never reaches the dashboard unless
the learner waits for one more scrape before it exits. A real HTTP server and client; the end-to-end test
runs the real stack (`sparkrl up`'s launcher, private redis-server) with a poller standing in for
Prometheus."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from _faults import settings, wait
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import free_port, start_stack
from prometheus_client import CollectorRegistry, Gauge

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.services.common.metrics_server import MetricsServer
from sparkrl.services.common.settings import MetricsEndpoint


class Served:
    """A MetricsServer on a free loopback port over a registry with one gauge, `value`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.value = Gauge("value", "the value a scrape reads", registry=self.registry)
        endpoint = MetricsEndpoint(host="127.0.0.1", port=free_port())
        self.server = MetricsServer(endpoint, self.registry, lambda: {"status": "ok"})
        self.server.start()

    def get(self, path: str = "/metrics") -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.server.port}{path}", timeout=10) as answer:
            return answer.read().decode()

    def scraped_value(self) -> float:
        found = re.search(r"^value (\S+)$", self.get(), re.M)
        assert found is not None
        return float(found[1])


@pytest.fixture
def served() -> Iterator[Served]:
    served = Served()
    yield served
    served.server.close()


def test_nobody_scraping_means_no_wait(served: Served) -> None:
    """Never scraped, or scraped once (a person's curl): the learner exits at once."""
    assert served.server.await_last_scrape(30.0) is False
    served.get()
    served.get("/healthz")  # a probe is not a scrape
    assert served.server.scrapes.begun == 1
    assert served.server.await_last_scrape(30.0) is False


def test_the_last_scrape_reads_the_final_values(served: Served) -> None:
    served.get()
    time.sleep(0.3)
    served.get()  # scraped every ~0.3 s: the wait is up to ~0.6 s, not the 30 s cap
    came: list[bool] = []

    def end() -> None:  # the learner's close: the final values, then the wait
        served.value.set(42)
        came.append(served.server.await_last_scrape(30.0))

    ender = threading.Thread(target=end)
    ender.start()
    read: list[float] = []
    while ender.is_alive():  # scraping on, as Prometheus does
        read.append(served.scraped_value())
        time.sleep(0.05)
    assert came == [True] and read[-1] == 42


def test_a_scrape_that_never_comes_ends_the_wait_at_twice_the_interval(served: Served) -> None:
    served.get()
    time.sleep(0.2)
    served.get()
    started = time.monotonic()
    assert served.server.await_last_scrape(60.0) is False
    assert time.monotonic() - started < 30  # bounded by 2 × the interval seen, far below the 60 s cap
    assert served.server.await_last_scrape(0.0) is False  # 0: off


@pytest.mark.slow
def test_the_learner_waits_for_a_last_scrape_so_the_final_step_is_scraped(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    """A run that ends by itself: the last /metrics a poller (every 0.5 s, like Prometheus) read from the
    learner holds its last step and every broadcast, and the learner says it waited."""
    steps = 6
    cfg = settings(tiny_model_dir, tmp_path / "run", f"learner.max_steps={steps}", "prompts.count=64")
    plan = plan_stack(cfg, workers=1, private_redis=True)
    write_configs(plan)
    endpoint = plan.settings.learner.metrics
    url = f"http://{endpoint.host}:{endpoint.port}/metrics"
    reads: list[str | None] = []  # a body, or None: refused (the learner not up yet, or gone)
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            try:
                with urllib.request.urlopen(url, timeout=5) as answer:
                    reads.append(answer.read().decode())
            except OSError:
                reads.append(None)
            done.wait(0.5)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    learner = stack.procs["learner"]
    wait("the learner to finish", lambda: learner.poll() is not None, plan.run_dir, timeout_s=300)
    done.set()
    poller.join(timeout=10)
    assert learner.returncode == 0
    assert any(body is not None for body in reads), "the learner's /metrics never answered"
    first = next(i for i, body in enumerate(reads) if body is not None)
    answered = reads[first : max(i for i, body in enumerate(reads) if body is not None) + 1]
    assert len(answered) >= 2 and None not in answered, "the endpoint refused a scrape while it was up"
    last = answered[-1]
    assert last is not None
    assert re.search(rf"^sparkrl_learner_policy_version {steps}\.0$", last, re.M), last[-2000:]
    assert re.search(rf"^sparkrl_sync_version {steps}\.0$", last, re.M), last[-2000:]
    log = (plan.run_dir / "logs" / "learner.log").read_text(errors="replace")
    assert "for a last scrape of /metrics" in log and "no scrape of /metrics came" not in log
