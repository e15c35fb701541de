"""The step-time model: compute, tensor-parallel and pipeline communication, the
pipeline bubble, data-parallel/ZeRO traffic with overlap, and the optimizer step.

Per micro-batch, on each pipeline rank (its layers, plus the embedding on the first
and the final norm, logits and loss on the last; layout/stages.py splits the layers):

    t_rank = its layers' compute + their TP collectives + EP all-to-alls + pipeline sends

and the slowest rank sets the pace (t_mb = max over ranks). Per step, with m = B/(b·N_d)
micro-batches, p stages and v chunks per stage:

    step   = m·t_mb + bubble + exposed DP/ZeRO traffic + contention + optimizer step
    bubble = (p-1)/v · t_mb          (so bubble/ideal = (p-1)/(m·v), REFERENCES.md)

The traffic that overlaps compute is not free: NCCL's kernels run on the same SMs and
memory as the compute they hide under. Lee et al. 2025 (arXiv 2507.03114, "Characterizing
Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning") measured
compute kernels 18.9% slower on average while collectives overlap them (A100, H100,
MI250, MI210; GPT and Llama layers; 40% at most): contention = OVERLAP_SLOWDOWN × the
hidden data-parallel traffic. Tensor-parallel traffic overlapped by Megatron-Core's
--tp-comm-overlap is left out: it moves through userbuffers and copy engines, not the
NCCL kernels the paper measured.

Compute is plan/core/work.py (matmuls through the device's curve, memory-bound kernels from
their bytes). Data-parallel traffic is plan/core/dp_traffic.py, shared with the CPU host
model (`host_step_time`, below: gloo, no streams, all of it exposed); in `step_time` it
overlaps compute as on a GPU, where NCCL runs on its own streams
(dp_traffic.exposed_on_gpu).

Expert parallelism (a mixture of experts, ep > 1): each MoE layer's tokens go to the
ranks holding their experts and back by all-to-all over the ep ranks of the expert group
(comm.ep_alltoall_bytes: dispatch and combine, forward and backward: four per layer and
micro-batch, six with full recomputation). They sit between the router and the experts'
matmuls, which wait for them: exposed, as the TP collectives are (no overlap of one
micro-batch's all-to-all with another's compute: DeepSeek's DualPipe and Megatron-Core's
--overlap-moe-expert-parallel-comm are not modelled). Routing is taken as balanced. The
routed experts' gradients are reduced over the dp/ep ranks holding the same experts, the
rest over dp, each overlapping the backward as above.

Context parallelism (cp > 1; layout.py): each rank runs s/cp tokens of a sequence, so
the TP collectives, pipeline sends and EP all-to-alls carry s/cp tokens, and exchanges
K and V with the cp - 1 other ranks of its group (cp ranks tp apart: NVLink when
cp·tp fits a node, else the network, as group_link gives any group), per layer and
micro-batch (`cp_exchange_s`): allgather (Llama 3) gathers K and V forward and
reduce-scatters their gradients backward; alltoall (Ulysses) runs three all-to-alls
forward (q, k and v, the output) and three backward; both sit between the projections
and the attention that needs them: exposed. ring passes K/V blocks round the ring in
cp - 1 steps, each under the attention of the block before it: only what a step's
transfer takes beyond its block's attention (1/cp of the layer's core) is exposed; the
backward passes K/V and dK/dV (twice the bytes) under 1/cp of the backward core. Full
recomputation repeats the forward exchange. Gradients are reduced over dp x cp ranks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from meshforge.errors import ConfigError
from meshforge.plan.core.comm import (
    NETWORK_SCALING,
    NetworkScaling,
    collective_time,
    cp_allgather_bytes,
    cp_alltoall_bytes,
    cp_ring_block_bytes,
    ep_alltoall_bytes,
    group_link,
)
from meshforge.plan.core.dp_traffic import (
    CLIP_BYTES_PER_PARAM,
    DDP_BUCKET_BYTES,
    GRAD_REDUCE_BYTES,
    OPTIMIZER_BYTES_PER_PARAM,
    DataParallelGroup,
    RankModel,
    data_parallel_traffic,
    exposed_on_gpu,
    rank_models,
)
from meshforge.plan.core.flops import GPTShape
from meshforge.plan.core.hardware import Cluster
from meshforge.plan.core.layout import Layout, Training
from meshforge.plan.core.memory import dtype_bytes
from meshforge.plan.core.profile import MachineProfile
from meshforge.plan.core.work import microbatch_work

if TYPE_CHECKING:
    from meshforge.plan.core.predict import Prediction

__all__ = [
    "OPTIMIZER_BYTES_PER_PARAM",
    "HostCosts",
    "TimedSteps",
    "Framework",
    "StepTime",
    "host_step_time",
    "pipeline_bubble_fraction",
    "pipeline_bubble_ratio",
    "step_time",
]

# compute runs this much slower while data-parallel collectives overlap it (Lee et al.
# 2025, arXiv 2507.03114: 18.9% on average over their GPUs and models; module docstring)
OVERLAP_SLOWDOWN = 0.189

# writing the 16-bit copy of the updated fp32 master parameters (read 4 B, write 2 B):
# Megatron's model params, FSDP's cast before its all-gather, autocast's weight copies
CAST_BYTES_PER_PARAM = 6.0


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
    # compute slowed by the data-parallel traffic hidden under it (OVERLAP_SLOWDOWN)
    contention_s: float = 0.0
    slowest_pp_rank: int = 0  # the pipeline rank whose compute sets the pace (not seconds)
    ep_comm_s: float = 0.0  # expert-parallel all-to-alls (exposed: the experts wait for them)
    cp_comm_s: float = 0.0  # context-parallel K/V exchange not hidden under attention

    @property
    def step_s(self) -> float:
        return (
            self.compute_s
            + self.tp_comm_s
            + self.ep_comm_s
            + self.cp_comm_s
            + self.pp_comm_s
            + self.bubble_s
            + self.dp_comm_exposed_s
            + self.contention_s
            + self.optimizer_s
        )

    @property
    def exposed_comm_s(self) -> float:
        return (self.tp_comm_s + self.ep_comm_s + self.cp_comm_s + self.pp_comm_s
                + self.dp_comm_exposed_s)  # fmt: skip

    def to_dict(self) -> dict[str, float]:
        out = asdict(self)
        del out["slowest_pp_rank"]  # a rank, not seconds: Prediction.to_dict has it
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


@dataclass(frozen=True)
class _RankTime:
    model: RankModel
    compute_s: float  # one micro-batch
    tp_s: float
    ep_s: float  # expert-parallel all-to-alls of one micro-batch
    cp_s: float  # context-parallel K/V exchange of one micro-batch, exposed
    forward_s: float  # one micro-batch's forward compute (for the DP overlap)
    backward_s: float


@dataclass(frozen=True)
class Framework:
    """How another trainer runs what the model counts; meshforge's own trainer is the
    default. Each setting has its source in the framework's code or paper."""

    # tensor-parallel collectives pipelined with the layer's matmuls (Megatron-Core's
    # --tp-comm-overlap, TransformerEngine userbuffers): only what the matmuls cannot
    # cover is exposed
    tp_comm_overlap: bool = False
    # ZeRO-1's after-step parameter gather hidden under the next forward (Megatron's
    # --overlap-param-gather)
    param_gather_overlap: bool = False
    grad_reduce_bytes: float = GRAD_REDUCE_BYTES  # per gradient element reduced
    # each tensor-parallel rank sends 1/t of a stage boundary's activations and the next
    # stage all-gathers them over NVLink (Megatron-LM's scatter/gather optimisation,
    # Narayanan et al. 2021 §4.1), instead of every rank sending the whole tensor
    pp_scatter_gather: bool = False
    # a stage's send and receive of one exchange run as one pair, two transfer times per
    # micro-batch and chunk (Megatron's send_forward_recv_backward /
    # send_backward_recv_forward). False for DeepSpeed's pipeline engine, whose
    # TrainSchedule (deepspeed/runtime/pipe/schedule.py) issues SendGrad, RecvActivation,
    # RecvGrad and SendActivation as four separate blocking transfers per micro-batch
    pp_paired_transfers: bool = True
    # ZeRO-0/1 gradient buckets: torch DDP's 25 MB ...
    grad_bucket_bytes: float = DDP_BUCKET_BYTES
    # ... or Megatron-Core's DistributedDataParallel default, max(40M, 1M·dp) elements
    # of grad_reduce_bytes each (megatron/core/distributed), which grows with dp
    megatron_core_buckets: bool = False
    # data-parallel traffic overlaps compute (module docstring). False for DeepSpeed's
    # pipeline engine: its TrainSchedule issues ReduceTiedGrads, ReduceGrads and
    # OptimizerStep after the last backward of the step, so every byte is exposed
    dp_overlap: bool = True

    def bucket_bytes(self, dp: int) -> float:
        """Bytes per ZeRO-0/1 gradient bucket at data-parallel degree `dp`."""
        if self.megatron_core_buckets:
            return max(40e6, 1e6 * dp) * self.grad_reduce_bytes
        return self.grad_bucket_bytes


