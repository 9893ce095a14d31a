"""Experiment tracking: step rows reach TensorBoard (read back by tensorboard's own event reader), wandb
(offline: its run files) and MLflow (a file store, read back by MLflow's client). Nothing leaves the
machine: wandb is offline, MLflow writes files, and the end-to-end run uses TensorBoard."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import clean_env

from sparkrl.proto import StepMetrics
from sparkrl.services.common.settings import TrackingSettings
from sparkrl.services.learner.tracking import Tracker

ROOT = Path(__file__).resolve().parents[1]


def _rows() -> list[StepMetrics]:
    return [
        StepMetrics(
            step=step,
            policy_version=step,
            time=1.0,
            metrics={"rollout/reward_mean": step / 10, "loss/entropy": 1.0 - step / 10, "loss/kl_ref": None},
            hparams={"lr": 1e-4 * step, "loss": "lp_reg"},
        )
        for step in (1, 2, 3)
    ]


def _tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_wandb_and_mlflow_get_every_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what the tracker sets for its file store
    tracker = Tracker(
        TrackingSettings(to=["tensorboard", "wandb", "mlflow"], project="t"), tmp_path, {"a": 1}
    )
    for row in _rows():
        tracker.log(row)
    tracker.close()

    scalars = _tensorboard_scalars(tmp_path / "tensorboard")
    assert [s for s, _ in scalars["rollout/reward_mean"]] == [1, 2, 3]
    assert [round(v, 6) for _, v in scalars["rollout/reward_mean"]] == [0.1, 0.2, 0.3]
    assert [round(v, 8) for _, v in scalars["hparams/lr"]] == [1e-4, 2e-4, 3e-4]
    assert "loss/kl_ref" not in scalars  # not measured: not written as a number

    offline = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1 and offline[0].stat().st_size > 0

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    history = client.get_metric_history(run.info.run_id, "loss/entropy")
    assert [(m.step, round(m.value, 6)) for m in history] == [(1, 0.9), (2, 0.8), (3, 0.7)]
    assert run.data.params["a"] == "1" and run.info.status == "FINISHED"


@pytest.mark.slow
def test_a_run_writes_tensorboard_events_with_its_step_metrics(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "sparkrl.cli", "up", "--preset", "smoke", "--run-dir", str(run_dir)]
    command += ["--set", f"model={tiny_model_dir}", "--set", "learner.tracking.to=[tensorboard]"]
    env = clean_env()
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scalars = _tensorboard_scalars(run_dir / "tensorboard")
    assert [s for s, _ in scalars["rollout/reward_mean"]] == [r["step"] for r in rows] == [1, 2, 3]
    for name in ("rollout/reward_mean", "loss/entropy", "time/step_seconds"):
        # A metric a step did not measure is not written (`loss/entropy` when every token of the step was
        # skipped: all its groups scored alike), so TensorBoard holds the steps that have it, each once.
        measured = [(r["step"], r["metrics"][name]) for r in rows if r["metrics"].get(name) is not None]
        written = scalars.get(name, [])
        assert [s for s, _ in written] == [s for s, _ in measured], name
        assert [v for _, v in written] == pytest.approx([v for _, v in measured], rel=1e-6), name


def test_the_tracked_config_has_the_whole_run_and_no_secret(tmp_path: Path) -> None:
    """The learner reads only its own settings, but a tracked run is compared by all of them: the workers'
    sampling, the prompts, eval and reward come from the files `sparkrl up` wrote; the Redis password and
    the weight-sync secret never leave the machine."""
    from sparkrl.plan import plan_stack, write_configs
    from sparkrl.services.common.settings import load_settings
    from sparkrl.services.common.settings.roles import LearnerConfig
    from sparkrl.services.learner.tracking import tracked_config

    secret = "a-weight-sync-secret-long-enough-0123456789"
    tree = load_settings(
        "demo",
        [f"run_dir={tmp_path}", "rollout.sampling.temperature=0.7", f"sync.secret={secret}", "eval.every=5"],
    )
    plan = plan_stack(tree, workers=1)
    write_configs(plan)
    learner = next(spec.config for spec in plan.services if spec.role == "learner")
    assert isinstance(learner, LearnerConfig) and learner.sync.secret == secret
    tracked = tracked_config(learner.model_dump(mode="json"), tmp_path)
    assert (
        tracked["rollout"]["sampling"]["temperature"] == 0.7
        and tracked["learner"]["lr"] == learner.learner.lr
    )
    assert {"prompts", "eval", "reward"} <= set(tracked) and tracked["eval"]["every"] == 5
    password = urlsplit(learner.bus.url).password
    assert password and password not in json.dumps(tracked) and secret not in json.dumps(tracked)
