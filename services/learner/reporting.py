"""What the learner reports, all through `Reports`: each step's row, its heartbeat, the sync events, and
the run's files.

- `step_row` builds the one `StepMetrics` per step (namespaced metrics, the fleet's versions, the
  hyperparameters in force).
- `Heartbeat` (heartbeat.py) re-publishes the learner's status every couple of seconds.
- `RunLog` appends `metrics.jsonl`, `trained_groups.jsonl` (the audit trail of "each group is trained
  once", which the ledger rebuilds the trained marks from) and `weights.jsonl` (the sync history) to the
  run directory, flushed per record: the record of the run for `sparkrl report`, never read back to learn
  the live state.
- `Reports` sends a step row everywhere it goes: those files, the trackers, the telemetry channel,
  Prometheus (metrics.py) and the heartbeat.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from sparkrl.proto import HparamValue, StepMetrics, SyncEvent, TrajectoryGroup, WorkerStatus
from sparkrl.proto.reward import REWARD_STATUSES
from sparkrl.proto.run_files import PromptCounts
from sparkrl.services.common.bus import QueueDepth
from sparkrl.services.common.settings import LearnerSettings
from sparkrl.services.common.telemetry import Telemetry
from sparkrl.services.learner.checkpoint import CheckpointError
from sparkrl.services.learner.dynamic_sampling import equal_rewards
from sparkrl.services.learner.exploration import exploration_stats, spark_tokens
from sparkrl.services.learner.heartbeat import Heartbeat
from sparkrl.services.learner.ledger import Batch
from sparkrl.services.learner.metrics import LearnerMetrics
from sparkrl.services.learner.state import TrainState
from sparkrl.services.learner.tracking import Tracker
from sparkrl.services.learner.version_lag import version_stats

log = logging.getLogger("sparkrl.learner")

TOP_SPARKS = 10  # sparks per step row, the most frequent


def _finite(value: float | None) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


def fleet_timings(workers: Iterable[WorkerStatus]) -> dict[str, float]:
    """The fleet's mean seconds per part of its last batch (`worker_generate`, …), over live workers."""
    parts: dict[str, list[float]] = {}
    for status in workers:
        for part, seconds in status.timings.items():
            parts.setdefault(f"worker_{part}", []).append(seconds)
    return {part: sum(values) / len(values) for part, values in parts.items()}


