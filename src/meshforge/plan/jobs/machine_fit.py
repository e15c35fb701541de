"""A measured machine as a profile (pure: no torch): the fits behind `train.calibration`.

`train.calibration.measure_profile` times this machine under a run's own conditions and
hands the raw figures here:

compute       the model's forward + backward at the run's micro-batch, `seconds` for
              `flops` (Megatron convention). The fixed cost per unit of work t0 of the
              planner's efficiency curve (plan/core/efficiency.py, with f_max = 1) is fitted
              so that the curve gives exactly that time at this size:
                  t_measured = F/peak + (F/W)·t0
              (W the unit of work). Other micro-batch sizes and recomputation then
              follow the curve. If the peak is below the rate measured at size (a
              figure cached while the machine was busy), the measured rate is the peak
              and t0 = 0.
all-reduce    (bytes, seconds) points on the run's group: t = 2(n-1)·α + 2(n-1)/n·S/busbw
              fitted by least squares in relative error (nccl-tests convention for
              busbw, REFERENCES.md).

`remember_profile` records the result in `$MESHFORGE_CACHE/machine_profiles.json`,
where `parallel: auto` finds it at the next launch (plan/jobs/auto.py).
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from meshforge.plan.core.profile import MachineProfile
from meshforge.plan.jobs.auto import (
    ASSUMED_HOST_COSTS,
    HostCosts,
    profile_cache_key,
    save_cached_profile,
)

log = logging.getLogger(__name__)

NO_LINK_BUSBW = 1e12  # placeholder for a single rank (no collective ever runs)
NO_PEAK_FLOPS = 1e9  # neither a peak nor a timed model: a stated placeholder


@dataclass(frozen=True)
class MeasuredProfile:
    """A profile plus how it was measured (for report.json)."""

    profile: MachineProfile
    details: dict[str, Any] = field(default_factory=dict)
    runtime_bytes: float = 0.0  # CPU: process RSS before training beyond the parameters
    host: HostCosts | None = None  # CPU: the optimizer rates of plan.jobs.auto's host model


@dataclass(frozen=True)
class ComputeAtSize:
    """The model's forward + backward of one micro-batch, timed (the slowest rank)."""

    micro_batch: int
    flops: float  # Megatron-convention FLOPs of the pass
    seconds: float  # every kernel of the model: what t0 is fitted to
    matmul_seconds: float  # its matmuls alone, for the record
    unit_flops: float  # W of the efficiency curve at this micro-batch


@dataclass(frozen=True)
class MachineMeasurements:
    """What `train.calibration` measured, agreed by all ranks (the slowest figures)."""

    device_type: str  # "cpu" or "cuda"
    backend: str  # the process group's ("gloo", "nccl"; "none" without one)
    threads: int  # torch threads per worker
    world_size: int
    peak_flops_per_s: float | None  # None: no peak known for this device and dtype
    peak_source: str
    memory_bytes: float
    per_device_memory: bool
    compute: ComputeAtSize | None = None  # None: not timed (no job, or it failed)
    host: HostCosts | None = None  # the optimizer rates; None: not timed
    allreduce_points: list[tuple[float, float]] | None = None  # None: a single rank
    # the host's 1-minute load average and its CPUs when measured (this run's own
    # workers included): how busy the machine was while the figures were taken
    load_average: float | None = None
    cpus: int | None = None

    @property
    def name(self) -> str:
        return f"{self.device_type}:{self.backend}:{self.threads}thr"


def fit_matmul_curve(
    peak: float | None, seconds: float, flops: float, unit_flops: float
) -> tuple[float, float]:
    """(peak, t0) with t(F) = F/peak + (F/W)·t0 equal to the measured `seconds`."""
    at_size = flops / seconds
    if peak is None or peak <= at_size:
        return at_size, 0.0
    units = flops / unit_flops
    return peak, (seconds - flops / peak) / units


