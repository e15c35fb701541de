"""Data-parallel traffic: which collectives, of what size, how many per step, per FSDP
unit and per ZeRO stage. One model, read two ways: `exposed_on_gpu` overlaps it with
compute as NCCL does on its own CUDA streams (timing.py), and the CPU host model
(host_time.py) exposes all of it, as gloo without streams does.

Gradients are reduced in fp32 unless told otherwise (meshforge's DDP and FSDP2
`reduce_dtype=fp32`; Megatron's default for bf16; `grad_reduce_bytes` 2 for Megatron with
fp16 or FSDP's "pure" bf16 mixed precision), and gradient sync is switched off on all but
the last micro-batch:

  ZeRO-0  DDP: one all-reduce of the grads per step, in buckets of 25 MB (torch's
          bucket_cap_mb), during the last micro-batch's backward.
  ZeRO-1  on a GPU, Megatron's distributed optimizer: the grads reduce-scattered in the
          same buckets, and the updated parameters all-gathered (param dtype) after the
          optimizer step; with Megatron's --overlap-param-gather that gather runs bucket
          by bucket under the next step's first forward. On the CPU trainer,
          ZeroRedundancyOptimizer: DDP's all-reduce, then each owner broadcasts its
          updated fp32 share (`zero1="redundancy"`).
  ZeRO-2  FSDP2, reshard_after_forward=False: per unit (each block, then the root:
          embeddings, final norm, head), one all-gather in the first forward and one
          reduce-scatter in the last backward.
  ZeRO-3  FSDP2, reshard_after_forward=True: per unit an all-gather in every forward
          and in every backward, one reduce-scatter per step. A recomputed forward runs
          inside its block's backward, on the parameters that backward gathered: no
          third gather (FSDP2 keeps the unit unsharded from pre- to post-backward).

On a GPU (Zhao et al. 2023, PyTorch FSDP, arXiv 2304.11277, §3.3: the next unit's
all-gather is prefetched while the current unit computes, one unit ahead), each layer
hides what its compute allows: exposed = Σ over layers max(0, comm_layer - compute_layer),
plus the first gathers (nothing to hide under) and the last reduce-scatters (nothing
left to compute). DDP's buckets (ZeRO-0/1) hide under the last micro-batch's backward,
less the last bucket, which is ready only when the backward ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshforge.layout.stages import pipeline_ranks
from meshforge.plan.core.comm import NETWORK_SCALING, NetworkScaling, collective_time, group_link
from meshforge.plan.core.flops import GPTShape, rank_params
from meshforge.plan.core.memory import dtype_bytes

DDP_BUCKET_BYTES = 25 * 1024**2  # torch DDP's default bucket_cap_mb
GRAD_REDUCE_BYTES = 4.0  # fp32 gradient reduction, whatever the compute precision
# AdamW: fp32 reads of param, grad and both moments, writes of param and moments, one
# more read of the grads for the norm; SGD one moment fewer
OPTIMIZER_BYTES_PER_PARAM = {"adamw": 32, "sgd": 24}
# the gradient norm reads each fp32 gradient once, clipping reads and writes it
CLIP_BYTES_PER_PARAM = 12


@dataclass(frozen=True)
class RankModel:
    """What one pipeline rank holds, per tensor-parallel rank."""

    layers: int
    embedding: bool  # the first stage: token (and position) embedding
    head: bool  # the last stage: final norm, output head, loss
    block_params: float  # one transformer block
    root_params: float  # embedding / final norm / head on this rank (FSDP's root unit)
    # the routed experts of one block, all of them (within block_params): expert
    # parallelism holds 1/ep of them and reduces their gradients over dp/ep ranks
    expert_block_params: float = 0.0

    def split_experts(self, ep: int) -> tuple[RankModel, RankModel]:
        """(the rest, the rank's E/ep routed experts) as two models: their gradients go
        over different groups (dp; the dp/ep ranks holding the same experts)."""
        rest_block = self.block_params - self.expert_block_params
        rest = RankModel(self.layers, self.embedding, self.head, rest_block, self.root_params)
        experts = RankModel(self.layers, False, False, self.expert_block_params / ep, 0.0)
        return rest, experts

    @property
    def params(self) -> float:
        return self.layers * self.block_params + self.root_params

    @property
    def units(self) -> list[float]:
        """FSDP units: each block, then the root (when the rank holds any of it)."""
        return [self.block_params] * self.layers + ([self.root_params] if self.root_params else [])


def rank_models(
    shape: GPTShape, tp: int = 1, pp: int = 1, virtual: int = 1, zbv: bool = False
) -> list[RankModel]:
    """Each pipeline rank's share, as `flops.rank_params` counts it (Megatron's split:
    weight matrices and column-parallel biases ÷ t, norms and row-parallel biases
    replicated, vocabulary-parallel embedding; the last stage's own head). `zbv`: ZB-V's
    placement (stages r and 2pp-1-r), `virtual` ignored."""
    out = []
    for r in pipeline_ranks(shape.n_layers, pp, virtual, zbv):
        held = rank_params(shape, tp, r)
        out.append(RankModel(r.layers, r.embedding, r.head, held.block, held.root,
                             held.expert_block))  # fmt: skip
    return out


@dataclass(frozen=True)
class DataParallelGroup:
    """The ranks a rank's data-parallel collectives run over: `dp` of them, `dp_stride`
    apart (a Layout is one; the dp/ep ranks holding the same experts another)."""

    dp: int
    dp_stride: int


@dataclass(frozen=True)
class DataParallelTraffic:
    """One rank's data-parallel collectives in one step. Sizes are full (unsharded)."""

    zero: int
    grad_bytes: float  # ZeRO-0/1: the gradients, all-reduced (or reduce-scattered) in buckets
    grad_bytes_per_param: float  # the dtype gradients are reduced in (4: fp32)
    grad_collective: str  # "all_reduce" | "reduce_scatter"
    param_bytes_after_step: float  # ZeRO-1: updated parameters redistributed after the step
    after_step_collective: str  # "all_gather" | "broadcast" (one per owner)
    units: tuple[float, ...]  # ZeRO-2/3: parameters of each FSDP unit
    gather_bytes_per_param: float  # ZeRO-2/3: all-gathers in the param dtype
    forward_gathers: int  # ZeRO-2/3: per unit per step
    backward_gathers: int
    reduce_scatters: int

    def buckets(self, bucket_mb: float = DDP_BUCKET_BYTES / 1024**2) -> list[tuple[float, int]]:
        """DDP's gradient buckets (ZeRO-0/1) as (size, count): the full ones, then the
        last, smaller one (the first to be ready is the last in this list)."""
        cap = bucket_mb * 1024**2
        full, rest = divmod(self.grad_bytes, cap)
        out = [(cap, int(full))] if full else []
        return out + ([(rest, 1)] if rest else [])


def data_parallel_traffic(
    rank: RankModel,
    zero: int,
    microbatches: int,
    precision: str,
    zero1: str = "distributed",
    grad_reduce_bytes: float = GRAD_REDUCE_BYTES,
) -> DataParallelTraffic:
    """The collectives of `rank` per step (module docstring). zero1: "distributed"
    (Megatron's distributed optimizer) or "redundancy" (torch's ZeroRedundancyOptimizer);
    grad_reduce_bytes: bytes per gradient element in the reduction."""
    params, p_bytes, g = rank.params, dtype_bytes(precision), grad_reduce_bytes
    if zero <= 1:
        redundancy = zero == 1 and zero1 == "redundancy"
        return DataParallelTraffic(
            zero=zero,
            grad_bytes=g * params, grad_bytes_per_param=g,
            grad_collective="reduce_scatter" if zero == 1 and not redundancy else "all_reduce",
            param_bytes_after_step=(4.0 if redundancy else p_bytes) * params if zero else 0.0,
            after_step_collective="broadcast" if redundancy else "all_gather",
            units=(), gather_bytes_per_param=0.0,
            forward_gathers=0, backward_gathers=0, reduce_scatters=0,
        )  # fmt: skip
    m = microbatches
    return DataParallelTraffic(
        zero=zero, grad_bytes=0.0, grad_bytes_per_param=g, grad_collective="",
        param_bytes_after_step=0.0,
        after_step_collective="", units=tuple(rank.units), gather_bytes_per_param=p_bytes,
        forward_gathers=m if zero == 3 else 1, backward_gathers=m if zero == 3 else 0,
        reduce_scatters=1,
    )  # fmt: skip


def exposed_on_gpu(
    traffic: DataParallelTraffic,
    cluster,
    layout,
    rank: RankModel,
    work,
    microbatches: int,
    scaling: NetworkScaling = NETWORK_SCALING,
    param_gather_overlap: bool = False,
    bucket_bytes: float = DDP_BUCKET_BYTES,
) -> tuple[float, float]:
    """(total, exposed) seconds of `traffic` per step on a GPU, where NCCL overlaps
    compute (module docstring). `layout`: the group the traffic runs over (a Layout, or a
    DataParallelGroup); `work` is plan/work.MicrobatchWork; param_gather_overlap:
    ZeRO-1's after-step gather runs under the next step's first forward (Megatron's
    --overlap-param-gather); bucket_bytes: ZeRO-0/1's gradient buckets."""
    d, m = layout.dp, microbatches
    if d == 1:
        return 0.0, 0.0
    bw, lat = group_link(cluster, d, layout.dp_stride, scaling)

    def t(kind: str, size: float) -> float:
        return collective_time(kind, size, d, bw, lat)

    fwd_layer, bwd_layer = work.layer.forward_s, work.layer.backward_s
    head_bwd = work.head.backward_s if rank.head else 0.0
    last_backward = rank.layers * bwd_layer + head_bwd
    if traffic.zero <= 1:
        buckets = [(t(traffic.grad_collective, size), n)
                   for size, n in traffic.buckets(bucket_bytes / 1024**2)]  # fmt: skip
        total = sum(seconds * n for seconds, n in buckets)
        exposed = max(0.0, total - last_backward) + (buckets[-1][0] if buckets else 0.0)
        after = t(traffic.after_step_collective, traffic.param_bytes_after_step)
        after_exposed = after
        if param_gather_overlap and after > 0.0:
            # bucket by bucket, each gathered ahead of the layers that need it: the first
            # bucket waits, the rest hides under the first micro-batch's forward
            first = after * min(1.0, bucket_bytes / traffic.grad_bytes)
            first_forward = rank.layers * fwd_layer + (work.head.forward_s if rank.head else 0.0)
            after_exposed = first + max(0.0, after - first - first_forward)
        return total + after, min(exposed, total) + after_exposed

    layers = rank.layers
    g_block = t("all_gather", traffic.gather_bytes_per_param * rank.block_params)
    g_root = t("all_gather", traffic.gather_bytes_per_param * rank.root_params)
    rs_block = t("reduce_scatter", traffic.grad_bytes_per_param * rank.block_params)
    rs_root = t("reduce_scatter", traffic.grad_bytes_per_param * rank.root_params)
    # a forward that gathers: the first unit exposed, then one unit ahead of compute
    fwd_pass = g_root + g_block + (layers - 1) * max(0.0, g_block - fwd_layer)
    if traffic.zero == 3:
        # backward gathers; the first one hides under the head's backward
        bwd_pass = max(0.0, g_block - head_bwd) + (layers - 1) * max(0.0, g_block - bwd_layer)
        bwd_sync = max(0.0, g_block - head_bwd)
        bwd_sync += (layers - 1) * max(0.0, g_block + rs_block - bwd_layer)
        bwd_sync += rs_block + rs_root
        exposed = m * fwd_pass + (m - 1) * bwd_pass + bwd_sync
        total = m * (g_root + layers * g_block) + m * layers * g_block
        total += layers * rs_block + rs_root
    else:
        bwd_sync = (layers - 1) * max(0.0, rs_block - bwd_layer) + rs_block + rs_root
        exposed = fwd_pass + bwd_sync
        total = g_root + layers * g_block + layers * rs_block + rs_root
    return total, min(exposed, total)
