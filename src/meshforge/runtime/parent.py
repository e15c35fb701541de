"""A process that must not outlive the one that started it (Linux; plain Python).

Used by a worker (train/worker.py: SIGTERM, so it checkpoints and leaves when its
launcher dies) and by the zygote's client (launch/zygote.py: the SIGTERM it passes on).
"""

from __future__ import annotations

import contextlib
import os
import signal


def signal_on_parent_death(signum: int, expected_parent: str | int | None = None) -> bool:
    """Ask the kernel for `signum` when this process's parent dies (PR_SET_PDEATHSIG),
    then check the parent is still `expected_parent` (a pid; default: the parent now).
    A parent that died before the request took effect left this process to init: False
    then, and the caller leaves. True also where prctl is not available."""
    import ctypes

    expected = str(expected_parent or "")
    parent = int(expected) if expected.isdigit() else os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signum), 0, 0, 0)  # PR_SET_PDEATHSIG
        return os.getppid() == parent
    return True


def term_on_parent_death(expected_parent: str | int | None = None) -> None:
    """SIGTERM when the parent dies; SIGTERM now if it already has."""
    if not signal_on_parent_death(signal.SIGTERM, expected_parent):
        os.kill(os.getpid(), signal.SIGTERM)
