"""What a training process adds to the run's history (rank 0 writes it; the files and
their formats are rundir/'s): its segment in segments.jsonl, opened at the start, its
first step marked, closed with how it ended; after an elastic restart, the restart's
cause and the steps it redoes, and when training resumed, in health/restarts.jsonl."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshforge.rundir.failures import recorded_failures
from meshforge.rundir.restarts import append_restart, restart_cause
from meshforge.rundir.segments import close_segment, mark_first_step, open_segment


class RunHistory:
    def __init__(
        self,
        run_dir: Path,
        world_size: int,
        writes: bool,
        attempt: int,
        previous: dict[str, Any] | None,
        warn: Callable[[str], None],
    ) -> None:
        """`writes`: this process keeps the history (rank 0); `attempt` and `previous`:
        the elastic attempt and this rank's last flight record of the one before."""
        self.run_dir, self.world_size, self.writes = run_dir, world_size, writes
        self.attempt, self.previous, self.warn = attempt, previous or {}, warn
        self.run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        self.segment: int | None = None  # this segment's number (rundir/segments.py)

    def begin(
        self, resumed_from: int | None, steps: int, lr_horizon: int, layout: dict[str, Any]
    ) -> None:
        if not self.writes:
            return
        self._record_restart(resumed_from)
        self.segment = open_segment(
            self.run_dir,
            start_step=resumed_from or 0,
            steps=steps,
            lr_horizon=lr_horizon,
            world_size=self.world_size,
            layout=layout,
            run_id=self.run_id,
            attempt=self.attempt,
        )

    def first_step(self, at: float) -> None:
        """Training (re)started at `at`: after a restart its gap ends here."""
        if not self.writes:
            return
        if self.attempt > 0:
            append_restart(self.run_dir, {"run_id": self.run_id, "attempt": self.attempt,
                                          "kind": "resumed", "resumed_at": at})  # fmt: skip
        if self.segment is not None:
            mark_first_step(self.run_dir, self.segment, at)

    def end(self, step: int, stopped: dict[str, Any] | None, wall_s: float) -> None:
        if not self.writes:
            return
        signal = (stopped or {}).get("signal")
        close_segment(
            self.run_dir,
            self.segment,
            step,
            "stopped" if stopped else "completed",
            wall_s=wall_s,
            **({"signal": signal} if signal else {}),
        )

    def _record_restart(self, resumed_from: int | None) -> None:
        """After an elastic restart: which attempt, where it resumed, and how many steps
        the failed attempt had done beyond that (redone now)."""
        if self.attempt == 0:
            return
        previous = self.previous
        reached = previous.get("step") if previous.get("attempt") == self.attempt - 1 else None
        since = previous.get("started", 0.0)
        failures = [r for r in recorded_failures(self.run_dir / "health") if r["time"] >= since]
        cause = restart_cause(failures, self.world_size)
        entry = {
            "run_id": self.run_id,
            "cause": {"rank": cause.get("rank"), "error": cause.get("error")},
            "attempt": self.attempt,
            "time": time.time(),
            # when the previous attempt failed: its first recorded error (a rank killed
            # without a word leaves its peers' broken connections), else the last flight
            # record of this rank's previous attempt
            "failed_at": min((r["time"] for r in failures), default=previous.get("time")),
            "resumed_from": resumed_from or 0,
            "reached_before": reached,
            "steps_redone": None if reached is None else max(0, reached - (resumed_from or 0)),
        }
        append_restart(self.run_dir, entry)
        self.warn(
            f"restart {self.attempt}: resumed from step {entry['resumed_from']}"
            + (f", redoing {entry['steps_redone']} step(s)" if reached is not None else "")
        )
