"""Names that become file names: what a message may carry that a reader turns into a path component.

A name from the wire is one component of a path under a folder the reader owns, never a path: one or
more of `A-Z a-z 0-9 . _ -`, starting with a letter or a digit (so never `.`, `..`, a hidden name, or
something an option parser would read as a flag), at most 128 characters. A checkpoint tag must also not
collide with the names the learner makes itself (`step-NNNNNN`, `latest`). The reader still checks that
the path it builds resolves inside its folder (`services/learner/checkpoint.py`): this is the first of
two locks, the one that answers the sender with a 422.
"""

import re
from typing import Annotated

from pydantic import AfterValidator, Field

SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
RESERVED_CHECKPOINT_NAMES = ("latest",)  # and every `step-*`: the learner's own folders
RESERVED_CHECKPOINT_PREFIX = "step-"


def safe_name(value: str) -> str:
    """`value` when it is one safe path component (see the module's docstring); ValueError naming why
    not and what is allowed."""
    if SAFE_NAME.fullmatch(value) is None:
        shown = value if len(value) <= 40 else value[:40] + "…"
        raise ValueError(
            f"{shown!r} is not a plain name: use 1 to 128 of A-Z a-z 0-9 . _ -, starting with a letter or a "
            "digit (no '/', no '.' or '..', no hidden name)"
        )
    return value


def checkpoint_tag(value: str) -> str:
    """`value` when it may name a checkpoint folder: a safe name that is not one the learner makes."""
    safe_name(value)
    lowered = value.lower()
    if lowered in RESERVED_CHECKPOINT_NAMES or lowered.startswith(RESERVED_CHECKPOINT_PREFIX):
        raise ValueError(
            f"{value!r} is a name the learner gives its own checkpoints ('latest', 'step-*'): "
            "pick another tag"
        )
    return value


CheckpointTag = Annotated[
    str,
    Field(min_length=1, max_length=128, examples=["before-lr-change"]),
    AfterValidator(checkpoint_tag),
]
