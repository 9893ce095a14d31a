"""The one settings tree people write, `SparkSettings`; each service reads only its role's part of it
(`roles.py`).

Sources, lowest to highest priority: field defaults < a YAML preset (`configs/<name>.yaml` or a path) <
environment (`SPARKRL_BUS__URL=...`, `__` separates levels) < `--set key.path=value` overrides.
Variants (engine, loss) are discriminated unions, so a typo fails when the config loads, not at step 300.
"""

from __future__ import annotations

import importlib.resources
import os
import re
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from sparkrl.services.common.losses import LossSettings, LpRegLoss
from sparkrl.services.common.paths import resolve_model_path
from sparkrl.services.common.settings.bus import BusSettings
from sparkrl.services.common.settings.engine import (
    EngineSettings,
    SamplingSettings,
    TorchEngineSettings,
    VllmEngineSettings,
)
from sparkrl.services.common.settings.evaluation import EvalSettings
from sparkrl.services.common.settings.learner import MAX_STALENESS, LearnerSettings
from sparkrl.services.common.settings.learner_knobs import (
    AdvantageSettings,
    KlSettings,
    LoraSettings,
    ScheduleSettings,
    TrackingSettings,
)
from sparkrl.services.common.settings.prompt_format import PromptFormat
from sparkrl.services.common.settings.prompts import CountdownSettings, PromptSettings
from sparkrl.services.common.settings.ray import RaySettings
from sparkrl.services.common.settings.reward import RewardSettings
from sparkrl.services.common.settings.rollout import RolloutSettings
from sparkrl.services.common.settings.servers import ControlSettings, EnvServiceSettings, MetricsEndpoint
from sparkrl.services.common.settings.supervision import SupervisionSettings, WorkerHealthSettings
from sparkrl.services.common.settings.sync import WeightSyncSettings

# Each section lives in its own file; they are re-exported here, the tree's one import point.
__all__ = [
    "MAX_STALENESS",
    "AdvantageSettings",
    "BusSettings",
    "ControlSettings",
    "CountdownSettings",
    "EngineSettings",
    "EvalSettings",
    "KlSettings",
    "LearnerSettings",
    "LoraSettings",
    "LossSettings",
    "LpRegLoss",
    "MetricsEndpoint",
    "PromptFormat",
    "PromptSettings",
    "RaySettings",
    "RewardSettings",
    "RolloutSettings",
    "SamplingSettings",
    "ScheduleSettings",
    "SupervisionSettings",
    "TorchEngineSettings",
    "TrackingSettings",
    "VllmEngineSettings",
    "WeightSyncSettings",
    "WorkerHealthSettings",
]


