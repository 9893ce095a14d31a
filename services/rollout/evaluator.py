"""The in-training evaluator (`sparkrl evaluator`, started by `sparkrl up` when `eval.every` is set): one
process, one loop. It follows the learner's weight announcements like a rollout worker that never joins a
broadcast: every `eval.every` versions it loads the newest snapshot the learner wrote, evaluates it on
held-out problems (`services/common/tasks/evaluation.py`), scores the answers through the reward service's
verifiers over HTTP, and writes one `EvalRecord` to the telemetry and to `RUN_DIR/eval.jsonl`.

The learner never waits for it: it reads the snapshot the learner writes anyway — from disk when it shares
the run directory (`sparkrl up`, a compose volume), else over the learner's weight-file HTTP server and
verified against the announced checksum (a Kubernetes Deployment) — and when an evaluation takes longer
than `every` steps it skips to the newest version rather than falling behind. It lives beside the rollout
worker because it drives the same engine and reads the same announcements.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial
from pathlib import Path

import httpx

from sparkrl.proto import EvalRecord, Prompt, WeightAnnouncement
from sparkrl.proto.reward import RewardItem
from sparkrl.services.common.bus import BusStopping, RedisBus
from sparkrl.services.common.modeling import chat_format_at_start
from sparkrl.services.common.reward_client import RewardClient
from sparkrl.services.common.settings import PromptSettings, SamplingSettings, TorchEngineSettings
from sparkrl.services.common.settings.roles import EvaluatorConfig
from sparkrl.services.common.tasks.datasets import file_prompts
from sparkrl.services.common.tasks.evaluation import EvalResult, evaluate_engine, heldout_countdown
from sparkrl.services.common.telemetry import Telemetry
from sparkrl.services.common.weight_sync.files import FetchFailed
from sparkrl.services.rollout.agent_loop import EpisodeRun
from sparkrl.services.rollout.announcements import AnnouncementGate
from sparkrl.services.rollout.batch import episode_results
from sparkrl.services.rollout.catch_up import catch_up, model_dir_for
from sparkrl.services.rollout.episode_eval import evaluate_episodes
from sparkrl.services.rollout.install import VersionInstaller
from sparkrl.services.rollout.remote_env import EnvironmentUnavailable, RemoteSession
from sparkrl.services.rollout.torch_engine import TorchEngine

log = logging.getLogger("sparkrl.evaluator")

EVAL_FILE = "eval.jsonl"


def eval_tasks(cfg: EvaluatorConfig) -> list[Prompt]:
    """The problems every evaluation of this run uses."""
    if cfg.eval.task == "countdown":
        return heldout_countdown(cfg.eval.problems, cfg.prompts.countdown)
    data = PromptSettings(
        task=cfg.eval.task, path=cfg.eval.path, count=cfg.eval.problems, template=cfg.prompts.template
    )
    data.prompt_field, data.answer_field = cfg.prompts.prompt_field, cfg.prompts.answer_field
    return list(file_prompts(data))


class Evaluator:
    """`step()` evaluates the newest version when it is due; `close()` releases engine, bus and client."""

    def __init__(self, cfg: EvaluatorConfig, stop: threading.Event) -> None:
        self.cfg, self.settings = cfg, cfg.eval
        if self.settings.every is None:
            raise ValueError("the evaluator needs eval.every (evaluate every N policy versions)")
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.bus = RedisBus(cfg.bus, stop)  # told to stop while Redis is down, it stops reconnecting
        self.telemetry = Telemetry(self.bus)
        self.gate = AnnouncementGate(self.bus, cfg.sync.secret, self.run_dir)
        self.rewards = RewardClient(cfg.reward.url)  # no stop: the final evaluation runs after it
        self.tasks = eval_tasks(cfg)
        model = model_dir_for(
            cfg.model, self.run_dir, self.gate, cfg.sync.secret, cfg.rollout.model_wait_s, stop
        )
        try:  # prompts rendered and ended as the workers' are; what the model cannot do stops us here
            log.info("%s", chat_format_at_start(model, cfg.rollout.prompt_format, cfg.rollout.eos_tokens))
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        self.engine = TorchEngine(
            model,
            TorchEngineSettings(threads=self.settings.threads, max_batch_sequences=256),
            eos_tokens=cfg.rollout.eos_tokens,
        )
        self.installer = VersionInstaller(self.engine, model)  # a LoRA run's snapshots are adapters
        self.evaluated: int | None = None  # the last version evaluated

    def step(self) -> bool:
        """One look at the announcements; True when it evaluated a version."""
        if self.evaluated is None:  # the initial model: the curve's first point
            self._evaluate()
            return True
        announcement = self.gate.latest()
        if announcement is None or announcement.version < self.evaluated + self.settings.every:
            return False
        if announcement.snapshot_path is None and announcement.files_url is None:
            log.warning("version %d has no snapshot to read: nothing to evaluate", announcement.version)
            self.evaluated = announcement.version
            return False
        # The file may hold a newer version than announced, or (sync.snapshot_every > 1) the one we hold.
        if self._load(announcement) is None:
            return False
        self._evaluate()
        return True

    def finish(self) -> None:
        """The newest snapshot, when it is newer than the last evaluated (the run's final point)."""
        announcement = self.gate.latest()
        if announcement is not None and self._load(announcement) is not None:
            self._evaluate()

    def _load(self, announcement: WeightAnnouncement) -> int | None:
        """The announced snapshot, from disk or over HTTP; None when there is nothing newer to load."""
        try:
            return catch_up(self.installer, announcement, self.gate, self.cfg.sync.secret)
        except FetchFailed as exc:  # replaced by a newer version meanwhile, or the learner is restarting
            log.info("version %d not loaded (%s); the next announcement is tried", announcement.version, exc)
            return None

    def _evaluate(self) -> None:
        s, agent = self.settings, self.cfg.rollout.agent
        if agent.environment is None:
            result = evaluate_engine(self.engine, self.tasks, self._score, s.n, s.temperature,
                                     s.max_new_tokens, s.seed, progress=False,
                                     fmt=self.cfg.rollout.prompt_format)  # fmt: skip
        else:  # multi-turn: pass@k over episodes, played as the workers play them
            try:
                result = self._episodes()
            except EnvironmentUnavailable as exc:
                log.warning("version %d not evaluated: the environment service failed (%s)",
                            self.engine.policy_version, exc)  # fmt: skip
                self.evaluated = self.engine.policy_version
                return
        version = self.engine.policy_version
        record = _record(result, version)
        self.telemetry.append(record)
        with (self.run_dir / EVAL_FILE).open("a") as file:
            file.write(record.model_dump_json() + "\n")
        self.evaluated = version
        log.info("version %d: pass@1 %.3f, pass@%d %.3f, greedy %.3f (%.1fs)", version, result.pass_at[1],
                 s.n, result.pass_at[s.n], result.greedy, result.seconds)  # fmt: skip

    def _episodes(self) -> EvalResult:
        s, agent = self.settings, self.cfg.rollout.agent
        sampled = SamplingSettings(n=s.n, temperature=s.temperature, max_new_tokens=s.max_new_tokens,
                                   topk_logprobs=1, seed=s.seed)  # fmt: skip
        with httpx.Client() as http:
            remote = None if agent.url is None else partial(RemoteSession, http, agent.url, agent.environment)
            return evaluate_episodes(
                self.engine, self.tasks, self._score_episodes, agent, self.cfg.rollout.prompt_format,
                sampled, remote,
            )  # fmt: skip

    def _score_episodes(self, tasks: list[Prompt], episodes: list[list[EpisodeRun]]) -> list[bool]:
        """Whether each episode solved its problem: what would train on it has full marks."""
        items = [
            RewardItem(task=t.task, completion=run.answer, answer=t.answer, task_data=t.task_data)
            for t, runs in zip(tasks, episodes, strict=True)
            for run in runs
        ]
        verdicts = self.rewards.score(items) if items else []
        results = episode_results(verdicts, episodes, self.cfg.rollout.agent.reward)
        return [result.status == "correct" for result in results]

    def _score(self, tasks: list[Prompt], texts: list[str]) -> list[bool]:
        items = [
            RewardItem(task=t.task, completion=text, answer=t.answer, task_data=t.task_data)
            for t, text in zip(tasks, texts, strict=True)
        ]
        return [result.status == "correct" for result in self.rewards.score(items)]

    def close(self) -> None:
        self.engine.close()
        self.rewards.close()
        self.bus.close()


def _record(result: EvalResult, version: int) -> EvalRecord:
    return EvalRecord(
        policy_version=version,
        time=time.time(),
        task=result.task,
        problems=result.problems,
        n=result.n,
        temperature=result.temperature,
        greedy=result.greedy,
        pass_at={str(k): v for k, v in result.pass_at.items()},
        seconds=result.seconds,
    )


def main(cfg: EvaluatorConfig, stop: threading.Event) -> None:
    """Evaluate until `stop` is set (a signal, or the launcher stopping the stack). Without `eval.every`
    (a deployment that runs the evaluator whatever the preset says) it only waits for its stop signal."""
    if cfg.eval.every is None:
        log.info("eval.every is not set in this run's settings: nothing to evaluate; idle until stopped")
        stop.wait()
        return
    evaluator = Evaluator(cfg, stop)
    try:
        while not stop.is_set():
            if not evaluator.step():
                stop.wait(cfg.eval.poll_s)
        if cfg.eval.final:
            evaluator.finish()
    except BusStopping as exc:
        log.warning("stopping without Redis (%s): no final evaluation", exc)
    finally:
        evaluator.close()
