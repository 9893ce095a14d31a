"""Keeping a run alive: `sparkrl up`'s restarts (the `supervision` section) and a rollout worker's guard
against burning the data set (`rollout.health`); re-exported by `settings.py`."""

from __future__ import annotations

from pydantic import Field

from sparkrl.services.common.settings.section import Section


class SupervisionSettings(Section):
    """How `sparkrl up` keeps the services it started alive: Redis, reward, control, evaluator, feeder and
    workers are restarted when they die (a clean exit of the feeder or of a stopped worker is not a
    death); one that dies more often than this cannot be kept alive, and the run ends saying so (a worker
    is given up while others remain: the fleet is elastic)."""

    max_restarts: int = Field(
        5,
        ge=0,
        le=1000,
        description="Restarts of one service within `restart_window_s`; one more death ends the run (0: "
        "no restarts).",
    )
    restart_window_s: float = Field(
        300.0, gt=0, le=86_400, description="The window `max_restarts` counts in, seconds."
    )


class WorkerHealthSettings(Section):
    """A rollout worker telling a sick model from a bad prompt. A generation that fails for a reason of
    the model or the engine (non-finite probabilities, CUDA or memory errors, a dead engine; or a short
    known-good probe prompt failing too) makes the worker `unhealthy`: it takes no prompts, leaves those
    in hand to be reclaimed, and tries again when a new policy version loads (or every `recheck_s`). Only
    a prompt that fails alone while the probe generates is dead-lettered. More than `dead_letter_burst`
    prompts dead-lettered across the fleet within `dead_letter_window_s` hold the feed: no worker takes
    prompts until `sparkrl resume`."""

    dead_letter_burst: int | None = Field(
        100,
        ge=1,
        description="Prompt dead letters (the whole fleet's) within `dead_letter_window_s` that hold the "
        "feed when exceeded; None: never hold.",
    )
    dead_letter_window_s: float = Field(
        60.0, gt=0, le=86_400, description="The window `dead_letter_burst` counts in, seconds."
    )
    recheck_s: float = Field(
        60.0,
        gt=0,
        le=86_400,
        description="An unhealthy worker probes its engine again this often even without new weights "
        "(a transient fault, e.g. memory taken by another process), seconds.",
    )
