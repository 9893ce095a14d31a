"""What the deployment files (compose, Kubernetes) are checked against: the settings tree itself."""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel

from sparkrl.services.common.settings import SparkSettings


def _models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in _models(arg)]


def settings_field(env_name: str) -> bool:
    """Whether SPARKRL_A__B__C names field a.b.c of the settings tree (in any variant of a union)."""
    models: list[type[BaseModel]] = [SparkSettings]
    for part in env_name.removeprefix("SPARKRL_").lower().split("__"):
        fields = [model.model_fields[part] for model in models if part in model.model_fields]
        if not fields:
            return False
        models = [model for field in fields for model in _models(field.annotation)]
    return True
