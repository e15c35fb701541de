"""Measure once, reuse: the figures `train.calibration` takes of this machine, cached
per machine and configuration, so a run never waits for a measurement it already has.

The key names what the figures depend on: the CPU model (or GPU name), device type,
backend, dtype, torch threads per rank, ranks in the group and on this node, nodes,
the torch version, and for the job's own timings the model's shape, the micro-batch
and whether the optimizer runs on shards. The entry holds the raw measurements
(`MachineMeasurements`), refitted on every use, and when they were taken.

`meshforge train --recalibrate` (MESHFORGE_RECALIBRATE=1 in the workers) measures
again and replaces the entry; deleting `$MESHFORGE_CACHE/machine_measurements.json`
forgets every entry. The file is written atomically (readers see the old or the new
one); an unreadable file is measured over, never an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict
from typing import Any

from meshforge.fileio import atomic_writer
from meshforge.plan.jobs.auto import HostCosts, cache_dir, cpu_model_name
from meshforge.plan.jobs.machine_fit import ComputeAtSize, MachineMeasurements

log = logging.getLogger(__name__)

CACHE_FILE = "machine_measurements.json"
RECALIBRATE_ENV = "MESHFORGE_RECALIBRATE"
# bump when what is measured, or how, changes: older entries are then measured over
FORMAT = 6


def measurement_key(
    *,
    machine: str | None,
    device_type: str,
    backend: str,
    dtype: str,
    threads: int,
    world: int,
    job: dict[str, Any] | None,
) -> str:
    """The cache key of one measurement (see the module docstring)."""
    import torch

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    nodes = max(1, world // max(1, local))
    job_part = "none"
    if job is not None:
        digest = hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()[:16]
        job_part = f"{job.get('name', 'model')}-{digest}"
    return (
        f"v{FORMAT}|{machine or cpu_model_name()}|{device_type}|{backend}|{dtype}"
        f"|threads={threads}|world={world}|local={local}|nodes={nodes}"
        f"|torch={torch.__version__}|job={job_part}"
    )


def recalibrating() -> bool:
    return os.environ.get(RECALIBRATE_ENV, "") not in ("", "0")


def _path():
    return cache_dir() / CACHE_FILE


def _read_all() -> dict[str, Any]:
    try:
        data = json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load(key: str) -> tuple[MachineMeasurements, dict[str, Any]] | None:
    """(measurements, entry) cached under `key`, or None (absent, unreadable, or
    written by another format)."""
    entry = _read_all().get(key)
    if not isinstance(entry, dict):
        return None
    try:
        return from_dict(entry["measurements"]), entry
    except (KeyError, TypeError, ValueError):
        return None


def save(key: str, m: MachineMeasurements, when: float, runtime_bytes: float | None = None) -> None:
    """Record `m`, measured at `when`, under `key` (atomically), with the process's
    runtime baseline taken after the measurements (`runtime_bytes`, for the runs that
    reuse them); a cache that cannot be written only warns."""
    root = cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
        data = _read_all()
        data[key] = {"measured_at": when, "measurements": asdict(m)}
        if runtime_bytes is not None:
            data[key]["runtime_bytes"] = runtime_bytes
        with atomic_writer(root / CACHE_FILE, "w") as f:
            json.dump(data, f, indent=1)
    except OSError as exc:
        log.warning("could not cache the machine measurements: %s", exc)


def from_dict(d: dict[str, Any]) -> MachineMeasurements:
    d = dict(d)
    if d.get("compute") is not None:
        d["compute"] = ComputeAtSize(**d["compute"])
    if d.get("host") is not None:
        d["host"] = HostCosts.from_dict(d["host"])
    if d.get("allreduce_points") is not None:
        d["allreduce_points"] = [(float(s), float(t)) for s, t in d["allreduce_points"]]
    return MachineMeasurements(**d)
