"""Control commands: pause, resume, stop, checkpoint and live hyperparameter changes.

Writer: the control API (REST), which wraps each request body in a `ControlCommand` envelope. Readers:
the learner and every rollout worker; each applies what concerns it (pause / resume / stop act on both,
checkpoint and set_hparams on the learner). The body is a union discriminated by `command`, so an
unknown command fails validation with the list of known ones.
"""

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, Strict, model_validator
from pydantic_core import PydanticCustomError

from sparkrl.proto.base import WireModel
from sparkrl.proto.names import CheckpointTag

CONTROL_SCHEMA_VERSION = 1

HparamValue = bool | int | float | str


def _not_a_string_or_bool(value: Any) -> Any:
    """Lax pydantic takes `"0.001"` as a number and `true` as 1.0 (which then failed a bound, with a message
    about the bound); a live value is a JSON number, and the message says what was sent instead."""
    if isinstance(value, bool):
        raise PydanticCustomError("number_type", "Input should be a number, not true or false")
    if isinstance(value, str):
        raise PydanticCustomError("number_type", "Input should be a number, not a string: send it unquoted")
    return value


# A live value as an operator sends it: a JSON number (an integer is a fine float), never coerced.
LiveFloat = Annotated[float, BeforeValidator(_not_a_string_or_bool), Strict()]
LiveInt = Annotated[int, BeforeValidator(_not_a_string_or_bool), Strict()]


class PauseCommand(WireModel):
    """Stop taking new work; keep state. Workers finish or abort in-flight generation; the learner
    finishes its current step."""

    command: Literal["pause"] = Field(description="Discriminator. Writer: control API. Readers: all.")
    reason: str | None = Field(
        default=None,
        max_length=500,
        description="Why, for the logs. Writer: control API (operator). Readers: all. None when not given.",
    )


class ResumeCommand(WireModel):
    """Take new work again after a pause."""

    command: Literal["resume"] = Field(description="Discriminator. Writer: control API. Readers: all.")


class StopCommand(WireModel):
    """Shut down cleanly: finish the current step, acknowledge what was used, exit."""

    command: Literal["stop"] = Field(description="Discriminator. Writer: control API. Readers: all.")
    checkpoint: bool = Field(
        default=True,
        description="Whether the learner writes a checkpoint before exiting. Writer: control API. Reader: "
        "learner.",
    )


class CheckpointCommand(WireModel):
    """Write a checkpoint after the current step."""

    command: Literal["checkpoint"] = Field(description="Discriminator. Writer: control API. Reader: learner.")
    tag: CheckpointTag | None = Field(
        default=None,
        description="Name of the checkpoint directory: one plain name (proto/names.py), never `latest` or "
        "`step-*`. Writer: control API. Reader: learner, which checks it again before it writes. None: the "
        "learner names it after its step.",
    )


class SetHparamsCommand(WireModel):
    """Change hyperparameters from the next step on (learning rate, Lp-Reg's ρ, κ, β, …)."""

    command: Literal["set_hparams"] = Field(
        description="Discriminator. Writer: control API. Reader: learner."
    )
    values: dict[Annotated[str, Field(min_length=1, max_length=128)], HparamValue] = Field(
        min_length=1,
        description='New values by hyperparameter name, e.g. `{"lr": 2e-6, "rho": 0.005}`; floats are '
        "finite. Writer: control API. Reader: learner, which rejects names it does not know and keeps the "
        "old values on any error.",
    )


ControlBody = Annotated[
    PauseCommand | ResumeCommand | StopCommand | CheckpointCommand | SetHparamsCommand,
    Field(discriminator="command"),
]