# Other trainers by name (`meshforge plan --framework`), each as the validation's
# published runs of it ran (plan/core/published.py), so that a row can be planned from the
# command line. torch FSDP and DDP (torchtitan, llm-foundry) are meshforge's own
# components: "meshforge".
FRAMEWORKS = {
    "meshforge": "meshforge's trainer (torch DDP, FSDP2, DTensor, pipelining): fp32 "
    "gradient reduction in 25 MB buckets, overlapped",
    "megatron-lm": "Megatron-LM of 2021-22 (Narayanan et al., Korthikanti et al.): "
    "pipeline scatter/gather, gradients reduced in fp16 under --fp16",
    "megatron-core": "Megatron-Core as its 2024 benchmark table ran: --tp-comm-overlap, "
    "--overlap-param-gather, buckets of max(40M, 1M x dp) elements",
    "deepspeed-pipeline": "DeepSpeed's pipeline engine (Megatron-DeepSpeed, GPT-NeoX, "
    "BLOOM): four unpaired transfers per micro-batch, gradients reduced after the step",
}


def framework_for(name: str, precision: str) -> Framework:
    """The named trainer's settings (FRAMEWORKS) for a run in `precision`."""
    if name not in FRAMEWORKS:
        raise ConfigError(f"--framework {name!r} is not one of {', '.join(FRAMEWORKS)}")
    if name == "megatron-lm":
        # --fp16 reduces gradients in the model dtype; under bf16 Megatron accumulates
        # and reduces them in fp32 (--accumulate-allreduce-grads-in-fp32)
        return Framework(grad_reduce_bytes=2.0 if precision == "fp16" else GRAD_REDUCE_BYTES,
                         pp_scatter_gather=True)  # fmt: skip
    if name == "megatron-core":
        return Framework(tp_comm_overlap=True, param_gather_overlap=True,
                         megatron_core_buckets=True)  # fmt: skip
    if name == "deepspeed-pipeline":
        return Framework(pp_paired_transfers=False, dp_overlap=False)
    return Framework()


