"""Experiment tracking (`learner.tracking`): each step row to TensorBoard, wandb and/or MLflow, beside
`metrics.jsonl` (which stays the record). A tracker that fails is reported once and dropped: tracking
never stops training.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import yaml

from sparkrl.proto import StepMetrics
from sparkrl.services.common.bus._text import mask_password
from sparkrl.services.common.settings import TrackingSettings

log = logging.getLogger("sparkrl.learner")


# The other roles' sections a run is compared by (sampling, data, evaluation, reward), each from the file of
# the service that owns it (`sparkrl up` writes RUN_DIR/config/<service>.yaml).
_OWNERS = {
    "rollout": "worker-*.yaml",
    "prompts": "prompts.yaml",
    "eval": "evaluator.yaml",
    "reward": "reward.yaml",
}


def tracked_config(config: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """What the trackers record as the run's config: the learner's settings, without its secrets (the
    Redis password, `sync.secret`), and the other roles' sections that `sparkrl up` wrote beside it
    (RUN_DIR/config/*.yaml: the workers' sampling, the prompts, eval): the learner reads only its own part,
    but a run is compared by all of it."""
    tracked = {**config}
    if isinstance(bus := tracked.get("bus"), dict) and isinstance(bus.get("url"), str):
        tracked["bus"] = {**bus, "url": mask_password(bus["url"])}
    if isinstance(sync := tracked.get("sync"), dict) and sync.get("secret") is not None:
        tracked["sync"] = {**sync, "secret": "***"}
    for section, owner in _OWNERS.items():
        for path in sorted((run_dir / "config").glob(owner))[:1]:
            try:
                written = yaml.safe_load(path.read_text())
            except (OSError, yaml.YAMLError):
                continue
            if isinstance(written, dict) and isinstance(written.get(section), dict):
                tracked.setdefault(section, written[section])
    return tracked


def _scalars(row: StepMetrics) -> dict[str, float]:
    values = {name: float(v) for name, v in row.metrics.items() if v is not None}
    lr = row.hparams.get("lr")
    if isinstance(lr, (int, float)) and not isinstance(lr, bool):
        values["hparams/lr"] = float(lr)
    return values


class _TensorBoard:
    def __init__(self, run_dir: Path, settings: TrackingSettings, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, run_dir: Path, settings: TrackingSettings, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(
            project=settings.project,
            dir=str(run_dir),
            mode=settings.wandb_mode,
            name=run_dir.name,
            config=config,
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, run_dir: Path, settings: TrackingSettings, config: dict[str, Any]) -> None:
        from mlflow.tracking import MlflowClient

        uri = settings.mlflow_uri or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 keeps its file store only on request; it is the one that needs no database here.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(settings.project)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(settings.project)
        )
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
        for key, value in _flat(config).items():
            self.client.log_param(self.run_id, key, str(value)[:500])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(name, value, 0, step) for name, value in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


BACKENDS = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _Mlflow}


class Tracker:
    """`log(row)` to every configured backend; `close()` at the end of the run."""

    def __init__(self, settings: TrackingSettings, run_dir: Path, config: dict[str, Any]) -> None:
        self.backends: dict[str, Any] = {}
        for name in settings.to:
            try:
                self.backends[name] = BACKENDS[name](run_dir, settings, config)
            except ImportError as exc:
                raise RuntimeError(
                    f"learner.tracking.to names {name}, which is not installed ({exc}): pip install "
                    "'sparkrl[tracking]' (keep torch==2.13.0 on the line)"
                ) from exc
            log.info("tracking step rows to %s", name)

    def log(self, row: StepMetrics) -> None:
        values = _scalars(row)
        for name, backend in list(self.backends.items()):
            try:
                backend.log(row.step, values)
            except Exception:  # a tracker's failure must cost the tracking, never the run
                log.exception("tracking to %s failed: it is off for the rest of the run", name)
                del self.backends[name]

    def close(self) -> None:
        for name, backend in self.backends.items():
            try:
                backend.close()
            except Exception:
                log.exception("closing the %s tracker failed", name)
        self.backends = {}
