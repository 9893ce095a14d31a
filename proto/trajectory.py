"""Prompts in, trajectory groups out: what a rollout worker reads and what the learner trains on.

Flow: the controller writes `Prompt`s to the prompt stream; a rollout worker samples `n` `Completion`s
per prompt, has them scored, and publishes one `TrajectoryGroup` (`group.py`; binary, `codec.py`) that the
learner reads. Per-token arrays are numpy (`tensors.py`); T is a completion's number of generated
tokens, K the number of top-k entries recorded per position, P the prompt's number of tokens.
"""

import hashlib
from typing import Any, Literal

import numpy as np
from pydantic import Field, ValidationInfo, model_validator

from sparkrl.proto.base import WireModel
from sparkrl.proto.checks import check_token_arrays
from sparkrl.proto.errors import FieldError
from sparkrl.proto.tensors import Float32Array1D, Float32Array2D, Int32Array1D, Int32Array2D

TRAJECTORY_SCHEMA_VERSION = 1
MAX_VOCAB_SIZE = 2**31 - 1  # ids travel as int32

# The codec checks the arrays of a whole group at once (one vectorized pass per field over the
# concatenated buffers) and then validates the models with this context, so the per-completion
# validators skip the value scans they would otherwise repeat. Only this module's sentinel counts.
_PRECHECKED_KEY = "sparkrl.proto.arrays_prechecked"
_PRECHECKED = object()


def prechecked_context() -> dict[str, object]:
    """Validation context for arrays already value-checked by `checks.check_token_arrays` (codec only)."""
    return {_PRECHECKED_KEY: _PRECHECKED}


def is_prechecked(info: ValidationInfo) -> bool:
    return isinstance(info.context, dict) and info.context.get(_PRECHECKED_KEY) is _PRECHECKED


def group_id_for(prompt_id: str) -> str:
    """The group id of a prompt delivery: `g-` + blake2b-128 of the prompt id, hex.

    Deterministic so a worker that crashes after publishing and retries the same prompt publishes the
    same id, and the learner trains on it once.
    """
    return "g-" + hashlib.blake2b(prompt_id.encode("utf-8"), digest_size=16).hexdigest()


class ChatMessage(WireModel):
    """One chat turn, for prompts that go through the tokenizer's chat template."""

    role: Literal["system", "user", "assistant", "tool"] = Field(
        description="Speaker. Writer: controller (from the dataset). Reader: rollout worker's chat template."
    )
    content: str = Field(description="The turn's text. Writer: controller. Reader: rollout worker.")


class Prompt(WireModel):
    """A prompt to sample a group for. Writer: controller (prompt stream). Reader: rollout worker.

    Exactly one of `text` and `messages` is set.
    """

    schema_version: Literal[1] = Field(
        default=TRAJECTORY_SCHEMA_VERSION, description="Wire version; readers reject others."
    )
    prompt_id: str = Field(
        min_length=1,
        max_length=256,
        description="Unique per delivery of a prompt into the stream (dataset row and epoch, e.g. "
        "`gsm8k/train/1234@2`). Writer: controller. Readers: rollout worker (derives the group id from it "
        "with `group_id_for`), learner (de-duplicates replays by group id).",
    )
    task: str = Field(
        min_length=1,
        max_length=64,
        description="Verifier name in the reward service's registry (`math`, `countdown`, …). Writer: "
        "controller. Readers: rollout worker, reward service.",
    )
    text: str | None = Field(
        default=None,
        description="The prompt exactly as the model sees it, already formatted (no chat template is "
        "applied). Writer: controller. Reader: rollout worker. None when `messages` is given.",
    )
    messages: list[ChatMessage] | None = Field(
        default=None,
        min_length=1,
        description="Chat turns for the tokenizer's chat template (the worker adds the generation prompt). "
        "Writer: controller. Reader: rollout worker. None when `text` is given.",
    )
    answer: str | None = Field(
        default=None,
        description="Reference answer for the verifier (e.g. `42`, `\\frac{1}{2}`). Writer: controller. "
        "Reader: reward service (via the worker). None when the task needs none.",
    )
    task_data: dict[str, Any] | None = Field(
        default=None,
        description='Task-specific data for the verifier, e.g. countdown\'s `{"numbers": [3, 7, 8], '
        '"target": 24}`. Writer: controller. Reader: reward service (via the worker). None when the task '
        "needs none.",
    )
    source: str | None = Field(
        default=None,
        description="Dataset the prompt came from, for metrics. Writer: controller. Readers: learner, "
        "dashboards. None when unknown.",
    )

    @model_validator(mode="after")
    def _one_form(self) -> "Prompt":
        if (self.text is None) == (self.messages is None):
            raise FieldError("text", "exactly one of `text` and `messages` must be set")
        return self


