"""The step-time model: compute, tensor-parallel and pipeline communication, the
pipeline bubble, data-parallel/ZeRO traffic with overlap, and the optimizer step.

Per micro-batch on the slowest pipeline stage (the last: it also computes the
logits):

    t_mb = compute + TP all-reduces + pipeline sends       (serialised, as in Megatron)

and per step, with m = B/(b·N_d) micro-batches, p stages, v chunks per stage:

    step = m·t_mb + bubble + exposed DP/ZeRO traffic + optimizer step,
    bubble = (p-1)/v · t_mb          (so bubble/ideal = (p-1)/(m·v), REFERENCES.md)

Data-parallel traffic follows meshforge's implementation (parallel/data_parallel.py;
fp32 gradient reduction; gradient sync switched off on all but the last micro-batch):
  ZeRO-0  DDP all-reduce of the grads once per step, hidden under the backward of
          the last micro-batch; the last bucket is exposed.
  ZeRO-1  the same, plus ZeroRedundancyOptimizer's broadcast of the updated params
          after the step (exposed): 3Ψ in all, 1.5x DDP.
  ZeRO-2  FSDP2 with reshard_after_forward=False and no resharding between
          micro-batches: one all-gather of the params (param dtype) per step, under
          the first forward, and one reduce-scatter of the grads under the last
          backward.
  ZeRO-3  params all-gathered in every forward and again in every backward; one
          reduce-scatter per step, under the last backward (3Ψ per step at m = 1).
  FSDP's first all-gather and last reduce-scatter (one block each) cannot hide
  under compute.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from meshforge.plan.comm import collective_time
from meshforge.plan.efficiency import matmul_unit_flops
from meshforge.plan.flops import GPTShape, microbatch_flops, params_per_rank
from meshforge.plan.hardware import Cluster
from meshforge.plan.layout import Layout, Training
from meshforge.plan.memory import dtype_bytes

DDP_BUCKET_BYTES = 25 * 1024**2  # torch DDP's default bucket_cap_mb
OPTIMIZER_BYTES_PER_PARAM = {"adamw": 32, "sgd": 24}  # fp32 reads + writes, grad-norm pass


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, and where they go. The parts add up to step_s."""

    compute_s: float  # m micro-batches of compute on the slowest stage
    tp_comm_s: float  # tensor-parallel collectives (exposed: they sit between matmuls)
    pp_comm_s: float  # pipeline point-to-point sends
    bubble_s: float  # pipeline fill and drain
    dp_comm_exposed_s: float  # data-parallel / ZeRO traffic not hidden under compute
    optimizer_s: float
    dp_comm_total_s: float  # all data-parallel traffic, hidden or not (not in the sum)
    compute_fraction_of_peak: float  # f(W) of efficiency.py for this matmul size

    @property
    def step_s(self) -> float:
        return (
            self.compute_s
            + self.tp_comm_s
            + self.pp_comm_s
            + self.bubble_s
            + self.dp_comm_exposed_s
            + self.optimizer_s
        )

    @property
    def exposed_comm_s(self) -> float:
        return self.tp_comm_s + self.pp_comm_s + self.dp_comm_exposed_s

    def to_dict(self) -> dict[str, float]:
        out = asdict(self)
        out["step_s"] = self.step_s
        out["exposed_comm_s"] = self.exposed_comm_s
        return out


