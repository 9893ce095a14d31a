"""A sick model is not a bad prompt: what a failed generation says, and whether the engine works again.

A prompt is dead-lettered only when it is shown to be the cause: it fails alone while a short known-good
probe prompt generates. A fault of the model or the engine — non-finite logits (torch's sampler raises
"probability tensor contains either inf, nan or element < 0"), non-finite log-probs in what it returned
(a `Completion` refuses them: vLLM samples on through NaN logits), CUDA and memory errors, a dead
engine — or a probe that fails as well makes the worker unhealthy instead: its prompts go back to the
fleet, untouched, and the data set is not burnt on weights that cannot sample.

`HealthGuard` carries that between batches: it reports the worker `unhealthy` (heartbeat, `/healthz`, a
`StateEvent`), probes again when new weights load, and holds the feed when the fleet's prompt dead
letters burst (`rollout.health`), so a fault that does look like bad prompts cannot burn the data set.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from dataclasses import dataclass, field

from sparkrl.proto import Completion
from sparkrl.proto.telemetry import StateEvent
from sparkrl.services.common.feeder import dead_letter_burst, feed_held, hold_feed
from sparkrl.services.common.modeling import render_prompt
from sparkrl.services.common.settings import PromptFormat, SamplingSettings, WorkerHealthSettings
from sparkrl.services.common.telemetry import Telemetry, worker_target
from sparkrl.services.rollout.engine import Engine
from sparkrl.services.rollout.heartbeat import Heartbeat, WorkerState
from sparkrl.services.rollout.metrics import WorkerMetrics

log = logging.getLogger("sparkrl.rollout")

PROBE_TEXT = "1 + 1 ="  # any tokenizer encodes it; any model that samples at all can continue it
PROBE_TOKENS = 4
# Errors that name the model or the engine, never a prompt: the sampler's non-finite probabilities, a
# `Completion`'s non-finite log-probs, CUDA / NCCL / memory errors, vLLM's dead engine.
_MODEL_FAULT = re.compile(
    r"probability tensor contains|not finite|non-?finite|\bnan\b|out of memory|\bcuda|cublas|cudnn|"
    r"\bnccl\b|device-side assert|engine ?(core )?(is )?(dead|closed)|enginedeaderror",
    re.IGNORECASE,
)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:1000]


def is_model_fault(exc: BaseException) -> bool:
    """Whether the error names the model or the engine (see `_MODEL_FAULT`); anything else may be the
    prompt's, which only a probe can tell."""
    return isinstance(exc, MemoryError) or bool(_MODEL_FAULT.search(describe(exc)))


def probe(engine: Engine, sampling: SamplingSettings, fmt: PromptFormat) -> str | None:
    """Generate a few tokens from a known-good prompt, rendered as the worker renders its prompts
    (`fmt`), with the sampling in force: None when the engine works, else its error."""
    ids = render_prompt(engine.tokenizer, PROBE_TEXT, fmt) or [engine.tokenizer.eos_token_id or 0]
    short = sampling.model_copy(
        update={"n": 1, "max_new_tokens": PROBE_TOKENS, "min_new_tokens": 0, "stop": [], "seed": 0}
    )
    try:
        engine.generate([ids], short)
    except Exception as exc:  # whatever it is, the engine cannot generate
        return describe(exc)
    return None


@dataclass
class Diagnosis:
    """What a failed generation of a batch says."""

    sick: str | None = None  # why the model or engine is at fault; None: it is not
    bad: dict[int, str] = field(default_factory=dict)  # prompt index → why it alone cannot be generated
    completions: dict[int, list[Completion]] = field(default_factory=dict)  # the others, one by one


def diagnose(
    engine: Engine, prompts: list[list[int]], sampling: SamplingSettings, exc: Exception, fmt: PromptFormat
) -> Diagnosis:
    """After `engine.generate(prompts)` raised `exc`: a fault of the model (named by the error, or the
    probe fails too), or the prompts that fail alone (the rest are generated here, one by one)."""
    if is_model_fault(exc):
        return Diagnosis(sick=describe(exc))
    broken = probe(engine, sampling, fmt)
    if broken is not None:
        return Diagnosis(sick=f"{describe(exc)}; a known-good probe prompt fails too: {broken}")
    if len(prompts) == 1:
        return Diagnosis(bad={0: describe(exc)})
    found = Diagnosis()
    for index, ids in enumerate(prompts):
        try:
            alone = engine.generate([ids], sampling)
        except Exception as one:  # this prompt's own error, unless it names the model
            if is_model_fault(one):
                return Diagnosis(sick=describe(one))
            found.bad[index] = describe(one)
            continue
        found.completions[index] = alone[0]
    if not found.bad:
        log.warning("a batch failed together (%s) and generated prompt by prompt", describe(exc))
    return found


