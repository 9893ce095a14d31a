"""Where sparkrl keeps what it builds (the tiny model, DeepSpeed's compiled ops), independent of the
working directory: `$SPARKRL_CACHE_DIR`, else a source checkout's own `.cache/` (what `make` uses), else
`$XDG_CACHE_HOME/sparkrl` (`~/.cache/sparkrl`) for an installed wheel.

A relative `model` of the form `.cache/NAME` (what the presets say) means NAME in that cache when it is not
there relative to the working directory, so `sparkrl up --preset demo` works from any directory.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SPARKRL_CACHE_DIR"
_CHECKOUT = Path(__file__).resolve().parents[2]  # the repository root, when running from a checkout


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "services").is_dir():
        return _CHECKOUT / ".cache"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "sparkrl"


def resolve_model_path(model: str) -> str:
    """`model` as given, unless it is a relative `.cache/NAME` that is not there but is in the cache."""
    path = Path(model)
    if path.is_absolute() or path.exists() or path.parts[:1] != (".cache",):
        return model
    cached = cache_dir().joinpath(*path.parts[1:])
    return str(cached) if cached.exists() else model