def step_time(
    shape: GPTShape,
    layout: Layout,
    training: Training,
    cluster: Cluster,
    scaling: NetworkScaling = NETWORK_SCALING,
    framework: Framework = Framework(),
) -> StepTime:
    """Seconds per step (module docstring). `scaling`: the network at scale (comm.py);
    `framework`: another trainer's settings (meshforge's own trainer: the defaults)."""
    fw = framework
    t, p, d, v = layout.tp, layout.pp, layout.dp, layout.virtual_stages
    b, precision = training.micro_batch, training.precision
    m = training.microbatches(d)
    act_bytes = dtype_bytes(precision)
    device = cluster.device
    work = microbatch_work(shape, t, layout.sequence_parallel, b, precision,
                           training.recompute, training.sdpa, device, layout.cp)  # fmt: skip
    local_seq = shape.seq_len // layout.cp  # a rank's tokens of each sequence

    # tensor parallel: 4 collectives of b·s·h per layer (6 with full recompute), one
    # for the vocabulary-parallel embedding, two around the head (gather, scatter)
    tp_one = 0.0
    if t > 1:
        bw, lat = group_link(cluster, t, 1, scaling)
        size = b * local_seq * shape.d_model * act_bytes
        tp_one = collective_time("all_reduce", size, t, bw, lat)
    per_layer = 4 + (2 if training.recompute == "full" else 0)

    # expert parallel: per MoE layer dispatch and combine, forward and backward (as many
    # as the TP collectives: a recomputed forward dispatches again)
    ep_one = 0.0
    if layout.ep > 1 and shape.is_moe:
        bw, lat = group_link(cluster, layout.ep, layout.ep_stride, scaling)
        size = ep_alltoall_bytes(b, local_seq, shape.d_model, shape.top_k, t, act_bytes)
        ep_one = collective_time("all_to_all", size, layout.ep, bw, lat)

    # pipeline: activations forward and gradients backward, at each of v chunk boundaries
    pp_s = 0.0
    if p > 1:
        bw, lat = cluster.p2p_bandwidth(p, layout.pp_stride)
        size = b * local_seq * shape.d_model * act_bytes
        gather = 0.0
        if layout.sequence_parallel:
            size /= t  # the boundary tensor is sequence-sharded
        elif fw.pp_scatter_gather and t > 1:
            gather = collective_time("all_gather", size, t, *group_link(cluster, t, 1, scaling))
            size /= t
        transfers = 2 if fw.pp_paired_transfers else 4
        pp_s = transfers * v * (size / bw + lat + gather)

    cp_layer = cp_exchange_s(shape, layout, b, act_bytes, training.recompute, work, cluster,
                             scaling)["exposed_s"]  # fmt: skip

    ranks = []
    models = rank_models(shape, t, p, v)
    for rank in dict.fromkeys(models):  # distinct ranks only
        fwd = rank.layers * work.layer.forward_s
        bwd = rank.layers * work.layer.backward_s
        tp_count = rank.layers * per_layer
        if rank.embedding:
            fwd += work.embedding.forward_s
            bwd += work.embedding.backward_s
            tp_count += 1
        if rank.head:
            fwd += work.head.forward_s
            bwd += work.head.backward_s
            tp_count += 2
        tp_s = tp_count * tp_one
        if fw.tp_comm_overlap:
            matmuls = rank.layers * work.layer.total_s * (1.0 - work.memory_bound_fraction)
            tp_s = max(0.0, tp_s - matmuls)
        ep_s = rank.layers * shape.moe_share * per_layer * ep_one
        cp_s = rank.layers * cp_layer
        ranks.append(_RankTime(rank, fwd + bwd, tp_s, ep_s, cp_s, fwd, bwd))
    slowest = max(ranks, key=lambda r: r.compute_s + r.tp_s + r.ep_s + r.cp_s)
    t_mb = slowest.compute_s + slowest.tp_s + slowest.ep_s + slowest.cp_s + pp_s
    bubble = pipeline_bubble_ratio(p, m, v) * m * t_mb  # = (p-1)/v · t_mb

    # data-parallel traffic and the optimizer: the rank that finishes last
    dp_total, dp_exposed, opt_s = 0.0, 0.0, 0.0
    after_step = -1.0
    for r in ranks:
        # weights are replicated over cp: gradients reduce over the dp x cp ranks (tp apart)
        dp_group = DataParallelGroup(
            layout.grad_dp, layout.tp if layout.cp > 1 else layout.dp_stride
        )
        groups = [(r.model, dp_group)]
        if layout.ep > 1 and r.model.expert_block_params:
            rest, experts = r.model.split_experts(layout.ep)
            groups = [(rest, dp_group),
                      (experts, DataParallelGroup(layout.edp, layout.edp_stride))]  # fmt: skip
        total, exposed = 0.0, 0.0
        for model, group in groups:
            traffic = data_parallel_traffic(model, layout.zero, m, precision, "distributed",
                                            fw.grad_reduce_bytes)  # fmt: skip
            seconds = exposed_on_gpu(traffic, cluster, group, model, work, m, scaling,
                                     fw.param_gather_overlap,
                                     fw.bucket_bytes(group.dp))  # fmt: skip
            total, exposed = total + seconds[0], exposed + seconds[1]
        if not fw.dp_overlap:
            exposed = total
        opt = _optimizer_seconds(r.model, layout, training, device)
        if exposed + opt > after_step:
            after_step, dp_total, dp_exposed, opt_s = exposed + opt, total, exposed, opt
    return StepTime(
        compute_s=m * slowest.compute_s,
        tp_comm_s=m * slowest.tp_s,
        ep_comm_s=m * slowest.ep_s,
        cp_comm_s=m * slowest.cp_s,
        pp_comm_s=m * pp_s,
        bubble_s=bubble,
        dp_comm_exposed_s=dp_exposed,
        optimizer_s=opt_s,
        dp_comm_total_s=dp_total,
        compute_fraction_of_peak=work.fraction_of_peak,
        contention_s=OVERLAP_SLOWDOWN * (dp_total - dp_exposed),
        slowest_pp_rank=models.index(slowest.model),  # the first of equal ranks
    )


