"""Each role its own settings: what one service reads, and nothing of the other services'.

`SparkSettings` stays the tree people write (presets, environment, `--set`); a role config is the part of
it one service reads, each part named as in the tree. So a role's file (`sparkrl up` writes
`RUN_DIR/config/<service>.yaml` with only its role's sections) is a sub-tree: it loads as the tree too,
and every role command takes either that file or a whole tree (a preset, the one file compose and
Kubernetes mount) and keeps its own part (`for_role`, or the role's `of`).

A part is a whole section of the tree, or, where a role reads a few fields of a section that is another
service's, a narrower section of the same name holding just those (`RewardEndpoint`, `EvaluatorRollout`).
"""

from __future__ import annotations

from copy import copy
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sparkrl.services.common.settings import (
    BusSettings,
    ControlSettings,
    EvalSettings,
    LearnerSettings,
    PromptFormat,
    PromptSettings,
    RewardSettings,
    RolloutSettings,
    SamplingSettings,
    SparkSettings,
    VllmEngineSettings,
    WeightSyncSettings,
)
from sparkrl.services.common.settings.prompt_format import ChatTemplateMode, TemplateKwargs
from sparkrl.services.common.settings.rollout import AgentSettings
from sparkrl.services.common.settings.section import Section
from sparkrl.services.common.settings.servers import EnvServiceSettings

Role = Literal["control", "reward", "env", "learner", "rollout", "evaluator", "prompts"]

# As the tree's sections: an unknown key is an error, an assignment (`--worker-id`) is validated.
_ROLE_CONFIG = ConfigDict(extra="forbid", validate_assignment=True)


def _same_field(section: type[BaseModel], name: str) -> Any:
    """The tree's own field (default, bounds, description), for a narrower section that repeats it."""
    return copy(section.model_fields[name])


class RewardEndpoint(Section):
    """The client's part of the `reward` section: where the reward service answers."""

    url: str = _same_field(RewardSettings, "url")


class EvaluatorRollout(Section):
    """The evaluator's part of the `rollout` section: how long it waits for the learner's weight files, and
    how the workers render prompts and where their completions end (held-out problems are asked alike)."""

    model_wait_s: float = _same_field(RolloutSettings, "model_wait_s")
    chat_template: ChatTemplateMode = _same_field(RolloutSettings, "chat_template")
    chat_template_kwargs: TemplateKwargs = _same_field(RolloutSettings, "chat_template_kwargs")
    system_prompt: str | None = _same_field(RolloutSettings, "system_prompt")
    eos_tokens: list[str | int] | None = _same_field(RolloutSettings, "eos_tokens")
    agent: AgentSettings = _same_field(RolloutSettings, "agent")  # multi-turn: held-out episodes alike

    @property
    def prompt_format(self) -> PromptFormat:
        return PromptFormat.of(self)

    @classmethod
    def of(cls, rollout: RolloutSettings) -> EvaluatorRollout:
        return cls(**{name: getattr(rollout, name) for name in cls.model_fields})


class AnswerBudget(Section):
    """The feeder's part of `rollout.sampling`: the completion budget a prompt leaves room for."""

    max_new_tokens: int = _same_field(SamplingSettings, "max_new_tokens")


class TorchContext(Section):
    """The feeder's part of a torch `rollout.engine`: none (the model's own context)."""

    kind: Literal["torch"] = "torch"


class VllmContext(Section):
    """The feeder's part of a vLLM `rollout.engine`: the context it is capped to."""

    kind: Literal["vllm"] = "vllm"
    max_model_len: int | None = _same_field(VllmEngineSettings, "max_model_len")


class PromptBudget(Section):
    """The feeder's part of the `rollout` section: how long a prompt may be, as the workers resolve it
    (`services/common/prompt_limits.py`)."""

    max_prompt_tokens: int | None = _same_field(RolloutSettings, "max_prompt_tokens")
    max_prompt_chars_per_token: int = _same_field(RolloutSettings, "max_prompt_chars_per_token")
    overlong: Literal["drop", "truncate"] = _same_field(RolloutSettings, "overlong")
    sampling: AnswerBudget = Field(default_factory=AnswerBudget)
    engine: Annotated[TorchContext | VllmContext, Field(discriminator="kind")] = Field(
        default_factory=TorchContext
    )

    @classmethod
    def of(cls, rollout: RolloutSettings) -> PromptBudget:
        engine = rollout.engine
        context = (
            VllmContext(max_model_len=engine.max_model_len)
            if isinstance(engine, VllmEngineSettings)
            else TorchContext()
        )
        return cls(
            max_prompt_tokens=rollout.max_prompt_tokens,
            max_prompt_chars_per_token=rollout.max_prompt_chars_per_token,
            overlong=rollout.overlong,
            sampling=AnswerBudget(max_new_tokens=rollout.sampling.max_new_tokens),
            engine=context,
        )


def _model() -> Any:
    return Field(description="Hugging Face model directory (config, weights, tokenizer), resolved.")


