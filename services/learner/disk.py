"""The run directory's disk: a run stops cleanly while it still has room to say why.

A full disk fails everything at once and mid-write: the journal (so the step cannot be committed), Redis's
append-only file (so Redis exits), the logs, `ended.json`. So the learner looks at the free space at every
step boundary (one `statvfs`, microseconds) and stops the run once it is below `learner.min_free_mb`: a
final checkpoint if it fits, `ended.json` with the fix, the reason on the status and the page. The journal
keeps every step since the last checkpoint, so `--resume` after space returns loses nothing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

MIB = 2**20


def free_mib(path: Path) -> float:
    return shutil.disk_usage(path).free / MIB


def short_of_space(run_dir: Path, min_free_mb: int) -> str | None:
    """Why the run must stop for its disk (free space below `min_free_mb`), or None."""
    if min_free_mb <= 0:
        return None
    free = free_mib(run_dir)
    if free >= min_free_mb:
        return None
    return (
        f"the disk of {run_dir} has {free:.1f} MiB free, below learner.min_free_mb ({min_free_mb}): the run "
        "stopped before a full disk fails its journal and Redis's append-only file mid-write. Fix: free "
        "space there (or lower learner.min_free_mb), then `sparkrl up --resume`"
    )


def failed_write(what: str, run_dir: Path, exc: Exception) -> str:
    """A write into the run directory that failed, in words: what, the error, the free space."""
    try:
        free = f"{free_mib(run_dir):.1f} MiB free"
    except OSError:
        free = "free space unknown"
    said = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"{what} could not be written: [{said}] ({free} in {run_dir})"
