"""A learner on the tiny model for tests, built by the product's own start path (`trainer.load`,
`ranks.trainer_for`, `service.assemble`): real DeepSpeed (gloo, one process) and a real bus; of the
threads only the publisher's runs (the heartbeat and /metrics are the service's)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from conftest import free_port

from sparkrl.proto import TrajectoryGroup
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import load_settings
from sparkrl.services.common.settings.roles import LearnerConfig
from sparkrl.services.learner.learner import Learner
from sparkrl.services.learner.ranks import trainer_for
from sparkrl.services.learner.service import assemble
from sparkrl.services.learner.trainer import Trainer, load
from sparkrl.services.learner.update import run_updates


def settings(model_dir: Path, run_dir: Path, *overrides: str) -> LearnerConfig:
    """The learner's part of the smoke preset on `model_dir`, writing to `run_dir`; a free port for the
    weight sync (never the default 29600, which another run on the machine may hold)."""
    return LearnerConfig.of(
        load_settings(
            "smoke", [f"model={model_dir}", f"run_dir={run_dir}", f"sync.port={free_port()}", *overrides]
        )
    )


def one_rank(cfg: LearnerConfig) -> Trainer:
    """The learner's trainer, fresh from `cfg.model` (one rank: no launcher here)."""
    return trainer_for(cfg, load(cfg, resume=False))


@contextmanager
def learner_loop(
    cfg: LearnerConfig, bus: RedisBus, trainer_as: Callable[[Trainer], Trainer] = lambda t: t
) -> Iterator[Learner]:
    """The loop and its parts, fresh; `trainer_as` wraps the trainer (a fault to inject)."""
    loaded = load(cfg, resume=False)
    learner = assemble(cfg, loaded, trainer_as(trainer_for(cfg, loaded)), bus, threading.Event())
    learner.fleet.publisher.start()
    try:
        yield learner
    finally:
        learner.fleet.close()


def gradient_and_stats(trainer: Trainer, groups: list[TrajectoryGroup], **cfg: object) -> tuple[list, dict]:
    """The gradients `run_updates` hands the optimizer (recorded at each step), and the step's statistics,
    under the trainer's settings with `cfg` changed (of the trained parameters: with LoRA, the adapter's, in
    the module's order). The weights and the optimizer's state are put back
    afterwards: every call starts from the same ones. One rank (`trainer.engine`)."""
    engine = trainer.engine
    weights = [p.detach().clone() for p in engine.module.parameters()]
    optimizer = copy.deepcopy(engine.optimizer.state_dict())
    grads: list[torch.Tensor] = []
    step: Callable[..., object] = engine.step

    def recording_step(*args: object, **kwargs: object) -> object:
        grads.extend(p.grad.detach().clone() for p in engine.module.parameters() if p.requires_grad)
        return step(*args, **kwargs)

    engine.step = recording_step  # type: ignore[method-assign]
    try:
        settings = trainer.cfg.model_copy(update=cfg)
        stats = run_updates(engine, groups, settings, trainer.pad_id, 1, trainer.reference).row()
    finally:
        engine.step = step  # type: ignore[method-assign]
        engine.optimizer.load_state_dict(optimizer)
        with torch.no_grad():
            for p, w in zip(engine.module.parameters(), weights, strict=True):
                p.copy_(w)
    return grads, stats


def assert_same_gradient(got: list[torch.Tensor], want: list[torch.Tensor], atol: float = 1e-6) -> None:
    """The gradients two ways of running one update handed the optimizer agree to `atol` (1e-6), and are
    not all 0."""
    assert len(got) == len(want) > 0
    for mine, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(mine, theirs, atol=atol, rtol=1e-5)
    assert any(float(g.abs().max()) > 1e-4 for g in want), "a gradient to compare"
