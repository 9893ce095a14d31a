"""A real tmpfs for the full-disk tests: a small filesystem that fills up as a disk does (root only)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (`8m`) mounted at `where` (made if missing), unmounted afterwards; the test is
    skipped, saying why, where none can be mounted (not root, or a kernel that refuses)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the full-disk cases run where CI runs: as root)")
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"this kernel refuses a tmpfs mount here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
