"""Prompt sources: a jsonl/parquet file of questions and answers (`math`), or the countdown generator.

Field names are mappable so the benchmark files load as they are, e.g. OlympiadBench with
`prompt_field=question answer_field=final_answer`, Minerva with `answer_field=solution` (its last
`\\boxed{}` is taken as the answer).
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sparkrl.proto import Prompt
from sparkrl.services.common.settings import PromptSettings
from sparkrl.services.common.tasks import countdown
from sparkrl.services.common.tasks.answers import last_boxed

DEFAULT_COUNTDOWN_PROMPTS = 64
PLACEHOLDER = "{prompt}"  # where prompts.template takes the question; other braces stay as written
NEEDS_ANSWER = frozenset({"math", "exact"})  # the tasks that check an answer: every row has one


class DatasetError(ValueError):
    """A prompt file that cannot be read as asked: the message names the file, the row and the field."""


class MalformedFile(DatasetError):
    """A line of the file is not a JSON object (or the file cannot be read at all): the file is wrong, not
    the field names asked of it."""


def read_rows(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of a jsonl or parquet file, as dicts."""
    for _, row in numbered_rows(path):
        yield row


def numbered_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) of a jsonl file (blank lines skipped), (row number, row) of a parquet file. A
    line that cannot be read is a `MalformedFile` naming the file, the line and the fix."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise MalformedFile(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from exc
        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow's many errors for a file that is not (whole) parquet
            raise MalformedFile(f"{path}: not a parquet file ({exc}): write it again, or use jsonl") from None
        yield from enumerate(table.to_pylist(), start=1)
        return
    with path.open("rb") as lines:  # bytes: the line of an invalid UTF-8 byte is known
        for number, raw in enumerate(lines, start=1):
            row = _row(f"{path}:{number}", raw)
            if row is not None:
                yield number, row


def _row(where: str, raw: bytes) -> dict[str, Any] | None:
    """One jsonl line as a row; None when blank."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedFile(
            f"{where}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}): save the file as "
            "UTF-8"
        ) from None
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise MalformedFile(
            f"{where}: not JSON ({exc.msg} at column {exc.colno}): each line must be one JSON object (jsonl)"
        ) from None
    except RecursionError:
        raise MalformedFile(f"{where}: nested too deeply to read: flatten the row") from None
    except ValueError as exc:  # Python's cap on the digits of an integer (json gives no column)
        raise MalformedFile(
            f"{where}: a number has more than {sys.get_int_max_str_digits()} digits: write it as a string "
            f'("...") ({exc})'[:400]
        ) from None
    if not isinstance(row, dict):
        raise MalformedFile(
            f"{where}: a row must be a JSON object, not {type(row).__name__}: each line must be one JSON "
            "object (jsonl)"
        )
    return row


def _text(where: str, field: str, value: str) -> str:
    """`value`, refused when it cannot be sent as UTF-8 (a lone surrogate escape such as \\ud800)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = f"\\u{ord(value[exc.start]):04x}"
        raise DatasetError(
            f"{where}: field {field!r} holds a lone surrogate ({bad} at character {exc.start + 1}), which is "
            "not text: remove the escape, or pair it"
        ) from None
    return value


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
    """Prompts from `cfg.path`, each with a stable id (file stem + row number). A task that checks an
    answer (`NEEDS_ANSWER`) needs one in every row; the others (a judge, a reward model, a mix, your own)
    take it where a row has one, and carry the question as written (`task_data.question`: what a judge's
    rubric and a reward model read)."""
    if cfg.path is None:
        raise DatasetError(f"task `{cfg.task}` needs prompts.path (a jsonl or parquet file)")
    path = Path(cfg.path)
    if not path.is_file():
        raise DatasetError(f"prompt file {path} does not exist")
    rows = list(numbered_rows(path))
    order = list(range(len(rows)))
    if cfg.shuffle:
        random.Random(cfg.seed).shuffle(order)
    if cfg.count is not None:
        order = order[: cfg.count]
    for index in order:
        line, row = rows[index]
        where = f"{path}:{line}, row {index + 1}"
        needed = (cfg.prompt_field, cfg.answer_field) if cfg.task in NEEDS_ANSWER else (cfg.prompt_field,)
        for field in needed:
            if row.get(field) is None:
                raise DatasetError(f"{where}: no field {field!r} (has {sorted(row)})")
        raw = row.get(cfg.answer_field)
        answer = None if raw is None else _text(where, cfg.answer_field, answer_text(raw))
        question = _text(where, cfg.prompt_field, str(row[cfg.prompt_field]))
        yield Prompt(
            prompt_id=f"{path.stem}-{index:06d}",
            task=cfg.task,
            text=_text(where, cfg.prompt_field, cfg.template.replace(PLACEHOLDER, question)),
            answer=answer,
            task_data=None if cfg.task in NEEDS_ANSWER else {"question": question},
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
