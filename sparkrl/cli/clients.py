"""The clients of the control API: `status`, `pause`, `resume`, `stop`, `checkpoint`, `set`. Each says on
stderr which API it talks to (from `--url`/`--token`, the environment, or `--run-dir`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sparkrl.cli.options import RunDir

commands = typer.Typer()

Url = Annotated[str | None, typer.Option(help="Control API base URL (env SPARKRL_CONTROL__URL).")]
Token = Annotated[str | None, typer.Option(help="Bearer token (env SPARKRL_CONTROL__TOKEN).")]
Json = Annotated[bool, typer.Option("--json", help="Print the API's JSON answer.")]
_SAID: set[str] = set()  # the control API URLs this process said it talks to


def _client_call(
    url: str | None, token: str | None, run_dir: Path | None, method: str, path: str, body: dict | None = None
) -> dict:
    from sparkrl.client import ClientError, RunEnded, call, resolve_endpoint

    try:
        endpoint = resolve_endpoint(url, token, run_dir)
        if endpoint.url not in _SAID:  # every client says where it connects (stderr: --json stays clean)
            _SAID.add(endpoint.url)
            found = f" (the live run {endpoint.found})" if endpoint.found else ""
            typer.echo(f"control API {endpoint.url}{found}", err=True)
        return call(endpoint, method, path, body)
    except RunEnded as exc:
        if path == "/api/v1/status":  # a status of a run that is over: said, and not an error
            typer.echo(f"{exc} (its summary: {Path(run_dir or '.') / 'summary.json'})")
            raise typer.Exit(0) from exc
        typer.echo(
            f"error: {exc}; nothing to send it: `sparkrl up --resume --run-dir {run_dir}` continues it",
            err=True,
        )
        raise typer.Exit(1) from exc
    except ClientError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc


def _command(
    url: str | None,
    token: str | None,
    run_dir: Path | None,
    path: str,
    body: dict | None,
    as_json: bool,
    method: str = "POST",
) -> None:
    import json

    from sparkrl.client import format_command

    answer = _client_call(url, token, run_dir, method, path, body)
    typer.echo(json.dumps(answer, indent=2) if as_json else format_command(answer))


@commands.command()
def status(url: Url = None, token: Token = None, run_dir: RunDir = None, as_json: Json = False) -> None:
    """Show the learner, the hyperparameters in force and every worker's version, lag and sync."""
    import json

    from sparkrl.client import format_status

    state = _client_call(url, token, run_dir, "GET", "/api/v1/status")
    workers = _client_call(url, token, run_dir, "GET", "/api/v1/workers")
    typer.echo(
        json.dumps({"status": state, "workers": workers}, indent=2)
        if as_json
        else format_status(state, workers)
    )


@commands.command()
def pause(
    url: Url = None,
    token: Token = None,
    run_dir: RunDir = None,
    reason: Annotated[str | None, typer.Option(help="Why, for the logs.")] = None,
    as_json: Json = False,
) -> None:
    """Pause: the learner stops taking trajectories, workers stop taking prompts; nothing is lost."""
    _command(url, token, run_dir, "/api/v1/pause", {"reason": reason} if reason else None, as_json)


@commands.command()
def resume(url: Url = None, token: Token = None, run_dir: RunDir = None, as_json: Json = False) -> None:
    """Resume after a pause."""
    _command(url, token, run_dir, "/api/v1/resume", None, as_json)


@commands.command()
def stop(
    url: Url = None,
    token: Token = None,
    run_dir: RunDir = None,
    checkpoint: Annotated[bool, typer.Option(help="Write a final checkpoint.")] = True,
    as_json: Json = False,
) -> None:
    """Stop the run cleanly: the learner finishes its step, checkpoints, and exits; the workers too."""
    _command(url, token, run_dir, "/api/v1/stop", {"checkpoint": checkpoint}, as_json)


@commands.command()
def checkpoint(
    url: Url = None,
    token: Token = None,
    run_dir: RunDir = None,
    tag: Annotated[
        str | None,
        typer.Option(help="Folder name: letters, digits, . _ - (default: step-NNNNNN).", show_default=False),
    ] = None,
    as_json: Json = False,
) -> None:
    """Write a checkpoint at the next step boundary."""
    from sparkrl.proto.names import checkpoint_tag

    if tag is not None:
        try:
            checkpoint_tag(tag)  # the service refuses it too (422); said here before anything is sent
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--tag") from exc
    _command(url, token, run_dir, "/api/v1/checkpoint", {"tag": tag} if tag is not None else None, as_json)


@commands.command("set")
def set_hparams(
    assignments: Annotated[
        list[str], typer.Argument(help="name=value … (lr, beta, rho, kappa, temperature …)")
    ],
    url: Url = None,
    token: Token = None,
    run_dir: RunDir = None,
    as_json: Json = False,
) -> None:
    """Change hyperparameters live, e.g. `sparkrl set lr=2e-6 beta=0.5 temperature=0.9`."""
    from sparkrl.client import ClientError, parse_assignments

    try:
        values = parse_assignments(assignments)
    except ClientError as exc:
        raise typer.BadParameter(str(exc)) from exc
    _command(url, token, run_dir, "/api/v1/hyperparameters", values, as_json, method="PATCH")
