"""The settings, described from their models: `sparkrl config show` (a resolved tree, each field with its
description) and the settings reference of docs/settings.md (`python -m sparkrl.settings_doc --write`
regenerates it; a test keeps it current).

Every field is listed by `services/common/settings/fields.py` (the settings' own "did you mean" uses it
too): variants chosen by name (`learner.loss`, `rollout.engine`) one block per variant, under the field's
path with the name in brackets: `learner.loss[clip_higher].clip_high`.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from sparkrl.services.common.settings import SparkSettings
from sparkrl.services.common.settings.fields import fields

DOC = Path(__file__).resolve().parents[1] / "docs" / "settings.md"
START, END = "<!-- settings-reference:start -->", "<!-- settings-reference:end -->"


def reference_table() -> str:
    lines = ["| setting | type | default | what |", "|---|---|---|---|"]
    for path, kind, default, description in fields(SparkSettings):
        cells = [f"`{path}`", f"`{kind}`", f"`{default}`", description]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


def with_reference(text: str) -> str:
    """docs/settings.md's text with its reference section regenerated (between the markers)."""
    if START not in text or END not in text:
        raise ValueError(f"{DOC} lacks the {START} … {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{reference_table()}\n{END}{tail}"


def annotated_yaml(settings: SparkSettings) -> str:
    """The resolved tree as YAML, each leaf followed by its description as a comment."""
    import yaml

    # Each field by its path with the variant it belongs to (`learner.loss[grpo].clip_low`): the tree holds
    # one variant per choice, and two variants may describe a field of the same name differently.
    described = {one: note for path, _, _, note in fields(SparkSettings) for one in _variant_paths(path)}
    out: list[str] = []

    def walk(node: Any, prefix: str, indent: int) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            pad = "  " * indent
            if isinstance(value, dict) and value:
                out.append(f"{pad}{key}:")
                chosen = f"{path}[{value.get('name', value.get('kind'))}]."  # a variant chosen by name
                walk(
                    value, chosen if any(k.startswith(chosen) for k in described) else f"{path}.", indent + 1
                )
                continue
            line = yaml.safe_dump({key: value}, default_flow_style=True, width=10_000).strip()
            line = line[1:-1] if line.startswith("{") else line
            note = described.get(path, "")
            out.append(f"{pad}{line}" + (f"  # {note}" if note else ""))

    walk(settings.model_dump(mode="json"), "", 0)
    return "\n".join(out) + "\n"


def _variant_paths(path: str) -> list[str]:
    """`learner.loss[ppo_clip|grpo].clip_low` → one path per variant name it holds."""
    found = re.search(r"\[([^\]]*)\]", path)
    if found is None:
        return [path]
    head, tail = path[: found.start()], path[found.end() :]
    return [f"{head}[{name}]{rest}" for name in found.group(1).split("|") for rest in _variant_paths(tail)]


def main() -> None:
    parser = argparse.ArgumentParser(description="The settings reference of docs/settings.md.")
    parser.add_argument("--write", action="store_true", help="Regenerate the reference in docs/settings.md.")
    args = parser.parse_args()
    if args.write:
        DOC.write_text(with_reference(DOC.read_text()))
        print(f"wrote the settings reference into {DOC}")
    else:
        sys.stdout.write(reference_table() + "\n")


if __name__ == "__main__":
    main()
