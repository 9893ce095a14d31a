"""Environment service messages (`sparkrl env`, docs/agents.md): an episode started, its turns answered,
its reward read. Writer of requests: a rollout worker (`rollout.agent.url`). Reader: the environment
service, which holds each episode's environment between calls.

    POST   /episodes                 EpisodeStart  → EpisodeStarted   (422: the environment refused it)
    POST   /episodes/{id}/turns      EpisodeTurn   → EpisodeReply
    DELETE /episodes/{id}                          → EpisodeEnded     (the episode is forgotten)
"""

from typing import Any, Literal

from pydantic import Field

from sparkrl.proto.base import WireModel
from sparkrl.proto.trajectory import ChatMessage, Prompt

ENVIRONMENT_SCHEMA_VERSION = 1
MAX_TURN_CHARS = 200_000
EPISODE_ID_PATTERN = r"^[0-9a-f]{32}$"


class EpisodeStart(WireModel):
    """Start one episode. Writer: rollout worker. Reader: environment service."""

    schema_version: Literal[1] = Field(
        default=ENVIRONMENT_SCHEMA_VERSION, description="Wire version; readers reject others."
    )

    environment: str = Field(
        min_length=1, max_length=64, description="The environment's name in the service's registry."
    )
    prompt: Prompt = Field(description="The prompt the episode starts from (`reset` reads it).")


class EpisodeStarted(WireModel):
    """A started episode. Writer: environment service. Reader: rollout worker."""

    schema_version: Literal[1] = Field(
        default=ENVIRONMENT_SCHEMA_VERSION, description="Wire version; readers reject others."
    )

    episode_id: str = Field(pattern=EPISODE_ID_PATTERN, description="The id of the episode's later calls.")
    said: str | None = Field(
        default=None, max_length=MAX_TURN_CHARS, description="What `reset` adds to the prompt's last turn."
    )
    tools: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=256,
        description="The tools' JSON schemas, for `apply_chat_template(tools=…)`.",
    )


class EpisodeTurn(WireModel):
    """The model's turn. Writer: rollout worker. Reader: environment service."""

    schema_version: Literal[1] = Field(
        default=ENVIRONMENT_SCHEMA_VERSION, description="Wire version; readers reject others."
    )

    text: str = Field(max_length=MAX_TURN_CHARS, description="The model's turn, decoded.")


class EpisodeReply(WireModel):
    """The environment's answer to a turn. Writer: environment service. Reader: rollout worker."""

    schema_version: Literal[1] = Field(
        default=ENVIRONMENT_SCHEMA_VERSION, description="Wire version; readers reject others."
    )

    messages: list[ChatMessage] | None = Field(
        description="The environment's turn (tool results, a user message); None: the episode is over."
    )
    tool_calls: dict[str, int] = Field(
        default_factory=dict, description="The turn's tool calls by status (ok, malformed, timeout, ...)."
    )
    error: str | None = Field(
        default=None,
        max_length=2000,
        description="The environment's own code raised (`respond`): the episode ends `environment_error`.",
    )


class EpisodeEnded(WireModel):
    """An episode's end. Writer: environment service. Reader: rollout worker."""

    schema_version: Literal[1] = Field(
        default=ENVIRONMENT_SCHEMA_VERSION, description="Wire version; readers reject others."
    )

    reward: float | None = Field(description="`get_reward()`; None: the environment keeps none.")
    error: str | None = Field(default=None, max_length=2000, description="`get_reward` raised: what.")
