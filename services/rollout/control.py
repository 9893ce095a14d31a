"""A rollout worker's side of the control plane: pause, resume, stop and sampling values, between batches
(and, with `rollout.partial`, between two decoding steps, so a stop hands the batch in hand over).

Pause means "take no new prompts": a batch in hand is still generated, scored and published (even if
that waits on a full trajectory stream), so nothing in flight is lost. Resume also lifts a feed hold (a
burst of dead letters held it: `health.py`), once the operator has looked at the dead letters. The
sampling values change only between batches, so every completion of a group is sampled, and recorded,
at one temperature: a change is a new `sampling` value, which the worker takes at its next turn.
"""

from __future__ import annotations

import logging
import threading

from sparkrl.proto import ControlCommand
from sparkrl.services.common.control_channel import ControlReader
from sparkrl.services.common.feeder import lift_feed_hold
from sparkrl.services.common.settings import SamplingSettings
from sparkrl.services.common.settings.hparams import HparamError, apply_sampling, split

log = logging.getLogger("sparkrl.rollout.control")


class WorkerControl:
    """Applies the control stream to one worker. The worker loop's thread only."""

    reader: ControlReader
    sampling: SamplingSettings  # the worker's sampling values in force: replaced by a change, never changed
    stop: threading.Event
    paused: bool

    def __init__(self, reader: ControlReader, sampling: SamplingSettings, stop: threading.Event) -> None:
        """`sampling`: the configured values; the fleet's live ones (a change made before this worker
        started) are adopted over them."""
        self.reader, self.sampling, self.stop = reader, sampling, stop
        initial = reader.initial_state()
        self.paused = initial.paused
        if initial.sampling:
            try:
                self.sampling, adopted = apply_sampling(sampling, initial.sampling)
                log.info("adopting the fleet's live sampling values: %s", adopted)
            except HparamError as exc:
                log.error("ignoring the fleet's sampling values: %s", exc)
        if self.paused:
            log.info("starting paused: the fleet is paused (`sparkrl resume` goes on)")

    def boundary(self, in_hand: int = 0) -> SamplingSettings:
        """Apply every command issued since the last call; `in_hand`: groups still to be published. Returns
        the sampling values in force, for the next batch."""
        for command in self.reader.poll():
            self._apply(command, in_hand)
        return self.sampling

    def _apply(self, command: ControlCommand, in_hand: int) -> None:
        name = command.body.command
        if name == "pause":
            self.paused = True
            after = f"; {in_hand} groups in hand are published first" if in_hand else ""
            self.reader.answer(command, "applied", "takes no new prompts" + after)
        elif name == "resume":
            was, self.paused = self.paused, False
            held = lift_feed_hold(self.reader.telemetry, self.reader.target)
            lifted = f"; the feed hold is lifted (it was held: {held.detail})" if held is not None else ""
            said = "takes prompts again" if was or held is not None else "was not paused"
            self.reader.answer(command, "applied", said + lifted)
        elif name == "stop":
            self.stop.set()
            said = "stopping: the batch in hand is handed over (rollout.partial) or finished first"
            self.reader.answer(command, "applied", said)
        elif name == "set_hparams":
            _, mine = split(command.body.values)  # type: ignore[union-attr]  (set_hparams)
            if not mine:
                return  # only learner values: not ours to answer
            try:
                self.sampling, values = apply_sampling(self.sampling, mine)
            except HparamError as exc:
                self.reader.answer(command, "rejected", str(exc))
                return
            self.reader.answer(command, "applied", "from the next batch on", values=values)
