"""Commands on models: `sparkrl eval` (held-out accuracy of a model, a checkpoint or a run) and
`sparkrl build-tiny-model` (the demo's model, built once and cached)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from sparkrl.cli.options import Overrides, settings
from sparkrl.services.common.logs import setup_logging

commands = typer.Typer()


@commands.command("eval")
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
        str | None,
        typer.Option(
            help="countdown: the difficulty of this preset's prompts.countdown; any task: its rollout "
            "chat template, kwargs, system prompt and eos_tokens."
        ),
    ] = None,
    overrides: Overrides = None,
) -> None:
    """Evaluate a model on held-out problems: greedy accuracy, pass@1 and unbiased pass@k; a table, then
    one JSON line. Prompts are rendered as the preset's (`--set`'s) rollout workers render them."""
    from sparkrl.evaluate import evaluate, math_tasks, resolve_model

    try:
        resolve_model(model)
    except FileNotFoundError as exc:
        raise typer.BadParameter(str(exc), param_hint="MODEL") from exc
    if task not in ("countdown", "math"):
        raise typer.BadParameter(f"{task!r}: the tasks are countdown and math", param_hint="--task")
    if (task == "math") != (data is not None):
        raise typer.BadParameter("--data FILE goes with --task math (and only with it)", param_hint="--data")
    cfg = settings(preset, overrides)
    tasks, difficulty = None, cfg.prompts.countdown if preset else None
    if data is not None:
        from sparkrl.services.common.tasks.datasets import DatasetError

        try:
            tasks = math_tasks(data, problems)
        except DatasetError as exc:
            raise typer.BadParameter(str(exc), param_hint="--data") from exc
    result = evaluate(
        model,
        problems or 256,
        n,
        temperature,
        max_new_tokens,
        seed,
        threads,
        tasks,
        difficulty,
        cfg.rollout.prompt_format,
        cfg.rollout.eos_tokens,
    )
    typer.echo(result.table())
    typer.echo(json.dumps(result.as_json()))


@commands.command("build-tiny-model")
def build_tiny_model(
    out: Annotated[
        Path | None,
        typer.Option(
            help="Cache folder (default: sparkrl's cache, where presets look); the model goes in a subfolder."
        ),
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Seed of the weights and the warm-up data (default: the recipe's).")
    ] = None,
    agent: Annotated[
        bool,
        typer.Option(help="The agent preset's model instead (tiny-agent: it answers by calling a tool)."),
    ] = False,
) -> None:
    """Build (once) the tiny countdown model: char tokenizer, Qwen2 config, a short supervised warm-up."""
    setup_logging("build-tiny-model")
    from sparkrl.services.common.paths import cache_dir

    if agent:
        from sparkrl.services.common.tiny_agent import ensure_tiny_agent

        typer.echo(
            ensure_tiny_agent(out or cache_dir())
            if seed is None
            else ensure_tiny_agent(out or cache_dir(), seed=seed)
        )
        return
    from sparkrl.services.common.tiny_model import ensure_tiny_model

    typer.echo(ensure_tiny_model(out or cache_dir(), seed=seed or 0))
