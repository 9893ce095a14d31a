"""Issue 49's faults inside a real run (private redis-server, a worker, the reward service, the DeepSpeed
learner, the control service): the run's reward comes from an LLM judge on loopback that answers some
items, answers others with garbage, keeps others at 429, is slower than the deadline for others (each
item's fate fixed by its text, so a retry meets the same judge), and then goes down altogether. Every
failure is a named status, the run goes on to its last step, every group is trained once, a failed item
trains with its group's scored mean (advantage 0), never as a silent 0, and the page's judge panel (the
workers view) counts what the judge spent and how it failed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from _endpoints import Endpoint
from _faults import assert_exactly_once, settings, steps_done, wait
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import start_stack
from test_judge_stack import _questions, _workers_judge

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.proto import decode_group
from sparkrl.proto.reward import UNSCORED
from sparkrl.services.learner.ledger import Journal

pytestmark = pytest.mark.slow

DEADLINE_S = 1.5
STEPS = 6
JUDGE_DOWN_AT = 2  # the judge goes down once this many steps are done


def _fate(body: dict[str, Any]) -> tuple[int, Any, float]:
    """The judge's answer to an item, by its text: a grade, garbage, 429 every time, or too late."""
    text = body["messages"][0]["content"]
    kind = hashlib.blake2b(text.encode(), digest_size=2).digest()[0] % 4
    return [
        (200, f"Grade: {len(text) % 11}", 0.0),  # scored: 0..10 on the default scale
        (200, "I would rather not grade this.", 0.0),  # unparseable
        (429, {"error": "rate limited"}, 0.0),  # error after reward.judge.retries
        (200, "Grade: 10", DEADLINE_S + 1.5),  # timeout
    ][kind]


def test_a_judge_that_fails_every_way_then_goes_down_costs_signal_never_a_silent_zero(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    judge = Endpoint()
    judge.choose = _fate
    run_dir = tmp_path / "run"
    cfg = settings(
        tiny_model_dir,
        run_dir,
        f"prompts.path={_questions(tmp_path / 'questions.jsonl', 64)}",
        "prompts.task=judge",
        f"reward.judge.url={judge.url}",
        f"reward.judge.deadline_s={DEADLINE_S}",
        "reward.judge.retries=2",
        "reward.judge.backoff_s=0.1",
        f"learner.max_steps={STEPS}",
        "learner.checkpoint_every=1000",  # the journal keeps every step's groups until the final checkpoint
    )
    plan = plan_stack(cfg, workers=1, private_redis=True)
    write_configs(plan)
    start_stack(stacks, Stack(plan, ready_timeout_s=180))
    wait(f"step {JUDGE_DOWN_AT}", lambda: steps_done(run_dir) >= JUDGE_DOWN_AT, run_dir)
    judge.server.shutdown()  # down: nothing listens any more
    judge.server.server_close()
    wait(f"step {STEPS - 1}", lambda: steps_done(run_dir) >= STEPS - 1, run_dir)
    spent = _workers_judge(run_dir)
    journal = Journal(run_dir)
    groups = [decode_group(e.payload) for step in journal.steps() for e in journal.read(step)]
    wait("the run's end", lambda: (run_dir / "ended.json").is_file(), run_dir)

    history = assert_exactly_once(plan, STEPS, queued_ok=True)  # the run went on, every group once
    assert len(groups) >= len(history.steps[1])
    details = [(g, d) for g in groups for d in g.reward_details or []]
    seen = {d.status for _, d in details}
    assert {"unparseable", "error", "timeout"} <= seen and seen & {"correct", "incorrect"}, seen
    said = " ".join(d.detail for _, d in details)
    assert "after 2 retries: HTTP 429" in said and "past reward.judge.deadline_s (1.5s)" in said
    assert "no score in the judge's reply" in said and "ConnectError" in said  # the judge down
    for group in groups:  # a failed item trains with its group's scored mean: no gradient, no silent 0
        scored = [r for r, d in zip(group.rewards, group.reward_details or [], strict=True)
                  if d.status not in UNSCORED]  # fmt: skip
        neutral = sum(scored) / len(scored) if scored else 0.0
        for reward, detail in zip(group.rewards, group.reward_details or [], strict=True):
            if detail.status in UNSCORED:
                assert reward == pytest.approx(neutral), (group.group_id, group.rewards)
    rows = [json.loads(line)["metrics"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for status in ("unparseable", "error", "timeout"):  # each step row counts them
        assert sum(row[f"rollout/status_{status}"] for row in rows) > 0, status
    # The page's judge panel: what the judge spent on the worker's groups, its failures by kind.
    assert len(spent) == 1, spent
    (tally,) = spent
    assert tally["calls"] > 0 and tally["tokens"] > 0 and tally["seconds"] > 0, tally
    assert all(tally["items"].get(status, 0) > 0 for status in ("unparseable", "error", "timeout")), tally