class HyperparameterPatch(WireModel):
    """Body of `PATCH /api/v1/hyperparameters`: the values to change, every field optional (at least one).

    Writer: an operator (REST, `sparkrl set`). Reader: control service, which checks each value against the
    settings models' bounds (422 naming the field and the bound) and sends the set to the learner (its keys)
    and the rollout workers (`temperature`, `top_p`) as one `set_hparams` command. A loss parameter must
    belong to the loss the learner runs. Values are strict JSON numbers: `"0.001"` and `true` are refused.
    """

    lr: LiveFloat | None = Field(default=None, description="Learning rate (learner.lr).")
    max_staleness: LiveInt | None = Field(
        default=None,
        description="Versions a group may lag before it is made again (learner.max_staleness).",
    )
    kappa: LiveFloat | None = Field(
        default=None, description="Min-p κ of the Lp-Reg proxy (learner.proxy_kappa)."
    )
    beta: LiveFloat | None = Field(default=None, description="Lp-Reg: weight of the pull toward the proxy.")
    rho: LiveFloat | None = Field(default=None, description="Lp-Reg: fraction of A<0 tokens considered.")
    rho_pos: LiveFloat | None = Field(default=None, description="Lp-Reg: fraction of A>0 tokens considered.")
    clip_low: LiveFloat | None = Field(default=None, description="ε_low of the active clipped loss.")
    clip_high: LiveFloat | None = Field(default=None, description="ε_high of the active clipped loss.")
    entropy_coef: LiveFloat | None = Field(default=None, description="entropy_bonus: weight of −entropy.")
    top_frac: LiveFloat | None = Field(default=None, description="eighty_twenty: fraction of tokens trained.")
    kl_cov_ratio: LiveFloat | None = Field(default=None, description="kl_cov: fraction of tokens penalized.")
    ppo_kl_coef: LiveFloat | None = Field(default=None, description="kl_cov: weight of the penalty.")
    clip_cov_ratio: LiveFloat | None = Field(default=None, description="clip_cov: fraction detached.")
    clip_cov_lb: LiveFloat | None = Field(default=None, description="clip_cov: lower covariance bound.")
    clip_cov_ub: LiveFloat | None = Field(default=None, description="clip_cov: upper covariance bound.")
    delta_low: LiveFloat | None = Field(default=None, description="dppo: probability fall that masks A<0.")
    delta_high: LiveFloat | None = Field(default=None, description="dppo: probability rise that masks A>0.")
    max_weight: LiveFloat | None = Field(default=None, description="dppo: cap of the importance weight.")
    prob_threshold: LiveFloat | None = Field(default=None, description="stapo: τ_p, a spurious token's p.")
    entropy_quantile: LiveFloat | None = Field(default=None, description="stapo: τ_h as an entropy quantile.")
    temperature: LiveFloat | None = Field(default=None, description="Rollout sampling temperature (workers).")
    top_p: LiveFloat | None = Field(default=None, description="Rollout nucleus mass (workers).")

    @model_validator(mode="after")
    def _not_empty(self) -> "HyperparameterPatch":
        if not self.values():
            raise ValueError(f"give at least one of: {', '.join(type(self).model_fields)}")
        return self

    def values(self) -> dict[str, HparamValue]:
        """The fields that were given, by name."""
        return {name: value for name, value in self.model_dump(exclude_none=True).items()}


class ControlState(WireModel):
    """The fleet's desired state, which a service (re)starting adopts before its first step: paused or not,
    and the live sampling values. Writer: control service, with every pause / resume / set_hparams it
    issues. Readers: learner and rollout workers, at start (live changes come as commands)."""

    schema_version: Literal[1] = Field(
        default=CONTROL_SCHEMA_VERSION, description="Wire version; readers reject others."
    )
    paused: bool = Field(default=False, description="Whether the fleet is paused. Writer: control service.")
    sampling: dict[Annotated[str, Field(min_length=1, max_length=64)], float] = Field(
        default_factory=dict,
        description="Rollout sampling values changed live (`temperature`, `top_p`); empty: as configured. "
        "Writer: control service. Readers: rollout workers.",
    )
    updated_at: float = Field(
        ge=0, description="Unix time (s) of the last change. Writer: control service. Readers: logs."
    )


class ControlCommand(WireModel):
    """The envelope of a control command. Writer: control API. Readers: learner, rollout workers."""

    schema_version: Literal[1] = Field(
        default=CONTROL_SCHEMA_VERSION, description="Wire version; readers reject others."
    )
    command_id: str = Field(
        min_length=1,
        max_length=128,
        description="Unique id of the command, so a reader applies a re-delivered command once and can "
        "acknowledge it by id. Writer: control API. Readers: learner, rollout workers.",
    )
    issued_at: float = Field(
        ge=0, description="Unix time (s) the API accepted it. Writer: control API. Readers: all (logs)."
    )
    body: ControlBody = Field(
        description="What to do. Writer: control API. Readers: learner, rollout workers."
    )
