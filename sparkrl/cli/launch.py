"""`sparkrl up`, the whole stack until the learner finishes, and `sparkrl check`, what `up` checks before it
starts anything."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from sparkrl.cli.options import Overrides, Preset, say, settings
from sparkrl.services.common.settings import SparkSettings

commands = typer.Typer()

# `sparkrl up`'s own options (the settings' flags are options.py's).
Workers = Annotated[
    int | None, typer.Option(min=1, help="Rollout worker processes (default: the preset's `workers`).")
]
RunDir = Annotated[
    str | None, typer.Option("--run-dir", "--output-dir", help="Run directory (logs, metrics, checkpoints).")
]
Model = Annotated[str | None, typer.Option(help="A Hugging Face model directory (sets `model`).")]
Dataset = Annotated[
    str | None,
    typer.Option(help="A jsonl/parquet prompt file (sets prompts.path and, unless given, task math)."),
]
Epochs = Annotated[
    int | None, typer.Option(min=1, help="Passes over the data (prompts.epochs); then the run ends.")
]
PrivateRedis = Annotated[
    bool | None, typer.Option(help="Start a private redis-server (default: when bus.url is not set).")
]
Resume = Annotated[bool, typer.Option(help="The learner continues from RUN_DIR/checkpoints/latest.")]
Overwrite = Annotated[
    bool, typer.Option(help="Delete an earlier run in RUN_DIR first (without it, one is refused).")
]
Ray = Annotated[
    bool,
    typer.Option("--ray", help="The learner and workers as Ray actors, the reward service on Ray Serve."),
]
Address = Annotated[
    str | None,
    typer.Option(help="With --ray: the Ray cluster to join (default ray.address, or a local Ray)."),
]


@commands.command()
def up(
    preset: Preset = None,
    overrides: Overrides = None,
    workers: Workers = None,
    run_dir: RunDir = None,
    model: Model = None,
    dataset: Dataset = None,
    epochs: Epochs = None,
    private_redis: PrivateRedis = None,
    resume: Resume = False,
    overwrite: Overwrite = False,
    ray: Ray = False,
    address: Address = None,
) -> None:
    """The whole stack, until the learner finishes; Ctrl-C stops it cleanly. Separate processes, or with
    `--ray` Ray actors and a Ray Serve deployment."""
    shortcuts = _shortcuts(run_dir, model, dataset, epochs, overrides or [])
    cfg = settings(preset, [*(overrides or []), *shortcuts])
    workers = cfg.workers if workers is None else workers
    _refuse_conflicts(cfg, ray, address, resume, overwrite)
    from sparkrl.plan import prepare_run_dir
    from sparkrl.run_lock import RunDirLive, lock_run_dir

    holder = "sparkrl up --ray" if ray else "sparkrl up"
    os.umask(0o077)  # the run directory and all it holds (logs, samples, Redis data) are this user's alone
    try:  # first: a live run's directory is refused as live, whatever else is wrong
        lock = lock_run_dir(Path(cfg.run_dir).resolve(), holder, resume, overwrite, say)
    except RunDirLive as exc:
        raise typer.BadParameter(str(exc), param_hint="--run-dir") from exc
    with lock:  # held until the run is over and summarized
        _preflight(cfg, cluster=ray and (address or cfg.ray.address) is not None)
        try:
            prepare_run_dir(Path(cfg.run_dir), resume, overwrite)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--run-dir") from exc
        if ray:
            from sparkrl.ray_mode import run_on_ray

            raise typer.Exit(run_on_ray(cfg, workers, private_redis, preset, resume, address))
        from sparkrl.launcher import run_stack

        raise typer.Exit(run_stack(cfg, workers, private_redis, preset, resume, lock.fd))


def _shortcuts(
    run_dir: str | None, model: str | None, dataset: str | None, epochs: int | None, overrides: list[str]
) -> list[str]:
    """`up`'s own flags as the settings they stand for, applied after `--set`."""
    shortcuts = [f"run_dir={run_dir}"] if run_dir else []
    shortcuts += [f"model={model}"] if model else []
    if dataset:
        given_task = any(o.split("=", 1)[0].strip() == "prompts.task" for o in overrides)
        shortcuts += [f"prompts.path={dataset}", *([] if given_task else ["prompts.task=math"])]
    shortcuts += [f"prompts.epochs={epochs}"] if epochs else []
    return shortcuts


def _refuse_conflicts(
    cfg: SparkSettings, ray: bool, address: str | None, resume: bool, overwrite: bool
) -> None:
    """Flags and settings `up` cannot honour together: refused before the run directory is touched."""
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


def _preflight(cfg: SparkSettings, cluster: bool = False) -> None:
    """Exit 2 with one line per problem, before anything is spawned; warnings said, not refused (`cluster`:
    also what the nodes of the Ray cluster `up --ray` joins would fail to reach)."""
    from sparkrl.preflight import check as find_problems
    from sparkrl.preflight import warnings

    for warning in warnings(cfg, cluster):
        typer.echo(f"warning: {warning}", err=True)
    problems = find_problems(cfg)
    for problem in problems:
        typer.echo(f"error: {problem}", err=True)
    if problems:
        typer.echo(
            f"{len(problems)} problem(s): nothing was started (`sparkrl check` checks again)", err=True
        )
        raise typer.Exit(2)


@commands.command()
def check(
    preset: Preset = None,
    overrides: Overrides = None,
    workers: Workers = None,
    run_dir: RunDir = None,
    model: Model = None,
    dataset: Dataset = None,
    epochs: Epochs = None,
) -> None:
    """What `sparkrl up` checks before it starts anything: model, data, context, engine, GPUs, sync. Takes
    `up`'s flags, so the same line with `check` for `up` checks that run."""
    shortcuts = _shortcuts(run_dir, model, dataset, epochs, overrides or [])
    cfg = settings(preset, [*(overrides or []), *shortcuts])
    if workers is not None:
        cfg = cfg.model_copy(update={"workers": workers})
    _preflight(cfg)
    typer.echo(f"ok: model {cfg.model}, {cfg.prompts.task} prompts, {cfg.rollout.engine.kind} engine, "
               f"{cfg.sync.backend} sync — `sparkrl up` would start")  # fmt: skip
