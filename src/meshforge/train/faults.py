"""Fault injection for tests and drills, from the MESHFORGE_FAULT variable.

crash:STEP[:RANK]          raise in the training loop after step STEP (on RANK, default 0)
kill_after_checkpoint:STEP SIGKILL rank 0 right after the checkpoint of STEP is committed
before_commit:STEP         fail rank 0 after the shards of STEP are written, before commit
kill:STEP:RANK             SIGKILL RANK after step STEP, in the first attempt only (a
                           restarted job then runs through)
oom:STEP:RANK              raise an out-of-memory error in RANK's forward at step STEP
hang:STEP:RANK             RANK stops itself (SIGSTOP) after step STEP: alive, silent
slow:RANK:FACTOR           RANK does FACTOR x its forward's work each step (busy, not
                           sleeping: a slow device, not an idle one)

Several faults: separated by commas."""

from __future__ import annotations

import os
import signal
import time

FAULT_ENV = "MESHFORGE_FAULT"


def _specs() -> list[list[str]]:
    text = os.environ.get(FAULT_ENV, "")
    return [part.split(":") for part in text.split(",") if part]


def _spec() -> list[str]:
    specs = _specs()
    return specs[0] if specs else []


def _find(kind: str) -> list[str] | None:
    return next((s for s in _specs() if s[0] == kind), None)


def _first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0")


def maybe_kill(step: int, rank: int) -> None:
    spec = _find("kill")
    if spec and int(spec[1]) == step and int(spec[2]) == rank and _first_attempt():
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_hang(step: int, rank: int) -> None:
    spec = _find("hang")
    if spec and int(spec[1]) == step and int(spec[2]) == rank:
        os.kill(os.getpid(), signal.SIGSTOP)


def maybe_oom(step: int, rank: int) -> None:
    """Raised as torch raises it when an allocation fails (torch.OutOfMemoryError)."""
    spec = _find("oom")
    if spec and int(spec[1]) == step and int(spec[2]) == rank:
        import torch

        raise torch.OutOfMemoryError(
            f"injected: tried to allocate 2.00 GiB at step {step} on rank {rank}; out of memory"
        )


def slow_factor(rank: int) -> float:
    """How many times its normal forward work RANK does (1.0: no fault)."""
    spec = _find("slow")
    if spec and int(spec[1]) == rank:
        return float(spec[2])
    return 1.0


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


class FaultHooks:
    """The faults of MESHFORGE_FAULT that concern one rank, at the points of the
    training loop where they strike (nothing at all when the variable is unset)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.slow = slow_factor(rank)

    def before_forward(self, step: int) -> None:
        maybe_oom(step, self.rank)

    def slow_down(self, step_s: float) -> None:
        """The `slow` fault: this rank's step took `slow` times as long."""
        if self.slow > 1:
            _busy(step_s, self.slow - 1)

    def after_checkpoint(self, step: int) -> None:
        maybe_kill_after_checkpoint(step, self.rank)

    def after_step(self, step: int) -> None:
        maybe_crash(step, self.rank)
        maybe_kill(step, self.rank)
        maybe_hang(step, self.rank)


def _busy(seconds: float, factor: float) -> None:
    """Burn `factor` x `seconds` of processor time (a slow device, not an idle one)."""
    end = time.process_time() + seconds * factor
    x = 0
    while time.process_time() < end:
        x += 1