class SamplingParams(WireModel):
    """How the completions of a group were sampled. Writer: rollout worker. Reader: learner."""

    temperature: float = Field(
        gt=0,
        description="Softmax temperature; `logprobs` and `topk_logprobs` are taken at it. Writer: rollout "
        "worker. Reader: learner (recomputes log-probs at the same temperature).",
    )
    top_p: float = Field(
        gt=0,
        le=1,
        description="Nucleus mass, 1.0 = off. Writer: rollout worker. Reader: learner (metrics).",
    )
    max_new_tokens: int = Field(
        ge=0,
        description="Generation budget in tokens; every completion's T is at most this. Writer: rollout "
        "worker. Reader: learner (length-normalization, metrics).",
    )


class Completion(WireModel):
    """One sampled response of a group, token by token. Writer: rollout worker. Reader: learner.

    T may be 0 (a budget of 0 new tokens). All arrays share T; the two top-k arrays share K.
    """

    token_ids: Int32Array1D = Field(
        description="Generated token ids, int32 [T], each in [0, vocab_size). Writer: rollout worker. "
        "Reader: learner."
    )
    logprobs: Float32Array1D = Field(
        description="Log-prob of each sampled token under the sampling distribution: softmax of the logits "
        "divided by the temperature over the full vocabulary (no top-p renormalization, so the learner can "
        "recompute it), float32 [T], finite, ≤ 0. Writer: rollout worker. Reader: learner (old_logp of the "
        "ratio, truncated importance sampling)."
    )
    topk_ids: Int32Array2D = Field(
        description="Ids of the K most likely tokens over the FULL vocabulary at each position, int32 [T, "
        "K], in the order of `topk_logprobs`. Writer: rollout worker. Reader: learner (Lp-Reg proxy)."
    )
    topk_logprobs: Float32Array2D = Field(
        description="Their log-probs at the sampling temperature, float32 [T, K], finite, ≤ 0, sorted "
        "descending along K (ties allowed). Writer: rollout worker. Reader: learner (Lp-Reg proxy)."
    )
    policy_versions: Int32Array1D = Field(
        description="Policy version of the weights each token was sampled under, int32 [T], ≥ 0; it can "
        "change mid-completion when the worker swaps weights. Writer: rollout worker. Reader: learner "
        "(staleness filter)."
    )
    text: str = Field(
        description="The decoded completion, without the prompt. Writer: rollout worker. Readers: reward "
        "service, learner (logging)."
    )
    finish_reason: Literal["stop", "length", "abort"] = Field(
        description="`stop`: EOS or a stop string; `length`: hit max_new_tokens; `abort`: cut short "
        "(pause/stop/weight reload). Writer: rollout worker. Reader: learner (masking, metrics)."
    )
    environment_spans: list[tuple[int, int]] | None = Field(
        default=None,
        max_length=4096,
        description="A multi-turn episode (docs/agents.md): the half-open ranges [start, end) of token "
        "positions the environment wrote (tool results, user turns and the template's delimiters "
        "around them), sorted, disjoint, within [0, T). They are context, never trained: their "
        "`logprobs` and `topk_logprobs` are 0, their `topk_ids` the token itself. Writer: rollout "
        "worker. Reader: learner (every loss and count takes the model's tokens only). None: every "
        "token is the model's.",
    )

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def model_tokens(self) -> int:
        """The tokens the model sampled (all but the environment's)."""
        return self.num_tokens - sum(end - start for start, end in self.environment_spans or ())

    def model_turns(self) -> list[int]:
        """The lengths of the model's runs of tokens between the environment's (one: T, if none; a
        sample that starts with the environment's tokens, a split episode's next part, has none before
        them)."""
        runs, start = [], 0
        for begin, end in [*(self.environment_spans or ()), (self.num_tokens, self.num_tokens)]:
            if begin > start:
                runs.append(begin - start)
            start = end
        return runs or [0]

    def model_token_mask(self) -> np.ndarray:
        """bool [T]: True where the model sampled the token."""
        mask = np.ones(self.num_tokens, dtype=bool)
        for start, end in self.environment_spans or ():
            mask[start:end] = False
        return mask

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> "Completion":
        T = self.token_ids.shape[0]
        for name in ("logprobs", "policy_versions"):
            if getattr(self, name).shape[0] != T:
                raise FieldError(name, f"has {getattr(self, name).shape[0]} entries, token_ids has T={T}")
        if self.topk_ids.shape[0] != T:
            raise FieldError("topk_ids", f"has {self.topk_ids.shape[0]} rows, token_ids has T={T}")
        if self.topk_logprobs.shape != self.topk_ids.shape:
            raise FieldError(
                "topk_logprobs",
                f"shape {list(self.topk_logprobs.shape)} differs from topk_ids {list(self.topk_ids.shape)}",
            )
        if not is_prechecked(info):
            check_token_arrays(
                self.token_ids, self.logprobs, self.policy_versions, self.topk_ids, self.topk_logprobs, None
            )
        _check_spans(self.environment_spans, T)
        return self