def cp_exchange_s(
    shape: GPTShape,
    layout: Layout,
    micro_batch: int,
    act_bytes: float,
    recompute: str,
    work,
    cluster: Cluster,
    scaling: NetworkScaling = NETWORK_SCALING,
) -> dict[str, float]:
    """One layer's context-parallel K/V exchange for one micro-batch (module docstring):
    {"total_s": the transfers' time, "exposed_s": what compute does not hide}. `work`:
    the layer's MicrobatchWork (its attention core, for ring's overlap)."""
    cp, t = layout.cp, layout.tp
    if cp <= 1:
        return {"total_s": 0.0, "exposed_s": 0.0}
    bw, lat = group_link(cluster, cp, layout.cp_stride, scaling)
    s, b = shape.seq_len, micro_batch
    forwards = 2 if recompute == "full" else 1  # a recomputed forward exchanges again
    if layout.cp_method == "allgather":
        size = cp_allgather_bytes(b, s, shape.kv_width, t, act_bytes)
        fwd = collective_time("all_gather", size, cp, bw, lat)
        bwd = collective_time("reduce_scatter", size, cp, bw, lat)
        total = forwards * fwd + bwd
        return {"total_s": total, "exposed_s": total}
    if layout.cp_method == "alltoall":
        sizes = cp_alltoall_bytes(b, s, shape.q_width, shape.kv_width, t, cp, act_bytes)
        one_pass = sum(collective_time("all_to_all", x, cp, bw, lat) for x in sizes)
        total = (forwards + 1) * one_pass
        return {"total_s": total, "exposed_s": total}
    # ring: cp - 1 steps, each one neighbour transfer under one block's attention
    block = cp_ring_block_bytes(b, s, shape.kv_width, t, cp, act_bytes)
    step_fwd, step_bwd = block / bw + lat, 2.0 * block / bw + lat
    core_fwd, core_bwd = work.attention.forward_s / cp, work.attention.backward_s / cp
    steps = cp - 1
    total = steps * (forwards * step_fwd + step_bwd)
    exposed = steps * (forwards * max(0.0, step_fwd - core_fwd) + max(0.0, step_bwd - core_bwd))
    return {"total_s": total, "exposed_s": exposed}