def _configs_dir() -> Path:
    """The presets: package data (so a wheel has them); a checkout installed before they were, its own."""
    try:
        return Path(str(importlib.resources.files("sparkrl.configs")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[3] / "configs"


CONFIGS_DIR = _configs_dir()


class SparkSettings(BaseSettings):
    """Root of the tree. Each service receives only its role's part (`roles.for_role`)."""

    model_config = SettingsConfigDict(
        env_prefix="SPARKRL_", env_nested_delimiter="__", extra="forbid", validate_assignment=True
    )

    model: str = Field(
        ".cache/tiny-countdown",
        description="Hugging Face model directory (config, weights, tokenizer) every service loads.",
    )
    run_dir: str = Field(
        "runs/default", description="Where logs, metrics, resolved configs and checkpoints go."
    )
    workers: int = Field(
        2,
        ge=1,
        le=1024,
        description="How many rollout workers `sparkrl up` starts (`--workers` overrides); on a small "
        "machine each one takes a core from the learner.",
    )
    bus: BusSettings = Field(default_factory=BusSettings)
    reward: RewardSettings = Field(default_factory=RewardSettings)
    env: EnvServiceSettings = Field(
        default_factory=EnvServiceSettings, description="The environment service (`sparkrl env`)."
    )
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    prompts: PromptSettings = Field(default_factory=PromptSettings)
    learner: LearnerSettings = Field(default_factory=LearnerSettings)
    sync: WeightSyncSettings = Field(default_factory=WeightSyncSettings)
    control: ControlSettings = Field(default_factory=ControlSettings)
    eval: EvalSettings = Field(
        default_factory=EvalSettings, description="Held-out evaluation while training."
    )
    ray: RaySettings = Field(default_factory=RaySettings, description="`sparkrl up --ray` only.")
    supervision: SupervisionSettings = Field(
        default_factory=SupervisionSettings, description="`sparkrl up` restarting what dies."
    )

    @field_validator("model")
    @classmethod
    def _model_from_the_cache(cls, model: str) -> str:
        return resolve_model_path(model)  # `.cache/tiny-countdown` from any working directory

    @model_validator(mode="after")
    def _filtering_needs_workers_that_keep_producing(self) -> SparkSettings:
        # A lockstep worker makes one step's share of groups per version, then waits for the next: the
        # groups filtered out would leave every step short until rollout.lockstep_wait_s passes.
        if self.learner.filter_groups != "none" and self.rollout.lockstep_groups is not None:
            raise ValueError(
                f"learner.filter_groups {self.learner.filter_groups} fills each batch with more groups than "
                "a lockstep worker makes per version (rollout.lockstep_groups): unset lockstep_groups "
                "(asynchronous workers keep producing) or set filter_groups none"
            )
        return self


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` → (["a", "b", "c"], value), the value parsed as YAML (so `3`, `true`, `[1, 2]` work),
    except for a text field, which takes the value as written: `prompts.template={prompt} … \\boxed{}.`
    is a sentence, not a YAML mapping."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override {text!r} is not key.path=value")
    path = key.strip().split(".")
    if _is_text_field(path):
        return path, raw
    return path, yaml.safe_load(raw)


def _is_text_field(path: list[str]) -> bool:
    """Whether the field at `path` takes text (str or str | None) in every variant that has it."""
    models: list[type[BaseModel]] = [SparkSettings]
    for index, part in enumerate(path):
        fields = [model.model_fields[part] for model in models if part in model.model_fields]
        if not fields:
            return False
        types = [t for f in fields for t in _alternatives(f.annotation)]
        if index == len(path) - 1:
            return str in types and all(t in (str, type(None)) for t in types)
        models = [t for t in types if isinstance(t, type) and issubclass(t, BaseModel)]
    return False


def _alternatives(annotation: Any) -> list[Any]:
    """The types a field's annotation allows: Annotated and unions unpacked, a container kept whole (a
    `list[str]` such as `rollout.sampling.stop` is not text: its value is parsed as YAML)."""
    if get_origin(annotation) is Annotated:
        return _alternatives(get_args(annotation)[0])
    if get_origin(annotation) in (Union, UnionType):  # `str | None`, a union of variants
        return [t for arg in get_args(annotation) for t in _alternatives(arg)]
    return [annotation]


DISCRIMINATORS = ("name", "kind")  # `learner.loss.name`, `rollout.engine.kind`


def _set_path(tree: dict[str, Any], path: list[str], value: Any, explicit: set[tuple[str, ...]]) -> None:
    """Set `value` at `path`. Switching a variant (`learner.loss.name: lp_reg → grpo`) drops the old
    variant's fields that came from the defaults or the preset, but keeps those the user set (`explicit`:
    environment and --set), so `rho` with `grpo` is an error in either order, never silently lost."""
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"override {'.'.join(path)}: {part} is not a section")
        node = child
    if path[-1] in DISCRIMINATORS and node.get(path[-1], value) != value:
        prefix = tuple(path[:-1])
        for key in list(node):
            if (*prefix, key) not in explicit:
                del node[key]
    node[path[-1]] = value
    explicit.add(tuple(path))


def _leaves(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[list[str], Any]]:
    out: list[tuple[list[str], Any]] = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out += _leaves(value, (*prefix, key))
        else:
            out.append(([*prefix, key], value))
    return out


def resolve_preset(preset: str) -> Path:
    """A preset name (`demo`) names `configs/demo.yaml`; anything else is a path."""
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") or path.exists():
        candidate = path
    else:
        candidate = CONFIGS_DIR / f"{preset}.yaml"
    if not candidate.is_file():
        known = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"preset {preset!r}: no file {candidate} (known presets: {', '.join(known)})")
    return candidate


def load_settings(preset: str | None = None, overrides: list[str] | None = None) -> SparkSettings:
    """Defaults < preset YAML < environment < overrides; raises pydantic's ValidationError on a bad key."""
    tree: dict[str, Any] = {}
    if preset is not None:
        tree = yaml.safe_load(resolve_preset(preset).read_text()) or {}
        if not isinstance(tree, dict):
            raise ValueError(f"preset {preset!r} is not a mapping")
    # Environment beats the preset: pydantic-settings reads it; its values are laid over the YAML tree one
    # by one, as --set's are (variants first: the env's order is not the user's).
    explicit: set[tuple[str, ...]] = set()
    from_env = _leaves(_env_tree())
    for path, value in sorted(from_env, key=lambda item: item[0][-1] not in DISCRIMINATORS):
        _set_path(tree, path, value, explicit)
    for text in overrides or []:
        path, value = parse_override(text)
        _set_path(tree, path, value, explicit)
    return SparkSettings(**tree)


def _env_tree() -> dict[str, Any]:
    """What the SPARKRL_* environment sets, as a tree of the settings' field names."""
    source = EnvSettingsSource(SparkSettings, env_prefix="SPARKRL_", env_nested_delimiter="__")
    return source()


def write_resolved(settings: BaseModel, path: Path, header: str = "") -> Path:
    """Write a fully resolved tree, or a role's part of it (`roles.py`), as YAML: that file alone
    reproduces a service (`--preset FILE`). `header`: comment lines on top, saying whose file it is.

    Refuses a tree holding the control token: a secret belongs in a 0600 file (`control.token_file`), and
    pydantic would write it masked anyway, breaking the service that reads it back."""
    control = getattr(settings, "control", None)
    if isinstance(control, ControlSettings) and control.token is not None:
        raise ValueError("refusing to write control.token into a config file: use control.token_file")
    if isinstance(control, ControlSettings) and control.read_token is not None:
        raise ValueError(
            "control.read_token is for a control service that gets its environment (compose, Kubernetes: "
            "SPARKRL_CONTROL__READ_TOKEN); `sparkrl up` writes no secret into a config file: use "
            "control.protect_reads there (the run's token, RUN_DIR/control-token, then reads too)"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    comment = "".join(f"# {line}\n".replace("# \n", "#\n") for line in header.splitlines())
    # Owner-only: a resolved tree may hold the Redis password and the weight-sync secret.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(comment + yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False))
    os.chmod(path, 0o600)
    return path


def describe_settings_error(exc: Exception) -> str:
    """A settings error for people: one line per problem, `path: what is wrong (got value)`, without
    pydantic's documentation links."""
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return str(exc)
    lines = [f"{exc.error_count()} invalid setting{'s' if exc.error_count() != 1 else ''}:"]
    for error in exc.errors():
        path = ".".join(str(part) for part in error["loc"])
        got = error.get("input")
        shown = "" if isinstance(got, dict) or error["type"] == "missing" else f" (got {got!r})"
        hint = _did_you_mean(path) if error["type"] == "extra_forbidden" else ""
        where = f"{path}: " if path else ""  # a check across sections has no one path
        lines.append(f"  {where}{error['msg']}{shown}{hint}")
    return "\n".join(lines)


def _did_you_mean(path: str) -> str:
    """`; did you mean learner.lr?` for a setting that does not exist but whose name is close to one in
    the same section (the deepest section the path names, a variant's tag skipped)."""
    import difflib

    from sparkrl.services.common.settings.fields import fields

    known = {re.sub(r"\[[^\]]*\]", "", p) for p, _, _, _ in fields(SparkSettings)}
    sections = {p.rsplit(".", 1)[0] for p in known if "." in p} | {""}
    parts, leaf = path.split(".")[:-1], path.split(".")[-1]
    section = next(".".join(parts[:n]) for n in range(len(parts), -1, -1) if ".".join(parts[:n]) in sections)
    prefix = f"{section}." if section else ""
    siblings = {p[len(prefix) :].split(".")[0] for p in known if p.startswith(prefix)}
    close = difflib.get_close_matches(leaf, sorted(siblings), n=1, cutoff=0.6)
    return f"; did you mean {prefix}{close[0]}?" if close else ""
