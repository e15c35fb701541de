"""This machine, measured for the planner: the figures a run predicts itself with.

`calibrate` runs before the trainer's `fit` (train/worker.py), on every rank together
(it uses the live process group), under the run's own conditions (the same threads
per worker, the other workers busy at the same moment). `plan.jobs.machine_fit` fits
the figures into a `MachineProfile` and caches it for `parallel: auto`.

compute     the peak: the cached big-matmul rate of this CPU for the dtype and thread
            count (`observe.peak`), or the GPU's datasheet figure; and the model's own
            compute at its size: one real block of the job's model and a 0-layer model
            (embeddings, final LayerNorm, head) with the loss, forward and backward at
            the run's micro-batch. Their nn.Linear layers and the block's attention
            are timed alone too, for the record (how far small matmuls fall below peak).
optimizer   the trainer's step (gradient norm, clipping, AdamW) on the GPT's own
            parameter shapes, as plain tensors (DDP, ZeRO-1) and as FSDP2's DTensor
            shards (ZeRO-2/3): 32 bytes per parameter the rank updates ÷ time.
all-reduce  gloo (CPU) or NCCL (GPU) fp32 all-reduce on the run's group at three sizes.
layout      the run's own layout, as the trainer runs it: with tp 1 or a pipeline,
            its whole step (accumulation or pipeline schedule, tensor-parallel plan,
            data-parallel wrapping, optimizer, a logged step's exchanges) with one and
            two layers per stage; under tensor parallelism alone (no pipeline), the
            model cut to one and two blocks and sharded by its own plan; where the step
            could not be timed, the data-parallel wrapping alone on one and two blocks
            (`TimedSteps`, `TensorParallelModels`, `WrappedBlocks` in plan/core/timing.py: the
            CPU host model's figures).
memory      host RAM on a CPU (shared by the ranks), the device's memory on a GPU; on a
            CPU also the process's own resident bytes beyond its parameters, after the
            measurements and one warm-up pass of the model cut to one block
            (`runtime_bytes`, added to the predicted total to compare with peak RSS).

Every rank measures; the slowest figures are kept (all-reduce MAX), so all ranks hold
the same profile, except while the workers share cores (more workers x threads than
cores): then each timing is the mean over the ranks (the scheduler shares the cores
evenly over a step; the slowest of short timings is a descheduled moment). It takes
about a second, once per machine and configuration: the raw figures are cached
(train/calibration_cache.py) and reused by later runs, and
`meshforge train --recalibrate` measures again (say, after the machine changed, or
when the cached figures were taken while other jobs shared the cores).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import psutil
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from meshforge.config import JobConfig, ModelConfig
from meshforge.models.gpt import DecoderLM
from meshforge.models.registry import blocks_of, family_model, tensor_parallel_plan
from meshforge.observe.peak import (
    _TORCH_DTYPES,
    _cuda_matmul_dtype,
    gpu_peak_flops,
    measure_cpu_matmul_flops,
)
from meshforge.observe.peak import METHOD as CPU_PEAK_METHOD
from meshforge.observe.straggler import StragglerWatch, rank_figures
from meshforge.parallel.activation_checkpointing import apply_activation_checkpointing
from meshforge.parallel.mesh import gradient_mesh
from meshforge.parallel.parallelize import (
    build_model_parts,
    data_parallel_kind,
    grad_norm_and_clip,
    loss_context,
    wrap_data_parallel,
)
from meshforge.plan.core.efficiency import matmul_unit_flops
from meshforge.plan.core.flops import microbatch_flops, shape_of
from meshforge.plan.core.timing import (
    OPTIMIZER_BYTES_PER_PARAM,
    HostCosts,
    TensorParallelModels,
    TimedSteps,
    WrappedBlocks,
)
from meshforge.plan.jobs.job import param_bytes_per_rank
from meshforge.plan.jobs.machine_fit import (
    ComputeAtSize,
    MachineMeasurements,
    MeasuredProfile,
    fit_profile,
    measurement_record,
    remember_profile,
)
from meshforge.train import calibration_cache
from meshforge.train.optim import Optimizers
from meshforge.train.step import cross_entropy, make_step

if TYPE_CHECKING:
    from meshforge.train.engine import Engine

log = logging.getLogger(__name__)

# All-reduce sizes (bytes) and timed repetitions: fixed, so every rank runs the same
# collectives; about 0.1 s with gloo on loopback at world 2.
ALLREDUCE_SIZES = (4 * 1024, 256 * 1024, 4 * 1024 * 1024)
ALLREDUCE_REPEATS = (7, 5, 3)
MATMUL_BUDGET_S = 0.4  # timed passes of the model's compute at its size stop after this
OPTIMIZER_MAX_PARAMS = 2_000_000  # larger models: a flat tensor of this many instead


# -- helpers ---------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def _oversubscribed(device: torch.device) -> bool:
    """More busy threads on this node (workers x torch threads) than CPU cores."""
    if device.type != "cpu":
        return False
    workers = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return workers * torch.get_num_threads() > len(os.sched_getaffinity(0))


def _agreed_seconds(values: list[float], device: torch.device, group: Any) -> list[float]:
    """The ranks' timings as one figure each: the slowest rank's (a synchronous step
    waits for it), except when the workers share cores: the scheduler then shares the
    cores evenly over a step, and the slowest of short timings is the one a descheduled
    moment fell into, so the mean over the ranks is taken."""
    if _world(group) == 1 or not _oversubscribed(device):
        return _max_across(values, device, group)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return (t / _world(group)).tolist()


def _barrier(device: torch.device, group: Any) -> None:
    if _world(group) > 1:
        dist.all_reduce(torch.zeros(1, device=device), group=group)
        _sync(device)


def _time_passes(
    fn: Callable[[], None], device: torch.device, budget_s: float, n: int = 2, warm: bool = False
) -> float:
    """Median seconds of `fn` after one warm-up (none if `warm`: the caller ran it),
    repeated while within `budget_s` (at least `n` times, at most 50; exactly `n` with
    no budget, as collectives need)."""
    if not warm:
        fn()
        _sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < n or (time.perf_counter() - start < budget_s and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _paired_difference(
    fn: Callable[[], None], base: Callable[[], None], device: torch.device, n: int
) -> float:
    """Median of `fn`'s time less `base`'s, the two timed one after the other n times
    (after one warm-up each): a load that comes and goes on a shared machine then
    weighs on both sides of each difference. Exactly n calls of `fn` (collectives)."""
    fn()
    base()
    _sync(device)
    differences = []
    for _ in range(n):
        t0 = time.perf_counter()
        base()
        _sync(device)
        t1 = time.perf_counter()
        fn()
        _sync(device)
        differences.append(time.perf_counter() - t1 - (t1 - t0))
    return statistics.median(differences)


def peak_matmul_flops(device: torch.device, dtype: str, threads: int) -> tuple[float | None, str]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        matmul_dtype = _cuda_matmul_dtype(dtype)
        return gpu_peak_flops(name, matmul_dtype), f"table:{name} {matmul_dtype}"
    flops = measure_cpu_matmul_flops(dtype, threads)
    return flops, f"cpu matmul {dtype} threads={threads} {CPU_PEAK_METHOD}"


def _stale_cpu_peak(measured: Any) -> bool:
    """A cached CPU profile whose peak was measured otherwise than now (before, in one
    operand layout only: bf16's came out ~10x low, observe/peak.py): measured again."""
    source = getattr(measured, "peak_source", None)
    return getattr(measured, "device_type", None) == "cpu" and (
        not isinstance(source, str) or not source.endswith(CPU_PEAK_METHOD)
    )


# -- the model's compute at its own size ---------------------------------------------


def _model_parts(
    model: ModelConfig, dtype: torch.dtype, device: torch.device
) -> tuple[nn.Module, DecoderLM]:
    """(one layer, the rest) of the run's model on `device` in `dtype`, in training
    mode: a block, and a 0-layer model (embeddings, final norm, head)."""
    with torch.device(device):
        block = family_model(model.model_copy(update={"n_layers": 1})).blocks["0"]
        ends = family_model(model.model_copy(update={"n_layers": 0}))
    return block.to(dtype).train(), ends.to(dtype).train()


def _grad_pass(forward: Callable, inputs: list, grad_out: Any = None) -> Callable[[], None]:
    """A pass: `forward()`, then its backward to `inputs` (seeded with `grad_out`)."""

    def run() -> None:
        torch.autograd.grad(forward(), inputs, grad_out)

    return run


def _layer_pass(block: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """One layer, forward and backward (gradients of its input and weights)."""
    inputs = [x.requires_grad_(), *block.parameters()]
    return _grad_pass(partial(block, x), inputs, torch.randn_like(x))


def _ends_pass(ends: DecoderLM, idx: torch.Tensor, targets: torch.Tensor) -> Callable[[], None]:
    """Embeddings, head and loss, forward and backward (the trainer's cross-entropy on
    fp32 logits, train/step.py)."""

    def loss() -> torch.Tensor:
        return F.cross_entropy(ends(idx).float().flatten(0, 1), targets.flatten())

    return _grad_pass(loss, list(ends.parameters()))


def _matmul_pass(module: nn.Module, rows: int, attention=None) -> Callable[[], None]:
    """The matmuls the planner counts in `module`, alone, forward and backward: every
    nn.Linear on `rows` rows, and causal attention on q, k, v of shape `attention`
    (b, heads, s, head_dim) if given."""
    w = next(module.parameters())
    like = {"dtype": w.dtype, "device": w.device}
    parts = []
    for lin in (m for m in module.modules() if isinstance(m, nn.Linear)):
        x = torch.randn(rows, lin.in_features, **like).requires_grad_()
        grad_out = torch.randn(rows, lin.out_features, **like)
        parts.append(_grad_pass(partial(lin, x), [x, *lin.parameters()], grad_out))
    if attention is not None:
        qkv = [torch.randn(attention, **like).requires_grad_() for _ in "qkv"]
        sdpa = partial(F.scaled_dot_product_attention, *qkv, is_causal=True)
        parts.append(_grad_pass(sdpa, qkv, torch.randn(attention, **like)))

    def run() -> None:
        for part in parts:
            part()

    return run


def measure_model_compute(
    model: ModelConfig, micro_batch: int, dtype: str, device: torch.device
) -> dict[str, float]:
    """Seconds and FLOPs of one micro-batch's forward + backward (nothing recomputed),
    timed on one real layer and on the embedding/head/loss: `seconds` with every
    kernel of the model (what the curve is fitted to), `matmul_seconds` with its
    matmuls alone (for the record)."""
    b, s, L = micro_batch, model.seq_len, model.n_layers
    block, ends = _model_parts(model, _TORCH_DTYPES[dtype], device)
    x = torch.randn(b, s, model.d_model, dtype=_TORCH_DTYPES[dtype], device=device)
    idx, targets = (torch.randint(0, model.vocab_size, (b, s), device=device) for _ in "it")
    heads = (b, model.n_heads, s, model.d_model // model.n_heads)
    t_layer = _time_passes(_layer_pass(block, x), device, MATMUL_BUDGET_S * 0.4)
    t_ends = _time_passes(_ends_pass(ends, idx, targets), device, MATMUL_BUDGET_S * 0.2)
    t_mm = _time_passes(_matmul_pass(block, b * s, heads), device, MATMUL_BUDGET_S * 0.3)
    t_mm_ends = _time_passes(_matmul_pass(ends, b * s), device, MATMUL_BUDGET_S * 0.1)
    # the same layer recomputed as the trainer recomputes it (torch.utils.checkpoint):
    # what full recomputation adds per layer, its hooks included; paired with the plain
    # layer (median of differences) so that load which comes and goes weighs on both
    recomputed = copy.deepcopy(block)
    apply_activation_checkpointing([recomputed], "full")
    t_extra = _paired_difference(
        _layer_pass(recomputed, x.detach().clone()), _layer_pass(block, x), device, 7
    )
    flops = microbatch_flops(shape_of(model), b)
    return {
        "seconds": L * t_layer + t_ends,
        "flops": 3.0 * (L * flops.layer_forward + flops.logits_forward),
        "matmul_seconds": L * t_mm + t_mm_ends,
        "recompute_layer_seconds": max(0.0, t_extra),
    }


# -- the optimizer step ------------------------------------------------------------------


def _param_shapes(model: ModelConfig) -> list[torch.Size]:
    """The shapes of the model's parameters (built on the meta device: no memory)."""
    with torch.device("meta"):
        gpt = family_model(model)
    return [p.shape for p in gpt.parameters()]


def _sharded(shape: torch.Size, device: torch.device, mesh: Any) -> nn.Parameter:
    """A parameter of `shape` as FSDP2 holds it: a Shard(0) DTensor (dim 0 padded to
    the mesh size), with a gradient."""
    rows = -(-shape[0] // mesh.size())
    full = torch.Size((rows * mesh.size(), *shape[1:]))
    stride = torch.empty(full, device="meta").stride()
    shard = partial(DTensor.from_local, device_mesh=mesh, placements=[Shard(0)],
                    run_check=False, shape=full, stride=stride)  # fmt: skip
    local = torch.zeros((rows, *shape[1:]), device=device)
    p = nn.Parameter(shard(local))
    p.grad = shard(torch.randn_like(local))
    return p


def _optimizer_params(model: ModelConfig, device: torch.device, mesh: Any) -> tuple[list, int]:
    """Parameters of the model's shapes with gradients: plain tensors, or (with a
    mesh) DTensor shards. Returns (parameters, full parameter count)."""
    shapes = _param_shapes(model)
    n = sum(s.numel() for s in shapes)
    if n > OPTIMIZER_MAX_PARAMS:
        shapes, n = [torch.Size((OPTIMIZER_MAX_PARAMS,))], OPTIMIZER_MAX_PARAMS
    if mesh is not None:
        return [_sharded(s, device, mesh) for s in shapes], n
    params = [nn.Parameter(torch.zeros(s, device=device)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    return params, n


def measure_optimizer_bandwidth(
    model: ModelConfig, device: torch.device, mesh: Any = None, repeats: int = 3
) -> float:
    """Effective bytes/s of the trainer's optimizer step (gradient norm, clipping,
    AdamW) on the model's parameter shapes, counted as the planner counts it: 32 bytes
    per parameter the rank updates. With `mesh`, on DTensor shards as FSDP2 holds them
    (collective: every rank calls it; a fixed number of repeats)."""
    params, n = _optimizer_params(model, device, mesh)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(params, lr=1e-6, **({"fused": True} if fused else {}))

    def step() -> None:
        grads = [p.grad for p in params]
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, total, foreach=True)
        opt.step()

    seconds = _time_passes(step, device, 0.0, repeats)  # the warm-up creates AdamW's state
    per_rank = n / (mesh.size() if mesh is not None else 1)
    return OPTIMIZER_BYTES_PER_PARAM["adamw"] * per_rank / seconds


# -- the trainer's data-parallel wrapping ----------------------------------------------


class _Blocks(nn.Module):
    """k of the model's blocks in a row: a stand-in for the model that the trainer's
    data-parallel wrapping treats as it treats the real one (`blocks` are FSDP units)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x


def measure_wrapped_blocks(
    cfg: JobConfig, microbatches: int, device: torch.device, mesh: Any, repeats: int = 7
) -> WrappedBlocks:
    """Seconds that the trainer's data-parallel wrapping (`wrap_data_parallel`: DDP for
    ZeRO 0/1, FSDP2 units for ZeRO 2/3, with the job's parallel.comm settings) adds to
    a step of one and of two of the job's blocks on `mesh`: `microbatches`
    forward+backward passes of the run's micro-batch, gradient sync on the last only,
    as the trainer accumulates; the same passes unwrapped are subtracted. Under ZeRO-1
    also the ZeroRedundancyOptimizer's step. Collective: every rank of the mesh calls
    it (a fixed number of repeats)."""
    model, zero, dtype = cfg.model, cfg._parallel().zero, cfg.precision.dtype
    x = torch.randn(cfg.train.micro_batch, model.seq_len, model.d_model, device=device)
    grad = torch.randn_like(x)
    cast = _TORCH_DTYPES[dtype] if dtype != "fp32" else None
    wrapper = data_parallel_kind(zero, mesh.size(), model_parallel=False)

    def blocks(k: int) -> _Blocks:
        with torch.device(device):
            some = model.model_copy(update={"n_layers": k})
            return _Blocks(list(family_model(some).blocks.values())).train()

    def step(module: nn.Module, parts: Any = None) -> Callable[[], None]:
        inputs = x.detach().requires_grad_()

        def run() -> None:
            for i in range(microbatches):
                sync = parts.gradient_sync(i == microbatches - 1) if parts else None
                on = cast is not None and wrapper in ("ddp", "none")  # FSDP casts by policy
                autocast = torch.autocast(device.type, dtype=cast or torch.float32, enabled=on)
                with sync or contextlib.nullcontext(), autocast:
                    out = module(inputs)
                out.float().backward(grad)
            if parts is not None:
                parts.reduce_gradients()
            for p in module.parameters():
                p.grad = None

        return run

    seconds, optimizer = [], []
    for k in (1, 2):
        plain = step(blocks(k))
        p = cfg._parallel()
        parts = wrap_data_parallel([blocks(k)], wrapper, zero, mesh, dtype, p.comm, device)
        seconds.append(_paired_difference(step(parts.callables[0], parts), plain, device, repeats))
        if zero == 1:  # ZeroRedundancyOptimizer: its shard's AdamW and every broadcast
            parts.callables[0](x).float().backward(grad)
            opt = Optimizers(cfg, parts, mesh, device).optimizers[0]  # the trainer's
            optimizer.append(_time_passes(opt.step, device, 0.0, repeats))
        del parts
    block_params = sum(p.numel() for p in blocks(1).parameters())
    one, two, *opt_s = _agreed_seconds(seconds + optimizer, device, mesh.get_group())
    return WrappedBlocks(
        zero, mesh.size(), microbatches, float(block_params), one, two, *(opt_s or (None, None))
    )


def measure_tensor_parallel(
    cfg: JobConfig, device: torch.device, tp_mesh: Any, dp_mesh: Any = None, repeats: int = 3
) -> TensorParallelModels:
    """Seconds of one step (the run's micro-batches, forward+backward with the
    trainer's loss) through the job's model cut to one and to two blocks, sharded over
    `tp_mesh` by the model's own tensor-parallel plan (DTensor collectives, dispatch and
    all) and, with a `dp_mesh` of more than one rank, wrapped for data parallelism as
    the trainer wraps it (gradient sync on the last micro-batch). Collective: every rank
    of the meshes calls it (a fixed number of repeats)."""
    p, model = cfg._parallel(), cfg.model
    b = cfg.train.micro_batch
    dp = dp_mesh.size() if dp_mesh is not None else 1
    m = cfg.train.global_batch // (b * dp)
    idx = torch.randint(0, model.vocab_size, (b, model.seq_len), device=device)
    seconds, steps = [], []
    for k in (1, 2):
        some = model.model_copy(update={"n_layers": k})
        with torch.device(device):
            lm = family_model(some).train()
        tensor_parallel_plan(model)(
            lm, tp_mesh, sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel
        )
        lm.tie_weights()
        wrapper = data_parallel_kind(p.zero, dp, model_parallel=True)
        parts = wrap_data_parallel(
            [lm], wrapper, p.zero, dp_mesh, cfg.precision.dtype, p.comm, device
        )

        def run(parts: Any = parts) -> None:
            cast = parts.autocast_dtype  # FSDP and replicate cast through their policy
            autocast = partial(torch.autocast, device.type, dtype=cast, enabled=bool(cast))
            for i in range(m):
                with parts.gradient_sync(i == m - 1), loss_context(p.loss_parallel):
                    with autocast():
                        logits = parts.callables[0](idx)
                    cross_entropy(logits, idx).backward()
            for q in parts.parameters():
                q.grad = None

        seconds.append(_time_passes(run, device, 0.0, repeats))
        # the trainer's optimizer step on these DTensor parameters: the gradient norm
        # (reduced over the meshes) and clipping, then AdamW
        with loss_context(p.loss_parallel):
            cross_entropy(parts.callables[0](idx), idx).backward()
        optimizer = Optimizers(cfg, parts, dp_mesh, device)

        def step(parts: Any = parts, optimizer: Any = optimizer) -> None:
            grad_norm_and_clip(parts, max(cfg.train.grad_clip, 1.0), None)
            optimizer.optimizers[0].step()

        steps.append(_time_passes(step, device, 0.0, repeats))
        del parts, lm, optimizer
    one, two, opt_one, opt_two = _agreed_seconds(seconds + steps, device, None)
    return TensorParallelModels(tp_mesh.size(), b, one, two, dp, m, p.zero, opt_one, opt_two)


STEP_BUDGET_S = 0.2  # seconds of timed steps per model size, beyond `repeats`


def measure_steps(cfg: JobConfig, device: torch.device, mesh: Any, repeats: int = 7) -> TimedSteps:
    """Seconds of one optimizer step of the job's layout (tp 1, or tensor-parallel
    stages of a pipeline) through its model cut to one and to two layers per stage (one
    stage without a pipeline), run by the trainer's own code: its model parts
    (`build_model_parts`: the pipeline split, the job's activation checkpointing and
    data-parallel wrapping over `mesh`'s dp), its Optimizers and its step
    (`train.step.make_step`: the accumulated micro-batches or the pipeline schedule with
    its sends, the loss, the gradient norm and clipping, AdamW), timed as a logged step:
    with the norm, and the loss and rank figures the trainer exchanges at each logged
    step; the median of `repeats` passes or more (a short step as many as fit in
    STEP_BUDGET_S, at most 50). Collective: every rank of `mesh` calls it (the same
    number of passes)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = cfg.dims(world)
    b, m = cfg.train.micro_batch, dims.microbatches
    shape = (b, cfg.model.seq_len)
    batch = [(torch.randint(0, cfg.model.vocab_size, shape),) * 2 for _ in range(m)]
    watch = StragglerWatch(world)
    seconds = []
    for k in (1, 2):
        model = cfg.model.model_copy(update={"n_layers": k * dims.n_stages})
        some = cfg.model_copy(update={"model": model})
        parts = build_model_parts(some, dims, mesh, device)
        optimizers = Optimizers(some, parts, gradient_mesh(mesh, dims), device)
        strategy = make_step(some, dims, mesh, parts, optimizers, device)

        def run(strategy: Any = strategy, optimizers: Any = optimizers) -> None:
            optimizers.zero_grad()
            t0 = time.perf_counter()
            result = strategy.step(1, batch, True)
            # a logged step's own collectives, as the trainer runs them: every row of
            # metrics.jsonl, whose median is the run's step time, is a logged step
            watch.exchange(True, rank_figures(device, time.perf_counter() - t0))
            strategy.reduce_loss(result.loss_sum / m).item()
            strategy.sync()

        run()  # torch's shape inference on the first step
        t0 = time.perf_counter()
        run()  # the warm-up, timed to size the passes
        _sync(device)
        # a short step is timed more often (up to about STEP_BUDGET_S, at most 50 times),
        # a load that comes and goes weighing less on its median; the same count on
        # every rank (collectives)
        (first,) = _max_across([time.perf_counter() - t0], device, None)
        n = max(repeats, min(50, int(STEP_BUDGET_S / max(first, 1e-6))))
        seconds.append(_time_passes(run, device, 0.0, n, warm=True))
        del strategy, optimizers, parts
    one, two = _agreed_seconds(seconds, device, None)
    schedule = dims.pp_schedule if dims.pp > 1 else "none"
    return TimedSteps(dims.pp, dims.n_stages // dims.pp, schedule, dims.dp, dims.zero, b, m,
                      one, two, tp=dims.tp, cp=dims.cp, cp_method=dims.cp_method)  # fmt: skip


# -- the all-reduce ------------------------------------------------------------------------


def measure_allreduce(device: torch.device, group: Any) -> list[tuple[float, float]] | None:
    """(bytes, median seconds) of fp32 all-reduces at ALLREDUCE_SIZES on `group`, the
    slowest rank's; None for a single rank. Collective: every rank must call it."""
    if _world(group) == 1:
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
    return medians


# -- memory --------------------------------------------------------------------------------


def _memory_bytes(device: torch.device) -> tuple[float, bool]:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory), True
    return float(psutil.virtual_memory().total), False


def _runtime_bytes(device: torch.device, cfg: JobConfig, world_size: int) -> float:
    """CPU: resident bytes of this process once PyTorch's kernels are warm, less the
    parameters it holds (which the planner counts itself). 0 on a GPU, whose peak counts
    tensors only."""
    if device.type == "cuda":
        return 0.0
    try:
        _warm_up(cfg, device)
    except Exception as exc:  # a family the narrow copy cannot build: the baseline as is
        log.debug("no warm-up pass before the runtime baseline: %s", exc)
    rss = float(psutil.Process().memory_info().rss)
    return max(0.0, rss - param_bytes_per_rank(cfg, world_size))


def _warm_up(cfg: JobConfig, device: torch.device) -> None:
    """One forward and backward of the model cut to one block, at the run's micro-batch
    (recomputed if the job recomputes), so that the baseline includes what the first
    pass allocates once and keeps: kernels and code paths initialised on first use
    (the first recomputed block imports torch._dynamo: about 50 MiB) and the
    allocator's arenas, which a run whose measurements came from the cache would
    otherwise grow in its first steps beyond the prediction (measured on this CPU:
    15-45 MiB for the small GPT of benchmarks/planner_accuracy.py)."""
    model, dtype = cfg.model, cfg.precision.dtype
    if model.is_factory:
        return
    one = model.model_copy(update={"n_layers": 1})
    with torch.random.fork_rng(devices=[]), torch.device(device):
        lm = family_model(one).to(_TORCH_DTYPES[dtype]).train()
        if cfg.train.activation_checkpointing != "none":
            apply_activation_checkpointing(blocks_of(lm), "full")
        idx = torch.randint(0, one.vocab_size, (cfg.train.micro_batch, one.seq_len))
        F.cross_entropy(lm(idx).float().flatten(0, 1), idx.flatten()).backward()


# -- the profile ----------------------------------------------------------------------------


def calibrate(cfg: JobConfig, engine: Engine, device: torch.device) -> MeasuredProfile | None:
    """This machine measured under the run's own layout, before `Trainer.fit`: its
    whole step (tp 1, or a pipeline of tensor-parallel stages) or its model under
    tensor parallelism alone, with the sharded-optimizer timing on the dp mesh when
    it spans the world. None under a parameter server or a user's model: the planner
    models neither. Under context parallelism (tp 1, no pipeline: what the trainer
    builds) the step timed is the job's own, its K/V exchange included, and the
    optimizer and all-reduce are timed over the dp x cp ranks that reduce gradients;
    with tp > 1 the machine alone (the tensor-parallel model is timed on whole
    sequences), the step then predicted by the host model's traffic, the planner's
    compute of s/cp tokens and its K/V exchange (plan.core.timing.host_step_time).
    Collective."""
    dims = engine.dims
    if dims.parameter_server or cfg.model.is_factory:
        return None
    if dims.cp_enabled:
        if dims.tp_enabled or dims.pp_enabled:
            return measure_profile(device, cfg.precision.dtype, None, cfg)
        group = gradient_mesh(engine.mesh, dims)
        return measure_profile(device, cfg.precision.dtype, group, cfg, layout_mesh=engine.mesh)
    whole = not (dims.tp_enabled or dims.pp_enabled)
    group = engine.mesh["dp"] if whole else None
    return measure_profile(device, cfg.precision.dtype, group, cfg, layout_mesh=engine.mesh)


def profile_line(details: dict[str, Any]) -> str:
    """Where the machine figures behind report.json's `predicted` come from."""
    load = details.get("load_average")
    then = f", load average {load:.1f}" if load is not None else ""
    if details.get("cached"):
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(details.get("measured_at") or 0))
        return (
            f"machine profile from the cache (measured {when}{then}; now "
            f"{os.getloadavg()[0]:.1f}; --recalibrate measures again)"
        )
    return f"machine profile measured{then}; cached for later runs of this job and layout"


def measure_profile(
    device: torch.device | str,
    dtype: str,
    group: Any = None,
    cfg: JobConfig | None = None,
    threads: int | None = None,
    layout_mesh: Any = None,
) -> MeasuredProfile:
    """Measure this machine for the planner (see the module docstring). Collective:
    every rank of `group` (a DeviceMesh, a process group, or None for the default
    group) must call it at the same point. With `cfg`, the model's compute and the
    optimizer step are timed at the job's own sizes (with a DeviceMesh as `group`, also
    the trainer's data-parallel wrapping; with `layout_mesh`, the run's (pp, dp, tp)
    mesh of a tensor-parallel layout, the model under its tensor parallelism and its
    data-parallel wrapping). The random number generators are
    left as they were (the measurement draws its tensors from a forked state)."""
    device = torch.device(device)
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        return _measure_profile(device, dtype, group, cfg, threads, layout_mesh)


def _time_job(
    cfg: JobConfig, dtype: str, device: torch.device, group: Any, mesh: Any, layout_mesh: Any
) -> tuple[ComputeAtSize | None, HostCosts | None]:
    """The model's compute and the optimizer step at the job's sizes, the slowest
    rank's; (None, None) if any rank failed. A local failure must not leave the other
    ranks waiting in a collective, so it is agreed on too; the sharded optimizer step
    is collective (the same code on every rank: it fails on all of them or none)."""
    model, b = cfg.model, cfg.train.micro_batch
    _barrier(device, group)  # all ranks compute together, as in training
    try:
        timed = measure_model_compute(model, b, dtype, device)
        plain = 1.0 / measure_optimizer_bandwidth(model, device)  # seconds per byte
        recompute = timed["recompute_layer_seconds"]
        local = [0.0, timed["seconds"], timed["matmul_seconds"], plain, plain, recompute]
    except Exception as exc:  # e.g. a dtype this device cannot run: keep the peak
        log.warning("could not time the model's compute: %s", exc)
        local = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    if mesh is not None:
        try:
            local[4] = 1.0 / measure_optimizer_bandwidth(model, device, mesh)
        except Exception as exc:
            log.warning("could not time the optimizer on DTensor shards: %s", exc)
    (failed,) = _max_across(local[:1], device, group)
    seconds, matmul_s, plain, sharded, recompute = _agreed_seconds(local[1:], device, group)
    if failed:
        return None, None
    # the run's own step, timed whole (tp 1: data parallel, accumulation, a pipeline;
    # a pipeline of tensor-parallel stages); under tensor parallelism alone the model
    # under its plan
    steps = tensor_parallel = wrapped = None
    if layout_mesh is not None and (layout_mesh["tp"].size() == 1 or layout_mesh["pp"].size() > 1):
        try:
            steps = measure_steps(cfg, device, layout_mesh)
        except Exception as exc:  # the wrapping's figures, or the traffic model
            log.warning("could not time the run's step: %s", exc)
        # every rank takes the same path through the collectives below
        (missing,) = _max_across([1.0 if steps is None else 0.0], device, None)
        steps = None if missing else steps
    elif layout_mesh is not None and layout_mesh["pp"].size() == 1:
        try:
            tp_mesh, dp_mesh = layout_mesh["tp"], layout_mesh["dp"]
            tensor_parallel = measure_tensor_parallel(cfg, device, tp_mesh, dp_mesh)
        except Exception as exc:  # the traffic model alone
            log.warning("could not time the model under tensor parallelism: %s", exc)
    if mesh is not None and steps is None:  # DDP even over one rank: its hooks and copies
        m = cfg.train.global_batch // (b * mesh.size())
        try:
            wrapped = measure_wrapped_blocks(cfg, m, device, mesh)
        except Exception as exc:  # the traffic model alone
            log.warning("could not time the data-parallel wrapping: %s", exc)
    unit = matmul_unit_flops(b, model.seq_len, model.d_model, model.mlp_hidden / model.d_model, 1)
    compute = ComputeAtSize(b, timed["flops"], seconds, matmul_s, unit)
    host = HostCosts(1.0 / plain, 1.0 / sharded, wrapped, tensor_parallel, recompute, steps)
    return compute, host


def _job_key(cfg: JobConfig | None, mesh: Any, layout_mesh: Any = None) -> dict[str, Any] | None:
    """What the job's own timings depend on (the model's shape, the micro-batch, and
    the shards the sharded optimizer step runs on)."""
    if cfg is None:
        return None
    key: dict[str, Any] = {
        "name": cfg.model.name,
        "model": cfg.model.model_dump(),
        "micro_batch": cfg.train.micro_batch,
        "sharded_over": mesh.size() if mesh is not None else None,
        # the wrapping timed on the run's blocks (measure_wrapped_blocks)
        "zero": cfg._parallel().zero,
        "global_batch": cfg.train.global_batch,
        "tp": layout_mesh["tp"].size() if layout_mesh is not None else None,
        "pp": layout_mesh["pp"].size() if layout_mesh is not None else None,
        "pp_schedule": cfg._parallel().pp_schedule,
        "virtual_stages": cfg._parallel().virtual_stages,
        "activation_checkpointing": cfg.train.activation_checkpointing,
    }
    p = cfg._parallel()
    if p.cp > 1:  # the step timed under context parallelism (cp 1 keeps its older keys)
        key.update(cp=p.cp, cp_method=p.cp_method)
    return key


def _agreed_cache_entry(key: str, device: torch.device, group: Any) -> Any:
    """The cached measurements as the group's first rank reads them, on every rank
    (None: measure), so that all ranks take the same path through the collectives."""
    found = None if calibration_cache.recalibrating() else calibration_cache.load(key)
    if _world(group) == 1:
        return found
    box = [found]
    dist.broadcast_object_list(box, group_src=0, group=group, device=device)
    return box[0]


def _measure_profile(device, dtype, group, cfg, threads, layout_mesh) -> MeasuredProfile:
    mesh = group if hasattr(group, "get_group") else None  # a DeviceMesh
    group = mesh.get_group() if mesh is not None else group
    world = _world(group)
    threads = threads or torch.get_num_threads()
    backend = dist.get_backend(group) if dist.is_initialized() else "none"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    key = calibration_cache.measurement_key(
        machine=gpu, device_type=device.type, backend=backend, dtype=dtype,
        threads=threads, world=world, job=_job_key(cfg, mesh, layout_mesh),
    )  # fmt: skip
    cached = _agreed_cache_entry(key, device, group)
    if cached is not None and _stale_cpu_peak(cached[0]):
        cached = None  # every rank agreed on the same entry: they all measure again
    if cached is not None:
        measured, entry = cached
        taken = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry["measured_at"]))
        log.info(
            "machine profile from the cache (measured %s; --recalibrate measures again)", taken
        )
    else:
        (when,) = _max_across([time.time()], device, group)  # one time on every rank
        peak, peak_source = peak_matmul_flops(device, dtype, threads)
        compute, host = (
            _time_job(cfg, dtype, device, group, mesh, layout_mesh) if cfg else (None, None)
        )
        points = measure_allreduce(device, group)
        memory, per_device = _memory_bytes(device)
        measured = MachineMeasurements(
            device.type, backend, threads, world, peak, peak_source, memory, per_device,
            compute, host, points, os.getloadavg()[0], os.cpu_count(),
        )  # fmt: skip
    profile, host = fit_profile(measured)
    if measured.compute is not None and (world == 1 or dist.get_rank() == 0):
        remember_profile(profile, host, measured)
    # after the measurements: what they leave in the allocator's arenas the training
    # steps reuse. A run that reuses cached measurements has not grown those arenas
    # yet, but its first steps do (a new user's trial: 314 MB against 341 MB, with the
    # same peak): it takes the baseline of the run that measured, when larger.
    runtime = _runtime_bytes(device, cfg, world) if cfg is not None else 0.0
    # the largest process's: the prediction is the busiest rank's peak, and the ranks'
    # allocators grow apart (measured here: one rank of four 30 MB above the others
    # after the same measurements, a different rank from one run to the next)
    (runtime,) = _max_across([runtime], device, None)
    if cached is not None:
        runtime = max(runtime, float(entry.get("runtime_bytes") or 0.0))
    elif world == 1 or dist.get_rank() == 0:
        calibration_cache.save(key, measured, when, runtime)
    details = measurement_record(measured, host)
    details["cached"] = cached is not None
    details["measured_at"] = entry["measured_at"] if cached is not None else when
    return MeasuredProfile(profile, details, runtime, host if device.type == "cpu" else None)
