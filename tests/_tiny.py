"""The tiny countdown model, built once under the repo's `.cache/` and shared by every test and run.

Import the fixture into a test module (`from _tiny import tiny_model_dir`); pytest puts `tests/` on the
path. The first session builds it (about 20 s on 2 cores); later ones reuse it while the recipe holds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkrl.services.common.tiny_model import ensure_tiny_model

CACHE_DIR = Path(__file__).resolve().parents[1] / ".cache"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return ensure_tiny_model(CACHE_DIR)
