"""What `sparkrl up` does when one of its services exits: the run ends, goes on, or the service is
restarted, within a budget (`supervision.max_restarts` per `supervision.restart_window_s`).

- The learner ends the run: exit 0 is the run's end, anything else its failure (it resumes on its own
  terms: `--auto-resume` under a supervisor that restarts it, `sparkrl up --resume` here).
- A clean exit is not a death where it has a meaning: the feeder fed everything, a worker obeyed a stop
  command, the evaluator is done.
- A service that exits with `EXIT_UNFIT` (78: its set-up is wrong, e.g. a worker whose engine cannot take
  the learner's tensors) ends the run with its last log lines: a restart would fail the same way.
- Everything else is restarted (Redis on its port and append-only file, reward, control, evaluator,
  feeder, workers): the others wait for it meanwhile (the workers' reward calls retry within
  `rollout.reward_deadline_s`, prompts left unacknowledged are reclaimed). One that dies more often than
  the budget cannot be kept alive: the run ends with that as its reason; only a worker (the fleet is
  elastic while another is left) and the evaluator (training goes on without evaluation) are given up
  with a warning.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sparkrl.plan import ServiceSpec
from sparkrl.proto.run_files import EXIT_UNFIT
from sparkrl.run_files import ENDED_FILE, read_ended, tail_bytes
from sparkrl.services.common.settings import SupervisionSettings

_CLEAN_EXIT_ROLES = ("prompts", "rollout", "evaluator")


def logtail_bytes(path: Path, lines: int = 20) -> str:
    """The last `lines` lines of a log, indented for a report."""
    text = tail_bytes(path, 16_384).decode(errors="replace")
    return "\n".join("    " + line for line in text.splitlines()[-lines:]) or "    (empty log)"


def failure(spec: ServiceSpec, what: str) -> str:
    """`<service> <what>; last lines of <its log>:` and those lines."""
    return f"{spec.name} {what}; last lines of {spec.log_path}:\n{logtail_bytes(spec.log_path)}"


@dataclass
class Restarts:
    """When each service was restarted (monotonic seconds), and the budget they are held to."""

    settings: SupervisionSettings
    times: dict[str, list[float]] = field(default_factory=dict)  # service name → its restarts, all

    def take(self, name: str, now: float) -> int | None:
        """Count a restart of `name` if the budget allows: its number within the window; None: over."""
        window = self.settings.restart_window_s
        recent = [t for t in self.times.get(name, []) if now - t < window]
        if len(recent) >= self.settings.max_restarts:
            return None
        self.times.setdefault(name, []).append(now)
        return len(recent) + 1


@dataclass(frozen=True)
class Outcome:
    """What an exit means for the run."""

    action: Literal["end", "restart", "go on"]
    message: str | None = None  # what the launcher says (None: nothing)
    code: int | None = None  # the run's exit code, when it ends
    reason: str | None = None  # why the run ended, for `ended.json`, when the launcher ended it


# Below this much free space a Redis that died is not restarted: its append-only file could not grow.
REDIS_MIN_FREE_MIB = 16


def disk_full(folder: Path) -> str | None:
    """Why Redis cannot be restarted on `folder`'s disk (under `REDIS_MIN_FREE_MIB` free), or None."""
    try:
        free = shutil.disk_usage(folder).free / 2**20
    except OSError:
        return None
    if free >= REDIS_MIN_FREE_MIB:
        return None
    return (
        f"the disk of {folder} is full ({free:.1f} MiB free): Redis cannot write its append-only file there, "
        "so it is not restarted. Fix: free space there, then `sparkrl up --resume` (nothing acknowledged is "
        "lost: the append-only file and the journal hold it)"
    )


def on_exit(spec: ServiceSpec, returncode: int, restarts: Restarts, now: float, workers_left: int) -> Outcome:
    """The run's answer to `spec` exiting with `returncode`; `workers_left`: other workers still running."""
    if spec.role == "learner":
        if returncode == 0:
            return Outcome("end", "learner finished", 0)
        # A signal death (-N) becomes 128+N, as a shell reports it.
        code = returncode if returncode > 0 else 128 - returncode
        return Outcome("end", f"error: {failure(spec, f'exited with code {returncode}')}", code)
    if spec.role == "redis" and (full := disk_full(spec.log_path.parents[1] / "redis")) is not None:
        # Restarted into a disk that cannot take its append-only file, it would die again at once.
        return Outcome("end", f"error: {failure(spec, f'exited with code {returncode}')}\n{full}", 1, full)
    if returncode == EXIT_UNFIT:  # its set-up is wrong: a restart would fail the same way
        said = f"error: {failure(spec, f'exited with code {returncode}: its set-up is wrong, not restarted')}"
        return Outcome("end", said, 1, f"{spec.name} exited with code {returncode}: its set-up is wrong")
    if returncode == 0 and spec.role in _CLEAN_EXIT_ROLES:
        said = {"rollout": f"{spec.name} stopped", "evaluator": f"{spec.name} finished"}.get(spec.role)
        return Outcome("go on", said)  # the feeder fed all it had: nothing to say
    budget, count = restarts.settings, restarts.take(spec.name, now)
    if count is not None:
        said = (
            f"warning: {spec.name} exited with code {returncode}; restarting it ({count} of at most "
            f"{budget.max_restarts} within {budget.restart_window_s:g}s; its log: {spec.log_path})"
        )
        return Outcome("restart", said)
    times = f"{budget.max_restarts} restart{'s' if budget.max_restarts != 1 else ''}"
    dead = (
        f"exited with code {returncode}, after {times} within {budget.restart_window_s:g}s "
        "(supervision.max_restarts): it cannot be kept alive"
    )
    if spec.role == "evaluator":
        return Outcome("go on", f"warning: {failure(spec, dead)}\n(training goes on without evaluation)")
    if spec.role == "rollout" and workers_left:
        message = f"warning: {failure(spec, dead)}\n(the fleet is elastic; workers left: {workers_left})"
        return Outcome("go on", message)
    last = "\nno rollout worker is left" if spec.role == "rollout" else ""
    return Outcome("end", f"error: {failure(spec, dead)}{last}", 1, f"{spec.name} {dead}")


def record_end(run_dir: Path, reason: str) -> None:
    """The launcher's end reason into `ended.json`, once the learner wrote its own (kept beside it, as
    `learner_reason`: it was stopped by the launcher's signal)."""
    ended = read_ended(run_dir)
    if ended.get("reason"):
        ended["learner_reason"] = ended["reason"]
    ended.update(reason=reason, time=time.time())
    with contextlib.suppress(OSError):
        (run_dir / ENDED_FILE).write_text(json.dumps(ended))
