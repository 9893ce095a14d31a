"""The built wheel carries every module of `proto/` and `services/` under `sparkrl.` and imports."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Build from a copy: setuptools' in-tree `build/` could carry stale modules into the wheel.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, source / name)
    for folder in ("sparkrl", "proto", "services"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(source)],
        check=True,
        timeout=300,
    )
    (path,) = out.glob("sparkrl-*.whl")
    return path


def _source_modules() -> set[str]:
    names = set()
    for folder in ("proto", "services"):
        for path in (REPO / folder).rglob("*.py"):
            names.add("sparkrl/" + path.relative_to(REPO).as_posix())
    return names


def test_wheel_contains_every_module(wheel: Path) -> None:
    contents = set(zipfile.ZipFile(wheel).namelist())
    missing = _source_modules() - contents
    assert not missing, f"wheel lacks {sorted(missing)}"
    assert "sparkrl/__init__.py" in contents
    assert any(name.startswith("sparkrl/proto/schema/") and name.endswith(".json") for name in contents)
    static = REPO / "services" / "control" / "static"
    pages = {"sparkrl/services/control/static/" + p.name for p in static.iterdir()}
    assert "sparkrl/services/control/static/index.html" in pages and pages <= contents


def test_wheel_imports_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    zipfile.ZipFile(wheel).extractall(tmp_path)
    code = "import sparkrl.proto, sparkrl.services.learner as l; print(l.__file__)"
    # -I: isolated mode, so neither the checkout nor the editable install's finder can serve the import.
    out = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r}); {code}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(tmp_path))
