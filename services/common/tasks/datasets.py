"""Prompt sources: a jsonl/parquet file of questions and answers (`math`), or the countdown generator.

Field names are mappable so the benchmark files load as they are, e.g. OlympiadBench with
`prompt_field=question answer_field=final_answer`, Minerva with `answer_field=solution` (its last
`\\boxed{}` is taken as the answer).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sparkrl.proto import Prompt
from sparkrl.services.common.settings import PromptSettings
from sparkrl.services.common.tasks import countdown
from sparkrl.services.common.tasks.answers import last_boxed

DEFAULT_COUNTDOWN_PROMPTS = 64
PLACEHOLDER = "{prompt}"  # where prompts.template takes the question; other braces stay as written


class DatasetError(ValueError):
    """A prompt file that cannot be read as asked: the message names the file, the row and the field."""


class MalformedFile(DatasetError):
    """A line of the file is not a JSON object (or the file cannot be read at all): the file is wrong, not
    the field names asked of it."""


def read_rows(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of a jsonl or parquet file, as dicts."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise MalformedFile(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from exc
        yield from pq.read_table(path).to_pylist()
        return
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise MalformedFile(f"{path}:{number}: not JSON ({exc})") from exc
            if not isinstance(row, dict):
                raise MalformedFile(f"{path}:{number}: a row must be a JSON object")
            yield row


def answer_text(value: Any) -> str:
    """Normalize an answer cell: lists (OlympiadBench) join with ', ', numbers print without a trailing .0."""
    if isinstance(value, list):
        return ", ".join(answer_text(item) for item in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    text = str(value)
    boxed = last_boxed(text)
    return boxed if boxed is not None else text


def file_prompts(cfg: PromptSettings) -> Iterator[Prompt]:
    """Prompts from `cfg.path`, each with a stable id (file stem + row number)."""
    if cfg.path is None:
        raise DatasetError("task `math` needs prompts.path (a jsonl or parquet file)")
    path = Path(cfg.path)
    if not path.is_file():
        raise DatasetError(f"prompt file {path} does not exist")
    rows = list(read_rows(path))
    order = list(range(len(rows)))
    if cfg.shuffle:
        random.Random(cfg.seed).shuffle(order)
    if cfg.count is not None:
        order = order[: cfg.count]
    for index in order:
        row = rows[index]
        for field in (cfg.prompt_field, cfg.answer_field):
            if row.get(field) is None:
                raise DatasetError(f"{path} row {index + 1}: no field {field!r} (has {sorted(row)})")
        yield Prompt(
            prompt_id=f"{path.stem}-{index:06d}",
            task=cfg.task,
            text=cfg.template.replace(PLACEHOLDER, str(row[cfg.prompt_field])),
            answer=answer_text(row[cfg.answer_field]),
            source=path.name,
        )


def countdown_prompts(cfg: PromptSettings) -> Iterator[Prompt]:
    """Seeded countdown problems; the id encodes seed and index so a re-feed is idempotent."""
    rng = random.Random(cfg.seed)
    for index in range(cfg.count or DEFAULT_COUNTDOWN_PROMPTS):
        problem = countdown.generate_problem(rng, **cfg.countdown.model_dump())
        yield Prompt(
            prompt_id=f"countdown-s{cfg.seed}-{index:06d}",
            task="countdown",
            text=cfg.template.replace(PLACEHOLDER, countdown.format_prompt(problem)),
            task_data={"numbers": list(problem.numbers), "target": problem.target},
            source="countdown",
        )


def iter_prompts(cfg: PromptSettings) -> Iterator[Prompt]:
    """The prompts `cfg` describes, in feeding order."""
    if cfg.task == "countdown" and cfg.path is None:
        return countdown_prompts(cfg)
    return file_prompts(cfg)
