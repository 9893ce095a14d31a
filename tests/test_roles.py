"""Each role its own settings: `sparkrl up` writes each service a file holding only its role's sections,
which loads back into that role's config (directly, and through the tree as the role commands load it);
a whole tree still gives every role its part. And the one setting a worker reads of the learner's,
`max_staleness`, arrives as a typed field of the learner's status, not a string key."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from sparkrl.plan import plan_stack, write_configs
from sparkrl.proto import LearnerStatus
from sparkrl.services.common.settings import LearnerSettings, load_settings
from sparkrl.services.common.settings.roles import (
    ROLE_CONFIGS,
    PromptsConfig,
    RolloutConfig,
    for_role,
)
from sparkrl.services.learner.heartbeat import LearnerReport, StatusSource
from sparkrl.services.learner.state import TrainState
from sparkrl.services.rollout.worker import too_stale

# The sections each role's file holds: what its service reads, nothing more.
SECTIONS = {
    "control": {"bus", "control"},
    "reward": {"reward"},
    "learner": {"model", "run_dir", "bus", "sync", "learner"},
    "rollout": {"model", "run_dir", "bus", "sync", "rollout", "reward"},
    "evaluator": {"model", "run_dir", "bus", "sync", "eval", "prompts", "reward", "rollout"},
    "prompts": {"model", "bus", "prompts", "rollout"},
}


@pytest.fixture(autouse=True)
def _no_sparkrl_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # load_settings lets SPARKRL_* override a file; these tests compare files with what was written.
    for key in [k for k in os.environ if k.startswith("SPARKRL_")]:
        monkeypatch.delenv(key)


def test_each_role_file_holds_only_its_sections_and_loads_back(tmp_path: Path) -> None:
    tree = load_settings("demo", [f"run_dir={tmp_path}", "eval.every=2", "learner.max_steps=7"])
    plan = plan_stack(tree, workers=2)
    write_configs(plan)
    roles = {spec.role for spec in plan.services}
    assert roles == {"redis", *SECTIONS}
    for spec in plan.services:
        if spec.role == "redis":
            continue
        written = yaml.safe_load(spec.config_path.read_text())
        assert set(written) == SECTIONS[spec.role], spec.name
        config_type = ROLE_CONFIGS[spec.role]
        assert config_type.model_validate(written) == spec.config  # the role's config, as it is
        # As `sparkrl <role> --preset FILE` loads it: through the tree, keeping the role's part.
        assert for_role(load_settings(str(spec.config_path)), spec.role) == spec.config
    by_name = {spec.name: spec.config for spec in plan.services}
    worker = by_name["worker-1"]
    assert isinstance(worker, RolloutConfig) and worker.rollout.worker_id == "worker-1"
    # A client's part of a section that is another service's: the reward URL, not its bind or pool.
    assert yaml.safe_load((tmp_path / "config" / "worker-1.yaml").read_text())["reward"] == {
        "url": plan.settings.reward.url
    }
    # The evaluator's: how long it waits for the model, how the workers render prompts and stop, and
    # how they play episodes (held-out problems of a multi-turn task are episodes too).
    assert yaml.safe_load((tmp_path / "config" / "evaluator.yaml").read_text())["rollout"] == {
        "model_wait_s": plan.settings.rollout.model_wait_s,
        "chat_template": "auto",
        "chat_template_kwargs": {},
        "system_prompt": None,
        "eos_tokens": None,
        "agent": plan.settings.rollout.agent.model_dump(),
    }
    # The services that run once (each named as its role) get exactly their part of the whole tree, as
    # compose and Kubernetes start them from one file.
    for role in ("control", "reward", "learner", "evaluator", "prompts"):
        assert for_role(plan.settings, role) == by_name[role]


def test_a_role_command_keeps_the_feeders_guard_on_the_bus_url() -> None:
    """`sparkrl prompts` writes only into a Redis it was pointed at: its part keeps which fields were set."""
    assert "url" not in PromptsConfig.of(load_settings("demo")).bus.model_fields_set
    pointed = PromptsConfig.of(load_settings("demo", ["bus.url=redis://10.0.0.5:6380/0"]))
    assert "url" in pointed.bus.model_fields_set


def _status(policy_version: int, max_staleness: int | None, **extra: object) -> LearnerStatus:
    return LearnerStatus(
        step=policy_version,
        policy_version=policy_version,
        state="training",
        groups_trained=0,
        group_epoch=0,
        max_staleness=max_staleness,
        heartbeat_at=time.time(),
        **extra,  # type: ignore[arg-type]
    )


def test_the_workers_staleness_check_reads_the_typed_field() -> None:
    # Learner at version 5, max_staleness 2: a group from version 3 is trained (5 - 3 = 2), one from 2 not.
    assert too_stale(_status(5, 2), oldest=2)
    assert not too_stale(_status(5, 2), oldest=3)
    assert too_stale(_status(5, 0), oldest=4)  # exactly on-policy
    # The hyperparameters' string key is not what counts: the typed field is.
    assert not too_stale(_status(5, None, hyperparameters={"max_staleness": 0}), oldest=1)
    assert too_stale(_status(5, 0, hyperparameters={"max_staleness": 100}), oldest=4)
    assert not too_stale(None, oldest=0)  # no learner yet
    assert not too_stale(_status(5, 0), oldest=None)  # a group without tokens


def test_an_older_learner_status_still_reads_and_says_nothing_of_staleness() -> None:
    """A status written before the field (same schema_version) loads, its max_staleness None: the worker
    then publishes every group, as it did when the learner did not say."""
    older = _status(5, 0).model_dump(mode="json")
    del older["max_staleness"]
    status = LearnerStatus.model_validate_json(LearnerStatus.model_validate(older).model_dump_json())
    assert status.max_staleness is None and not too_stale(status, oldest=0)


def test_the_learners_status_carries_the_max_staleness_in_force() -> None:
    cfg = LearnerSettings(max_staleness=3)
    publisher = SimpleNamespace(last_sync=None, epoch=1, members=["w0"], snapshot_failure=None)
    source = StatusSource(publisher, cfg)  # type: ignore[arg-type]
    assert source(LearnerReport(), TrainState()).max_staleness == 3  # before the loop reports
    # A live change (`sparkrl set max_staleness=1`) reaches the status with the hyperparameters in force,
    # which the loop reports each turn.
    assert source(LearnerReport(hparams={"max_staleness": 1}), TrainState()).max_staleness == 1


def test_a_role_command_refuses_another_roles_file(tmp_path: Path) -> None:
    """`sparkrl learner --preset config/worker-0.yaml` would run on the learner section's defaults: refused
    before anything starts, naming whose file it is."""
    import subprocess
    import sys

    plan = plan_stack(load_settings("demo", [f"run_dir={tmp_path}"]), workers=1)
    write_configs(plan)
    worker = next(spec for spec in plan.services if spec.role == "rollout")
    command = [sys.executable, "-m", "sparkrl.cli", "learner", "--preset", str(worker.config_path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKRL_")} | {"COLUMNS": "300"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    said = " ".join(done.stderr.replace("│", " ").split())
    assert done.returncode == 2, done.stderr
    assert f"is {worker.name}'s settings" in said and "`sparkrl learner` needs its own file" in said, said