def fit_allreduce(points: list[tuple[float, float]], n: int) -> tuple[float, float]:
    """(busbw, per-step latency α) from (bytes, seconds) points of an n-rank all-reduce:
    t = 2(n-1)·α + 2(n-1)/n·S/busbw, least squares in relative error."""
    steps, factor = 2 * (n - 1), 2.0 * (n - 1) / n
    # minimise Σ ((a + c·S - t)/t)²: normal equations in (a, c) with weights 1/t²
    sw = sum(1 / t**2 for _, t in points)
    ss = sum(s / t**2 for s, t in points)
    sss = sum(s * s / t**2 for s, t in points)
    st = sum(1 / t for _, t in points)
    sst = sum(s / t for s, t in points)
    det = sw * sss - ss * ss
    a = (st * sss - ss * sst) / det if det else 0.0
    c = (sw * sst - ss * st) / det if det else 0.0
    if a < 0:  # no measurable latency: a line through the origin
        a, c = 0.0, sst / sss
    if c <= 0:  # no measurable bandwidth term: the largest message's rate
        size, t = max(points)
        c = t / size
    return factor / c, a / steps


def allreduce_record(points: list[tuple[float, float]] | None, n: int) -> dict[str, Any] | None:
    """The fitted busbw and latency with the points they come from (None: one rank)."""
    if not points:
        return None
    busbw, latency = fit_allreduce(points, n)
    return {
        "busbw_bytes_per_s": busbw,
        "latency_s": latency,
        "points": [{"bytes": s, "seconds": t} for s, t in points],
    }


def compute_record(c: ComputeAtSize | None) -> dict[str, Any] | None:
    """report.json's `compute_at_size`."""
    if c is None:
        return None
    return {
        "micro_batch": c.micro_batch,
        "flops": c.flops,
        "seconds": c.seconds,  # every kernel of the model: what t0 is fitted to
        "flops_per_s": c.flops / c.seconds,
        "matmul_only_seconds": c.matmul_seconds,
        "matmul_only_flops_per_s": c.flops / c.matmul_seconds,
        "unit_flops": c.unit_flops,
    }


def fit_profile(m: MachineMeasurements) -> tuple[MachineProfile, HostCosts]:
    """The planner's profile of the measured machine, and the host's optimizer rates
    (the assumed ones when the model was not timed)."""
    c = m.compute
    if c is not None:
        peak, t0 = fit_matmul_curve(m.peak_flops_per_s, c.seconds, c.flops, c.unit_flops)
    else:
        peak, t0 = (m.peak_flops_per_s or NO_PEAK_FLOPS), 0.0
    host = m.host if c is not None and m.host is not None else ASSUMED_HOST_COSTS
    comm = allreduce_record(m.allreduce_points, m.world_size)
    profile = MachineProfile(
        matmul_flops_per_s=float(peak),
        allreduce_busbw_bytes_per_s=float(comm["busbw_bytes_per_s"] if comm else NO_LINK_BUSBW),
        memory_bytes=m.memory_bytes,
        name=m.name,
        allreduce_latency_s=float(comm["latency_s"] if comm else 0.0),
        memory_bandwidth_bytes_per_s=float(host.optimizer_bytes_per_s),
        matmul_overhead_s=float(t0),
        per_device_memory=m.per_device_memory,
    )
    return profile, host


def measurement_record(m: MachineMeasurements, host: HostCosts) -> dict[str, Any]:
    """report.json's `predicted.measurement`: the figures and how they were fitted."""
    return {
        "threads": m.threads,
        "world_size": m.world_size,
        "peak_matmul_flops_per_s": m.peak_flops_per_s,
        "peak_source": m.peak_source,
        "compute_at_size": compute_record(m.compute),
        "optimizer_bytes_per_s": host.optimizer_bytes_per_s,
        "sharded_optimizer_bytes_per_s": host.sharded_optimizer_bytes_per_s,
        "allreduce": allreduce_record(m.allreduce_points, m.world_size),
        "load_average": m.load_average,
        "cpus": m.cpus,
    }


def remember_profile(profile: MachineProfile, host: HostCosts, m: MachineMeasurements) -> None:
    """Cache the profile for `parallel: auto` at launch (plan/jobs/auto.py reads it), keyed
    by this machine, device, backend, world size, nodes and threads per worker."""
    world = m.world_size
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    nnodes = max(1, world // max(1, local_world))
    key = profile_cache_key(m.device_type, m.backend, world, m.threads, nnodes)
    extra = {"compute_at_size": compute_record(m.compute), "host": asdict(host)}
    try:
        save_cached_profile(key, profile, extra)
    except OSError as exc:  # no writable cache: the run does not need it
        log.warning("could not cache the machine profile: %s", exc)
