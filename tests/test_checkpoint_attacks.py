"""A checkpoint tag must not delete a run, and no disk or file may kill one (issue 28), on the real stack
(`sparkrl up`'s launcher, private redis-server, HTTP, DeepSpeed, two workers):

- every traversal form of a tag, through the REST API and the CLI, is refused with a 4xx and the run's
  files are unchanged (checksummed); tagged checkpoints are pruned like the periodic ones;
- a full disk (a real tmpfs under `checkpoints/`, as root) fails the periodic checkpoints while training
  goes on, the failure in the step rows and on the status the page reads; once there is room the run
  finishes, every group trained once;
- a corrupt latest checkpoint: `--resume` names it, sets it aside, falls back to the one before and
  replays the journal from there; every group trained once, `ended.json` this run's;
- a start that fails while loading writes `ended.json` (an earlier run's reason never stays).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _faults import assert_exactly_once, kill9, settings, steps_done, wait
from _live import Live
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from _tmpfs import tmpfs
from conftest import start_stack
from test_checkpoint_folder import TRAVERSALS, corrupt

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.run_files import read_steps
from sparkrl.services.learner.checkpoint_folder import held, latest_checkpoint

pytestmark = pytest.mark.slow

PER_STEP = 4


def fingerprint(run_dir: Path) -> dict[str, str | bytes]:
    """Every file under `run_dir` but the logs and Redis' own files (a paused run still writes heartbeats):
    its sha256, a link's target, and an append-only record file's (`*.jsonl`) whole content."""
    out: dict[str, str | bytes] = {}
    for dirpath, dirnames, filenames in os.walk(run_dir):
        rel = Path(dirpath).relative_to(run_dir)
        if rel.parts[:1] in (("logs",), ("redis",)):
            continue
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            key = str(rel / name)
            if path.is_symlink():
                out[key] = "-> " + os.readlink(path)
            elif path.is_file():
                data = path.read_bytes()
                out[key] = data if name.endswith(".jsonl") else hashlib.sha256(data).hexdigest()
    return out


def assert_unchanged(before: dict[str, str | bytes], after: dict[str, str | bytes]) -> None:
    """Nothing removed or rewritten; an append-only record may only have grown (a broadcast that ends
    during the pause still writes its line to weights.jsonl)."""
    assert sorted(after) == sorted(before), set(after) ^ set(before)
    for key, old in before.items():
        new = after[key]
        if isinstance(old, bytes) and isinstance(new, bytes):
            assert new.startswith(old), f"{key} was rewritten"
        else:
            assert new == old, f"{key} changed"


def live(plan: object, stack: Stack) -> Live:
    return Live(plan, stack, plan.settings.control.url, plan.token_path.read_text().strip())  # type: ignore[attr-defined]


def test_every_traversal_form_is_refused_and_the_run_is_untouched(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    cfg = settings(
        tiny_model_dir,
        tmp_path / "run",
        "learner.max_steps=400",
        f"learner.prompts_per_step={PER_STEP}",
        "learner.checkpoint_every=2",
        "learner.keep_tagged_checkpoints=2",
    )
    plan = plan_stack(cfg, workers=2, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    run = live(plan, stack)
    wait("a checkpoint", lambda: latest_checkpoint(plan.run_dir) is not None, plan.run_dir)
    assert run.send("POST", "/api/v1/pause", {"reason": "traversal probes"}).status_code == 200
    run.wait("the learner to pause", lambda: run.get("/api/v1/status")["state"] == "paused")
    before = fingerprint(plan.run_dir)
    assert any(name.startswith("checkpoints/step-") for name in before)

    bodies = [{"tag": tag} for tag in TRAVERSALS] + [{"tag": [".."]}, {"tag": {"x": ".."}}, {"tag": 5}]
    for body in bodies:
        for token in ("", None):  # with the token: 422; without: 401 (the body never reaches a parser)
            answer = run.send("POST", "/api/v1/checkpoint", body, token=token)
            assert answer.status_code == (422 if token == "" else 401), (
                body,
                answer.status_code,
                answer.text,
            )
    assert "a" * 129 not in run.send("POST", "/api/v1/checkpoint", {"tag": "a" * 129}).text, "input echoed"
    escaped = httpx.post(  # '..' spelled as JSON escapes
        run.url + "/api/v1/checkpoint",
        content=b'{"tag": "\\u002e\\u002e"}',
        headers=run.headers() | {"Content-Type": "application/json"},
        timeout=30,
    )
    assert escaped.status_code == 422, escaped.text
    cli = [sys.executable, "-m", "sparkrl.cli", "checkpoint", "--run-dir", str(plan.run_dir), "--tag"]
    for tag in (".", "..", "../..", "a/b", "latest", "step-000001", ".hidden", "-rf"):
        done = subprocess.run([*cli, tag], capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and "Invalid value for --tag" in done.stderr, (tag, done.stderr)
    assert_unchanged(before, fingerprint(plan.run_dir))

    # Plain tags work, and the tagged ones are pruned (keep_tagged_checkpoints=2), the newest kept.
    for tag in ("t1", "t2", "t3"):
        answer = run.send("POST", "/api/v1/checkpoint", {"tag": tag})
        assert answer.status_code == 200 and answer.json()["outcome"] == "applied", answer.text
    tagged = sorted(h.path.name for h in held(plan.run_dir / "checkpoints") if h.tagged)
    assert tagged == ["t2", "t3"]
    assert latest_checkpoint(plan.run_dir) == plan.run_dir / "checkpoints" / "t3"


@pytest.fixture
def small_checkpoint_disk(tmp_path: Path) -> Iterator[Path]:
    """RUN_DIR/checkpoints on a real 8 MiB tmpfs (one of the stack's 5.9 MB checkpoints fits, two do not)."""
    with tmpfs(tmp_path / "run" / "checkpoints", "8m") as where:
        yield where


def test_a_full_disk_fails_checkpoints_training_goes_on_and_the_run_finishes(
    small_checkpoint_disk: Path,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    steps = 14
    cfg = settings(
        tiny_model_dir,
        tmp_path / "run",
        f"learner.max_steps={steps}",
        f"learner.prompts_per_step={PER_STEP}",
        "learner.checkpoint_every=2",
        f"prompts.count={steps * PER_STEP}",
    )
    plan = plan_stack(cfg, workers=2, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    run = live(plan, stack)

    def failures() -> float:
        rows = read_steps(plan.run_dir).rows
        return rows[-1].metrics.get("checkpoint/failures_total") or 0.0 if rows else 0.0

    wait("a checkpoint to fail on the full disk", lambda: failures() >= 1, plan.run_dir)
    shown = run.get("/api/v1/status")["checkpoint_failure"]
    assert shown is not None and "could not be written" in shown, shown
    # The failed write left no partial folder (the next step's checkpoint may be under way meanwhile: its
    # own `.partial-` folder is not the failed one's).
    failed = re.search(r"step-\d+", shown)
    assert failed is not None, shown
    hidden = [p.name for p in small_checkpoint_disk.iterdir() if p.name.startswith(".")]
    assert not [name for name in hidden if name.endswith(failed.group())], hidden
    log = (plan.run_dir / "logs" / "learner.log").read_text()
    assert "the next one will likely fail" in log  # the space check warned before the write
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_checkpoint_disk)], check=True)
    learner = stack.procs["learner"]
    wait("the learner to finish", lambda: learner.poll() is not None, plan.run_dir, timeout_s=300)
    assert learner.returncode == 0
    assert_exactly_once(plan, steps)
    ended = json.loads((plan.run_dir / "ended.json").read_text())
    assert ended["reason"] == f"learner.max_steps ({steps}) reached"
    assert read_steps(plan.run_dir).rows[-1].metrics["checkpoint/failures_total"] >= 1


