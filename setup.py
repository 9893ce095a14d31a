"""Package list for setuptools: `proto/` and `services/` install as `sparkrl.proto` and `sparkrl.services`.

pyproject.toml maps the folders (package-dir); this file lists every subpackage under its `sparkrl.` name
(and those of `sparkrl/` itself, such as `sparkrl.cli`), so a built wheel carries all of them without a
hand-kept list.
"""

from setuptools import find_packages, setup

subpackages = find_packages(include=["proto", "proto.*", "services", "services.*"])
own = find_packages(include=["sparkrl", "sparkrl.*"])
setup(packages=[*own, "sparkrl.configs", *(f"sparkrl.{name}" for name in subpackages)])
