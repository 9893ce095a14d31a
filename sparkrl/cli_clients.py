"""The CLI's clients: of the control API (`status`, `pause`, `resume`, `stop`, `checkpoint`, `set`), of the
dead-letter stream (`dead`), the run report (`report`) and the settings (`config show`). Registered on
`sparkrl.cli.app` when that module loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sparkrl.cli import Overrides, Preset, _settings, app

# ── clients of the control API ───────────────────────────────────────────────────────────────────────

Url = Annotated[str | None, typer.Option(help="Control API base URL (env SPARKRL_CONTROL__URL).")]
Token = Annotated[str | None, typer.Option(help="Bearer token (env SPARKRL_CONTROL__TOKEN).")]
RunDir = Annotated[
    Path | None, typer.Option("--run-dir", help="Take the URL and token from a `sparkrl up` run directory.")
]
Json = Annotated[bool, typer.Option("--json", help="Print the API's JSON answer.")]
_SAID: set[str] = set()  # the control API URLs this process said it talks to


def _client_call(
    url: str | None, token: str | None, run_dir: Path | None, method: str, path: str, body: dict | None = None
) -> dict:
    from sparkrl.client import ClientError, call, resolve_endpoint

    try:
        endpoint = resolve_endpoint(url, token, run_dir)
        if endpoint.url not in _SAID:  # every client says where it connects (stderr: --json stays clean)
            _SAID.add(endpoint.url)
            typer.echo(f"control API {endpoint.url}", err=True)
        return call(endpoint, method, path, body)
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


@app.command()
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


@app.command()
def pause(
    url: Url = None,
    token: Token = None,
    run_dir: RunDir = None,
    reason: Annotated[str | None, typer.Option(help="Why, for the logs.")] = None,
    as_json: Json = False,
) -> None:
    """Pause: the learner stops taking trajectories, workers stop taking prompts; nothing is lost."""
    _command(url, token, run_dir, "/api/v1/pause", {"reason": reason} if reason else None, as_json)


@app.command()
def resume(url: Url = None, token: Token = None, run_dir: RunDir = None, as_json: Json = False) -> None:
    """Resume after a pause."""
    _command(url, token, run_dir, "/api/v1/resume", None, as_json)


@app.command()
def stop(
    url: Url = None,
    token: Token = None,
    run_dir: RunDir = None,
    checkpoint: Annotated[bool, typer.Option(help="Write a final checkpoint.")] = True,
    as_json: Json = False,
) -> None:
    """Stop the run cleanly: the learner finishes its step, checkpoints, and exits; the workers too."""
    _command(url, token, run_dir, "/api/v1/stop", {"checkpoint": checkpoint}, as_json)


@app.command()
def checkpoint(
    url: Url = None,
    token: Token = None,
    run_dir: RunDir = None,
    tag: Annotated[str | None, typer.Option(help="Folder name (default: step-NNNNNN).")] = None,
    as_json: Json = False,
) -> None:
    """Write a checkpoint at the next step boundary."""
    _command(url, token, run_dir, "/api/v1/checkpoint", {"tag": tag} if tag else None, as_json)


@app.command("set")
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


@app.command()
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
    cfg = _settings(preset, overrides)
    if run_dir is None and "url" not in cfg.bus.model_fields_set:
        # This command writes (--requeue): never into a Redis it was not pointed at.
        raise typer.BadParameter(
            "say which Redis: --run-dir RUN_DIR (a live `sparkrl up`) or --set bus.url=..."
        )
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
    from sparkrl.dead_letters import DEAD_LETTERS_FILE, listing, load_dead_letters

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


@app.command()
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


# ── settings ──────────────────────────────────────────────────────────────────────────────────────────

config_app = typer.Typer(no_args_is_help=True, help="The settings: what a preset resolves to, described.")
app.add_typer(config_app, name="config")


@config_app.command("show")
def config_show(preset: Preset = None, overrides: Overrides = None) -> None:
    """Print the resolved settings (defaults < preset < environment < --set) with each field's meaning."""
    from sparkrl.settings_doc import annotated_yaml

    typer.echo(annotated_yaml(_settings(preset, overrides)), nl=False)
