"""`parallel: auto`: the planner chooses a job's layout at launch (pure: no torch).

`meshforge train` calls `resolve_parallel_auto` right after loading the config. It
asks the planner (`search.best_layout`) for the fastest layout of this machine's
world size among those the trainer can run: every tp x pp x dp split of the world
that `ParallelDims` accepts for the model (pp needs an untied output head), ZeRO
stage 0-3, the 1F1B schedule, and a micro-batch that divides the per-rank batch
(every divisor is tried, not only powers of two). The activation checkpointing
mode stays as configured (the trainer's `selective`, every other block recomputed,
is searched as `none`, which needs more memory, so a layout that fits with it fits
with `selective`).

Which machine the planner assumes:

* a *measured* profile, if a run on this machine with the same device, backend,
  world size and threads per worker measured one (every `meshforge train` run
  measures its machine, `train.calibration`, and caches the result in
  `$MESHFORGE_CACHE/machine_profiles.json`, default `~/.cache/meshforge/`);
* otherwise an *assumed* profile: on a CPU, the figures of ASSUMED_CPU_PROFILE (said
  so in the printed line); on a GPU, an H100 node from the catalogue.

The chosen layout is written into the resolved config (RUN_DIR/config.yaml).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshforge.config import JobConfig, ParallelConfig, build_config
from meshforge.errors import ConfigError
from meshforge.fileio import atomic_writer
from meshforge.plan.core.cluster import build_cluster
from meshforge.plan.core.flops import shape_of
from meshforge.plan.core.hardware import Cluster
from meshforge.plan.core.layout import Training
from meshforge.plan.core.predict import Prediction
from meshforge.plan.core.profile import MachineProfile
from meshforge.plan.core.search import LayoutChoice, best_layout
from meshforge.plan.core.timing import HostCosts, host_step_time  # noqa: F401

log = logging.getLogger(__name__)

# Assumed when this machine has no measured profile yet: the order of magnitude of one
# core of a current x86 server with gloo over loopback (matmul rate of a mid-sized fp32
# matmul on one thread; all-reduce bus bandwidth and per-step latency; the effective
# bandwidth of a CPU AdamW step). A run measures the real figures and caches them.
ASSUMED_CPU_PROFILE = MachineProfile(
    name="cpu (assumed)",
    matmul_flops_per_s=3e10,
    allreduce_busbw_bytes_per_s=1e9,
    allreduce_latency_s=3e-4,
    memory_bytes=8e9,
    memory_bandwidth_bytes_per_s=3e9,
    matmul_overhead_s=0.0,
)
PROFILE_CACHE_FILE = "machine_profiles.json"


# -- the measured-profile cache (written by train.calibration, read here) ---------------


def cache_dir() -> Path:
    return Path(os.environ.get("MESHFORGE_CACHE") or Path.home() / ".cache" / "meshforge")


def cpu_model_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or platform.machine() or "unknown-cpu"


def profile_cache_key(
    device_type: str, backend: str, world_size: int, threads: int, nnodes: int = 1
) -> str:
    return (
        f"{cpu_model_name()}|{device_type}|{backend}|world={world_size}|nnodes={nnodes}"
        f"|threads={threads}"
    )


def load_cached_profile(key: str) -> tuple[MachineProfile, dict[str, Any]] | None:
    """(profile, cache entry) measured earlier on this machine for `key`, or None."""
    try:
        data = json.loads((cache_dir() / PROFILE_CACHE_FILE).read_text())
        entry = data[key]
        return MachineProfile.from_dict(entry["profile"]), entry
    except Exception:  # missing, unreadable or from another version: plan without it
        return None


def save_cached_profile(key: str, profile: MachineProfile, extra: dict[str, Any]) -> None:
    """Record a measured profile (atomically: readers see the old file or the new one)."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    path = root / PROFILE_CACHE_FILE
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data[key] = {"profile": profile.to_dict(), "measured_unix_s": time.time(), **extra}
    with atomic_writer(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)


