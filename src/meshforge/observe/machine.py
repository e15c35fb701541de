"""This machine, measured for the planner: the profile a run predicts itself with.

`measure_profile` runs inside the trainer, on every rank together (it uses the live
process group), right after the peak FLOP/s are known. It measures what the
planner's time model needs, under the run's own conditions (the same thread count
per worker, the other workers busy at the same moment):

compute       the peak is the cached big-matmul rate of this CPU for the run's dtype
              and torch thread count (`observe.peak`), or the GPU's datasheet figure.
              Small matmuls run well below it, so the model's own compute is timed at
              its own size: one transformer layer as meshforge's GPT runs it (LayerNorm,
              QKV, causal SDPA, projection, GELU MLP, residual adds) and the
              embedding/head/loss, forward and backward, at the run's micro-batch. The
              fixed cost per unit of work t0 of the planner's efficiency curve
              (plan/efficiency.py, with f_max = 1) is fitted so that the curve gives
              exactly that time at this size:
                  t_measured = F/peak + (F/W)·t0
              (F the Megatron-convention FLOPs timed, W the unit of work). Other
              micro-batch sizes and recomputation then follow the curve. The model's
              matmuls alone are timed too, for the record. If the cached peak is below
              the rate measured at size (a figure cached while the machine was busy),
              the measured rate is the peak and t0 = 0.
optimizer     the trainer's optimizer step (gradient norm, clipping, AdamW) on tensors
              of the model's parameter shapes, as plain tensors (DDP, ZeRO-1) and as
              FSDP2's DTensor shards (ZeRO-2/3): 32 bytes per parameter the rank
              updates ÷ time, the planner's count (plan/timing.py).
all-reduce    gloo (CPU) or NCCL (GPU) fp32 all-reduce on the run's process group at
              three sizes; t = 2(n-1)·α + 2(n-1)/n·S/busbw fitted by least squares in
              relative error (nccl-tests convention for busbw, REFERENCES.md).
memory        host RAM on a CPU (shared by the ranks), the device's memory on a GPU;
              on a CPU also what the process holds before training beyond its
              parameters (the interpreter, PyTorch, the token array): `runtime_bytes`,
              added to the predicted total so that it compares with peak RSS.

Every rank measures; the slowest figures are kept (all-reduce MAX of the times), so
all ranks hold the same profile. The whole measurement takes about a second. It is
measured afresh for every run, because it describes the machine as it is during
this run (a figure cached while colleagues' jobs shared the cores would mislead every
later run); rank 0 then records it in `$MESHFORGE_CACHE/machine_profiles.json`
(atomically), where `parallel: auto` finds it at the next launch (plan/auto.py).

`predict_for_job` maps a job config onto `plan.predict.predict_run`; on a CPU host
with the trainer's own semantics for data-parallel traffic (`plan.auto.host_step_time`).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshforge.config import JobConfig
from meshforge.observe.peak import _cuda_matmul_dtype, gpu_peak_flops, measure_cpu_matmul_flops
from meshforge.plan.auto import (
    ASSUMED_HOST_COSTS,
    HostCosts,
    host_step_time,
    profile_cache_key,
    save_cached_profile,
    shape_of,
)
from meshforge.plan.efficiency import matmul_unit_flops
from meshforge.plan.flops import GPTShape, microbatch_flops, params_per_rank
from meshforge.plan.layout import Layout
from meshforge.plan.memory import model_state_bytes
from meshforge.plan.predict import predict_run
from meshforge.plan.profile import MachineProfile
from meshforge.plan.timing import OPTIMIZER_BYTES_PER_PARAM

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# All-reduce sizes (bytes) and timed repetitions: fixed, so every rank runs the same
# collectives; about 0.1 s with gloo on loopback at world 2.
ALLREDUCE_SIZES = (4 * 1024, 256 * 1024, 4 * 1024 * 1024)
ALLREDUCE_REPEATS = (7, 5, 3)
MATMUL_BUDGET_S = 0.4  # timed passes of the model's compute at its size stop after this
OPTIMIZER_MAX_PARAMS = 2_000_000  # larger models: a flat tensor of this many instead
NO_LINK_BUSBW = 1e12  # placeholder for a single rank (no collective ever runs)


@dataclass(frozen=True)
class MeasuredProfile:
    """A profile plus how it was measured (for report.json)."""

    profile: MachineProfile
    details: dict[str, Any] = field(default_factory=dict)
    runtime_bytes: float = 0.0  # CPU: process RSS before training beyond the parameters
    host: HostCosts | None = None  # CPU: the optimizer rates of plan.auto's host model


# -- helpers ---------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _group_of(group: Any) -> Any:
    """A DeviceMesh's process group, a process group, or None (the default group)."""
    if group is not None and hasattr(group, "get_group"):
        return group.get_group()
    return group


