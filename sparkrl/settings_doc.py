"""The settings, described from their models: `sparkrl config show` (a resolved tree, each field with its
description) and the README's settings reference (`python -m sparkrl.settings_doc --write` regenerates it;
a test keeps it current).

Variants chosen by name (`learner.loss`, `rollout.engine`) are listed one block per variant, under the
field's path with the name in brackets: `learner.loss[clip_higher].clip_high`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from sparkrl.services.common.settings import SparkSettings

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- settings-reference:start -->", "<!-- settings-reference:end -->"


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The settings models an annotation holds: itself, or each variant of a union."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) is typing.Annotated:
        return _models_in(get_args(annotation)[0])
    if get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for arg in get_args(annotation) for m in _models_in(arg)]
    return []


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    return re.sub(r"\bNoneType\b", "None", text)


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        return "(section)" if _models_in(field.annotation) else repr(field.default_factory())
    value = field.get_default()
    return "required" if value is ... else json.dumps(value, default=str)


def fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(path, type, default, description) of every leaf field under `model`, in declaration order."""
    rows: list[tuple[str, str, str, str]] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        variants = _models_in(field.annotation)
        if len(variants) > 1:  # a discriminated union: one block per variant
            for variant in variants:
                tag = get_args(
                    variant.model_fields["name" if "name" in variant.model_fields else "kind"].annotation
                )
                rows += fields(variant, f"{path}[{'|'.join(map(str, tag))}].")
        elif variants:
            rows += fields(variants[0], f"{path}.")
        else:
            rows.append((path, _type_name(field.annotation), _default(field), field.description or ""))
    return rows


def reference_table() -> str:
    lines = ["| setting | type | default | what |", "|---|---|---|---|"]
    for path, kind, default, description in fields(SparkSettings):
        cells = [f"`{path}`", f"`{kind}`", f"`{default}`", description]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


def readme_with_reference(text: str) -> str:
    """The README text with its reference section regenerated (between the markers)."""
    if START not in text or END not in text:
        raise ValueError(f"README.md lacks the {START} … {END} markers")
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
    parser = argparse.ArgumentParser(description="The settings reference of README.md.")
    parser.add_argument("--write", action="store_true", help="Regenerate README.md's reference section.")
    args = parser.parse_args()
    if args.write:
        README.write_text(readme_with_reference(README.read_text()))
        print(f"wrote the settings reference into {README}")
    else:
        sys.stdout.write(reference_table() + "\n")


if __name__ == "__main__":
    main()