# -- which machine to plan for --------------------------------------------------------------


def launch_device(cfg: JobConfig) -> tuple[str, str]:
    """(device type, backend) a launch will use, without importing torch."""
    r = cfg.runtime
    cuda = r.device == "cuda" or (r.device == "auto" and Path("/dev/nvidiactl").exists())
    device = "cuda" if cuda else "cpu"
    backend = r.backend if r.backend != "auto" else ("nccl" if cuda else "gloo")
    return device, backend


def threads_per_worker(cfg: JobConfig, nproc: int) -> int:
    """What runtime.dist gives each worker: the config's, OMP_NUM_THREADS, or a share."""
    if cfg.runtime.threads_per_worker:
        return cfg.runtime.threads_per_worker
    with contextlib.suppress(ValueError):
        if "OMP_NUM_THREADS" in os.environ:
            return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // max(1, nproc))


# -- the trainer on a host without streams (CPU, gloo): plan/core/timing.py -------------------

ASSUMED_HOST_COSTS = HostCosts(3e9, 0.75e9)  # stated: a CPU AdamW on DTensors is ~4x slower


@dataclass(frozen=True)
class PlanningMachine:
    cluster: Cluster
    host: HostCosts | None  # a CPU host: rank layouts with host_step_time
    source: str  # how the profile was obtained, for the printed line


def launch_machine(cfg: JobConfig, world_size: int, nproc: int, nnodes: int = 1):
    """The machine `parallel: auto` plans for: measured (cached) or assumed."""
    device, backend = launch_device(cfg)
    threads = threads_per_worker(cfg, nproc)
    cached = load_cached_profile(profile_cache_key(device, backend, world_size, threads, nnodes))
    if cached is not None:
        profile, entry = cached
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.get("measured_unix_s", 0)))
        host = None
        if device == "cpu":
            try:
                host = HostCosts.from_dict(entry["host"])
            except (KeyError, TypeError):
                host = HostCosts.from_profile(profile)
        return PlanningMachine(profile.to_cluster(world_size), host, f"profile measured {when}")
    if device == "cuda":
        cluster = build_cluster(world_size, "h100", gpus_per_node=max(1, nproc))
        return PlanningMachine(cluster, None, "assumed h100 (no measured profile yet)")
    return PlanningMachine(
        ASSUMED_CPU_PROFILE.to_cluster(world_size),
        ASSUMED_HOST_COSTS,
        "assumed cpu profile (none measured yet)",
    )


# -- the choice --------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass(frozen=True)
class AutoChoice:
    prediction: Prediction  # the planner's evaluation of the chosen layout
    step_time_s: float  # with the host model on a CPU host, else the planner's

    @property
    def fits(self) -> bool:
        return self.prediction.fits


def choose_layout(
    cfg: JobConfig, world_size: int, cluster: Cluster, host: HostCosts | None = None
) -> AutoChoice:
    """The fastest layout the trainer supports for `world_size` ranks (if none fits,
    the one needing least memory, with `fits` False). Each candidate (ZeRO stage,
    micro-batch) is evaluated by `best_layout` with every field fixed; with `host`, the
    step time is the CPU host's (host_step_time)."""
    t = cfg.train
    splits = _trainable_splits(cfg, world_size)
    if not splits:
        raise ConfigError(
            f"parallel: auto: no layout of {world_size} ranks can train this job "
            f"(train.global_batch={t.global_batch} must be divisible by the data-parallel "
            "degree x a micro-batch size)"
        )
    recompute = "full" if t.activation_checkpointing == "full" else "none"
    training = Training(
        global_batch=t.global_batch,
        micro_batch=1,
        precision=cfg.precision.dtype,
        recompute=recompute,
        optimizer="adamw",
        sdpa=True,
    )
    shape = shape_of(cfg)
    bucket_mb = ParallelConfig().comm.bucket_mb
    best: AutoChoice | None = None
    for tp, pp, zero, b in splits:
        dp = world_size // (tp * pp)
        choice = LayoutChoice(dp=dp, tp=tp, pp=pp, zero=zero, micro_batch=b,
                              virtual_stages=1, recompute=recompute,
                              sequence_parallel=False, ep=1)  # fmt: skip
        with contextlib.suppress(ConfigError):  # a split the planner's rules reject
            pred = best_layout(shape, training, cluster, choice)
            step = pred.step_time_s or 0.0
            if host is not None:
                step = host_step_time(pred, shape, cluster, host, bucket_mb)["step_s"]
            candidate = AutoChoice(pred, step)
            if best is None or _better(candidate, best):
                best = candidate
    if best is None:
        raise ConfigError(f"parallel: auto: the planner found no layout for {world_size} ranks")
    return best