def _run_dir() -> Any:
    return Field(description="The run directory: logs, metrics, resolved configs, checkpoints.")


class ControlConfig(BaseModel):
    """What `sparkrl control` reads: the bus (telemetry and commands) and its own section."""

    model_config = _ROLE_CONFIG

    bus: BusSettings
    control: ControlSettings

    @classmethod
    def of(cls, tree: SparkSettings) -> ControlConfig:
        """The control service's part of `tree`, copied."""
        t = tree.model_copy(deep=True)
        return cls(bus=t.bus, control=t.control)


class RewardConfig(BaseModel):
    """What `sparkrl reward` reads: its own section (the service never touches the bus)."""

    model_config = _ROLE_CONFIG

    reward: RewardSettings

    @classmethod
    def of(cls, tree: SparkSettings) -> RewardConfig:
        """The reward service's part of `tree`, copied."""
        return cls(reward=tree.reward.model_copy(deep=True))


class EnvConfig(BaseModel):
    """What `sparkrl env` reads: its own section."""

    model_config = _ROLE_CONFIG

    env: EnvServiceSettings

    @classmethod
    def of(cls, tree: SparkSettings) -> EnvConfig:
        """The environment service's part of `tree`, copied."""
        return cls(env=tree.env.model_copy(deep=True))


class _FollowsWeights(BaseModel):
    """The parts every role that holds the model shares: the model, the run directory, the bus and the
    weight sync (it follows, or makes, the announced versions)."""

    model_config = _ROLE_CONFIG

    model: str = _model()
    run_dir: str = _run_dir()
    bus: BusSettings
    sync: WeightSyncSettings

    @staticmethod
    def _shared(t: SparkSettings) -> dict[str, Any]:
        return {"model": t.model, "run_dir": t.run_dir, "bus": t.bus, "sync": t.sync}


class LearnerConfig(_FollowsWeights):
    """What `sparkrl learner` reads: the shared parts and its own section."""

    learner: LearnerSettings

    @classmethod
    def of(cls, tree: SparkSettings) -> LearnerConfig:
        """The learner's part of `tree`, copied."""
        t = tree.model_copy(deep=True)
        return cls(**cls._shared(t), learner=t.learner)


class RolloutConfig(_FollowsWeights):
    """What `sparkrl rollout` reads: the shared parts, its own section and where the reward service
    answers."""

    rollout: RolloutSettings
    reward: RewardEndpoint

    @classmethod
    def of(cls, tree: SparkSettings) -> RolloutConfig:
        """A rollout worker's part of `tree`, copied."""
        t = tree.model_copy(deep=True)
        return cls(**cls._shared(t), rollout=t.rollout, reward=RewardEndpoint(url=t.reward.url))


class EvaluatorConfig(_FollowsWeights):
    """What `sparkrl evaluator` reads: the shared parts, its own `eval` section, the prompts' format (the
    held-out problems are asked as the training ones: `prompts.template`, the workers' chat template and
    stop tokens), where the reward service answers, and how long to wait for the model."""

    eval: EvalSettings
    prompts: PromptSettings
    reward: RewardEndpoint
    rollout: EvaluatorRollout

    @classmethod
    def of(cls, tree: SparkSettings) -> EvaluatorConfig:
        """The evaluator's part of `tree`, copied."""
        t = tree.model_copy(deep=True)
        return cls(
            **cls._shared(t),
            eval=t.eval,
            prompts=t.prompts,
            reward=RewardEndpoint(url=t.reward.url),
            rollout=EvaluatorRollout.of(t.rollout),
        )


class PromptsConfig(BaseModel):
    """What `sparkrl prompts` reads: the bus it feeds, its own section, and how long a prompt may be (the
    model, whose context bounds it where its config is at hand, and the workers' limits)."""

    model_config = _ROLE_CONFIG

    model: str = _model()
    bus: BusSettings
    prompts: PromptSettings
    rollout: PromptBudget = Field(default_factory=PromptBudget)

    @classmethod
    def of(cls, tree: SparkSettings) -> PromptsConfig:
        """The feeder's part of `tree`, copied (the bus's set fields too: the feeder writes only into a
        Redis it was pointed at)."""
        t = tree.model_copy(deep=True)
        return cls(model=t.model, bus=t.bus, prompts=t.prompts, rollout=PromptBudget.of(t.rollout))


RoleConfig = (
    ControlConfig | RewardConfig | EnvConfig | LearnerConfig | RolloutConfig | EvaluatorConfig | PromptsConfig
)

ROLE_CONFIGS: dict[Role, type[RoleConfig]] = {
    "control": ControlConfig,
    "reward": RewardConfig,
    "env": EnvConfig,
    "learner": LearnerConfig,
    "rollout": RolloutConfig,
    "evaluator": EvaluatorConfig,
    "prompts": PromptsConfig,
}


def for_role(tree: SparkSettings, role: Role) -> RoleConfig:
    """`role`'s part of `tree`: its config, holding only the sections that service reads."""
    return ROLE_CONFIGS[role].of(tree)
