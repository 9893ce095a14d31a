"""The Dockerfiles' dependency layer: empty package directories, from the packaging itself.

    python3 stub_packages.py [ROOT]

An image installs the project's dependencies before it copies the source, so that a source change rebuilds
only the layers after it. `pip install ".[extras]"` on pyproject.toml and setup.py alone fails as soon as
the package map (`[tool.setuptools] package-dir`) names a directory that is not there ("package directory
'configs' does not exist"). This script creates every directory that map names, each with an empty
`__init__.py`, and an empty README.md (`readme` of the metadata) in ROOT (default: the working directory),
so the stubs cannot drift from the packaging. Standard library only (Python 3.11+: tomllib).
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib


def package_dirs(pyproject: Path) -> list[str]:
    """The directories pyproject.toml's package map names (a package at the root is ".")."""
    tool = tomllib.loads(pyproject.read_text()).get("tool", {}).get("setuptools", {})
    mapping: dict[str, str] = tool.get("package-dir", {})
    if not mapping:
        raise SystemExit(f"{pyproject}: no [tool.setuptools] package-dir, nothing to stub")
    return sorted({directory or "." for directory in mapping.values()})


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path.cwd()
    for directory in package_dirs(root / "pyproject.toml"):
        (root / directory).mkdir(parents=True, exist_ok=True)
        (root / directory / "__init__.py").touch()
    readme = tomllib.loads((root / "pyproject.toml").read_text())["project"].get("readme")
    if isinstance(readme, str):
        (root / readme).touch()
    print(f"stub_packages: {', '.join(package_dirs(root / 'pyproject.toml'))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
