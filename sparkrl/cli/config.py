"""`sparkrl config show`: what a preset resolves to, each field described."""

from __future__ import annotations

import typer

from sparkrl.cli.options import Overrides, Preset, settings

commands = typer.Typer(no_args_is_help=True, help="The settings: what a preset resolves to, described.")


@commands.command("show")
def config_show(preset: Preset = None, overrides: Overrides = None) -> None:
    """Print the resolved settings (defaults < preset < environment < --set) with each field's meaning."""
    from sparkrl.settings_doc import annotated_yaml

    typer.echo(annotated_yaml(settings(preset, overrides)), nl=False)
