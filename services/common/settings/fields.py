"""Every leaf field of a settings model, with its type, default and description: what `sparkrl config show`,
the settings reference and the settings' own "did you mean" read.

Variants chosen by name (`learner.loss`, `rollout.engine`) are listed one block per variant, under the
field's path with the name in brackets: `learner.loss[clip_higher].clip_high`.
"""

from __future__ import annotations

import json
import re
import types
import typing
from typing import Any, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo


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
