"""When a run checkpoints: every `checkpoint.every` steps, after its last step, and
after the step at which it was asked to stop (SIGTERM, Ctrl-C). The `Checkpointer`
(train/checkpoint.py) writes and commits; this decides and keeps the times."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from meshforge.observe.flight import FlightRecorder
from meshforge.observe.straggler import StragglerWatch
from meshforge.train.checkpoint import Checkpointer
from meshforge.train.timing import RunTiming


class CheckpointCadence:
    def __init__(
        self,
        checkpointer: Checkpointer,
        every: int,
        steps: int,
        state: Callable[[int, float | None], dict[str, Any]],
        stragglers: StragglerWatch,
        timing: RunTiming,
        flight: FlightRecorder,
        last_saved: int | None = None,
    ) -> None:
        """`state(step, loss)`: the trainer state a checkpoint records."""
        self.checkpointer, self.every, self.steps, self.state = checkpointer, every, steps, state
        self.stragglers, self.timing, self.flight = stragglers, timing, flight
        self.last_saved = last_saved  # the step of the newest checkpoint this run has

    def after_step(self, done: int, stop: bool, loss: float | None) -> bool:
        """Save after step `done` when it is due; True when it saved. Collective."""
        last = done == self.steps or stop
        if last:
            self.timing.last_step_at = time.time()
        if not (last or (self.every and done % self.every == 0)):
            return False
        self.flight.set_phase("checkpoint")
        cpu0, wall0 = time.process_time(), time.perf_counter()
        self.checkpointer.save(done, self.state(done, loss))
        if last:
            self.timing.final_checkpoint_s = time.perf_counter() - wall0
        # rank 0 writes more of a checkpoint: not a sign of a slow rank
        self.stragglers.exclude(time.process_time() - cpu0)
        self.last_saved = done
        return True
