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
  measures its machine, `observe.machine`, and caches the result in
  `$MESHFORGE_CACHE/machine_profiles.json`, default `~/.cache/meshforge/`);
* otherwise an *assumed* profile: on a CPU, the figures of ASSUMED_CPU_PROFILE (said
  so in the printed line); on a GPU, an H100 node from the catalogue.

The chosen layout is written into the resolved config (RUN_DIR/config.yaml).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshforge.config import JobConfig, ParallelConfig, build_config
from meshforge.errors import ConfigError
from meshforge.plan.flops import GPTShape, shape_of
from meshforge.plan.hardware import Cluster
from meshforge.plan.layout import Training
from meshforge.plan.predict import Prediction
from meshforge.plan.profile import MachineProfile
from meshforge.plan.search import LayoutChoice, best_layout

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


# -- the measured-profile cache (written by observe.machine, read here) -------------------


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
    fd, tmp = tempfile.mkstemp(dir=root, prefix=PROFILE_CACHE_FILE + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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


# -- the trainer on a host without streams (CPU, gloo) -------------------------------------
#
# The planner's time model (timing.py) is the GPU one: FSDP's collectives run on their
# own CUDA streams, hidden under compute. On a CPU with gloo, meshforge's trainer does
# not overlap them: FSDP2 waits for each unit's all-gather before its compute and for
# each reduce-scatter in the post-backward hook (a profile of a ZeRO-3 step shows the
# time as FSDP::all_gather and post_backward_reduce self time), and every collective
# pays its latency per unit (a block or the root), not once per model. The optimizer
# step runs on FSDP2's DTensor shards, much slower per byte than on plain tensors. So
# on a CPU the data-parallel and optimizer terms of a prediction are replaced by:
#
#   ZeRO-0   DDP: the grads all-reduced in buckets of parallel.comm.bucket_mb, all but the
#            last hidden under the backward of the last micro-batch (gloo's thread)
#   ZeRO-1   as 0, plus ZeroRedundancyOptimizer's broadcast of the updated parameters
#            from their owners after the step, exposed (it issues one broadcast per
#            parameter, all in flight together: counted as one per owner rank)
#   ZeRO-2   per unit, one all-gather (the first forward) and one reduce-scatter (the
#            last backward) per step, exposed
#   ZeRO-3   per unit, an all-gather in every forward and every backward, one
#            reduce-scatter per step, exposed
#   all      the loss all-reduce of a logged step (report.json's step times are those
#            of logged steps)
#
# with the measured bus bandwidth and latency of the group (collective_time), and the
# optimizer step at the measured rate for plain tensors (DDP, ZeRO-1) or DTensor shards
# (ZeRO-2/3).


@dataclass(frozen=True)
class HostCosts:
    """What a CPU host measures beyond the MachineProfile (observe.machine)."""

    optimizer_bytes_per_s: float  # AdamW + clipping on plain tensors, 32 B per parameter
    sharded_optimizer_bytes_per_s: float  # the same on FSDP2 DTensor shards

    @classmethod
    def from_profile(cls, profile: MachineProfile) -> HostCosts:
        bw = profile.memory_bandwidth_bytes_per_s
        return cls(bw, bw)


ASSUMED_HOST_COSTS = HostCosts(3e9, 0.75e9)  # stated: a CPU AdamW on DTensors is ~4x slower


def _gpt_units(shape: GPTShape, tp: int = 1, pp: int = 1) -> list[float]:
    """Parameters of each FSDP unit one rank holds: its stage's blocks, then the root."""
    from meshforge.plan.flops import params_per_rank

    rank = params_per_rank(shape, tp, pp)
    return [rank.block] * (shape.n_layers // pp) + [rank.root]


def host_step_time(
    prediction: Prediction,
    shape: GPTShape,
    cluster: Cluster,
    host: HostCosts,
    bucket_mb: float = 25.0,
    logged: bool = True,
) -> dict[str, float]:
    """Seconds per step of meshforge's trainer on a CPU host (see above), from a
    planner prediction, whose compute, tensor-parallel, pipeline and bubble times it
    keeps; the data-parallel and optimizer terms are the host's."""
    from meshforge.plan.comm import collective_time
    from meshforge.plan.timing import OPTIMIZER_BYTES_PER_PARAM

    if prediction.time is None:
        raise ConfigError("a host step time needs a GPT shape")
    layout, training = prediction.layout, prediction.training
    d, zero = layout.dp, layout.zero
    m = training.microbatches(d)
    units = _gpt_units(shape, layout.tp, layout.pp)
    params = sum(units)
    bw, lat = cluster.group_busbw(d, layout.dp_stride)

    def t(kind: str, size: float) -> float:
        return collective_time(kind, size, d, bw, lat)

    compute = prediction.time.compute_s
    fwd_share = 0.25 if training.recompute == "full" else 1.0 / 3.0
    last_backward = compute / m * (1.0 - fwd_share)
    comm = 0.0
    if d > 1 and zero <= 1:
        grads, cap = 4.0 * params, bucket_mb * 1024**2
        n_full, rest = divmod(grads, cap)
        buckets = [cap] * int(n_full) + ([rest] if rest else [])
        total = sum(t("all_reduce", b) for b in buckets)
        comm = max(0.0, total - last_backward) + t("all_reduce", buckets[-1])
        if zero == 1:  # per-parameter broadcasts, all in flight: one per owner's share
            comm += d * t("broadcast", 4.0 * params / d)
    elif d > 1:
        p_bytes = 2.0 if training.precision != "fp32" else 4.0
        gathers = sum(t("all_gather", p_bytes * u) for u in units)
        scatters = sum(t("reduce_scatter", 4.0 * u) for u in units)
        comm = (gathers if zero == 2 else 2 * m * gathers) + scatters
    logging = t("all_reduce", 4.0) if logged else 0.0
    rate = host.sharded_optimizer_bytes_per_s if zero >= 2 else host.optimizer_bytes_per_s
    updated = params / (d if zero >= 1 else 1)
    optimizer = updated * OPTIMIZER_BYTES_PER_PARAM[training.optimizer] / rate
    model_parallel = prediction.time.tp_comm_s + prediction.time.pp_comm_s
    bubble = prediction.time.bubble_s
    step = compute + model_parallel + bubble + comm + logging + optimizer
    return {
        "compute_s": compute,
        "tp_pp_comm_s": model_parallel,
        "bubble_s": bubble,
        "dp_comm_exposed_s": comm,
        "logging_allreduce_s": logging,
        "optimizer_s": optimizer,
        "step_s": step,
    }


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
                host = HostCosts(**entry["host"])
            except (KeyError, TypeError):
                host = HostCosts.from_profile(profile)
        return PlanningMachine(profile.to_cluster(world_size), host, f"profile measured {when}")
    if device == "cuda":
        from meshforge.plan.request import build_cluster

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
                              sequence_parallel=False)  # fmt: skip
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
    """(tp, pp, zero, micro_batch) candidates that ParallelDims accepts for `cfg`."""
    from meshforge.parallel.dims import ParallelDims

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
                        ParallelDims.from_config(build_config(raw), world_size)
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
