"""Stragglers: a rank consistently slower than the others at its own work.

In synchronous training every rank's step takes the same wall time (the fast ones wait
for the slow one inside the gradient collectives), so step times cannot name the slow
rank. What differs is each rank's own work: its data wait plus the processor time its
process spent (computing; a rank blocked in a collective uses none). Every log interval
the ranks exchange that figure; a rank above the median by `margin` in `intervals`
consecutive intervals is named, with its slowdown."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshforge.observe.memhealth import cuda_memory_stats
from meshforge.observe.memory import current_memory_bytes, peak_memory_bytes

# what each rank sends with its own work at a logged step (StragglerWatch.exchange's extra)
RANK_FIGURES = ("step_s", "memory", "peak", "reserved", "retries", "ooms")


def rank_figures(device: torch.device, step_s: float) -> list[float]:
    """This rank's step time and memory, in RANK_FIGURES order."""
    cuda = cuda_memory_stats(device) or {}
    return [
        step_s,
        float(current_memory_bytes(device)),
        float(peak_memory_bytes(device)),
        float(cuda.get("reserved_bytes") or 0),
        float(cuda.get("alloc_retries") or 0),
        float(cuda.get("ooms") or 0),
    ]


@dataclass
class StragglerWatch:
    world_size: int
    margin: float = 0.25
    intervals: int = 2
    _cpu0: float = field(default_factory=time.process_time)
    _data_s: float = 0.0
    _streak: dict[int, int] = field(default_factory=dict)
    named: dict[int, float] = field(default_factory=dict)  # rank -> worst slowdown seen

    def add_data_wait(self, seconds: float) -> None:
        self._data_s += seconds

    def exclude(self, cpu_seconds: float) -> None:
        """Leave out processor time spent on work that is not the step's (a checkpoint)."""
        self._cpu0 += cpu_seconds

    def exchange(
        self, skip: bool = False, extra: Sequence[float] = ()
    ) -> tuple[list[float], list[int], list[list[float]]]:
        """Collective over the world: every rank's own work in the interval just ended,
        the ranks that are stragglers now, and every rank's `extra` figures (its step
        time and memory: one collective carries them all). `skip` (the first interval,
        start-up included) exchanges but judges nothing."""
        now = time.process_time()
        own = (now - self._cpu0) + self._data_s
        self._cpu0, self._data_s = now, 0.0
        values = torch.zeros(self.world_size, 1 + len(extra), dtype=torch.float64)
        rank = dist.get_rank() if dist.is_initialized() else 0
        values[rank, 0] = own
        if extra:
            values[rank, 1:] = torch.tensor(list(extra), dtype=torch.float64)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(values)
        per_rank = values[:, 0].tolist()
        return per_rank, ([] if skip else self.judge(per_rank)), values[:, 1:].tolist()

    def judge(self, per_rank: list[float]) -> list[int]:
        """The ranks above the median by the margin for `intervals` intervals in a row."""
        if len(per_rank) < 2:
            return []
        median = statistics.median(per_rank)
        slow = []
        for rank, value in enumerate(per_rank):
            if median > 0 and value > median * (1 + self.margin):
                self._streak[rank] = self._streak.get(rank, 0) + 1
                if self._streak[rank] >= self.intervals:
                    slow.append(rank)
                    self.named[rank] = max(self.named.get(rank, 0.0), value / median)
            else:
                self._streak[rank] = 0
        return slow