def _optimizer_seconds(rank: RankModel, layout: Layout, training: Training, device) -> float:
    """Memory-bound: OPTIMIZER_BYTES_PER_PARAM per parameter the rank updates, plus the
    16-bit copy of the updated parameters in bf16/fp16 (a GPU curve: at its bandwidth
    fraction; a measured machine's rate is its own optimizer rate). With expert
    parallelism a rank holds E/ep of the routed experts: under ZeRO its share of them is
    1/(dp/ep) of those, 1/dp of all, like the rest."""
    params = rank.params
    if layout.zero == 0 and layout.ep > 1:
        params -= rank.layers * rank.expert_block_params * (1.0 - 1.0 / layout.ep)
    updated = params / (layout.grad_dp if layout.zero >= 1 else 1)
    per_param = OPTIMIZER_BYTES_PER_PARAM[training.optimizer]
    bw = device.memory_bandwidth_bytes_per_s
    if device.curve.scope == "matmul":
        bw *= device.curve.bandwidth_fraction
        if training.precision in ("bf16", "fp16"):
            per_param += CAST_BYTES_PER_PARAM
    return updated * per_param / bw


# -- the trainer on a host without streams (CPU, gloo) -------------------------------------
#
# On a CPU with gloo, meshforge's trainer does not overlap FSDP's collectives: FSDP2
# waits for each unit's all-gather before its compute and for each reduce-scatter in the
# post-backward hook (a profile of a ZeRO-3 step shows the time as FSDP::all_gather and
# post_backward_reduce self time), and every collective pays its latency per unit. DDP's
# gradient buckets do overlap the last backward (gloo's own thread). The optimizer step
# runs on FSDP2's DTensor shards, much slower per byte than on plain tensors. So on a CPU
# the data-parallel and optimizer terms of a prediction are the traffic of
# dp_traffic.data_parallel_traffic (ZeRO-1 as ZeroRedundancyOptimizer: one broadcast
# per owner, all in flight), all exposed except DDP's buckets, plus a logged step's two
# small all-reduces over the world (report.json's step times are those of logged steps),
# and the optimizer at the measured rate for plain tensors (DDP, ZeRO-1) or DTensor
# shards.
#
# The traffic model leaves out the wrappers' own work on a CPU (DDP's and FSDP2's hooks,
# copies in and out of flat buffers, DTensor dispatch), which on a small model costs as
# much as the collectives. So a run times its own layout at its start (train/calibration.py)
# and the host model takes those figures where they apply: `WrappedBlocks` (the
# data-parallel wrapping on one and two of the job's blocks, for the same ZeRO stage, dp
# and micro-batches per step) and `TensorParallelModels` (the model under the same tp).
# Any other layout (`parallel: auto`'s candidates, `meshforge plan`) gets the traffic
# model alone.