def pipeline_bubble_ratio(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Bubble time / ideal time = (p-1)/(m·v) (GPipe and 1F1B: v = 1; REFERENCES.md)."""
    return (pp - 1) / (microbatches * virtual_stages)


def pipeline_bubble_fraction(
    schedule: str, pp: int, microbatches: int, virtual_stages: int = 1
) -> float:
    """Share of a pipeline step a stage sits idle: (p-1)/(m+p-1) for GPipe and 1F1B,
    (p-1)/(m·v+p-1) for interleaved 1F1B with v stages per rank (Narayanan et al.
    2021). ZB-V (Qi et al. 2024) holds two stages per rank in a V and fills the bubble
    with weight-gradient work; its ideal bubble (equal forward, input-gradient and
    weight-gradient times, m >= 2p) is zero, which no measurement can be compared
    against, so this returns the bound it starts from: two stages per rank without
    the fill, (p-1)/(2m+p-1)."""
    if pp <= 1:
        return 0.0
    v = virtual_stages if schedule == "interleaved_1f1b" else 2 if schedule == "zbv" else 1
    return (pp - 1) / (microbatches * v + pp - 1)


def step_time(shape: GPTShape, layout: Layout, training: Training, cluster: Cluster) -> StepTime:
    t, p, d, v = layout.tp, layout.pp, layout.dp, layout.virtual_stages
    b, precision = training.micro_batch, training.precision
    m = training.microbatches(d)
    act_bytes = dtype_bytes(precision)
    device = cluster.device
    peak = device.peak(precision)

    # compute of one micro-batch on the last stage (its layers plus the logits)
    flops = microbatch_flops(shape, b)
    stage_layers = shape.n_layers / p
    stage_hw = flops.hardware(stage_layers, training.recompute) / t
    unit = matmul_unit_flops(b, shape.seq_len, shape.d_model, shape.mlp_width / shape.d_model, t)
    fraction = device.curve.fraction(unit, peak)
    comp = stage_hw / (peak * fraction)
    forward_share = (stage_layers * flops.layer_forward + flops.logits_forward) / t / stage_hw
    fwd_s, bwd_s = comp * forward_share, comp * (1.0 - forward_share)

    # tensor parallel: 4 all-reduces of b·s·h per layer (6 with full recompute)
    tp_s = 0.0
    if t > 1:
        bw, lat = cluster.group_busbw(t, 1)
        per_layer = 4 + (2 if training.recompute == "full" else 0)
        size = b * shape.seq_len * shape.d_model * act_bytes
        tp_s = stage_layers * per_layer * collective_time("all_reduce", size, t, bw, lat)

    # pipeline: activations forward and gradients backward, at each of v chunk boundaries
    pp_s = 0.0
    if p > 1:
        bw, lat = cluster.p2p_bandwidth(p, layout.pp_stride)
        size = b * shape.seq_len * shape.d_model * act_bytes
        if layout.sequence_parallel:
            size /= t  # the boundary tensor is sequence-sharded
        pp_s = 2 * v * (size / bw + lat)

    t_mb = comp + tp_s + pp_s
    bubble = pipeline_bubble_ratio(p, m, v) * m * t_mb  # = (p-1)/v · t_mb

    rank = params_per_rank(shape, t, p)
    dp_total, dp_exposed = _data_parallel_seconds(
        rank.total, rank.block, layout, precision, cluster, m, fwd_s, bwd_s
    )
    opt_params = rank.total / (d if layout.zero >= 1 else 1)
    opt_s = (
        opt_params
        * OPTIMIZER_BYTES_PER_PARAM[training.optimizer]
        / device.memory_bandwidth_bytes_per_s
    )
    return StepTime(
        compute_s=m * comp,
        tp_comm_s=m * tp_s,
        pp_comm_s=m * pp_s,
        bubble_s=bubble,
        dp_comm_exposed_s=dp_exposed,
        optimizer_s=opt_s,
        dp_comm_total_s=dp_total,
        compute_fraction_of_peak=fraction,
    )


def _data_parallel_seconds(
    params: float,
    block_params: float,
    layout: Layout,
    precision: str,
    cluster: Cluster,
    m: int,
    fwd_s: float,
    bwd_s: float,
) -> tuple[float, float]:
    """(total, exposed) seconds of data-parallel traffic per step; see module docstring."""
    d = layout.dp
    if d == 1:
        return 0.0, 0.0
    bw, lat = cluster.group_busbw(d, layout.dp_stride)
    grad_bytes = 4.0 * params  # fp32 gradient reduction in every precision

    def t(collective: str, size: float) -> float:
        return collective_time(collective, size, d, bw, lat)

    if layout.zero <= 1:
        all_reduce = t("all_reduce", grad_bytes)
        last_bucket = t("all_reduce", min(DDP_BUCKET_BYTES, grad_bytes))
        exposed = max(0.0, all_reduce - bwd_s) + min(last_bucket, all_reduce)
        total = all_reduce
        if layout.zero == 1:
            broadcast = t("all_gather", 4.0 * params)  # owners send updated fp32 params
            total += broadcast
            exposed += broadcast
        return total, exposed

    param_bytes = dtype_bytes(precision) * params
    gather = t("all_gather", param_bytes)
    scatter = t("reduce_scatter", grad_bytes)
    edge_gather = t("all_gather", dtype_bytes(precision) * block_params)
    edge_scatter = t("reduce_scatter", 4.0 * block_params)
    if layout.zero == 2:
        total = gather + scatter
        exposed = max(0.0, gather - fwd_s) + max(0.0, scatter - bwd_s)
        exposed += edge_gather + edge_scatter
        return total, min(exposed, total)
    total = 2 * m * gather + scatter
    exposed_early = max(0.0, gather - fwd_s) + max(0.0, gather - bwd_s) + 2 * edge_gather
    exposed_last = max(0.0, gather - fwd_s) + max(0.0, gather + scatter - bwd_s)
    exposed_last += 2 * edge_gather + edge_scatter
    exposed = (m - 1) * exposed_early + exposed_last
    return total, min(exposed, total)
