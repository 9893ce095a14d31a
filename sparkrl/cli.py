"""`sparkrl`: one command per service (what a container runs), the prompt feeder, the tiny model, the
control API's clients and the run report.

Every service command takes the same settings flags: `--preset NAME|FILE` (a YAML from `configs/`, or the
resolved config a launcher wrote), `--set key.path=value` (repeatable), and `SPARKRL_*` environment
variables. Service imports happen inside the commands so `sparkrl reward` never loads torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from sparkrl.services.common.logs import setup_logging
from sparkrl.services.common.settings import SparkSettings, describe_settings_error, load_settings

SUMMARY = (
    "sparkrl: RL from verifiable rewards with Lp-Reg. `sparkrl up --preset demo` runs the whole stack; one "
    "command per service, the control clients, `report` and `eval` for the rest."
)
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, help=SUMMARY)


def _version(value: bool) -> None:
    if value:
        from sparkrl import __version__

        typer.echo(f"sparkrl {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """sparkrl: distributed RL from verifiable rewards with Lp-Reg."""


Preset = Annotated[
    str | None, typer.Option("--preset", "-p", help="configs/<NAME>.yaml, or a path to a YAML settings file.")
]
Overrides = Annotated[
    list[str] | None, typer.Option("--set", "-s", help="Override one setting: key.path=value (repeatable).")
]
BusRunDir = Annotated[
    Path | None, typer.Option("--run-dir", help="Use the Redis of this live `sparkrl up` run directory.")
]


def _settings(preset: str | None, overrides: list[str] | None) -> SparkSettings:
    try:
        return load_settings(preset, overrides)
    except (ValueError, FileNotFoundError) as exc:
        raise typer.BadParameter(describe_settings_error(exc)) from exc


@app.command()
def reward(preset: Preset = None, overrides: Overrides = None) -> None:
    """Run the reward service (FastAPI) on reward.host:reward.port."""
    cfg = _settings(preset, overrides)
    setup_logging("reward")
    from sparkrl.services.reward.app import main

    main(cfg.reward)


@app.command()
def rollout(
    preset: Preset = None,
    overrides: Overrides = None,
    worker_id: Annotated[str | None, typer.Option(help="Consumer name; default hostname-pid.")] = None,
) -> None:
    """Run one rollout worker: prompts → n completions → scores → trajectory stream."""
    cfg = _settings(preset, overrides)
    if worker_id is not None:
        cfg.rollout.worker_id = worker_id
    log = setup_logging(f"rollout[{cfg.rollout.worker_id or 'auto'}]")
    from sparkrl.services.common.logs import stop_on_signals
    from sparkrl.services.rollout.service import main

    main(cfg, stop_on_signals(log, "the batch in hand"))


@app.command()
def control(preset: Preset = None, overrides: Overrides = None) -> None:
    """Run the control service (REST API, live page, fleet metrics) on control.host:control.port."""
    cfg = _settings(preset, overrides)
    setup_logging("control")
    from sparkrl.services.control.app import main

    try:
        main(cfg)
    except ValueError as exc:  # no token configured: say how to set one
        raise typer.BadParameter(str(exc)) from exc


@app.command()
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
    cfg = _settings(preset, overrides)
    rank = os.environ.get("RANK", "0")  # under torchrun (learner.ranks > 1) each rank says which it is
    log = setup_logging("learner" if rank == "0" else f"learner[rank {rank}]")
    import threading

    from sparkrl.services.common.logs import stop_on_signals
    from sparkrl.services.learner.service import main, run_state

    if auto_resume:
        found = run_state(Path(cfg.run_dir))
        resume = found is not None
        log.info("--auto-resume: %s", f"resuming ({found})" if found else f"a fresh run in {cfg.run_dir}")

    stop = threading.Event()
    # Signals are taken over once the engine is built: until then SIGTERM ends a stuck start at once.
    main(cfg, resume=resume, stop=stop, engine_built=lambda: stop_on_signals(log, "the current step", stop))
    from sparkrl.services.common.weight_sync.sender import epochs_tearing_down

    if epochs_tearing_down():  # finalizing now would let gloo abort the process (exit code -6)
        import logging
        import sys

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


@app.command()
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
    cfg = _settings(preset, overrides)
    log = setup_logging("prompts")
    if "url" not in cfg.bus.model_fields_set:
        # This command writes: never into a Redis it was not pointed at (6379 may be someone else's).
        raise typer.BadParameter(
            "say which Redis: --run-dir RUN_DIR (a live `sparkrl up`) or --set bus.url=..."
        )
    epochs = epochs or cfg.prompts.epochs
    from sparkrl.services.common.bus._text import mask_password

    log.info("feeding %s into %s (namespace %s)", cfg.prompts.path or "the countdown generator",
             mask_password(cfg.bus.url), cfg.bus.namespace)  # fmt: skip
    from sparkrl.services.common.bus import RedisBus
    from sparkrl.services.common.datasets import iter_prompts
    from sparkrl.services.common.feeder import (
        FeedReport,
        feed_prompts,
        mark_fed,
        mark_feeding,
        watch_and_refeed,
    )
    from sparkrl.services.common.logs import stop_on_signals
    from sparkrl.services.common.recovery import ensure_incarnation, warn_if_not_persistent

    stop = stop_on_signals(log, "feeding")
    with RedisBus(cfg.bus) as bus:
        warn_if_not_persistent(bus)

        def feed_all(skip_trained: bool = False) -> FeedReport:
            mark_feeding(bus)
            total = FeedReport(0, 0, 0.0)
            for epoch in range(epochs):
                prompts = iter_prompts(cfg.prompts)
                report = feed_prompts(bus, prompts, epoch=epoch, skip_trained=skip_trained, stop=stop)
                log.info(
                    "epoch %d: %d prompts fed, %d already there, %.1fs",
                    epoch, report.published, report.duplicates, report.seconds,
                )  # fmt: skip
                total = FeedReport(total.published + report.published, total.duplicates + report.duplicates,
                                   total.seconds + report.seconds)  # fmt: skip
            if not stop.is_set():
                mark_fed(bus, total, epochs)  # all of it is in: once trained, the run is over
            return total

        known = ensure_incarnation(bus)  # before feeding: a wipe while the first feed blocks still counts
        feed_all()
        if watch:
            watch_and_refeed(bus, lambda: feed_all(skip_trained=True), stop, known)


@app.command()
def up(
    preset: Preset = None,
    overrides: Overrides = None,
    workers: Annotated[
        int | None, typer.Option(min=1, help="Rollout worker processes (default: the preset's `workers`).")
    ] = None,
    run_dir: Annotated[
        str | None,
        typer.Option("--run-dir", "--output-dir", help="Run directory (logs, metrics, checkpoints)."),
    ] = None,
    model: Annotated[str | None, typer.Option(help="A Hugging Face model directory (sets `model`).")] = None,
    dataset: Annotated[
        str | None,
        typer.Option(help="A jsonl/parquet prompt file (sets prompts.path and, unless given, task math)."),
    ] = None,
    epochs: Annotated[
        int | None, typer.Option(min=1, help="Passes over the data (prompts.epochs); then the run ends.")
    ] = None,
    private_redis: Annotated[
        bool | None, typer.Option(help="Start a private redis-server (default: when bus.url is not set).")
    ] = None,
    resume: Annotated[
        bool, typer.Option(help="The learner continues from RUN_DIR/checkpoints/latest.")
    ] = False,
    overwrite: Annotated[
        bool, typer.Option(help="Delete an earlier run in RUN_DIR first (without it, one is refused).")
    ] = False,
    ray: Annotated[
        bool,
        typer.Option("--ray", help="The learner and workers as Ray actors, the reward service on Ray Serve."),
    ] = False,
    address: Annotated[
        str | None,
        typer.Option(help="With --ray: the Ray cluster to join (default ray.address, or a local Ray)."),
    ] = None,
) -> None:
    """The whole stack, until the learner finishes; Ctrl-C stops it cleanly. Separate processes, or with
    `--ray` Ray actors and a Ray Serve deployment."""
    shortcuts = [f"run_dir={run_dir}"] if run_dir else []
    shortcuts += [f"model={model}"] if model else []
    if dataset:
        given_task = any(o.split("=", 1)[0].strip() == "prompts.task" for o in overrides or [])
        shortcuts += [f"prompts.path={dataset}", *([] if given_task else ["prompts.task=math"])]
    shortcuts += [f"prompts.epochs={epochs}"] if epochs else []
    cfg = _settings(preset, [*(overrides or []), *shortcuts])
    workers = cfg.workers if workers is None else workers
    if address is not None and not ray:
        raise typer.BadParameter("--address is for --ray: add --ray, or drop --address")
    if resume and overwrite:
        raise typer.BadParameter("--resume continues the run in RUN_DIR, --overwrite deletes it: pick one")
    if ray and cfg.learner.ranks > 1:
        raise typer.BadParameter(
            "learner.ranks > 1 runs the learner under torchrun, which --ray does not do yet: drop --ray, "
            "or set learner.ranks=1",
            param_hint="--ray",
        )
    if cfg.control.read_token is not None:
        raise typer.BadParameter(
            "control.read_token is for a control service that gets its own environment (compose, "
            "Kubernetes); `sparkrl up` writes no secret into a config file: set control.protect_reads=true "
            "instead (the run's token, RUN_DIR/control-token, then reads too)"
        )
    from sparkrl.plan import prepare_run_dir
    from sparkrl.run_lock import RunDirLive, lock_run_dir

    holder = "sparkrl up --ray" if ray else "sparkrl up"
    try:  # first: a live run's directory is refused as live, whatever else is wrong
        lock = lock_run_dir(Path(cfg.run_dir).resolve(), holder, resume, overwrite, _say)
    except RunDirLive as exc:
        raise typer.BadParameter(str(exc), param_hint="--run-dir") from exc
    with lock:  # held until the run is over and summarized
        _preflight(cfg)
        try:
            prepare_run_dir(Path(cfg.run_dir), resume, overwrite)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--run-dir") from exc
        if ray:
            from sparkrl.ray_mode import run_on_ray

            raise typer.Exit(run_on_ray(cfg, workers, private_redis, preset, resume, address))
        from sparkrl.launcher import run_stack

        raise typer.Exit(run_stack(cfg, workers, private_redis, preset, resume))


def _say(line: str) -> None:
    typer.echo(line, err=True)


def _preflight(cfg: SparkSettings) -> None:
    """Exit 2 with one line per problem, before anything is spawned."""
    from sparkrl.preflight import check as find_problems

    problems = find_problems(cfg)
    for problem in problems:
        typer.echo(f"error: {problem}", err=True)
    if problems:
        typer.echo(
            f"{len(problems)} problem(s): nothing was started (`sparkrl check` checks again)", err=True
        )
        raise typer.Exit(2)


@app.command()
def check(preset: Preset = None, overrides: Overrides = None) -> None:
    """What `sparkrl up` checks before it starts anything: model, data, context, engine, GPUs, sync."""
    cfg = _settings(preset, overrides)
    _preflight(cfg)
    typer.echo(f"ok: model {cfg.model}, {cfg.prompts.task} prompts, {cfg.rollout.engine.kind} engine, "
               f"{cfg.sync.backend} sync — `sparkrl up` would start")  # fmt: skip


@app.command()
def evaluator(preset: Preset = None, overrides: Overrides = None) -> None:
    """Run the in-training evaluator: every `eval.every`-th published version on held-out problems."""
    cfg = _settings(preset, overrides)
    log = setup_logging("evaluator")
    from sparkrl.services.common.logs import stop_on_signals
    from sparkrl.services.rollout.evaluator import main

    main(cfg, stop_on_signals(log, "the current evaluation"))


@app.command("eval")
def eval_model(
    model: Annotated[Path, typer.Argument(help="A model directory, a checkpoint, or a run directory.")],
    task: Annotated[
        str, typer.Option(help="countdown (the held-out split) or math (--data FILE).")
    ] = "countdown",
    data: Annotated[Path | None, typer.Option(help="math: a jsonl/parquet benchmark file.")] = None,
    problems: Annotated[
        int | None, typer.Option(min=1, help="Problems (default: countdown 256, math all).")
    ] = None,
    n: Annotated[int, typer.Option(min=1, max=1024, help="Samples per problem (pass@k for k ≤ n).")] = 8,
    temperature: Annotated[float, typer.Option(min=0.01, help="Sampling temperature.")] = 1.0,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Longest answer, tokens.")] = 24,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    threads: Annotated[int | None, typer.Option(min=1, help="torch CPU threads (default: all).")] = None,
    preset: Annotated[
        str | None, typer.Option(help="countdown: the difficulty of this preset's prompts.countdown.")
    ] = None,
) -> None:
    """Evaluate a model on held-out problems: greedy accuracy, pass@1 and unbiased pass@k; a table, then
    one JSON line."""
    import json

    from sparkrl.evaluate import evaluate, math_tasks, resolve_model

    try:
        resolve_model(model)
    except FileNotFoundError as exc:
        raise typer.BadParameter(str(exc), param_hint="MODEL") from exc
    if task not in ("countdown", "math"):
        raise typer.BadParameter(f"{task!r}: the tasks are countdown and math", param_hint="--task")
    if (task == "math") != (data is not None):
        raise typer.BadParameter("--data FILE goes with --task math (and only with it)", param_hint="--data")
    tasks, difficulty = None, _settings(preset, None).prompts.countdown if preset else None
    if data is not None:
        from sparkrl.services.common.datasets import DatasetError

        try:
            tasks = math_tasks(data, problems)
        except DatasetError as exc:
            raise typer.BadParameter(str(exc), param_hint="--data") from exc
    result = evaluate(
        model, problems or 256, n, temperature, max_new_tokens, seed, threads, tasks, difficulty
    )
    typer.echo(result.table())
    typer.echo(json.dumps(result.as_json()))


@app.command("build-tiny-model")
def build_tiny_model(
    out: Annotated[
        Path | None,
        typer.Option(
            help="Cache folder (default: sparkrl's cache, where presets look); the model goes in a subfolder."
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the weights and the warm-up data.")] = 0,
) -> None:
    """Build (once) the tiny countdown model: char tokenizer, Qwen2 config, a short supervised warm-up."""
    setup_logging("build-tiny-model")
    from sparkrl.services.common.paths import cache_dir
    from sparkrl.services.common.tiny_model import ensure_tiny_model

    typer.echo(ensure_tiny_model(out or cache_dir(), seed=seed))


# The clients (control API, dead letters, report, config) live in cli_clients.py; importing it
# registers them on `app`.
from sparkrl import cli_clients  # noqa: E402, F401

if __name__ == "__main__":
    # `python -m sparkrl.cli` runs this file as __main__; the clients registered on the module's own `app`.
    from sparkrl.cli import app as _app

    _app()
