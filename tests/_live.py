"""A live stack for the control-plane tests: the product's launcher starts the real services (private
redis-server, control service, reward service, DeepSpeed learner, two rollout workers, the feeder) from
resolved configs; the tests talk to it over HTTP like a user would.

Import the fixtures into a test module (`from _live import live_stack, tiny_model_dir`: pytest looks a
fixture up by name in the module, so the one `live_stack` needs comes too); each module gets its own stack.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from _tiny import tiny_model_dir  # noqa: F401  (fixture)

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.plan import StackPlan
from sparkrl.services.common.settings import load_settings


@dataclass
class Live:
    plan: StackPlan
    stack: Stack
    url: str  # the control service's base URL
    token: str

    @property
    def run_dir(self) -> Path:
        return self.plan.run_dir

    def headers(self, token: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token or self.token}"}

    def get(self, path: str, **params: Any) -> Any:
        response = httpx.get(self.url + path, params=params, headers=self.headers(), timeout=30)
        response.raise_for_status()
        return response.json()

    def send(self, method: str, path: str, body: Any = None, token: str | None = "") -> httpx.Response:
        """A mutating call; `token=None` sends no Authorization header, "" the right token."""
        headers = {} if token is None else self.headers(token or None)
        return httpx.request(method, self.url + path, json=body, headers=headers, timeout=60)

    def wait(self, what: str, condition: Callable[[], bool], timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}\n{self.logs()}")
            time.sleep(0.3)

    def logs(self, lines: int = 15) -> str:
        return "\n".join(
            f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
            for log in sorted((self.run_dir / "logs").glob("*.log"))
        )

    def step(self) -> int:
        return int(self.get("/api/v1/status")["step"])


@pytest.fixture(scope="module")
def live_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:  # noqa: F811
    """The whole stack, running until the module's tests are done (a run that never ends by itself)."""
    run_dir = tmp_path_factory.mktemp("live") / "run"
    cfg = load_settings(
        "smoke",
        [
            f"model={tiny_model_dir}",
            f"run_dir={run_dir}",
            "learner.max_steps=100000",
            "learner.checkpoint_every=1000",
            "learner.max_staleness=1000",  # nothing is dropped, however long a pause
            "prompts.count=20000",
            "bus.trajectory_maxlen=16",  # workers wait for the learner instead of racing far ahead
            "control.command_timeout_s=60",
            "eval.every=5",  # the in-training evaluator, small: held-out points on the page
            "eval.problems=16",
            "eval.n=2",
        ],
    )
    plan = plan_stack(cfg, workers=2, private_redis=True)
    write_configs(plan)
    stack = Stack(plan, ready_timeout_s=180)
    live = Live(plan, stack, plan.settings.control.url, plan.token_path.read_text().strip())
    try:
        stack.start()
        # Both workers too: a fast learner steps before the second worker has registered, and a command
        # sent then would reach one worker only.
        live.wait(
            "the first step and both workers live",
            lambda: live.step() >= 1 and live.get("/api/v1/status")["workers_live"] == 2,
            timeout_s=240,
        )
        yield live
    finally:
        stack.shutdown()
