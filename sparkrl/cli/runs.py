"""Commands on what a run holds or left: `sparkrl dead` (the dead-letter stream, or RUN_DIR/dead_letters.jsonl
once the run is over) and `sparkrl report` (charts and report.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sparkrl.cli.options import WHICH_REDIS, Overrides, Preset, RunDir, settings

commands = typer.Typer()


@commands.command()
def dead(
    preset: Preset = None,
    overrides: Overrides = None,
    run_dir: RunDir = None,
    requeue: Annotated[
        list[str] | None,
        typer.Option(help="Put this dead letter back into its stream (an id of the listing)."),
    ] = None,
    count: Annotated[int, typer.Option(min=1, max=10_000, help="How many to list, newest first.")] = 20,
) -> None:
    """The dead-letter stream: what was set aside and why; `--requeue ID` delivers one again. For a run
    that is over, what it left in RUN_DIR/dead_letters.jsonl."""
    from sparkrl.dead_letters import as_record, listing
    from sparkrl.services.common.bus import RedisBus

    if run_dir is not None:
        if _run_is_over(run_dir):
            _left_behind(run_dir, bool(requeue), count)
            return
        preset = str(run_dir / "config" / "learner.yaml")
    cfg = settings(preset, overrides)
    if run_dir is None and "url" not in cfg.bus.model_fields_set:
        # This command writes (--requeue): never into a Redis it was not pointed at.
        raise typer.BadParameter(WHICH_REDIS)
    with RedisBus(cfg.bus) as bus:
        for record_id in requeue or []:
            new_id = bus.requeue_dead_letter(record_id)
            if new_id is None:
                typer.echo(f"error: no dead letter {record_id} in {bus.stream_key('dead')}", err=True)
                raise typer.Exit(1)
            typer.echo(f"requeued {record_id} as {new_id}")
        if requeue:
            return
        letters = bus.dead_letters(count)
        typer.echo(
            f"{bus.dead_letter_count()} dead letters in {bus.stream_key('dead')}" + (":" if letters else "")
        )
        for letter in letters:
            typer.echo(listing(as_record(bus, letter)))


def _run_is_over(run_dir: Path) -> bool:
    """No `sparkrl up` holds the directory and its Redis was the run's own: gone with it."""
    from sparkrl.run_lock import live_holder

    return live_holder(run_dir) is None and (run_dir / "config" / "redis.conf").is_file()


def _left_behind(run_dir: Path, requeue: bool, count: int) -> None:
    """`sparkrl dead` of a run that is over: what it left in RUN_DIR/dead_letters.jsonl, at once."""
    from sparkrl.dead_letters import listing
    from sparkrl.run_files import DEAD_LETTERS_FILE, load_dead_letters

    back = f"`sparkrl up --resume --run-dir {run_dir}` brings its Redis back"
    if requeue:
        typer.echo(
            f"error: the run in {run_dir} is over and its Redis with it: {back}, then requeue", err=True
        )
        raise typer.Exit(1)
    records = load_dead_letters(run_dir)
    if records is None:
        typer.echo(
            f"error: the run in {run_dir} is over and left no {DEAD_LETTERS_FILE} (`sparkrl up` writes it "
            f"as it stops; one killed outright cannot): {back}",
            err=True,
        )
        raise typer.Exit(1)
    path = run_dir / DEAD_LETTERS_FILE
    typer.echo(
        f"the run in {run_dir} is over: {len(records)} dead letters as it left them ({path})"
        + (":" if records else "")
    )
    for record in records[::-1][:count]:
        typer.echo(listing(record))


@commands.command()
def report(run_dir: Annotated[Path, typer.Argument(help="The run directory.")]) -> None:
    """Charts (reward, entropy, regularized tokens, worker versions and lag, sync seconds) and report.md."""
    from sparkrl.report import write_report
    from sparkrl.run_lock import describe, live_holder

    holder = live_holder(run_dir)
    if holder is not None:  # the run goes on: this is a snapshot, the launcher writes the final report
        typer.echo(
            f"note: {run_dir} is live ({describe(holder)}): this report covers its steps so far; "
            "`sparkrl up` writes the final one when the run ends",
            err=True,
        )
    try:
        typer.echo(write_report(run_dir))
    except (FileNotFoundError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
