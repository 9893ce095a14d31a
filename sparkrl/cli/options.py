"""What the commands share: the settings flags (`--preset`, `--set`), the run-directory flags, and loading
the settings with an error that says which setting is wrong."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from sparkrl.services.common.settings import SparkSettings, describe_settings_error, load_settings

Preset = Annotated[
    str | None, typer.Option("--preset", "-p", help="configs/<NAME>.yaml, or a path to a YAML settings file.")
]
Overrides = Annotated[
    list[str] | None, typer.Option("--set", "-s", help="Override one setting: key.path=value (repeatable).")
]
BusRunDir = Annotated[
    Path | None, typer.Option("--run-dir", help="Use the Redis of this live `sparkrl up` run directory.")
]
RunDir = Annotated[
    Path | None, typer.Option("--run-dir", help="Take the URL and token from a `sparkrl up` run directory.")
]
WHICH_REDIS = "say which Redis: --run-dir RUN_DIR (a live `sparkrl up`) or --set bus.url=..."


def settings(preset: str | None, overrides: list[str] | None) -> SparkSettings:
    """defaults < preset < environment < `--set`; a bad value is the command's usage error."""
    try:
        return load_settings(preset, overrides)
    except (ValueError, FileNotFoundError) as exc:
        raise typer.BadParameter(describe_settings_error(exc)) from exc


_ROLE_FILE = re.compile(r"^# (\S+): `sparkrl (\w+)` settings")  # plan.py's header on a role's file


def role_settings(role: str, preset: str | None, overrides: list[str] | None) -> SparkSettings:
    """The tree for `sparkrl ROLE` (the role keeps its part). A file `sparkrl up` wrote for another role is
    refused: it holds only that role's sections, so this role's would silently be the defaults."""
    path = Path(preset) if preset else None
    if path is not None and path.is_file():
        with path.open() as file:
            written_for = _ROLE_FILE.match(file.readline())
        if written_for is not None and written_for.group(2) != role:
            raise typer.BadParameter(
                f"{preset} is {written_for.group(1)}'s settings, written by `sparkrl up` with only the "
                f"{written_for.group(2)} role's part; `sparkrl {role}` needs its own file (RUN_DIR/config/ "
                "holds one per service) or a whole tree (a preset)",
                param_hint="--preset",
            )
    return settings(preset, overrides)


def say(line: str) -> None:
    """A line for the user on stderr (stdout stays the command's answer)."""
    typer.echo(line, err=True)
