"""Before anything starts: the task the prompts name is one the reward service will score (a rule verifier,
the judge, the reward model, a mix), and what that needs is set — each problem as (setting, what to do)."""

from __future__ import annotations

from pathlib import Path

from sparkrl.services.common.settings import SparkSettings
from sparkrl.services.common.settings.reward import JUDGE_TASK, REWARD_MODEL_TASK


def scored_tasks(cfg: SparkSettings) -> dict[str, str]:
    """Every task the reward service scores with these settings, each with what scores it."""
    from sparkrl.services.reward.verifiers import custom_verifier_name, registry

    reward = cfg.reward
    tasks = {name: "rule verifier" for name in registry()}
    tasks |= {custom_verifier_name(path): "your verifier" for path in reward.custom_verifiers}
    if reward.judge.url is not None or reward.judge.serve is not None:
        tasks[JUDGE_TASK] = "the LLM judge"
    if reward.model.path is not None:
        tasks[REWARD_MODEL_TASK] = "the reward model"
    return tasks


def problems(cfg: SparkSettings) -> list[tuple[str, str]]:
    """What stops the reward service scoring the prompts' task, as (setting, message naming the fix)."""
    found: list[tuple[str, str]] = []
    reward, scored = cfg.reward, scored_tasks(cfg)
    for name, mix in reward.mixes.items():
        for part in mix.parts:
            if part.verifier not in scored:
                found.append((f"reward.mixes.{name}", _unscored(part.verifier, scored)))
    task = cfg.prompts.task
    if task not in scored and task not in reward.mixes:
        found.append(("prompts.task", _unscored(task, scored | dict.fromkeys(reward.mixes, "a mix"))))
    model = reward.model.path
    if model is not None and not (Path(model) / "config.json").is_file():
        fix = "point it at a Hugging Face model folder"
        found.append(("reward.model.path", f"{model} has no config.json: {fix}"))
    judge = reward.judge
    if judge.serve is not None:
        if not (Path(judge.serve) / "config.json").is_file():
            found.append(("reward.judge.serve", f"{judge.serve} has no config.json: a model folder to serve"))
        if not Path(judge.serve_python).is_file():
            fix = "an interpreter with vLLM (`make vllm-env` makes .venv-vllm)"
            found.append(("reward.judge.serve_python", f"{judge.serve_python} does not exist: {fix}"))
    return found


def _unscored(task: str, scored: dict[str, str]) -> str:
    fix = {
        JUDGE_TASK: "set reward.judge.url (or reward.judge.serve, a model to serve as the judge)",
        REWARD_MODEL_TASK: "set reward.model.path (a sequence classifier's folder)",
    }.get(task, "name one of them, or add yours to reward.custom_verifiers / reward.mixes")
    return f"task {task!r} is not scored here (scored: {', '.join(sorted(scored))}): {fix}"
