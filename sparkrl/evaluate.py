"""`sparkrl eval`: a model (a directory, a checkpoint, or a run's latest checkpoint) on held-out problems —
the countdown held-out split, or a math benchmark file (`../shared/data/math-eval/`, or any jsonl/parquet
with a question and an answer) — scored by the reward service's verifiers, run in this process. The
sampling, pass@k and the split live in `services/common/tasks/evaluation.py`, shared with the in-training
evaluator.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from sparkrl.proto import Prompt
from sparkrl.services.common.settings import (
    CountdownSettings,
    PromptFormat,
    PromptSettings,
    TorchEngineSettings,
)
from sparkrl.services.common.tasks.evaluation import EvalResult, evaluate_engine, heldout_countdown, pass_at_k

__all__ = ["EvalResult", "evaluate", "heldout_countdown", "local_scorer", "math_tasks", "pass_at_k"]


def resolve_model(path: Path) -> Path:
    """A model directory as given, a checkpoint's (`…/step-N` → `hf/`), or a run's latest checkpoint.

    `checkpoints/latest` (a link, or a file naming the folder in older runs) is followed as the learner
    follows it: only to one plain folder name directly inside `checkpoints/` (`latest_target`)."""
    from sparkrl.services.learner.checkpoint_folder import latest_target

    for candidate in (path, path / "hf"):
        if (candidate / "config.json").is_file():
            return candidate
    latest = latest_target(path / "checkpoints")
    if latest is not None and (latest / "hf" / "config.json").is_file():
        return latest / "hf"
    raise FileNotFoundError(
        f"{path}: no model here (config.json), nor a checkpoint's hf/, nor a run's checkpoints/latest "
        "naming a checkpoint inside checkpoints/"
    )


# Field names of the benchmark files in ../shared/data/math-eval/, tried in order when none are given.
QUESTION_FIELDS = ("problem", "question", "prompt")
ANSWER_FIELDS = ("answer", "final_answer", "solution")


def math_tasks(
    path: Path,
    count: int | None = None,
    prompt_field: str | None = None,
    answer_field: str | None = None,
    template: str = "{prompt}",
) -> list[Prompt]:
    """The rows of a math benchmark file as problems; fields not given are found among the benchmarks'
    names (MATH-500's `problem`/`answer`, OlympiadBench's `question`/`final_answer`, Minerva's
    `solution`). DatasetError names a missing field."""
    from sparkrl.services.common.tasks.datasets import DatasetError, file_prompts, read_rows

    if not path.is_file():
        raise DatasetError(f"math file {path} does not exist")
    if prompt_field is None or answer_field is None:
        first = next(iter(read_rows(path)), None)
        if first is None:
            raise DatasetError(f"{path} has no rows")
        prompt_field = prompt_field or _first_present(first, QUESTION_FIELDS, path, "question")
        answer_field = answer_field or _first_present(first, ANSWER_FIELDS, path, "answer")
    cfg = PromptSettings(
        task="math",
        path=str(path),
        prompt_field=prompt_field,
        answer_field=answer_field,
        count=count,
        template=template,
    )
    return list(file_prompts(cfg))


def _first_present(row: dict[str, object], names: tuple[str, ...], path: Path, what: str) -> str:
    from sparkrl.services.common.tasks.datasets import DatasetError

    for name in names:
        if row.get(name) is not None:
            return name
    raise DatasetError(f"{path}: no {what} field among {list(names)} (has {sorted(row)}); name it")


def local_scorer(tasks: list[Prompt], texts: list[str]) -> list[bool]:
    """The reward service's verifier for each problem's task, called in this process."""
    from sparkrl.services.reward.verifiers import registry, run_verifier

    verifiers = registry()
    verdicts = []
    for task, text in zip(tasks, texts, strict=True):
        if task.task not in verifiers:
            raise ValueError(f"no verifier for task {task.task!r} (known: {sorted(verifiers)})")
        _, status, _ = run_verifier(verifiers[task.task], text, task.answer, task.task_data)
        verdicts.append(status == "correct")
    return verdicts


def evaluate(
    path: Path,
    problems: int = 256,
    n: int = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 24,
    seed: int = 0,
    threads: int | None = None,
    tasks: list[Prompt] | None = None,
    difficulty: CountdownSettings | None = None,
    fmt: PromptFormat | None = None,
    eos_tokens: Sequence[str | int] | None = None,
) -> EvalResult:
    """`tasks`: these problems instead of the countdown held-out split's first `problems`; `fmt` and
    `eos_tokens`: the run's `rollout` chat template, its variables, system prompt and stop tokens (None:
    the defaults)."""
    from sparkrl.services.rollout.torch_engine import TorchEngine  # torch only when evaluating

    model_dir = resolve_model(path)
    tasks = tasks if tasks is not None else heldout_countdown(problems, difficulty)
    settings = TorchEngineSettings(threads=threads, max_batch_sequences=256)
    engine = TorchEngine(model_dir, settings, eos_tokens=eos_tokens)
    try:
        return evaluate_engine(
            engine,
            tasks,
            local_scorer,
            n,
            temperature,
            max_new_tokens,
            seed,
            model=str(model_dir),
            fmt=fmt or PromptFormat(),
        )
    finally:
        engine.close()
