"""Prompt sources: the benchmark files load as they are (field names mapped), countdown is seeded."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkrl.services.common.settings import PromptSettings
from sparkrl.services.common.tasks.answers import last_boxed
from sparkrl.services.common.tasks.countdown import score_countdown
from sparkrl.services.common.tasks.datasets import DatasetError, iter_prompts

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "math-eval"
# file → (question field, answer field, rows)
BENCHMARKS = {
    "math500.jsonl": ("problem", "answer", 500),
    "aime24.jsonl": ("problem", "answer", 30),
    "amc23.jsonl": ("problem", "answer", 40),
    "minerva_math.jsonl": ("problem", "solution", 272),
    "olympiadbench.jsonl": ("question", "final_answer", 675),
}


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_benchmark_files_load_as_they_are(name: str) -> None:
    if not (DATA / name).is_file():
        pytest.skip(f"{DATA / name} not found (shared/ is not beside this checkout)")
    question, answer, rows = BENCHMARKS[name]
    cfg = PromptSettings(task="math", path=str(DATA / name), prompt_field=question, answer_field=answer)
    prompts = list(iter_prompts(cfg))
    assert len(prompts) == rows
    assert len({p.prompt_id for p in prompts}) == rows
    assert all(p.answer and "\\boxed" not in p.answer for p in prompts)
    assert all(p.task == "math" and p.text for p in prompts)


def test_answers_are_normalized() -> None:
    assert last_boxed(r"so \boxed{\frac{1}{2}} and finally \boxed{x^{2}}.") == "x^{2}"
    assert last_boxed("no box") is None


def test_template_count_shuffle_and_parquet(tmp_path: Path) -> None:
    rows = [{"q": f"What is {i}+{i}?", "a": 2 * i} for i in range(10)]
    path = tmp_path / "tiny.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = PromptSettings(
        task="math",
        path=str(path),
        prompt_field="q",
        answer_field="a",
        count=4,
        shuffle=True,
        seed=3,
        template="Q: {prompt}\nA:",
    )
    first, again = list(iter_prompts(cfg)), list(iter_prompts(cfg))
    assert first == again and len(first) == 4
    assert all(p.text.startswith("Q: What is") and p.text.endswith("A:") for p in first)
    assert {p.answer for p in first} <= {str(2 * i) for i in range(10)}


def test_a_missing_field_names_the_row_and_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "x", "answer": "1"}) + "\n" + json.dumps({"prompt": "y"}) + "\n")
    with pytest.raises(DatasetError, match="row 2: no field 'answer'"):
        list(iter_prompts(PromptSettings(task="math", path=str(path))))
    with pytest.raises(DatasetError, match=r"needs prompts\.path"):
        list(iter_prompts(PromptSettings(task="math")))


def test_countdown_prompts_are_seeded_and_solvable_data() -> None:
    cfg = PromptSettings(task="countdown", count=20, seed=5)
    prompts = list(iter_prompts(cfg))
    assert prompts == list(iter_prompts(cfg))
    assert len({p.prompt_id for p in prompts}) == 20
    for p in prompts:
        numbers, target = p.task_data["numbers"], p.task_data["target"]
        assert (
            score_countdown(str(target), numbers, target)[1] == "incorrect"
        )  # copying the target is no answer


BAD_LINES = {
    "invalid UTF-8": (b'{"prompt": "caf\xe9", "answer": "1"}', "not UTF-8 (byte 0xe9 at column 16)"),
    "a 100k-digit number": (b'{"prompt": "x", "answer": ' + b"7" * 100_000 + b"}", "write it as a string"),
    "deep nesting": (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    "a lone surrogate": (b'{"prompt": "a \\ud800 b", "answer": "1"}', "lone surrogate (\\ud800 at character"),
    "not an object": (b'["prompt", "answer"]', "a row must be a JSON object, not list"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_a_bad_line_is_one_error_naming_the_file_the_line_and_the_fix(tmp_path: Path, case: str) -> None:
    line, said = BAD_LINES[case]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "fine", "answer": "1"}\n\n' + line + b"\n")
    with pytest.raises(DatasetError) as error:
        list(iter_prompts(PromptSettings(task="math", path=str(path))))
    message = str(error.value)
    assert message.startswith(f"{path}:3") and said in message and "\n" not in message, message
    assert len(message) < 500


def test_a_file_that_is_not_parquet_is_one_error(tmp_path: Path) -> None:
    path = tmp_path / "data.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(
        DatasetError, match=r"data\.parquet: not a parquet file .*: write it again, or use jsonl"
    ):
        list(iter_prompts(PromptSettings(task="math", path=str(path))))
