"""How a service's start-up went, phase by phase: seconds from the process's own start (the kernel's
clock, so the interpreter and the imports count) to each phase's end. The learner and the workers put
theirs in their heartbeats (`startup_s`); `sparkrl up` prints them with the first step and keeps them in
`RUN_DIR/summary.json`, so a slow start says where it went."""

from __future__ import annotations

import os
import time
from pathlib import Path


def process_started_at() -> float:
    """Unix time this process started: /proc's start tick against the uptime on Linux (to 10 ms); else
    now (the imports then go uncounted; the later phases are still right)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, after the command name's ")"
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - max(uptime - ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return time.time()


class StartClock:
    """`mark(phase)` at the end of each phase; `phases` holds each one's seconds, in order."""

    def __init__(self) -> None:
        self.started_at = process_started_at()
        self.last = self.started_at
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.time()
        self.phases[phase] = round(now - self.last, 2)
        self.last = now

    @property
    def total(self) -> float:
        return round(self.last - self.started_at, 2)