@dataclass
class Sickness:
    """Why a worker is unhealthy, and when its engine was last tried."""

    reason: str
    version: int | None  # the policy version that failed: new weights are probed at once
    checked_at: float  # monotonic


@dataclass
class HealthGuard:
    """One worker's health and its part in the feed hold, between batches. The loop's thread only."""

    engine: Engine
    telemetry: Telemetry
    state: WorkerState
    heartbeat: Heartbeat
    metrics: WorkerMetrics
    settings: WorkerHealthSettings  # the worker's live `rollout.health`
    prompt_format: PromptFormat  # how the probe prompt is rendered: as the worker's prompts are
    sick: Sickness | None = None
    dead_seen: int = -1  # the dead stream's length at the last burst check: unchanged, nothing to read

    def fall_sick(self, reason: str) -> None:
        """Take no prompts; those in hand are no longer kept alive, so the fleet reclaims them."""
        log.error(
            "generation fails for a reason of the model or the engine, not of the prompts: %s. This "
            "worker takes no prompts until new weights (or a retry in %.0fs) generate; the %d in hand go "
            "back to the fleet, not to the dead letters",
            reason,
            self.settings.recheck_s,
            len(self.state.in_flight),
        )
        self.sick = Sickness(reason, self.engine.policy_version, time.monotonic())
        self.state.in_flight = []
        self.metrics.unhealthy.set(1)
        self._change("unhealthy", reason)

    def recovered(self, sampling: SamplingSettings) -> bool:
        """Unhealthy: probe the engine once new weights loaded, or every `recheck_s`; True once it
        generates again (the worker takes prompts from then on)."""
        sick = self.sick
        if sick is None:
            return True
        fresh = self.engine.policy_version != sick.version
        if not fresh and time.monotonic() - sick.checked_at < self.settings.recheck_s:
            return False
        broken = probe(self.engine, sampling, self.prompt_format)
        if broken is not None:
            log.error("still unhealthy on policy version %s: %s", self.engine.policy_version, broken)
            self.sick = Sickness(broken, self.engine.policy_version, time.monotonic())
            self.state.state_reason = broken
            return False
        log.warning("healthy again on policy version %s: the probe generates", self.engine.policy_version)
        self.sick = None
        self.metrics.unhealthy.set(0)
        self._change("generating", None)
        return True

    def held(self) -> bool:
        """Whether the feed is held (the worker then takes no prompts and reports `held`)."""
        hold = feed_held(self.telemetry.bus)
        self.metrics.feed_held.set(float(hold is not None))
        if hold is None:
            if self.state.state == "held":
                log.warning("the feed flows again: taking prompts")
                self._change("generating", None, event=False)
            return False
        if self.state.state != "held":
            log.error("the feed is held, taking no prompts: %s", hold.detail)
            self._change("held", hold.detail, event=False)
        return True

    def check_burst(self) -> None:
        """Hold the feed when the fleet's prompt dead letters burst (`rollout.health.dead_letter_burst`)."""
        limit, bus = self.settings.dead_letter_burst, self.telemetry.bus
        if limit is None:
            return
        seen, self.dead_seen = self.dead_seen, bus.dead_letter_count()
        if seen == self.dead_seen:
            return
        window = self.settings.dead_letter_window_s
        burst = dead_letter_burst(bus, limit, window)
        if burst is None:
            return
        reason, times = Counter(d.reason[:200] for d in burst).most_common(1)[0]
        detail = (
            f"{len(burst)} prompts dead-lettered within {window:g}s, over rollout.health.dead_letter_burst "
            f"({limit}); the most common reason ({times}x): {reason}. `sparkrl dead` lists them and "
            "`--requeue` puts one back; fix the cause, then `sparkrl resume`"
        )
        hold_feed(self.telemetry, self.state.worker_id, detail)

    def _change(self, new: str, reason: str | None, event: bool = True) -> None:
        """A new state in the heartbeat now (not a period later); an alert on the telemetry channel."""
        if event:
            target = worker_target(self.state.worker_id)
            detail = reason[:2000] if reason is not None else None
            change = StateEvent(
                target=target, state=new, previous=self.state.state, detail=detail, at=time.time()
            )
            self.telemetry.append(change)
        self.state.state, self.state.state_reason = new, reason
        if new in ("unhealthy", "held"):
            self.state.tokens_per_s = 0.0  # the fleet's speed leaves it out
        self.heartbeat.beat()
