"""Ctrl-C on `meshforge train`: the first stops the workers with a checkpoint, a second
one kills them.

The workers run in sessions of their own, so a Ctrl-C in the terminal reaches the
launcher only. The first one stops them as SIGTERM does: torch's elastic agent passes
SIGINT on and waits for them to checkpoint and leave (up to its shutdown timeout). A
second one while they stop means now: they are killed (SIGKILL), the run keeps its last
committed checkpoint, and the launcher reports the run `interrupted` (launch/local.py).

torch's own handler would take the second Ctrl-C as the first again (it raises inside
the agent's shutdown, which then starts over with SIGTERM and waits again), so SIGINT is
taken out of the signals the agent handles (its launch config's `signals_to_handle`,
torchrun's --signals-to-handle) and handled here; the first raises the agent's
SignalException as its handler would.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig


# One press can arrive twice: GNU `timeout -s INT` signals its child and then the child's
# process group, so the launcher gets SIGINT twice within microseconds. A person's second
# press takes far longer than this; a SIGINT this soon after the first is the same press.
SAME_PRESS_S = 0.5


class CtrlC:
    """How many times Ctrl-C was pressed, and whether the second one killed workers."""

    def __init__(self) -> None:
        self.presses = 0
        self.killed = False
        self._first_at = 0.0

    def install(self, config: LaunchConfig) -> CtrlC:
        """In the main thread, before the agent starts; kept until the launcher exits
        (a Ctrl-C while it writes the report after a stop must not interrupt that)."""
        names = [n.strip() for n in config.signals_to_handle.split(",")]
        if "SIGINT" not in names:  # the user took it from the agent: theirs
            return self
        config.signals_to_handle = ",".join(n for n in names if n != "SIGINT")
        signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum: int, frame: Any) -> None:  # noqa: ARG002 - signal API
        from torch.distributed.elastic.multiprocessing.api import SignalException

        now = time.monotonic()
        if self.presses == 1 and now - self._first_at < SAME_PRESS_S:
            return  # the first press, delivered twice (see SAME_PRESS_S)
        self.presses += 1
        if self.presses == 1:
            self._first_at = now
            raise SignalException(f"Process {os.getpid()} got signal: SIGINT", signal.SIGINT)
        self.killed = kill_workers() or self.killed


def kill_workers() -> bool:
    """SIGKILL this launcher's workers (its child processes) and theirs; whether any
    was alive."""
    import psutil

    try:
        workers = psutil.Process().children(recursive=True)
    except psutil.Error:
        return False
    for worker in workers:
        with contextlib.suppress(psutil.Error):
            worker.kill()
    return bool(workers)
