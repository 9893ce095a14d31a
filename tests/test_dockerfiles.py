"""Every Dockerfile installs the project from a /src that the packaging accepts, without a Docker engine.

Each `RUN ... pip install ".[extras]"` (or `pip install .`) of the project is replayed here: the `COPY`s
into /src since the last `rm -rf /src`, then the commands of that RUN that make stubs (`stub_packages.py`,
`mkdir`, `touch`), then the check — every directory of the package map (`[tool.setuptools] package-dir`)
is there with its `__init__.py`, and pip builds the wheel from what is there. A new package directory that
a Dockerfile's dependency layer or source layer does not create fails here, not 7 minutes into an image
build (issue 18: `configs` became a package and the compose image stopped building).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The images that run sparkrl (Dockerfile.prometheus installs Debian's Prometheus and nothing of ours).
DOCKERFILES = sorted(
    p for p in (ROOT / "deploy" / "docker").glob("Dockerfile.*") if p.name != "Dockerfile.prometheus"
)
sys.path.insert(0, str(ROOT / "deploy" / "docker"))
from stub_packages import package_dirs  # noqa: E402

# `pip install` of the project itself: `.` or `".[extras]"` among its arguments.
PROJECT_INSTALL = re.compile(r"pip install\b.*?(\s\.(\s|$)|\s[\"']?\.\[)")
STUB_COMMAND = re.compile(r"^(mkdir|touch)\b|stub_packages\.py")


@dataclass
class Instruction:
    line: int
    keyword: str
    args: str


def instructions(dockerfile: Path) -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    found: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(dockerfile.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if not pending:
            start = number
        pending.append(stripped.removesuffix("\\").strip())
        if not stripped.endswith("\\"):
            keyword, _, args = " ".join(pending).partition(" ")
            found.append(Instruction(start, keyword.upper(), args.strip()))
            pending = []
    return found


def project_installs(dockerfile: Path) -> list[Instruction]:
    return [i for i in instructions(dockerfile) if i.keyword == "RUN" and PROJECT_INSTALL.search(i.args)]


def replay_src(dockerfile: Path, install: Instruction, src: Path) -> None:
    """/src as the image has it when `install` runs (COPYs into it since it was last emptied, then stubs)."""
    workdir = "/"
    for instruction in instructions(dockerfile):
        if instruction.keyword == "WORKDIR":
            workdir = instruction.args
        elif instruction.keyword == "COPY" and workdir == "/src" and "--from" not in instruction.args:
            parts = [p for p in shlex.split(instruction.args) if not p.startswith("--")]
            *sources, dest = parts
            target = src / dest
            for source in sources:
                origin = ROOT / source
                if origin.is_dir():
                    shutil.copytree(
                        origin, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
                    )
                else:
                    (target if dest.endswith("/") else target.parent).mkdir(parents=True, exist_ok=True)
                    shutil.copy(origin, target / origin.name if dest.endswith("/") else target)
        elif (
            instruction.keyword == "RUN"
            and instruction.line != install.line
            and "rm -rf /src" in instruction.args
        ):
            shutil.rmtree(src)
            src.mkdir()
        elif instruction.line == install.line:
            for command in (c.strip() for c in install.args.split("&&")):
                if PROJECT_INSTALL.search(command):
                    return
                if STUB_COMMAND.search(command):
                    command = re.sub(r"\bpython3?\b", shlex.quote(sys.executable), command)
                    subprocess.run(["bash", "-c", command], cwd=src, check=True, capture_output=True)
            return


CASES = [(d, i) for d in DOCKERFILES for i in project_installs(d)]


def test_every_dockerfile_installs_the_project() -> None:
    assert {d.name for d, _ in CASES} == {d.name for d in DOCKERFILES}, "a Dockerfile never installs sparkrl"


@pytest.mark.parametrize(("dockerfile", "install"), CASES, ids=[f"{d.name}:{i.line}" for d, i in CASES])
def test_the_package_map_is_there_when_the_project_installs(
    dockerfile: Path, install: Instruction, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    replay_src(dockerfile, install, src)
    missing = [d for d in package_dirs(ROOT / "pyproject.toml") if not (src / d / "__init__.py").is_file()]
    assert not missing, (
        f"{dockerfile.name}:{install.line}: `pip install` of the project runs without the package "
        f"directories {missing} that pyproject.toml's package-dir names; the build would stop with "
        f"\"package directory '{missing[0]}' does not exist\" (stub them with deploy/docker/stub_packages.py "
        "in a dependency layer, COPY them in a source layer)"
    )
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            tmp_path,
            ".",
        ],
        cwd=src,
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, f"{dockerfile.name}:{install.line}: pip cannot build /src:\n{built.stderr}"