def _check_spans(spans: list[tuple[int, int]] | None, T: int) -> None:
    """Sorted, disjoint, non-empty ranges within [0, T)."""
    last = 0
    for index, (start, end) in enumerate(spans or ()):
        if not last <= start < end <= T:
            raise FieldError(
                f"environment_spans[{index}]",
                f"[{start}, {end}) is not a non-empty range after the previous one ({last}) within T={T}",
            )
        last = end


def completions_of_rows(
    token_ids: np.ndarray,
    logprobs: np.ndarray,
    topk_ids: np.ndarray,
    topk_logprobs: np.ndarray,
    policy_versions: np.ndarray,
    lengths: list[int],
    texts: list[str],
    finish_reasons: list[str],
) -> list[Completion]:
    """An engine's batch as completions: row r of each array ([B, S] or [B, S, K], padded past
    `lengths[r]`) holds completion r. Every value is checked in one vectorized pass over the rows' valid
    parts (errors name `completions[r].<field>`), not row by row as each `Completion` alone would."""
    mask = np.arange(token_ids.shape[1]) < np.asarray(lengths)[:, None]
    arrays = {
        "token_ids": token_ids.astype(np.int32, copy=False),
        "logprobs": logprobs.astype(np.float32, copy=False),
        "topk_ids": topk_ids.astype(np.int32, copy=False),
        "topk_logprobs": topk_logprobs.astype(np.float32, copy=False),
        "policy_versions": policy_versions.astype(np.int32, copy=False),
    }
    check_token_arrays(
        **{name: array[mask] for name, array in arrays.items()}, vocab_size=None, lengths=lengths
    )
    context = prechecked_context()
    return [
        Completion.model_validate(
            {name: array[row, :length] for name, array in arrays.items()}
            | {"text": text, "finish_reason": finish},
            context=context,
        )
        for row, (length, text, finish) in enumerate(zip(lengths, texts, finish_reasons, strict=True))
    ]