@dataclass(frozen=True)
class WrappedBlocks:
    """One and two of the job's blocks wrapped as the trainer wraps them (DDP for ZeRO
    0/1, FSDP2 units for ZeRO 2/3) on the run's data-parallel group, timed through one
    step of `microbatches` forward+backward passes (gradient sync on the last only):
    seconds beyond the same passes unwrapped (train/calibration.py)."""

    zero: int
    dp: int
    microbatches: int
    block_params: float
    one_block_s: float
    two_blocks_s: float
    # ZeRO-1: the ZeroRedundancyOptimizer's step (its shard's AdamW, then each owner's
    # broadcast of every parameter it updated), one and two blocks
    optimizer_one_s: float | None = None
    optimizer_two_s: float | None = None

    def optimizer_s(self, params: float) -> float | None:
        """ZeRO-1's optimizer step for `params`, linear through the two figures."""
        if self.optimizer_one_s is None or self.optimizer_two_s is None:
            return None
        slope = max(0.0, self.optimizer_two_s - self.optimizer_one_s) / self.block_params
        return max(0.0, self.optimizer_one_s + slope * (params - self.block_params))

    def matches(self, zero: int, dp: int, microbatches: int) -> bool:
        return (self.zero, self.dp, self.microbatches) == (zero, dp, microbatches)


@dataclass(frozen=True)
class TensorParallelModels:
    """One step (`microbatches` forward+backward passes of `micro_batch` sequences)
    through the job's model cut to one and to two blocks, sharded by its tensor-parallel
    plan over `tp` ranks and wrapped for data parallelism over `dp` as the trainer wraps
    it (train/calibration.py): the difference is a block's time under tensor parallelism
    (its share of the matmuls, its collectives, its data-parallel traffic and DTensor's
    dispatch on a CPU), the rest the embeddings, head and loss."""

    tp: int
    micro_batch: int
    one_block_s: float
    two_blocks_s: float
    dp: int = 1
    microbatches: int = 1
    zero: int = 0
    # the trainer's optimizer step on the model's DTensor parameters (gradient norm over
    # the meshes, clipping, AdamW), one and two blocks
    optimizer_one_s: float | None = None
    optimizer_two_s: float | None = None

    def optimizer_s(self, n_layers: int) -> float | None:
        if self.optimizer_one_s is None or self.optimizer_two_s is None:
            return None
        per_block = max(0.0, self.optimizer_two_s - self.optimizer_one_s)
        return max(0.0, self.optimizer_one_s + per_block * (n_layers - 1))

    def matches(self, layout: Layout, micro_batch: int, microbatches: int) -> bool:
        return (self.tp, self.dp, self.zero, self.micro_batch, self.microbatches) == (
            layout.tp,
            layout.dp,
            layout.zero,
            micro_batch,
            microbatches,
        ) and layout.pp == 1

    def block_s(self) -> float:
        return max(0.0, self.two_blocks_s - self.one_block_s)

    def ends_s(self) -> float:
        return max(0.0, self.one_block_s - self.block_s())


@dataclass(frozen=True)
class TimedSteps:
    """One optimizer step of the run's own layout (tp 1, or a pipeline of tensor-
    parallel stages) as the trainer runs it (its model parts with the job's
    recomputation and data-parallel wrapping, its accumulation or pipeline schedule, the
    gradient norm, clipping and AdamW), through the model cut to one and to two layers
    per stage (train/calibration.py; a layout without a pipeline has one stage): the
    difference is a layer per stage, its collectives, sends, bubble and optimizer share
    included; the rest the embedding, head, loss and the step's fixed cost. Under
    context parallelism (`cp` > 1, tp 1) the step of s/cp tokens a rank, its K/V
    exchange included."""

    pp: int
    stages_per_rank: int  # more than one with interleaved and ZB-V schedules
    schedule: str  # "none" without a pipeline
    dp: int
    zero: int
    micro_batch: int
    microbatches: int
    one_layer_s: float  # a step with one layer in every stage
    two_layers_s: float  # ... with two
    tp: int = 1
    cp: int = 1
    cp_method: str = "allgather"

    def matches(self, layout: Layout, schedule: str, micro_batch: int, microbatches: int) -> bool:
        schedule = schedule if layout.pp > 1 else "none"
        method = layout.cp_method if layout.cp > 1 else "allgather"
        return (
            self.tp, self.pp, self.schedule, self.dp, self.zero, self.micro_batch,
            self.microbatches, self.cp, self.cp_method,
        ) == (
            layout.tp, layout.pp, schedule, layout.dp, layout.zero, micro_batch, microbatches,
            layout.cp, method,
        )  # fmt: skip

    def step_s(self, layers_per_stage: float) -> float:
        """A step whose slowest stage holds `layers_per_stage` layers."""
        per_layer = max(0.0, self.two_layers_s - self.one_layer_s)
        return max(0.0, self.one_layer_s + per_layer * (layers_per_stage - 1.0))


