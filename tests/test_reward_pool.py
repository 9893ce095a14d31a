"""The verifier pool: a stuck item times out, its process is replaced, the others keep running."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sparkrl.services.reward.pool import VerifierPool
from sparkrl.services.reward.verifiers import VerifyFn, load_custom_verifiers, registry


def sleep_forever(
    completion: str, answer: str | None, task_data: dict[str, Any] | None
) -> tuple[float, str, str]:
    """A custom verifier that never returns: only a kill ends it."""
    while True:
        time.sleep(3600)


def sleep_a_second(
    completion: str, answer: str | None, task_data: dict[str, Any] | None
) -> tuple[float, str, str]:
    """A custom verifier that takes a second, then says correct: a slow item well within its limit."""
    time.sleep(1.0)
    return 1.0, "correct", "slept a second"


def die_now(completion: str, answer: str | None, task_data: dict[str, Any] | None) -> tuple[float, str, str]:
    """A custom verifier whose process dies mid-item (as a segfault or the OOM killer would)."""
    os._exit(3)


def _verifiers() -> dict[str, VerifyFn]:
    """The built-ins plus this module's verifiers, loaded by path as `custom_verifiers` would be."""
    names = load_custom_verifiers([f"{__name__}:sleep_forever", f"{__name__}:die_now"])
    assert names == ["sleep_forever", "die_now"]
    return registry()


@pytest.fixture(scope="module")
def pool() -> Iterator[VerifierPool]:
    verifier_pool = VerifierPool(2, _verifiers())
    verifier_pool.start()
    yield verifier_pool
    verifier_pool.close()


def test_stuck_item_times_out_and_pool_recovers(pool: VerifierPool) -> None:
    before = pool.stats()
    stuck = pool.submit("sleep_forever", "x", None, None, timeout_s=3.0)
    # Submitted after the stuck item: they run on the other process and finish before its deadline.
    normal = [pool.submit("math", f"so \\boxed{{{n}}}", str(n), None, timeout_s=10.0) for n in range(4)]
    assert [f.result(timeout=30).status for f in normal] == ["correct"] * 4
    assert not stuck.done(), "the other process should not wait for the stuck one"

    result = stuck.result(timeout=30)
    assert (result.status, result.score) == ("timeout", 0.0)
    assert 3.0 <= result.elapsed_s < 5.0
    assert "3s limit" in result.detail

    after_timeout = pool.stats()
    assert after_timeout.timeouts == before.timeouts + 1
    assert after_timeout.restarts == before.restarts + 1
    assert after_timeout.alive == 2
    # Both processes serve again: more items than processes, all scored.
    again = [pool.submit("math", "\\boxed{\\frac{1}{2}}", "0.5", None, timeout_s=10.0) for _ in range(4)]
    assert [f.result(timeout=30).status for f in again] == ["correct"] * 4


def test_dead_process_is_an_error_and_replaced(pool: VerifierPool) -> None:
    before = pool.stats()
    result = pool.submit("die_now", "x", None, None, timeout_s=10.0).result(timeout=30)
    assert (result.status, result.score) == ("error", 0.0)
    assert "died" in result.detail and "exit code 3" in result.detail
    after = pool.stats()
    assert (after.crashes, after.restarts) == (before.crashes + 1, before.restarts + 1)
    assert pool.submit("math", "\\boxed{7}", "7", None, timeout_s=10.0).result(timeout=30).status == "correct"


def test_submit_rejects_unknown_task(pool: VerifierPool) -> None:
    with pytest.raises(KeyError, match=r"unknown task 'nope'.*math"):
        pool.submit("nope", "x", None, None, timeout_s=1.0)


def test_lambda_verifier_is_refused() -> None:
    with pytest.raises(ValueError, match="module-level function"):
        VerifierPool(1, {"anon": lambda c, a, d: (1.0, "correct", "")})


def test_close_fails_queued_items_and_stops_workers() -> None:
    verifier_pool = VerifierPool(1, _verifiers())
    verifier_pool.start()
    stuck = verifier_pool.submit("sleep_forever", "x", None, None, timeout_s=60.0)
    queued = verifier_pool.submit("math", "\\boxed{1}", "1", None, timeout_s=60.0)
    time.sleep(0.2)  # let the slot pick up the stuck item
    started = time.monotonic()
    verifier_pool.close()
    assert time.monotonic() - started < 5.0
    assert queued.result(timeout=5).status == "error"
    assert stuck.result(timeout=5).status == "error"
    assert verifier_pool.stats().alive == 0
    with pytest.raises(RuntimeError, match="not running"):
        verifier_pool.submit("math", "\\boxed{1}", "1", None, timeout_s=1.0)
