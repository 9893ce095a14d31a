"""`sparkrl`: one command per service (what a container runs), the launcher `up`, the prompt feeder, the
control API's clients, the run report, `eval` and the tiny model.

Every service command takes the same settings flags: `--preset NAME|FILE` (a YAML from `configs/`, or the
resolved config a launcher wrote), `--set key.path=value` (repeatable), and `SPARKRL_*` environment
variables (`options.py`). Each module below holds a group of commands on its own `typer.Typer`; this one
gathers them on `app`, the console script (`sparkrl = "sparkrl.cli:app"`, and `python -m sparkrl.cli`).
"""

from __future__ import annotations

from typing import Annotated

import typer

from sparkrl.cli import clients, config, launch, models, runs, services

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


for group in (services, launch, models, clients, runs):
    app.add_typer(group.commands)  # no name: the group's commands sit at the top level
app.add_typer(config.commands, name="config")
