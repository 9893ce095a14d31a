"""The built wheel carries every module of `sparkrl/`, `proto/` and `services/` under `sparkrl.` and the
presets, imports outside the checkout, and runs the demo preset from another directory (issue 12, item 7)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import clean_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Build from a copy: setuptools' in-tree `build/` could carry stale modules into the wheel.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, source / name)
    for folder in ("sparkrl", "proto", "services", "configs"):
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
    names = {path.relative_to(REPO).as_posix() for path in (REPO / "sparkrl").rglob("*.py")}
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
    presets = {f"sparkrl/configs/{p.name}" for p in (REPO / "configs").glob("*.yaml")}
    assert "sparkrl/configs/demo.yaml" in presets and presets <= contents


def test_wheel_imports_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    zipfile.ZipFile(wheel).extractall(tmp_path)
    code = "import sparkrl.proto, sparkrl.cli, sparkrl.services.learner as l; print(l.__file__)"
    # -I: isolated mode, so neither the checkout nor the editable install's finder can serve the import.
    out = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r}); {code}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(tmp_path))


@pytest.mark.timeout(600)
def test_the_installed_wheel_runs_the_demo_preset_from_another_directory(
    wheel: Path,
    tmp_path: Path,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    # An environment holding the wheel and the dependencies (the checkout's venv, as a plain path: its
    # editable-install finder is not loaded), run from a directory that is not the checkout.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "env")], check=True)
    (lib,) = (tmp_path / "env" / "lib").glob("python3*")
    deps = next(p for p in map(Path, sys.path) if p.name == "site-packages" and (p / "torch").is_dir())
    (lib / "site-packages" / "deps.pth").write_text(f"{site}\n{deps}\n")
    python, elsewhere = str(tmp_path / "env" / "bin" / "python"), tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = clean_env()
    env |= {"SPARKRL_CACHE_DIR": str(tiny_model_dir.parent)}  # where the tiny model was built once
    where = subprocess.run([python, "-c", "import sparkrl; print(sparkrl.__file__)"], capture_output=True,
                           text=True, cwd=elsewhere, env=env, timeout=60)  # fmt: skip
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr

    command = [python, "-m", "sparkrl.cli", "up", "--preset", "demo", "--run-dir", "run"]
    done = subprocess.run(
        [*command, "--set", "learner.max_steps=3", "--set", "learner.checkpoint_every=3"],
        capture_output=True, text=True, cwd=elsewhere, env=env, timeout=500,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"run {elsewhere / 'run'}: 3 steps" in done.stdout
    assert (elsewhere / "run" / "checkpoints" / "step-000003").is_dir()