def _world(group: Any) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _max_across(values: list[float], device: torch.device, group: Any) -> list[float]:
    """Element-wise maximum over the ranks (a collective: every rank calls it)."""
    if _world(group) == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _barrier(device: torch.device, group: Any) -> None:
    if _world(group) > 1:
        dist.all_reduce(torch.zeros(1, device=device), group=group)
        _sync(device)


def peak_matmul_flops(device: torch.device, dtype: str, threads: int) -> tuple[float | None, str]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        matmul_dtype = _cuda_matmul_dtype(dtype)
        return gpu_peak_flops(name, matmul_dtype), f"table:{name} {matmul_dtype}"
    return measure_cpu_matmul_flops(dtype, threads), f"cpu matmul {dtype} threads={threads}"


# -- matmuls at the model's own size -------------------------------------------------


def _model_matmul_pass(shape: GPTShape, micro_batch: int, dtype: torch.dtype, device):
    """(one layer's pass, the logits' pass, layer FLOPs, logits FLOPs): forward and
    backward of the matmuls the planner counts, at the run's sizes."""
    b, s, h, r, a, v = (micro_batch, shape.seq_len, shape.d_model, shape.mlp_ratio,
                        shape.n_heads, shape.vocab_size)  # fmt: skip
    rows = b * s

    def linear(n_in: int, n_out: int, bias: bool = True):
        x = torch.randn(rows, n_in, dtype=dtype, device=device, requires_grad=True)
        w = torch.randn(n_out, n_in, dtype=dtype, device=device, requires_grad=True)
        bb = torch.randn(n_out, dtype=dtype, device=device, requires_grad=True) if bias else None
        g = torch.randn(rows, n_out, dtype=dtype, device=device)
        inputs = (x, w) if bb is None else (x, w, bb)

        def run() -> None:
            torch.autograd.grad(F.linear(x, w, bb), inputs, g)

        return run

    layer_parts = [linear(h, 3 * h), linear(h, h), linear(h, r * h), linear(r * h, h)]
    qkv = [
        torch.randn(b, a, s, h // a, dtype=dtype, device=device, requires_grad=True)
        for _ in range(3)
    ]
    g_att = torch.randn(b, a, s, h // a, dtype=dtype, device=device)

    def attention() -> None:
        out = F.scaled_dot_product_attention(*qkv, is_causal=True)
        torch.autograd.grad(out, qkv, g_att)

    layer_parts.append(attention)
    logits = linear(h, v, bias=False)

    def layer() -> None:
        for part in layer_parts:
            part()

    flops = microbatch_flops(shape, b)
    return layer, logits, 3.0 * flops.layer_forward, 3.0 * flops.logits_forward


def _time_passes(fn, device: torch.device, budget_s: float) -> float:
    """Median seconds of `fn` after one warm-up, repeated while within `budget_s`
    (at least twice)."""
    fn()
    _sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 2 or (time.perf_counter() - start < budget_s and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _model_layer_pass(shape: GPTShape, micro_batch: int, dtype: torch.dtype, device):
    """(one transformer layer's pass, the embedding + head + loss pass) as meshforge's
    GPT runs them (models/gpt.py: pre-LayerNorm block, SDPA attention, GELU MLP, tied
    head, cross-entropy on fp32 logits), forward and backward, at the run's sizes.
    Built from torch.nn.functional so that observe/ does not import models/."""
    b, s, h, r, a, v = (micro_batch, shape.seq_len, shape.d_model, shape.mlp_ratio,
                        shape.n_heads, shape.vocab_size)  # fmt: skip

    def param(*size: int) -> torch.Tensor:
        return (0.02 * torch.randn(*size, dtype=dtype, device=device)).requires_grad_()

    ln = [(param(h), param(h)) for _ in range(3)]
    w = {"qkv": (param(3 * h, h), param(3 * h)), "proj": (param(h, h), param(h)),
         "fc": (param(r * h, h), param(r * h)), "out": (param(h, r * h), param(h))}  # fmt: skip
    x = torch.randn(b, s, h, dtype=dtype, device=device, requires_grad=True)
    g = torch.randn(b, s, h, dtype=dtype, device=device)
    layer_inputs = [x, *ln[0], *ln[1], *(t for pair in w.values() for t in pair)]

    def layer() -> None:
        q, k, vv = F.linear(F.layer_norm(x, (h,), *ln[0]), *w["qkv"]).split(h, dim=2)
        q, k, vv = (t.view(b, s, a, h // a).transpose(1, 2) for t in (q, k, vv))
        y = F.scaled_dot_product_attention(q, k, vv, is_causal=True)
        x2 = x + F.linear(y.transpose(1, 2).reshape(b, s, h), *w["proj"])
        hidden = F.gelu(F.linear(F.layer_norm(x2, (h,), *ln[1]), *w["fc"]))
        out = x2 + F.linear(hidden, *w["out"])
        torch.autograd.grad(out, layer_inputs, g)

    tok, pos = param(v, h), param(s, h)
    idx = torch.randint(0, v, (b, s), device=device)
    targets = torch.randint(0, v, (b, s), device=device)
    positions = torch.arange(s, device=device)

    def head() -> None:
        z = F.embedding(idx, tok) + F.embedding(positions, pos)
        logits = F.linear(F.layer_norm(z, (h,), *ln[2]), tok)
        loss = F.cross_entropy(logits.float().view(-1, v), targets.view(-1))
        torch.autograd.grad(loss, [tok, pos, *ln[2]])

    flops = microbatch_flops(shape, b)
    return layer, head, 3.0 * flops.layer_forward, 3.0 * flops.logits_forward


def measure_model_compute(
    shape: GPTShape, micro_batch: int, dtype: str, device: torch.device
) -> dict[str, float]:
    """Seconds and FLOPs of one micro-batch's forward + backward (nothing recomputed),
    timed on one layer and on the embedding/head/loss: `seconds` with every kernel of
    the model (what the curve is fitted to), `matmul_seconds` with its matmuls alone
    (for the record: how far small matmuls fall below the peak)."""
    torch_dtype = _DTYPES[dtype]
    layer, head, layer_flops, logits_flops = _model_layer_pass(
        shape, micro_batch, torch_dtype, device
    )
    t_layer = _time_passes(layer, device, MATMUL_BUDGET_S * 0.4)
    t_head = _time_passes(head, device, MATMUL_BUDGET_S * 0.2)
    mm_layer, mm_logits, _, _ = _model_matmul_pass(shape, micro_batch, torch_dtype, device)
    t_mm = _time_passes(mm_layer, device, MATMUL_BUDGET_S * 0.3)
    t_mm_logits = _time_passes(mm_logits, device, MATMUL_BUDGET_S * 0.1)
    return {
        "seconds": shape.n_layers * t_layer + t_head,
        "flops": shape.n_layers * layer_flops + logits_flops,
        "layer_s": t_layer,
        "head_s": t_head,
        "matmul_seconds": shape.n_layers * t_mm + t_mm_logits,
    }


def fit_matmul_curve(
    peak: float | None, seconds: float, flops: float, unit_flops: float
) -> tuple[float, float]:
    """(peak, t0) with t(F) = F/peak + (F/W)·t0 equal to the measured `seconds`."""
    at_size = flops / seconds
    if peak is None or peak <= at_size:
        return at_size, 0.0
    units = flops / unit_flops
    return peak, (seconds - flops / peak) / units


# -- the optimizer step ------------------------------------------------------------------


def _param_shapes(shape: GPTShape) -> list[tuple[int, ...]]:
    h, r = shape.d_model, shape.mlp_ratio
    block = [(3 * h, h), (3 * h,), (h, h), (h,), (r * h, h), (r * h,), (h, r * h), (h,)]
    block += [(h,)] * 4  # two LayerNorms
    return [(shape.vocab_size, h), (shape.seq_len, h), *block * shape.n_layers, (h,), (h,)]


def _optimizer_params(shape: GPTShape, device: torch.device, mesh: Any) -> tuple[list, int]:
    """Parameters of the model's shapes with gradients: plain tensors, or (with a
    mesh) FSDP2-style DTensor shards (Shard(0), dim 0 padded to the mesh size).
    Returns (parameters, full parameter count)."""
    shapes = _param_shapes(shape)
    n = sum(torch.Size(s).numel() for s in shapes)
    if n > OPTIMIZER_MAX_PARAMS:
        shapes, n = [(OPTIMIZER_MAX_PARAMS,)], OPTIMIZER_MAX_PARAMS
    params = []
    for s in shapes:
        if mesh is None:
            p = torch.nn.Parameter(torch.zeros(s, device=device))
            p.grad = torch.randn_like(p)
        else:
            from torch.distributed.tensor import DTensor, Shard

            rows = -(-s[0] // mesh.size())
            local = torch.zeros((rows, *s[1:]), device=device)
            full = torch.Size((rows * mesh.size(), *s[1:]))
            stride = torch.empty(full, device="meta").stride()

            def shard(t: torch.Tensor, full=full, stride=stride):
                return DTensor.from_local(
                    t, mesh, [Shard(0)], run_check=False, shape=full, stride=stride
                )

            p = torch.nn.Parameter(shard(local))
            p.grad = shard(torch.randn_like(local))
        params.append(p)
    return params, n


def measure_optimizer_bandwidth(
    shape: GPTShape, device: torch.device, mesh: Any = None, repeats: int = 3
) -> float:
    """Effective bytes/s of the trainer's optimizer step (gradient norm, clipping,
    AdamW) on the model's parameter shapes, counted as the planner counts it: 32 bytes
    per parameter the rank updates. With `mesh`, on DTensor shards as FSDP2 holds them
    (collective: every rank calls it; a fixed number of repeats)."""
    from torch.distributed.tensor import DTensor

    params, n = _optimizer_params(shape, device, mesh)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(params, lr=1e-6, **({"fused": True} if fused else {}))

    def step() -> None:
        grads = [p.grad for p in params]
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, total, foreach=True)
        opt.step()

    step()  # warm-up: AdamW creates its state
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    per_rank = n / (mesh.size() if mesh is not None else 1)
    return OPTIMIZER_BYTES_PER_PARAM["adamw"] * per_rank / statistics.median(times)


# -- the all-reduce ------------------------------------------------------------------------


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


def measure_allreduce(device: torch.device, group: Any) -> dict[str, Any] | None:
    """Median seconds of fp32 all-reduces at ALLREDUCE_SIZES on `group` and the fitted
    busbw and latency. Collective: every rank of the group must call it."""
    n = _world(group)
    if n == 1:
        return None
    medians: list[tuple[float, float]] = []
    for size, repeats in zip(ALLREDUCE_SIZES, ALLREDUCE_REPEATS, strict=True):
        buf = torch.zeros(size // 4, dtype=torch.float32, device=device)
        dist.all_reduce(buf, group=group)  # warm-up: connections, buffers
        times = []
        for _ in range(repeats):
            _barrier(device, group)
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=group)
            _sync(device)
            times.append(time.perf_counter() - t0)
        times = _max_across(times, device, group)  # a collective ends with its slowest rank
        medians.append((float(size), statistics.median(times)))
    busbw, latency = fit_allreduce(medians, n)
    return {
        "busbw_bytes_per_s": busbw,
        "latency_s": latency,
        "points": [{"bytes": s, "seconds": t} for s, t in medians],
    }


# -- the profile ----------------------------------------------------------------------------


def _memory_bytes(device: torch.device) -> tuple[float, bool]:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory), True
    return float(psutil.virtual_memory().total), False


def _runtime_bytes(device: torch.device, cfg: JobConfig, world_size: int) -> float:
    """CPU: resident bytes of this process now, less the parameters it holds (which the
    planner counts itself). 0 on a GPU, whose peak counts tensors only."""
    if device.type == "cuda":
        return 0.0
    rss = float(psutil.Process().memory_info().rss)
    dp = cfg.resolve_dp(world_size)
    rank_params = model_params_per_rank(cfg)
    params = model_state_bytes(rank_params, cfg.parallel.zero, dp, cfg.precision.dtype)["params"]
    return max(0.0, rss - params)


def model_params_per_rank(cfg: JobConfig) -> float:
    p = cfg.parallel
    return params_per_rank(shape_of(cfg), p.tp, p.pp).total


def measure_profile(
    device: torch.device | str,
    dtype: str,
    group: Any = None,
    cfg: JobConfig | None = None,
    threads: int | None = None,
) -> MeasuredProfile:
    """Measure this machine for the planner (see the module docstring). Collective:
    every rank of `group` (a DeviceMesh, a process group, or None for the default
    group) must call it at the same point. With `cfg`, the model's compute and the
    optimizer step are timed at the job's own sizes. The random number generators are
    left as they were (the measurement draws its tensors from a forked state)."""
    device = torch.device(device)
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        return _measure_profile(device, dtype, group, cfg, threads)


def _measure_profile(device, dtype, group, cfg, threads) -> MeasuredProfile:
    mesh = group if hasattr(group, "get_group") else None
    group = _group_of(group)
    world = _world(group)
    threads = threads or torch.get_num_threads()
    details: dict[str, Any] = {"threads": threads, "world_size": world}
    runtime = _runtime_bytes(device, cfg, world) if cfg is not None else 0.0

    peak, peak_source = peak_matmul_flops(device, dtype, threads)
    details["peak_matmul_flops_per_s"] = peak
    details["peak_source"] = peak_source

    # (compute seconds at size, optimizer seconds per byte: plain, sharded; failed;
    # matmuls-only seconds): a local failure must not leave the other ranks waiting in
    # a collective, so it is agreed on too. The sharded optimizer step is collective.
    local = [0.0, 0.0, 0.0, 0.0, 0.0]
    flops = unit = 0.0
    if cfg is not None:
        shape = shape_of(cfg)
        b = cfg.train.micro_batch
        unit = matmul_unit_flops(b, shape.seq_len, shape.d_model, shape.mlp_ratio, 1)
        _barrier(device, group)  # all ranks compute together, as in training
        try:
            timed = measure_model_compute(shape, b, dtype, device)
            flops, local[0], local[4] = timed["flops"], timed["seconds"], timed["matmul_seconds"]
            local[1] = 1.0 / measure_optimizer_bandwidth(shape, device)
        except Exception as exc:  # e.g. a dtype this device cannot run: keep the peak
            log.warning("could not time the model's compute: %s", exc)
            local[3] = 1.0
        local[2] = local[1]
        if mesh is not None:
            try:  # the same code on every rank: it fails on all of them or on none
                local[2] = 1.0 / measure_optimizer_bandwidth(shape, device, mesh)
            except Exception as exc:
                log.warning("could not time the optimizer on DTensor shards: %s", exc)
    agreed = _max_across(local, device, group)
    at_size_s, opt_s_per_byte, sharded_s_per_byte, failed, matmul_s = agreed
    if cfg is not None and not failed:
        peak_used, t0 = fit_matmul_curve(peak, at_size_s, flops, unit)
        details["compute_at_size"] = {
            "micro_batch": cfg.train.micro_batch,
            "flops": flops,
            "seconds": at_size_s,  # every kernel of the model: what t0 is fitted to
            "flops_per_s": flops / at_size_s,
            "matmul_only_seconds": matmul_s,
            "matmul_only_flops_per_s": flops / matmul_s,
            "unit_flops": unit,
        }
        host = HostCosts(1.0 / opt_s_per_byte, 1.0 / sharded_s_per_byte)
    else:
        peak_used, t0 = (peak or 1e9), 0.0
        host = ASSUMED_HOST_COSTS
        details["compute_at_size"] = None
    mem_bw = host.optimizer_bytes_per_s
    details["optimizer_bytes_per_s"] = host.optimizer_bytes_per_s
    details["sharded_optimizer_bytes_per_s"] = host.sharded_optimizer_bytes_per_s

    comm = measure_allreduce(device, group)
    details["allreduce"] = comm
    busbw = comm["busbw_bytes_per_s"] if comm else NO_LINK_BUSBW
    latency = comm["latency_s"] if comm else 0.0

    memory, per_device = _memory_bytes(device)
    backend = dist.get_backend(group) if dist.is_initialized() else "none"
    name = f"{device.type}:{backend}:{threads}thr"
    profile = MachineProfile(
        matmul_flops_per_s=float(peak_used),
        allreduce_busbw_bytes_per_s=float(busbw),
        memory_bytes=memory,
        name=name,
        allreduce_latency_s=float(latency),
        memory_bandwidth_bytes_per_s=float(mem_bw),
        matmul_overhead_s=float(t0),
        per_device_memory=per_device,
    )
    if cfg is not None and not failed and (world == 1 or dist.get_rank() == 0):
        _remember(profile, host, device, backend, world, threads, details)
    return MeasuredProfile(profile, details, runtime, host if device.type == "cpu" else None)


def _remember(profile, host, device, backend: str, world: int, threads: int, details) -> None:
    """Cache the profile for `parallel: auto` at launch (plan/auto.py reads it)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    nnodes = max(1, world // max(1, local_world))
    key = profile_cache_key(device.type, backend, world, threads, nnodes)
    try:
        extra = {"compute_at_size": details.get("compute_at_size"), "host": asdict(host)}
        save_cached_profile(key, profile, extra)
    except OSError as exc:  # no writable cache: the run does not need it
        log.warning("could not cache the machine profile: %s", exc)


# -- the prediction ------------------------------------------------------------------------


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
        return pred, host_step_time(pred, shape, cluster, host, p.bucket_mb)

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
