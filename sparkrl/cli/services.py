"""One command per service, what a container or `sparkrl up` runs: `reward`, `env`, `rollout`,
`control`, `learner`, `evaluator`, and the prompt feeder `prompts`. Each takes a settings file or preset
(its role's file that `sparkrl up` wrote, or a whole tree, as compose and Kubernetes mount) plus `--set`,
and hands its service only its role's part (`services/common/settings/roles.py`). Service imports happen
inside the commands so `sparkrl reward` never loads torch."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import astuple
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from sparkrl.cli.options import WHICH_REDIS, BusRunDir, Overrides, Preset, role_settings
from sparkrl.services.common.logs import setup_logging
from sparkrl.services.common.settings.roles import (
    ControlConfig,
    EnvConfig,
    EvaluatorConfig,
    LearnerConfig,
    PromptsConfig,
    RewardConfig,
    RolloutConfig,
)

if TYPE_CHECKING:
    from sparkrl.services.common.bus import RedisBus
    from sparkrl.services.common.feeder import FeedReport
    from sparkrl.services.common.prompt_limits import PromptLimits

commands = typer.Typer()


@commands.command()
def reward(preset: Preset = None, overrides: Overrides = None) -> None:
    """Run the reward service (FastAPI) on reward.host:reward.port."""
    cfg = RewardConfig.of(role_settings("reward", preset, overrides))
    setup_logging("reward")
    from sparkrl.services.reward.app import main

    main(cfg.reward)


@commands.command()
def env(preset: Preset = None, overrides: Overrides = None) -> None:
    """Run the environment service (FastAPI) on env.host:env.port: episodes' environments over HTTP."""
    cfg = EnvConfig.of(role_settings("env", preset, overrides))
    setup_logging("env")
    from sparkrl.services.env.app import main

    main(cfg.env)


@commands.command()
def rollout(
    preset: Preset = None,
    overrides: Overrides = None,
    worker_id: Annotated[str | None, typer.Option(help="Consumer name; default hostname-pid.")] = None,
) -> None:
    """Run one rollout worker: prompts → n completions → scores → trajectory stream."""
    cfg = RolloutConfig.of(role_settings("rollout", preset, overrides))
    if worker_id is not None:
        cfg.rollout.worker_id = worker_id
    log = setup_logging(f"rollout[{cfg.rollout.worker_id or 'auto'}]")
    from sparkrl.services.common.logs import stop_on_signals
    from sparkrl.services.rollout.service import main

    in_hand = "the decoding step in hand (its batch handed over)" if cfg.rollout.partial.enabled else None
    main(cfg, stop_on_signals(log, in_hand or "the batch in hand"))
    _exit_now()


@commands.command()
def control(preset: Preset = None, overrides: Overrides = None) -> None:
    """Run the control service (REST API, live page, fleet metrics) on control.host:control.port."""
    cfg = ControlConfig.of(role_settings("control", preset, overrides))
    setup_logging("control")
    from sparkrl.services.control.app import main

    try:
        main(cfg)
    except ValueError as exc:  # no token configured: say how to set one
        raise typer.BadParameter(str(exc)) from exc


@commands.command()
def learner(
    preset: Preset = None,
    overrides: Overrides = None,
    resume: Annotated[bool, typer.Option(help="Continue from RUN_DIR/checkpoints/latest.")] = False,
    auto_resume: Annotated[
        bool,
        typer.Option(
            help="Continue when RUN_DIR holds this run's state (a checkpoint or a journal), else start "
            "fresh: for a supervisor that restarts the learner (compose, Kubernetes)."
        ),
    ] = False,
) -> None:
    """Run the learner: trajectory stream → Lp-Reg (or a baseline) under DeepSpeed → weights to the fleet."""
    cfg = LearnerConfig.of(role_settings("learner", preset, overrides))
    rank = os.environ.get("RANK", "0")  # under torchrun (learner.ranks > 1) each rank says which it is
    log = setup_logging("learner" if rank == "0" else f"learner[rank {rank}]")
    from sparkrl.services.common.logs import stop_on_signals
    from sparkrl.services.learner.service import main, run_state

    if auto_resume:
        found = run_state(Path(cfg.run_dir))
        resume = found is not None
        log.info("--auto-resume: %s", f"resuming ({found})" if found else f"a fresh run in {cfg.run_dir}")

    stop = threading.Event()
    # Signals are taken over once the engine is built: until then SIGTERM ends a stuck start at once.
    main(cfg, resume=resume, stop=stop, engine_built=lambda: stop_on_signals(log, "the current step", stop))
    _exit_now()


def _exit_now() -> None:
    """A learner, worker or evaluator ended cleanly: what it writes is written and closed (the learner's
    checkpoint, ended.json, trackers; every service's bus). What the interpreter's finalization would still
    do is tear down torch, transformers, DeepSpeed and gloo — 1-2.4 s a process here, which `sparkrl up`
    waits for between the last step and its exit — and, in a learner while a dead weight-sync
    epoch's teardown runs on its thread (weight_sync/sender.py's `_abort`), let gloo abort the process
    ("terminate called without an active exception", exit code -6). So the logs are flushed and the
    process exits at once."""
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@commands.command()
def evaluator(preset: Preset = None, overrides: Overrides = None) -> None:
    """Run the in-training evaluator: every `eval.every`-th published version on held-out problems."""
    cfg = EvaluatorConfig.of(role_settings("evaluator", preset, overrides))
    log = setup_logging("evaluator")
    from sparkrl.services.common.logs import stop_on_signals
    from sparkrl.services.rollout.evaluator import main

    main(cfg, stop_on_signals(log, "the current evaluation"))
    _exit_now()


