"""Time a step spends in tensor-parallel communication, measured with the profiler.

DTensor runs tensor parallel's collectives through torch's functional collectives
(`_c10d_functional::all_reduce`, `reduce_scatter_tensor`, `all_gather_into_tensor`,
and `wait_tensor`, where the step blocks until one completes); data parallel (DDP,
FSDP) calls the process group directly (`c10d::...`). So the functional ops of one
profiled step are its TP communication: the CPU time spent in them (launch plus
waiting), or on a GPU the device time of the kernels they launched, whichever is
larger. Ring attention (parallel.cp_method=ring) exchanges K and V point to point,
under profiler ranges named `cp_ring::...` (parallel/context_parallel.py,
RingAttend.rotate): those count too. Profiling costs time, so the trainer samples one
step per run.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.profiler import ProfilerActivity, profile

T = TypeVar("T")
_FUNCTIONAL = "_c10d_functional::"
_COUNTED = (_FUNCTIONAL, "cp_ring::")  # RingAttend.rotate's ranges


def functional_collective_s(events: Any) -> float:
    """Seconds in top-level functional-collective ops (and ring attention's exchanges)
    among profiler `events`."""
    total_us = 0.0
    for ev in events:
        if not ev.name.startswith(_COUNTED):
            continue
        parent = ev.cpu_parent
        if parent is not None and parent.name.startswith(_COUNTED):
            continue  # counted with its parent
        device_us = getattr(ev, "device_time_total", 0.0) or 0.0
        total_us += max(ev.cpu_time_total, device_us)
    return total_us / 1e6


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Silence what native code writes to file descriptor 2 (the profiler backend
    announces every start and stop there, on every rank's console)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def measure_tp_comm(fn: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """Run `fn` under the profiler; (its result, seconds of TP communication)."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    with quiet_native_stderr():
        prof.start()
    try:
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        with quiet_native_stderr():
            prof.stop()
    return result, functional_collective_s(prof.events())
