"""A job config's prediction (pure: no torch): what `report.json`'s `predicted` says.

`predict_for_job` maps a job config onto `plan.predict.predict_run`; on a CPU host
with the trainer's own semantics for data-parallel traffic (`plan.auto.host_step_time`).
The profile is usually the one the run measured of its own machine
(`observe.machine.measure_profile`).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from meshforge.config import JobConfig
from meshforge.errors import ConfigError
from meshforge.plan.auto import HostCosts, host_step_time
from meshforge.plan.flops import params_per_rank, shape_of
from meshforge.plan.layout import Layout
from meshforge.plan.memory import model_state_bytes
from meshforge.plan.predict import predict_run
from meshforge.plan.profile import MachineProfile


def _collective_only(cfg: JobConfig) -> None:
    if cfg.parallel != "auto" and cfg.parallel.mode == "parameter_server":
        raise ConfigError("the planner models parallel.mode=collective only, not parameter_server")


def param_bytes_per_rank(cfg: JobConfig, world_size: int) -> float:
    """Bytes of the parameters one rank holds (the planner's count)."""
    _collective_only(cfg)
    p = cfg.parallel
    rank_params = params_per_rank(shape_of(cfg), p.tp, p.pp).total
    dp = cfg.resolve_dp(world_size)
    return model_state_bytes(rank_params, p.zero, dp, cfg.precision.dtype)["params"]


def predict_for_job(
    cfg: JobConfig,
    world_size: int,
    profile: MachineProfile,
    runtime_bytes: float = 0.0,
    host: HostCosts | None = None,
) -> dict[str, Any]:
    """What the planner predicts for `cfg` at `world_size` ranks on `profile`.

    On a CPU host (`host` given, or a profile named cpu...) the data-parallel and
    optimizer terms follow meshforge's trainer on gloo (`plan.auto.host_step_time`:
    no overlap of FSDP's collectives, per-unit latency, DTensor optimizer); on a GPU
    the planner's own time model. The trainer's `activation_checkpointing: selective`
    recomputes every other block in full, which is not Korthikanti's selective
    recomputation: it is predicted as half the layers with `none` and half with
    `full` (memory and time are sums over layers). `memory_total_bytes` adds
    `runtime_bytes` (the process's own baseline on a CPU) to the planner's total."""
    _collective_only(cfg)
    dp = cfg.resolve_dp(world_size)
    p, t = cfg.parallel, cfg.train
    layout = Layout(dp=dp, tp=p.tp, pp=p.pp, zero=p.zero, virtual_stages=p.virtual_stages)
    shape = shape_of(cfg)
    if host is None and profile.name.startswith("cpu"):
        host = HostCosts.from_profile(profile)
    cluster = profile.to_cluster(world_size)

    def run(recompute: str) -> tuple[Any, dict[str, float]]:
        pred = predict_run(
            shape, layout, t.global_batch, t.micro_batch, cfg.precision.dtype, recompute,
            profile, optimizer="adamw", sdpa=True,
        )  # fmt: skip
        if host is None:
            return pred, pred.time.to_dict()
        return pred, host_step_time(pred, shape, cluster, host, p.comm.bucket_mb)

    mode = t.activation_checkpointing
    parts = [run("none"), run("full")] if mode == "selective" else [run(mode)]

    def mean(get) -> float:
        return sum(get(pred, times) for pred, times in parts) / len(parts)

    first = parts[0][0]
    states = {
        "params": first.memory.params,
        "grads": first.memory.grads,
        "optimizer": first.memory.optimizer,
        "total": first.memory.model_states,
    }
    planner_total = mean(lambda pred, _: pred.memory.total)
    step_s = mean(lambda _, times: times["step_s"])
    breakdown = {key: mean(lambda _, times, k=key: times[k]) for key in parts[0][1]}
    return {
        "model_state_bytes": states,
        "activations_bytes": mean(lambda pred, _: pred.memory.activations or 0.0),
        "working_bytes": first.memory.working,
        "planner_memory_total_bytes": planner_total,
        "runtime_bytes": runtime_bytes,
        "memory_total_bytes": planner_total + runtime_bytes,
        "step_time_s": step_s,
        "tokens_per_s": t.global_batch * shape.seq_len / step_s,
        "time_model": "planner" if host is None else "planner + cpu host (plan.auto)",
        "time_breakdown_s": breakdown,
        "layout": {**layout.to_dict(), "micro_batch": t.micro_batch, "recompute": mode},
        "profile": profile.to_dict(),
        "host": None if host is None else asdict(host),
    }