def test_a_corrupt_latest_checkpoint_resumes_from_the_one_before(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    stacks: list[Stack],
) -> None:
    steps = 12
    cfg = settings(
        tiny_model_dir,
        tmp_path / "run",
        f"learner.max_steps={steps}",
        f"learner.prompts_per_step={PER_STEP}",
        "learner.checkpoint_every=2",
        f"prompts.count={steps * PER_STEP}",
    )
    plan = plan_stack(cfg, workers=2, private_redis=True)
    write_configs(plan)
    stack = start_stack(stacks, Stack(plan, ready_timeout_s=180))
    wait("step 7", lambda: steps_done(plan.run_dir) >= 7, plan.run_dir)
    kill9(stack, "learner")
    (plan.run_dir / "ended.json").write_text(json.dumps({"reason": "an earlier run's reason", "step": 1}))
    newest = latest_checkpoint(plan.run_dir)
    assert newest is not None
    corrupt(newest)

    again = plan_stack(plan.settings.model_copy(deep=True), workers=2, private_redis=False, resume=True)
    resumed = start_stack(stacks, Stack(again, services=["learner"], ready_timeout_s=180))
    wait("the resumed learner", lambda: resumed.procs["learner"].poll() is not None, plan.run_dir, 300)
    assert resumed.procs["learner"].returncode == 0
    log = (plan.run_dir / "logs" / "learner.log").read_text()
    assert f"checkpoint {newest} does not load" in log and "set aside to" in log
    aside = list((plan.run_dir / "checkpoints" / "set-aside").iterdir())
    assert [p.name.rsplit("-", 2)[0] for p in aside] == [newest.name]
    assert_exactly_once(plan, steps)
    ended = json.loads((plan.run_dir / "ended.json").read_text())
    assert ended["reason"] == f"learner.max_steps ({steps}) reached"


def test_a_start_that_fails_while_loading_writes_ended_json(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    broken = tmp_path / "model"
    broken.mkdir()
    (broken / "config.json").write_text("{ not json")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model_dir / name).is_file():
            (broken / name).write_bytes((tiny_model_dir / name).read_bytes())
    run_dir = tmp_path / "run"
    cfg = settings(tiny_model_dir, run_dir, f"model={broken}")
    plan = plan_stack(cfg, workers=1, private_redis=True)
    write_configs(plan)
    (run_dir / "ended.json").write_text(json.dumps({"reason": "an earlier run's reason", "step": 3}))
    learner_config = run_dir / "config" / "learner.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "sparkrl.cli", "learner", "--preset", str(learner_config)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    reason = json.loads((run_dir / "ended.json").read_text())["reason"]
    assert reason.startswith("the learner failed to start: "), reason
