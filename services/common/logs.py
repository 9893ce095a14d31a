"""Logging set-up shared by every service: one line per record, service name and time first."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading


def setup_logging(service: str, level: str | None = None) -> logging.Logger:
    """Configure the root logger once for this process; `SPARKRL_LOG_LEVEL` overrides the level."""
    level = level or os.environ.get("SPARKRL_LOG_LEVEL", "INFO")
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    # httpx logs every request at INFO: far too chatty for a worker that scores every few seconds.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return logging.getLogger(f"sparkrl.{service}")


def stop_on_signals(log: logging.Logger, what: str, stop: threading.Event | None = None) -> threading.Event:
    """SIGTERM/SIGINT set the returned event (`stop`, or a new one); a service loop checks it between steps,
    so it finishes `what` (the step in hand) and shuts down cleanly instead of dying mid-write. Only the
    CLI calls this: signals reach the main thread alone, and a Ray actor is stopped by its driver."""
    stop = stop if stop is not None else threading.Event()

    def handler(signum: int, _frame: object) -> None:
        log.info("signal %d: finishing %s, then stopping", signum, what)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop
