"""Fault injection for tests and drills, from the MESHFORGE_FAULT variable.

crash:STEP[:RANK]          raise in the training loop after step STEP (on RANK, default 0)
kill_after_checkpoint:STEP SIGKILL rank 0 right after the checkpoint of STEP is committed
before_commit:STEP         fail rank 0 after the shards of STEP are written, before commit
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "MESHFORGE_FAULT"


def _spec() -> list[str]:
    return os.environ.get(FAULT_ENV, "").split(":") if os.environ.get(FAULT_ENV) else []


def maybe_crash(step: int, rank: int) -> None:
    spec = _spec()
    if spec and spec[0] == "crash" and int(spec[1]) == step:
        target = int(spec[2]) if len(spec) > 2 else 0
        if rank == target:
            raise RuntimeError(f"injected crash at step {step} on rank {rank}")


def maybe_kill_after_checkpoint(step: int, rank: int) -> None:
    spec = _spec()
    if spec and spec[0] == "kill_after_checkpoint" and int(spec[1]) == step and rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)


def fail_before_commit(step: int) -> bool:
    spec = _spec()
    return bool(spec) and spec[0] == "before_commit" and int(spec[1]) == step
