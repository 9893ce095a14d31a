"""Typed errors of the wire contracts, and the one place that turns pydantic errors into them.

Every error names the field it is about with a path such as `completions[3].topk_logprobs`, so a
dead-letter entry or a 4xx answer tells the producer exactly what to fix.
"""

from collections.abc import Sequence

from pydantic import ValidationError

MAX_REPORTED_ERRORS = 5


class FieldError(ValueError):
    """A value check failed on one field. Raised inside validators; `path` is relative to the model.

    Pydantic keeps the exception in the error's `ctx`, so `codec_error_from` can append `path` to the
    location pydantic reports (the model's position in the message) and name the exact field.
    """

    path: str
    reason: str

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class CodecError(ValueError):
    """A message could not be encoded or decoded. `path` names the field ("" for the whole payload)."""

    path: str
    reason: str

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}" if path else reason)
        self.path = path
        self.reason = reason


def format_loc(loc: Sequence[int | str]) -> str:
    """`("completions", 3, "token_ids")` → `completions[3].token_ids`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _join_paths(outer: str, inner: str) -> str:
    if not outer:
        return inner
    if not inner:
        return outer
    return f"{outer}{inner}" if inner.startswith("[") else f"{outer}.{inner}"


def _strip_value_error(msg: str) -> str:
    # pydantic prefixes messages of ValueErrors raised in validators; the prefix says nothing useful.
    prefix = "Value error, "
    return msg[len(prefix) :] if msg.startswith(prefix) else msg


def validation_problems(exc: ValidationError) -> list[tuple[str, str]]:
    """(path, reason) for each error pydantic reports, with `FieldError` paths folded in."""
    problems = []
    for err in exc.errors(include_url=False):
        path = format_loc(err["loc"])
        inner = err.get("ctx", {}).get("error")
        if isinstance(inner, FieldError):
            problems.append((_join_paths(path, inner.path), inner.reason))
        elif err["loc"] and err["loc"][-1] == "schema_version" and err["type"] == "literal_error":
            expected = err.get("ctx", {}).get("expected")
            problems.append(
                (path, f"unsupported schema_version {err['input']!r}; this build reads {expected}")
            )
        else:
            problems.append((path, _strip_value_error(err["msg"])))
    return problems


def codec_error_from(exc: ValidationError) -> CodecError:
    """One `CodecError` for a pydantic `ValidationError`: the first problem's path, all problems' text."""
    problems = validation_problems(exc)
    first_path, first_reason = problems[0]
    reason = first_reason
    for path, more in problems[1:MAX_REPORTED_ERRORS]:
        reason += f"; {path}: {more}" if path else f"; {more}"
    if len(problems) > MAX_REPORTED_ERRORS:
        reason += f"; … and {len(problems) - MAX_REPORTED_ERRORS} more"
    return CodecError(first_path, reason)