@commands.command()
def prompts(
    preset: Preset = None,
    overrides: Overrides = None,
    run_dir: BusRunDir = None,
    epochs: Annotated[
        int | None,
        typer.Option(min=1, help="Passes over the data (default prompts.epochs); later passes get new ids."),
    ] = None,
    watch: Annotated[
        bool,
        typer.Option(help="Stay up after feeding and feed again what a Redis that lost its data took away."),
    ] = False,
) -> None:
    """Feed a dataset (prompts.path) or the countdown generator into the prompt stream of the Redis named by
    --run-dir (a live `sparkrl up`) or bus.url."""
    if run_dir is not None:
        preset = str(run_dir / "config" / "prompts.yaml")
    cfg = PromptsConfig.of(role_settings("prompts", preset, overrides))
    log = setup_logging("prompts")
    if "url" not in cfg.bus.model_fields_set:
        # This command writes: never into a Redis it was not pointed at (6379 may be someone else's).
        raise typer.BadParameter(WHICH_REDIS)
    from sparkrl.services.common.bus._text import mask_password

    log.info("feeding %s into %s (namespace %s)", cfg.prompts.path or "the countdown generator",
             mask_password(cfg.bus.url), cfg.bus.namespace)  # fmt: skip
    _feed(cfg, epochs or cfg.prompts.epochs, watch, log)


def _feed(cfg: PromptsConfig, epochs: int, watch: bool, log: logging.Logger) -> None:
    """Every epoch into the prompt stream, then (with `watch`) again whenever the Redis lost its data. A
    prompt file that cannot be read is one line and exit code 2, with nothing fed and no mark left."""
    from sparkrl.services.common.bus import RedisBus
    from sparkrl.services.common.feeder import feeder_name, mark_feeding, watch_and_refeed
    from sparkrl.services.common.logs import stop_on_signals
    from sparkrl.services.common.ownership import NamespaceOwned, refuse_foreign_owner
    from sparkrl.services.common.prompt_limits import feeder_limits
    from sparkrl.services.common.recovery import ensure_incarnation, warn_if_not_persistent
    from sparkrl.services.common.tasks.datasets import DatasetError, iter_prompts

    if cfg.prompts.path is not None:
        try:  # every row read once first: a bad one (its field missing, row 500) is said before any is fed
            sum(1 for _ in iter_prompts(cfg.prompts))
        except DatasetError as exc:
            log.error("%s", exc)
            raise typer.Exit(2) from exc
    limits = feeder_limits(cfg.rollout, Path(cfg.model))
    if limits.max_tokens is None:
        log.warning("no prompt limit here: %s has no config.json saying its context, and "
                    "rollout.max_prompt_tokens is unset (the workers, which load the model, apply theirs)",
                    cfg.model)  # fmt: skip
    else:
        log.info("prompts over %d characters are %s (%s)", limits.max_chars,
                 "cut" if limits.overlong == "truncate" else "not fed", limits.describe())  # fmt: skip
    name = feeder_name(cfg.prompts, epochs)
    stop = stop_on_signals(log, "feeding")
    with RedisBus(cfg.bus) as bus:
        try:  # a feeder of this run feeds no other run's namespace
            refuse_foreign_owner(bus, cfg.bus.run_id, "the feeder")
        except NamespaceOwned as exc:
            log.error("%s", exc)
            raise typer.Exit(2) from exc
        warn_if_not_persistent(bus)

        def feed_all(skip_trained: bool = False) -> FeedReport:
            mark_feeding(bus, name)
            return _feed_epochs(bus, cfg, epochs, name, skip_trained, stop, limits, log)

        known = ensure_incarnation(bus)  # before feeding: a wipe while the first feed blocks still counts
        feed_all()
        if watch:
            watch_and_refeed(bus, lambda: feed_all(skip_trained=True), stop, known)


def _feed_epochs(
    bus: RedisBus,
    cfg: PromptsConfig,
    epochs: int,
    name: str,
    skip_trained: bool,
    stop: threading.Event,
    limits: PromptLimits,
    log: logging.Logger,
) -> FeedReport:
    """One feed: every epoch, each logged, then this feeder's done mark (unless stopped first)."""
    from sparkrl.services.common.feeder import FeedReport, feed_prompts, mark_fed
    from sparkrl.services.common.tasks.datasets import iter_prompts

    total = FeedReport(0, 0, 0.0)
    for epoch in range(epochs):
        prompts = iter_prompts(cfg.prompts)
        report = feed_prompts(bus, prompts, epoch, skip_trained=skip_trained, stop=stop, limits=limits)
        refused = f", {report.refused} refused (over the prompt limit)" if report.refused else ""
        log.info(
            "epoch %d: %d prompts fed, %d already there%s, %.1fs",
            epoch, report.published, report.duplicates, refused, report.seconds,
        )  # fmt: skip
        total = FeedReport(*(a + b for a, b in zip(astuple(total), astuple(report), strict=True)))
    if not stop.is_set():
        mark_fed(bus, total, epochs, name)  # all of it is in: once every feed is trained, the run is over
    return total