def step_row(
    batch: Batch,
    stats: dict[str, float],
    state: TrainState,
    seconds: float,
    sync: SyncEvent | None,
    fleet: dict[str, int | None],
    depth: tuple[QueueDepth, QueueDepth],
    hparams: dict[str, HparamValue],
    timings: dict[str, float] | None = None,
    exploration: dict[str, float] | None = None,
    top_sparks: dict[str, int] | None = None,
) -> StepMetrics:
    """The step's row. `stats` are the trainer's (loss statistics); `depth` is (trajectories, prompts);
    `timings` (seconds by part: the learner's, and the fleet's `worker_*`) become `time/<part>_s`;
    `exploration` is exploration.py's `explore/*`."""
    rewards = [r for g in batch.groups for r in g.rewards]
    temperatures = [g.sampling.temperature for g in batch.groups]
    trajectories, prompts = depth
    tokens = stats.get("tokens", 0.0)
    lags = [state.policy_version - v for v in fleet.values() if v is not None]
    metrics: dict[str, float | None] = {
        f"loss/{'value' if name == 'loss' else name}": value
        for name, value in stats.items()
        if name != "tokens"
    }
    metrics |= {
        "rollout/reward_mean": sum(rewards) / max(len(rewards), 1),
        "rollout/groups": float(len(batch.groups)),
        "rollout/tokens": tokens,
        "rollout/staleness_mean": batch.staleness_mean,
        "rollout/dropped_stale": float(batch.dropped_stale),
        "rollout/temperature": sum(temperatures) / max(len(temperatures), 1),
        "sync/seconds": sync.seconds if sync else None,
        "sync/version": float(sync.version) if sync else None,
        "sync/lag_max": float(max(lags)) if lags else None,
        "bus/trajectory_lag": float(trajectories.lag),
        "bus/trajectory_pending": float(trajectories.pending),
        "bus/prompt_lag": float(prompts.lag),
        "time/step_seconds": seconds,
        "time/tokens_per_s": tokens / seconds if seconds > 0 else None,
    }
    metrics["rollout/dropped_stale_total"] = float(state.groups_dropped_stale)
    if state.groups_filtered:  # dynamic sampling: the extra groups this step took to fill its batch
        metrics["rollout/groups_filtered"] = float(batch.filtered)
        metrics["rollout/filtered_share"] = batch.filtered / max(len(batch.groups) + batch.filtered, 1)
        metrics["rollout/groups_filtered_total"] = float(state.groups_filtered)
    metrics["loss/nonfinite_skipped_total"] = float(state.nonfinite_skipped)  # updates not applied
    metrics["checkpoint/failures_total"] = float(state.checkpoint_failures)  # writes that failed, run goes on
    metrics |= status_counts(batch.groups) | length_stats(batch.groups)
    # Trained groups whose rewards were all equal (no gradient): what learner.filter_groups would filter.
    metrics["rollout/groups_uninformative"] = float(sum(equal_rewards(g) for g in batch.groups))
    metrics |= version_stats(batch.groups, state.policy_version - 1)  # the version the step trained against
    metrics |= {f"time/{part}_s": value for part, value in (timings or {}).items()}
    metrics |= exploration or {}
    return StepMetrics(
        step=state.step,
        policy_version=state.policy_version,
        time=time.time(),
        metrics={name: _finite(value) for name, value in metrics.items()},
        worker_versions=fleet,
        hparams=hparams,
        top_sparks=top_sparks or {},
    )


class RunLog:
    """The run's own record, appended and flushed per record."""

    def __init__(self, run_dir: Path) -> None:
        self.metrics = (run_dir / "metrics.jsonl").open("a")
        self.trained = (run_dir / "trained_groups.jsonl").open("a")
        self.weights = (run_dir / "weights.jsonl").open("a")
        self.samples = (run_dir / "samples.jsonl").open("a")
        self._weights_lock = threading.Lock()  # the publisher thread writes sync events

    def write_step(self, row: StepMetrics, state: TrainState) -> None:
        self.metrics.write(row.model_dump_json() + "\n")
        self.metrics.flush()
        self.trained.write(json.dumps({"step": state.step, "group_ids": state.trained_group_ids}) + "\n")
        self.trained.flush()
        loss = row.value("loss/value")
        reward = row.value("rollout/reward_mean") or 0.0
        log.info("step %d: reward %.3f loss %s", row.step, reward, "n/a" if loss is None else f"{loss:.4g}")

    def write_samples(self, rows: list[dict[str, object]]) -> None:
        for row in rows:
            self.samples.write(json.dumps(row, default=str) + "\n")
        self.samples.flush()

    def write_sync(self, event: SyncEvent) -> None:
        with self._weights_lock:
            self.weights.write(event.model_dump_json() + "\n")
            self.weights.flush()

    def close(self) -> None:
        for file in (self.metrics, self.trained, self.weights, self.samples):
            file.close()


ENDED_FILE = "ended.json"
STATUSES = REWARD_STATUSES