@dataclass(frozen=True)
class HostCosts:
    """What a CPU host measures beyond the MachineProfile (train.calibration)."""

    optimizer_bytes_per_s: float  # AdamW + clipping on plain tensors, 32 B per parameter
    sharded_optimizer_bytes_per_s: float  # the same on FSDP2 DTensor shards
    wrapped: WrappedBlocks | None = None  # the run's own layout, timed on its blocks
    tensor_parallel: TensorParallelModels | None = None  # the same, under its tp
    # seconds full recomputation adds to one layer's forward+backward at the run's
    # micro-batch, as the trainer recomputes (torch.utils.checkpoint, its hooks included)
    recompute_layer_s: float | None = None
    steps: TimedSteps | None = None  # the run's own step, timed (tp 1, or tp with pp)

    @classmethod
    def from_profile(cls, profile: MachineProfile) -> HostCosts:
        bw = profile.memory_bandwidth_bytes_per_s
        return cls(bw, bw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HostCosts:
        d = dict(d)
        if d.get("wrapped") is not None:
            d["wrapped"] = WrappedBlocks(**d["wrapped"])
        if d.get("tensor_parallel") is not None:
            d["tensor_parallel"] = TensorParallelModels(**d["tensor_parallel"])
        if d.get("steps") is not None:
            d["steps"] = TimedSteps(**d["steps"])
        return cls(**d)


def host_step_time(
    prediction: Prediction,
    shape: GPTShape,
    cluster: Cluster,
    host: HostCosts,
    bucket_mb: float = 25.0,
    logged: bool = True,
    schedule: str = "1f1b",
) -> dict[str, float]:
    """Seconds per step of meshforge's trainer on a CPU host (see above), from a
    planner prediction, whose compute, tensor-parallel, pipeline and bubble times it
    keeps; the data-parallel and optimizer terms are the host's. Where the run's own
    step (tp 1) or tensor-parallel model was timed (`HostCosts.steps`,
    `.tensor_parallel`, for this layout), those figures replace the model's.

    Context parallelism (cp > 1): the gradients are reduced (and ZeRO shards) over the
    dp x cp ranks holding the same weights, and the planner's exposed K/V exchange
    (`cp_comm_s`) is added; of the timed figures only the run's own step applies
    (`TimedSteps` of the same cp: the exchange is in it), the wrapping and the
    tensor-parallel model being timed on whole sequences."""
    if prediction.time is None:
        raise ConfigError("a host step time needs a GPT shape")
    layout, training = prediction.layout, prediction.training
    d, zero = layout.grad_dp, layout.zero
    m = training.microbatches(layout.dp)  # cp takes no share of the batch
    bw, lat = cluster.group_busbw(d, layout.tp if layout.cp > 1 else layout.dp_stride)
    timed_layout = layout.cp == 1  # the wrapping and tp figures are of layouts without cp

    def t(kind: str, size: float) -> float:
        return collective_time(kind, size, d, bw, lat)

    compute = prediction.time.compute_s
    fwd_share = 0.25 if training.recompute == "full" else 1.0 / 3.0
    last_backward = compute / m * (1.0 - fwd_share)
    comm, optimizer = 0.0, 0.0
    rate = host.sharded_optimizer_bytes_per_s if zero >= 2 else host.optimizer_bytes_per_s
    wrapped = host.wrapped
    if wrapped is not None and not (
        timed_layout and wrapped.matches(zero, d, m) and layout.tp == layout.pp == 1
    ):
        wrapped = None  # timed for another layout: the traffic model alone
    for rank in rank_models(shape, layout.tp, layout.pp):
        traffic = data_parallel_traffic(rank, zero, m, training.precision, "redundancy")
        rank_comm = 0.0
        if wrapped is not None:
            rank_comm = _wrapped_comm(wrapped, rank, traffic, t)
        elif d > 1 and zero <= 1:
            buckets = [(t(traffic.grad_collective, b), n) for b, n in traffic.buckets(bucket_mb)]
            total = sum(seconds * n for seconds, n in buckets)
            rank_comm = max(0.0, total - last_backward) + buckets[-1][0]
            if zero == 1:  # per-parameter broadcasts, all in flight: one per owner's share
                rank_comm += d * t("broadcast", traffic.param_bytes_after_step / d)
        elif d > 1:
            for unit in traffic.units:
                gathers = traffic.forward_gathers + traffic.backward_gathers
                rank_comm += gathers * t("all_gather", traffic.gather_bytes_per_param * unit)
                grads = traffic.grad_bytes_per_param * unit
                rank_comm += traffic.reduce_scatters * t("reduce_scatter", grads)
        updated = rank.params / (d if zero >= 1 else 1)
        rank_opt = updated * OPTIMIZER_BYTES_PER_PARAM[training.optimizer] / rate
        if wrapped is not None and wrapped.optimizer_s(rank.params) is not None:
            # ZeRO-1's step timed as the trainer runs it, with the gradient clipping on
            # the full gradients at the plain rate
            clip = rank.params * CLIP_BYTES_PER_PARAM / host.optimizer_bytes_per_s
            rank_opt = wrapped.optimizer_s(rank.params) + clip
        if rank_comm + rank_opt > comm + optimizer:
            comm, optimizer = rank_comm, rank_opt
    # a logged step's two small all-reduces over every rank (the straggler watch's
    # figures, and the loss)
    world = layout.world_size
    w_bw, w_lat = cluster.group_busbw(world, 1)
    logging = 2 * collective_time("all_reduce", 8.0, world, w_bw, w_lat) if logged else 0.0
    model_parallel = prediction.time.tp_comm_s + prediction.time.pp_comm_s
    cp_comm = prediction.time.cp_comm_s
    tp = host.tensor_parallel
    if timed_layout and tp is not None and tp.matches(layout, training.micro_batch, m):
        # the blocks and ends as timed under the job's tensor parallelism and its
        # data-parallel wrapping (their collectives included); a recomputed forward
        # repeats a third of a block
        again = 4.0 / 3.0 if training.recompute == "full" else 1.0
        compute = shape.n_layers * tp.block_s() * again + tp.ends_s()
        model_parallel, comm = prediction.time.pp_comm_s, 0.0
        timed_optimizer = tp.optimizer_s(shape.n_layers)
        if timed_optimizer is not None:
            optimizer = timed_optimizer
    bubble = prediction.time.bubble_s
    timed = host.steps
    if timed is not None and timed.matches(layout, schedule, training.micro_batch, m):
        # the whole step as timed: every stage's layers, sends, bubble, the data-parallel
        # wrapping, the job's accumulation and recomputation, the optimizer, a logged
        # step's exchanges, and under cp the K/V exchange
        v = timed.stages_per_rank
        zbv = schedule == "zbv"
        per_rank = max(r.layers for r in rank_models(shape, 1, layout.pp, v, zbv))
        compute = timed.step_s(per_rank / v)
        model_parallel, bubble, comm, optimizer, logging = 0.0, 0.0, 0.0, 0.0, 0.0
        cp_comm = 0.0
    step = compute + model_parallel + cp_comm + bubble + comm + logging + optimizer
    return {
        "compute_s": compute,
        "tp_pp_comm_s": model_parallel,
        "cp_comm_s": cp_comm,
        "bubble_s": bubble,
        "dp_comm_exposed_s": comm,
        "logging_allreduce_s": logging,
        "optimizer_s": optimizer,
        "step_s": step,
    }


def _wrapped_comm(wrapped: WrappedBlocks, rank, traffic, t) -> float:
    """Seconds per step the trainer's data-parallel wrapping adds to `rank`, from the
    run's own blocks timed under it (`WrappedBlocks`): on a CPU this time is exposed
    (gloo has no streams to hide it under).

    ZeRO 0/1 (DDP: one all-reduce of every gradient in buckets, plus its hooks): linear
    in the parameters through the one- and two-block figures; ZeRO-1 adds each owner's
    broadcast of its updated share (traffic model). ZeRO 2/3 (FSDP2 units): each block
    costs half the two-block figure (its gathers, reduce-scatters and hooks, and a share
    of the root's work; the difference between the two figures is too noisy on a loaded
    CPU to separate them), the root unit (embeddings, head) the same unit's fixed part
    (beyond its traffic) plus its own traffic."""
    p = wrapped.block_params
    if traffic.zero <= 1:
        per_param = max(0.0, wrapped.two_blocks_s - wrapped.one_block_s) / p
        comm = wrapped.one_block_s + per_param * (rank.params - p)
        if traffic.zero == 1 and wrapped.optimizer_s(rank.params) is None:
            d = wrapped.dp
            comm += d * t("broadcast", traffic.param_bytes_after_step / d)
        return max(0.0, comm)

    def traffic_of(params: float) -> float:
        gathers = traffic.forward_gathers + traffic.backward_gathers
        seconds = gathers * t("all_gather", traffic.gather_bytes_per_param * params)
        return seconds + traffic.reduce_scatters * t(
            "reduce_scatter", traffic.grad_bytes_per_param * params
        )

    per_unit = max(0.0, wrapped.two_blocks_s) / 2
    fixed = max(0.0, per_unit - traffic_of(p))
    root = fixed + traffic_of(rank.root_params) if rank.root_params else 0.0
    return rank.layers * per_unit + root
