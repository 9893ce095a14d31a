"""Reading a final answer out of text: the content of its last `\\boxed{}`. The reward service's math
verifier reads completions with it, the datasets read reference answers (Minerva's solutions) with it, so
a box means the same on both sides."""

from __future__ import annotations

BOX_COMMANDS = ("\\boxed", "\\fbox")  # a final answer in either counts as boxed


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (balanced braces, `\\{` skipped); None if absent.

    An unclosed last box (a truncated completion) counts as absent content: the model never finished its
    answer, so an earlier box must not be credited in its place.
    """
    start = max(text.rfind(cmd) for cmd in BOX_COMMANDS)
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        # `\boxed 5`: TeX takes the next token.
        token = text[i:].split(maxsplit=1)
        return token[0].rstrip("$.") if token else None
    depth = 0
    j = i
    while j < len(text):
        char = text[j]
        if char == "\\":
            j += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
        j += 1
    return None
