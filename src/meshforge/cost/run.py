"""The cost of one training run, owned versus rented, and what synchronisation cost.

A run uses G GPUs for T seconds: G·T/3600 GPU-hours (a run resumed at another world
size: the sum over its segments). Owned, each costs the
cluster's owned $/GPU-hour at its expected utilisation; rented, the cloud price.
Money lost to synchronisation = exposed communication fraction x cost (the share
of the step during which GPUs wait on the network instead of computing).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from meshforge.cost.tco import Tco
from meshforge.errors import ConfigError
from meshforge.plan.core.predict import Prediction
from meshforge.rundir.report import ReportError, read_report, report_path


@dataclass(frozen=True)
class RunCost:
    source: str  # "measured" (a run directory) or "planned" (the planner)
    gpus: int
    wall_s: float
    gpu_hours: float
    owned_usd: float
    rented_usd: float
    exposed_comm_fraction: float | None
    sync_loss_owned_usd: float | None
    sync_loss_rented_usd: float | None
    steps: int | None = None
    step_time_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_cost(
    gpus: int,
    wall_s: float,
    exposed_comm_fraction: float | None,
    costs: Tco,
    source: str,
    steps: int | None = None,
    step_time_s: float | None = None,
    gpu_s: float | None = None,
) -> RunCost:
    """`gpu_s`: the GPU-seconds when they are not gpus x wall_s (a run whose segments
    had different world sizes)."""
    gpu_hours = (gpus * wall_s if gpu_s is None else gpu_s) / 3600.0
    owned = gpu_hours * costs.owned_per_gpu_hour_usd
    rented = gpu_hours * costs.cloud_per_gpu_hour_usd
    frac = exposed_comm_fraction
    return RunCost(
        source=source,
        gpus=gpus,
        wall_s=wall_s,
        gpu_hours=gpu_hours,
        owned_usd=owned,
        rented_usd=rented,
        exposed_comm_fraction=frac,
        sync_loss_owned_usd=None if frac is None else frac * owned,
        sync_loss_rented_usd=None if frac is None else frac * rented,
        steps=steps,
        step_time_s=step_time_s,
    )


def _number(report: dict[str, Any], key: str, where: str) -> float:
    value = report.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{where}: '{key}' is missing or not a number >= 0")
    return float(value)


def run_usage(report: dict[str, Any], where: str) -> tuple[int, float, float]:
    """(GPUs, wall seconds, GPU-seconds) of the run a report describes. A run of several
    segments (resumed, perhaps at another world size) used sum(world_size_i x wall_s_i)
    GPU-seconds over its segments, and GPUs is its last segment's world size. A report
    without segments, or with a segment whose size or wall time is unknown: world_size
    x wall_time_s (or x steps x step_time_s)."""
    gpus = int(_number(report, "world_size", where))
    segments = report.get("segments")
    if isinstance(segments, list) and segments:
        pairs = [(s.get("world_size"), s.get("wall_s")) for s in segments if isinstance(s, dict)]
        known = len(pairs) == len(segments) and all(
            isinstance(n, int) and n > 0 and isinstance(w, int | float) and w >= 0 for n, w in pairs
        )
        if known:
            return gpus, sum(w for _, w in pairs), sum(n * w for n, w in pairs)
    steps = int(_number(report, "steps", where))
    step_s = _number(report, "step_time_s", where)
    wall = report.get("wall_time_s")
    wall_s = float(wall) if isinstance(wall, int | float) and wall > 0 else steps * step_s
    return gpus, wall_s, gpus * wall_s


def run_cost_from_report(run_dir: str | Path, costs: Tco) -> RunCost:
    """Cost of a finished run from RUN_DIR/report.json (measured).

    GPU-hours from the segments' world_size x wall_s (`run_usage`), else world_size x
    wall_time_s (or steps x step_time_s); the time_breakdown.exposed_comm fraction when
    the report has one."""
    path = report_path(run_dir)
    if not path.is_file():
        raise ConfigError(f"--run {run_dir}: no report.json in it")
    try:
        report = read_report(run_dir)
    except ReportError as exc:
        if exc.problem == "not JSON":
            raise ConfigError(f"{path}: not valid JSON") from None
        raise ConfigError(str(exc)) from None  # "expected a JSON object", or an OSError
    if report is None:  # removed since
        raise ConfigError(f"--run {run_dir}: no report.json in it")
    gpus, wall_s, gpu_s = run_usage(report, str(path))
    steps = int(_number(report, "steps", str(path)))
    step_s = _number(report, "step_time_s", str(path))
    breakdown = report.get("time_breakdown") or {}
    frac = breakdown.get("exposed_comm") if isinstance(breakdown, dict) else None
    frac = float(frac) if isinstance(frac, int | float) else None
    return run_cost(gpus, wall_s, frac, costs, "measured", steps, step_s, gpu_s)


def run_cost_from_plan(prediction: Prediction, tokens: float, costs: Tco) -> RunCost:
    """Cost of training on `tokens` tokens with a planned layout: steps = ⌈T / (B·s)⌉."""
    if not (tokens > 0 and math.isfinite(tokens)):
        raise ConfigError(f"--tokens must be a finite number > 0, got {tokens}")
    if prediction.time is None or prediction.seq_len is None:
        raise ConfigError("--tokens needs the model shape (--layers ...), not --params")
    per_step = prediction.training.global_batch * prediction.seq_len
    steps = math.ceil(tokens / per_step)
    step_s = prediction.time.step_s
    frac = prediction.time.exposed_comm_s / step_s
    return run_cost(prediction.n_gpus, steps * step_s, frac, costs, "planned", steps, step_s)