def _trainable_splits(cfg: JobConfig, world_size: int) -> list[tuple[int, int, int, int]]:
    """(tp, pp, zero, micro_batch) candidates that the layout rules accept for `cfg`."""
    t = cfg.train
    raw = cfg.model_dump(mode="json")
    out = []
    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            dp = world_size // (tp * pp)
            if t.global_batch % dp:
                continue
            for zero in (0, 1, 2, 3) if dp > 1 else (0,):
                for b in _divisors(t.global_batch // dp):
                    raw["parallel"] = {"dp": dp, "tp": tp, "pp": pp, "zero": zero}
                    raw["train"]["micro_batch"] = b
                    try:
                        build_config(raw).dims(world_size)
                    except ConfigError:
                        continue
                    out.append((tp, pp, zero, b))
    return out


def _better(a: AutoChoice, b: AutoChoice) -> bool:
    if a.fits != b.fits:
        return a.fits
    if not a.fits:
        return a.prediction.memory.total < b.prediction.memory.total
    return (a.step_time_s, a.prediction.memory.total) < (
        b.step_time_s,
        b.prediction.memory.total,
    )


def apply_choice(cfg: JobConfig, prediction: Prediction) -> JobConfig:
    """`cfg` with the chosen layout written in (a fresh, validated config)."""
    raw = cfg.model_dump(mode="json")
    layout = prediction.layout
    raw["parallel"] = ParallelConfig(
        dp=layout.dp, zero=layout.zero, tp=layout.tp, pp=layout.pp
    ).model_dump(mode="json")
    raw["train"]["micro_batch"] = prediction.training.micro_batch
    return build_config(raw)


def resolve_parallel_auto(
    cfg: JobConfig,
    world_size: int,
    nproc: int | None = None,
    nnodes: int = 1,
    machine: PlanningMachine | None = None,
) -> tuple[JobConfig, str | None]:
    """(config with the layout chosen, the one line saying so); unchanged and None when
    the config does not say `parallel: auto`."""
    if cfg.parallel != "auto":
        return cfg, None
    machine = machine or launch_machine(cfg, world_size, nproc or world_size, nnodes)
    choice = choose_layout(cfg, world_size, machine.cluster, machine.host)
    resolved = apply_choice(cfg, choice.prediction)
    layout = choice.prediction.layout
    fits = "" if choice.fits else ", does NOT fit in memory"
    line = (
        f"meshforge: parallel: auto -> dp={layout.dp} zero={layout.zero} tp={layout.tp} "
        f"pp={layout.pp} "
        f"micro_batch={choice.prediction.training.micro_batch} "
        f"(predicted {1e3 * choice.step_time_s:.1f} ms/step{fits}; {machine.source})"
    )
    return resolved, line


def resolve_open_decisions(cfg: JobConfig, world: int) -> JobConfig:
    """What is left to decide once the world is known: `parallel: auto`."""
    if cfg.parallel != "auto":
        return cfg
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cfg, line = resolve_parallel_auto(cfg, world, local, max(1, world // max(1, local)))
    if line:
        log.info("%s", line)
        print(line, flush=True)
    return cfg
