"""`sparkrl`: one command per service (what a container runs), plus the prompt feeder and the tiny model.

Every command takes the same settings flags: `--preset NAME|FILE` (a YAML from `configs/`, or the
resolved config a launcher wrote), `--set key.path=value` (repeatable), and `SPARKRL_*` environment
variables. Service imports happen inside the commands so `sparkrl reward` never loads torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sparkrl.services.common.logs import setup_logging
from sparkrl.services.common.settings import SparkSettings, load_settings

app = typer.Typer(
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, help=__doc__.splitlines()[0]
)

Preset = Annotated[
    str | None, typer.Option("--preset", "-p", help="configs/<NAME>.yaml, or a path to a YAML settings file.")
]
Overrides = Annotated[
    list[str] | None, typer.Option("--set", "-s", help="Override one setting: key.path=value (repeatable).")
]


def _settings(preset: str | None, overrides: list[str] | None) -> SparkSettings:
    try:
        return load_settings(preset, overrides)
    except (ValueError, FileNotFoundError) as exc:
        raise typer.BadParameter(str(exc)) from exc


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
    setup_logging(f"rollout[{cfg.rollout.worker_id or 'auto'}]")
    from sparkrl.services.rollout.worker import main

    main(cfg)


@app.command()
def learner(
    preset: Preset = None,
    overrides: Overrides = None,
    resume: Annotated[bool, typer.Option(help="Continue from RUN_DIR/checkpoints/latest.")] = False,
) -> None:
    """Run the learner: trajectory stream → Lp-Reg (or a baseline) under DeepSpeed → weights to the fleet."""
    cfg = _settings(preset, overrides)
    setup_logging("learner")
    from sparkrl.services.learner.learner import main

    main(cfg, resume=resume)


@app.command()
def prompts(
    preset: Preset = None,
    overrides: Overrides = None,
    epochs: Annotated[int, typer.Option(min=1, help="Passes over the data; later passes get new ids.")] = 1,
) -> None:
    """Feed a dataset (prompts.path) or the countdown generator into the prompt stream."""
    cfg = _settings(preset, overrides)
    log = setup_logging("prompts")
    from sparkrl.services.common.bus import RedisBus
    from sparkrl.services.common.datasets import iter_prompts
    from sparkrl.services.common.feeder import feed_prompts

    with RedisBus(cfg.bus) as bus:
        for epoch in range(epochs):
            report = feed_prompts(bus, iter_prompts(cfg.prompts), epoch=epoch)
            log.info(
                "epoch %d: %d prompts fed, %d already there, %.1fs",
                epoch,
                report.published,
                report.duplicates,
                report.seconds,
            )


@app.command()
def up(
    preset: Preset = None,
    overrides: Overrides = None,
    workers: Annotated[int, typer.Option(min=1, help="Rollout worker processes.")] = 2,
    run_dir: Annotated[str | None, typer.Option(help="Run directory (logs, metrics, checkpoints).")] = None,
    private_redis: Annotated[
        bool | None, typer.Option(help="Start a private redis-server (default: when bus.url is not set).")
    ] = None,
    resume: Annotated[
        bool, typer.Option(help="The learner continues from RUN_DIR/checkpoints/latest.")
    ] = False,
) -> None:
    """The whole stack as separate processes, until the learner finishes; Ctrl-C stops it cleanly."""
    cfg = _settings(preset, [*(overrides or []), *([f"run_dir={run_dir}"] if run_dir else [])])
    from sparkrl.launcher import run_stack

    raise typer.Exit(run_stack(cfg, workers, private_redis, preset, resume))


@app.command("build-tiny-model")
def build_tiny_model(
    out: Annotated[Path, typer.Option(help="Cache folder; the model lands in a subfolder.")] = Path(".cache"),
    seed: Annotated[int, typer.Option(help="Seed of the weights and the warm-up data.")] = 0,
) -> None:
    """Build (once) the tiny countdown model: char tokenizer, Qwen2 config, a short supervised warm-up."""
    setup_logging("build-tiny-model")
    from sparkrl.services.common.tiny_model import ensure_tiny_model

    typer.echo(ensure_tiny_model(out, seed=seed))


if __name__ == "__main__":
    app()