def status_counts(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """`rollout/status_<status>`: the step's completions by the reward service's verdict."""
    counts = dict.fromkeys(STATUSES, 0)
    for group in groups:
        for detail in group.reward_details or []:
            if detail is not None and detail.status in counts:
                counts[detail.status] += 1
    return {f"rollout/status_{status}": float(count) for status, count in counts.items()}


def length_stats(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """`rollout/truncated_share`: the step's completions that hit max_new_tokens; with over-long shaping,
    `rollout/overlong_penalty_mean` (over every completion) and `rollout/overlong_penalized` (how many got
    a penalty below 0); with episodes (rollout.agent), `rollout/environment_token_share` (of the
    completions' tokens, those the environment wrote), `rollout/model_turns_mean` (per sample: an episode,
    or a part of one split where its template could not extend it) and `rollout/split_samples` (the samples
    that continue a split episode: they start with the re-rendered history, environment tokens)."""
    completions = [c for g in groups for c in g.completions]
    truncated = sum(c.finish_reason == "length" for c in completions)
    stats = {"rollout/truncated_share": truncated / max(len(completions), 1)}
    if any(c.environment_spans for c in completions):
        tokens = sum(c.num_tokens for c in completions)
        stats["rollout/environment_token_share"] = 1 - sum(c.model_tokens for c in completions) / max(
            tokens, 1
        )
        stats["rollout/model_turns_mean"] = sum(len(c.model_turns()) for c in completions) / len(completions)
        stats["rollout/split_samples"] = float(
            sum(bool(c.environment_spans) and c.environment_spans[0][0] == 0 for c in completions)
        )
    penalties = [p for g in groups for p in g.overlong_penalties or ()]
    if penalties:
        stats["rollout/overlong_penalty_mean"] = sum(penalties) / len(penalties)
        stats["rollout/overlong_penalized"] = float(sum(p < 0 for p in penalties))
    return stats


def sample_rows(
    step: int, groups: list[TrajectoryGroup], count: int, tokenizer: PreTrainedTokenizerBase
) -> list[dict[str, object]]:
    """The first completion of each of the step's first `count` groups, for people to read: prompt (the
    question as fed, and `rendered_prompt`: what the model saw, its prompt token ids decoded with the
    special tokens — chat template, system prompt, its variables' effect), completion, its length and how
    it ended, reward = the verifier's score + its over-long penalty (0 without shaping), verdict."""
    rows = []
    for group in groups[:count]:
        if not group.completions:
            continue
        detail = group.reward_details[0] if group.reward_details else None
        completion = group.completions[0]
        rows.append(
            {
                "step": step,
                "group_id": group.group_id,
                "prompt": group.prompt.text if group.prompt.text is not None else group.prompt.messages,
                "rendered_prompt": tokenizer.decode(
                    group.prompt_token_ids.tolist(), skip_special_tokens=False
                ),
                "completion": completion.text,
                "tokens": completion.num_tokens,
                "environment_tokens": completion.num_tokens - completion.model_tokens,
                "finish_reason": completion.finish_reason,
                "reward": group.rewards[0],
                "score": detail.score if detail is not None else None,
                "overlong_penalty": group.overlong_penalties[0] if group.overlong_penalties else 0.0,
                "status": detail.status if detail is not None else None,
                "detail": detail.detail if detail is not None else None,
            }
        )
    return rows


def write_ended(run_dir: Path, reason: str, step: int, prompts: PromptCounts | None = None) -> None:
    """Why the run ended (`learner.max_steps` reached, the data ran out, a stop command, a signal), for
    the launcher's summary; `prompts`: how the prompts fed ended, when the data ran out."""
    ended: dict[str, object] = {"reason": reason, "step": step, "time": time.time()}
    if prompts is not None:
        ended["prompts"] = prompts.model_dump()
    # Written whole or not at all (a full disk must not leave half a file), and a failure is said, not
    # raised: the rest of the close (the last status, the last broadcast) still runs.
    path, tmp = run_dir / ENDED_FILE, run_dir / f".{ENDED_FILE}.tmp"
    try:
        tmp.write_text(json.dumps(ended))
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        log.error("%s could not be written (%s); the run ended: %s", path, exc, reason)


@dataclass(frozen=True)
class StepTaken:
    """A step as the loop took it, for its row."""

    batch: Batch  # the groups it trained
    stats: dict[str, float]  # the updates' statistics (stats.Updated.row): the row's loss/*
    seconds: float  # the step's wall time
    timings: dict[str, float]  # seconds by part (waits, the update's parts, copy, bookkeeping, publish)
    hparams: dict[str, HparamValue]  # in force for it
    acked: int  # stream entries acknowledged with it


@dataclass
class Reports:
    """Where the learner's account of itself goes: each step's row (`step`), its phase and hyperparameters
    (the heartbeat), each sync event (`sync`), checkpoints and commands (Prometheus)."""

    telemetry: Telemetry
    heartbeat: Heartbeat
    metrics: LearnerMetrics
    run_log: RunLog
    tokenizer: PreTrainedTokenizerBase  # the sparks' text
    tracker: Tracker | None = None  # learner.tracking's backends

    def step(
        self, took: StepTaken, state: TrainState, sync: SyncEvent | None, cfg: LearnerSettings
    ) -> StepMetrics:
        """The step's row (`took`, after `state` counted it; `sync`: the last broadcast), written and sent
        everywhere."""
        batch = took.batch
        depth = (self.telemetry.bus.pending_info("trajectories"), self.telemetry.bus.pending_info("prompts"))
        fleet = self.telemetry.live_workers()
        row = step_row(
            batch,
            took.stats,
            state,
            took.seconds,
            sync,
            {w: s.policy_version for w, s in fleet.items()},
            depth,
            took.hparams,
            took.timings | fleet_timings(fleet.values()),
            exploration_stats(batch.groups, cfg.proxy_kappa),
            self.top_sparks(batch),
        )
        self.run_log.write_step(row, state)
        self.run_log.write_samples(
            sample_rows(state.step, batch.groups, cfg.samples_per_step, self.tokenizer)
        )
        if self.tracker is not None:
            self.tracker.log(row)
        self.telemetry.append(row)
        self.metrics.observe_step(row, len(batch.groups), took.acked)
        self.heartbeat.update(row=row)
        return row

    def top_sparks(self, batch: Batch) -> dict[str, int]:
        """The step's most frequent sparks, by their text."""
        top: dict[str, int] = {}
        for token_id, count in spark_tokens(batch.groups).most_common(TOP_SPARKS):
            text = self.tokenizer.decode([token_id])  # two ids may decode alike: their counts add up
            top[text] = top.get(text, 0) + count
        return top

    def turn(self, paused: bool, hparams: dict[str, HparamValue]) -> None:
        """At each turn of the loop: training or paused, with the hyperparameters in force."""
        self.heartbeat.update(phase="paused" if paused else "training", hparams=hparams)
        self.metrics.paused.set(float(paused))

    def phase(self, phase: str) -> None:
        self.heartbeat.update(phase=phase)

    @contextmanager
    def checkpointing(self) -> Iterator[None]:
        """Around a checkpoint's write: its phase, and its failure counted."""
        previous = self.heartbeat.report.phase
        self.heartbeat.update(phase="checkpointing")
        try:
            yield
        except CheckpointError as exc:
            self.metrics.checkpoint_failures.inc()
            self.heartbeat.update(checkpoint_failure=str(exc)[:1000])  # on the page until one is written
            raise
        finally:
            self.heartbeat.update(phase=previous)

    @property
    def last_checkpoint(self) -> str | None:
        return self.heartbeat.report.last_checkpoint

    def checkpointed(self, path: Path) -> None:
        self.metrics.checkpoints.inc()
        self.heartbeat.update(last_checkpoint=str(path), checkpoint_failure=None)

    def disk_failure(self, why: str) -> None:
        """The run's disk stopped it: on the status and the page (the last beat carries it)."""
        self.heartbeat.update(disk_failure=why[:2000])

    def published(self) -> None:
        """Before a command is answered: the status shows what it changed (bounded; a Redis that is down
        only delays the answer by the heartbeat's flush timeout)."""
        self.heartbeat.flush()

    def close(self) -> None:
        """The last beat (`stopped`), then the files and the trackers."""
        self.heartbeat.update(phase="stopped")
        self.heartbeat.close()
        self.run_log.close()
        if self.tracker is not None:
            self.tracker.close()
