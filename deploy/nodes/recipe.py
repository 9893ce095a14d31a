"""docs/deployment.md's "Three machines, step by step" as the smoke runs it: each bash block cut at its
`# on X` lines into chunks, each chunk a script for the machines it names, run as printed.

The section's first block holds the values a cluster changes (`A=… B=… C=…`, `THIS`, `IFACE`, `SHARED`,
`SECRETS`, and the line that enters the checkout); the smoke puts the test bed's in their place
(`values_script`) and runs every other line as it is. A `# on every machine` chunk is what each terminal of
its subsection typed first (Ray's token): it opens every later chunk of that subsection.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

SECTION = "## Three machines, step by step"
VALUES = ("A", "B", "C", "THIS", "IFACE", "SHARED", "SECRETS")
LETTERS = ("A", "B", "C")


class RecipeError(RuntimeError):
    """The document no longer has a command the smoke runs: the two must change together."""


@dataclass(frozen=True)
class Chunk:
    """Lines typed on some machines: `where` as the document says it (`A`, `B and C`, `every machine`)."""

    part: str  # the subsection it is in ("" before the first ###)
    where: str
    lines: tuple[str, ...]

    @property
    def machines(self) -> tuple[str, ...]:
        if self.where.startswith(("every", "each", "any")):
            return LETTERS
        return tuple(letter for letter in LETTERS if re.search(rf"\b{letter}\b", self.where))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@dataclass(frozen=True)
class Recipe:
    chunks: tuple[Chunk, ...]
    source: Path

    def find(self, part: str, where: str, says: str) -> Chunk:
        """The chunk of subsection `part` typed on `where` whose text contains `says`."""
        for chunk in self.chunks:
            if chunk.part.startswith(part) and chunk.where.startswith(where) and says in chunk.text:
                return chunk
        raise RecipeError(
            f"{self.source}, {SECTION} / {part or '(top)'}: no `# on {where}` block with {says!r}; "
            "deploy/nodes/smoke.py runs that section's commands as printed: change the two together"
        )

    def opening(self, part: str) -> str:
        """What every terminal of subsection `part` typed first (its `# on every machine` chunks); the
        values block, before the first subsection, is the test bed's (`values_script`)."""
        opening = [c for c in self.chunks if part and c.part == part and c.where == "every machine"]
        return "\n".join(c.text for c in opening)


def read(path: Path) -> Recipe:
    text = path.read_text()
    if SECTION not in text:
        raise RecipeError(f"{path} has no {SECTION!r} section: the smoke runs its commands")
    section = text[text.index(SECTION) + len(SECTION) :]
    end = re.search(r"^## ", section, flags=re.M)
    section = section[: end.start()] if end else section
    chunks: list[Chunk] = []
    part = ""
    for piece in re.split(r"^(### .*)$", section, flags=re.M):
        if piece.startswith("### "):
            part = piece[4:].strip()
            continue
        for block in re.findall(r"```bash\n(.*?)```", piece, flags=re.S):
            chunks += _chunks(part, block, path)
    _check_values(chunks, path)
    return Recipe(tuple(chunks), path)


def _chunks(part: str, block: str, path: Path) -> list[Chunk]:
    chunks: list[Chunk] = []
    where, lines = "", []
    for line in block.splitlines():
        said = re.match(r"# on (.+?)(?::.*)?$", line)
        if said:
            if where:
                chunks.append(Chunk(part, where, tuple(lines)))
            where, lines = said.group(1).strip(), []
        elif not where and line.strip():
            raise RecipeError(f"{path}: a command before any `# on MACHINE` line: {line!r}")
        else:
            lines.append(line)
    if where:
        chunks.append(Chunk(part, where, tuple(lines)))
    return chunks


def _check_values(chunks: list[Chunk], path: Path) -> None:
    if not chunks or chunks[0].where != "every machine" or chunks[0].part:
        raise RecipeError(f"{path}, {SECTION}: its first block must be `# on every machine`, the values")
    names = re.findall(r"(?:^|\s)([A-Z]+)=", chunks[0].text, flags=re.M)
    if tuple(sorted(names)) != tuple(sorted(VALUES)) or "source .venv/bin/activate" not in chunks[0].text:
        raise RecipeError(
            f"{path}, {SECTION}: the first block sets {', '.join(names)}; the smoke puts the test bed's "
            f"values in place of exactly {', '.join(VALUES)} and the checkout's activate line"
        )


def values_script(values: dict[str, str], root: Path) -> str:
    """The first block, as the test bed's: its values, the checkout entered and activated."""
    assigned = " ".join(f"{name}={shlex.quote(values[name])}" for name in VALUES)
    return f"{assigned}\ncd {shlex.quote(str(root))} && source .venv/bin/activate"


def script(recipe: Recipe, chunk: Chunk, values: dict[str, str], root: Path) -> str:
    """A chunk as one bash script for one machine: the values, its subsection's opening, the lines."""
    opening = recipe.opening(chunk.part) if chunk.where != "every machine" else ""
    # -e: a command that fails ends the chunk with its status, as it would stop someone typing them.
    return "\n".join(["set -e", values_script(values, root), opening, chunk.text])
