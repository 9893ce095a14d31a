"""Control commands: pause, resume, stop, checkpoint and live hyperparameter changes.

Writer: the control API (REST), which wraps each request body in a `ControlCommand` envelope. Readers:
the learner and every rollout worker; each applies what concerns it (pause / resume / stop act on both,
checkpoint and set_hparams on the learner). The body is a union discriminated by `command`, so an
unknown command fails validation with the list of known ones.
"""

from typing import Annotated, Literal

from pydantic import Field

from sparkrl.proto.base import WireModel

CONTROL_SCHEMA_VERSION = 1

HparamValue = bool | int | float | str


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
    tag: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Name of the checkpoint directory. Writer: control API. Reader: learner. None: the "
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
