"""Stopping together, and deadlines.

**Stop on SIGTERM or Ctrl-C.** A scheduler's time limit, a preemption or an eviction
sends SIGTERM, to every worker (srun) or to the launcher, which passes it on (the elastic
agent), or to one node only (a Kubernetes eviction); Ctrl-C on `meshforge train` reaches
the workers as SIGINT the same way. The handler only sets a flag (a second SIGINT raises
KeyboardInterrupt as usual: a user who presses Ctrl-C twice means now).
Every step each rank contributes its flag to a tiny MAX all-reduce on a gloo group of
its own, issued when the step starts and read when it ends (so it overlaps the step
and costs no GPU synchronisation); when any rank has been told to stop, every rank
learns it after the same step, and they checkpoint that step together and leave
within `runtime.grace_s`.

**Deadlines.** Collectives get `runtime.timeout_s` while the job starts (the first
step), then the shorter `runtime.step_timeout_s` for training, as torchtitan does: a
peer that died or hangs is noticed in minutes, not hours."""

from __future__ import annotations

import logging
import signal
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class StopControl:
    """The job-wide "stop after this step" decision."""

    def __init__(
        self, world_size: int, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)
    ) -> None:
        self.requested_by: str | None = None  # the signal this rank received, if any
        self._flag = torch.zeros(1)
        self._work = None
        self._group = None
        if world_size > 1 and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:  # noqa: ARG002 - signal API
        if signum == signal.SIGINT and self.requested_by == "SIGINT":
            raise KeyboardInterrupt
        if self.requested_by is None:
            self.requested_by = signal.Signals(signum).name
            log.warning(
                "received %s: stopping after this step with a checkpoint", self.requested_by
            )

    def begin_step(self) -> None:
        """Contribute this rank's flag (when the step starts)."""
        self._flag[0] = 1.0 if self.requested_by else 0.0
        if self._group is not None:
            self._work = dist.all_reduce(
                self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True
            )

    def end_step(self) -> bool:
        """Whether any rank asked to stop (when the step ends); the same on every rank."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return bool(self._flag[0] > 0)


def set_collective_timeout(seconds: float) -> None:
    """Apply a new timeout to every process group this process has."""
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    timeout = timedelta(seconds=seconds)
    for group in list(_world.pg_map.keys()):
        try:
            _set_pg_timeout(timeout, group)
        except Exception as exc:  # noqa: BLE001 - a backend that cannot change it keeps its own
            log.info("cannot change the timeout of a process group: %s", exc)
