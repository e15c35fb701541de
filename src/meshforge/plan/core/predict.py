"""One layout, evaluated: memory per GPU, step time, throughput, MFU and HFU.

`evaluate` is what `meshforge plan` and the layout search call; `predict_run` is
the trainer's entry: the same model, for its own run on a measured machine.

MFU and HFU use Megatron-LM's FLOP counting (all matmuls, full s x s attention,
logits; HFU adds recomputation), so they compare with the published Megatron and
Korthikanti tables. meshforge's run reports count the same model FLOPs
(`flops.training_flops_per_token`, `flops.FLOPS_CONVENTION`: 6·N_matmul + 12·l·s·h
per token), so a plan's MFU and a report's compare directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshforge.errors import ConfigError
from meshforge.layout.stages import RankStages, pipeline_ranks
from meshforge.plan.core.flops import GPTShape, gpt_param_count, microbatch_flops, rank_params
from meshforge.plan.core.hardware import Cluster
from meshforge.plan.core.layout import Layout, Training, check_layout
from meshforge.plan.core.memory import (
    FRAGMENTATION_MARGIN,
    comm_buffer_bytes,
    model_state_bytes,
    rank_activation_bytes,
    working_bytes,
)
from meshforge.plan.core.profile import MachineProfile
from meshforge.plan.core.timing import Framework, StepTime, step_time

Model = GPTShape | float  # a GPT shape, or a bare parameter count (model-state maths only)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU on the busiest rank. total = everything below except `device`."""

    params: float
    grads: float
    optimizer: float
    comm_buffers: float  # resident buffers beyond the model states (0 in meshforge today)
    working: float  # transient: unsharded params/grads, autocast weight copies
    activations: float | None  # None with a bare parameter count
    margin: float  # FRAGMENTATION_MARGIN of the allocated bytes
    reserved: float  # CUDA context, NCCL and cuBLAS workspaces
    device: float  # what the device has
    convention: str

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        allocated = self.model_states + self.comm_buffers + self.working + (self.activations or 0)
        return allocated + self.margin + self.reserved

    @property
    def fits(self) -> bool:
        return self.total <= self.device

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_states": self.model_states,
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "comm_buffers": self.comm_buffers,
            "working": self.working,
            "activations": self.activations,
            "margin": self.margin,
            "reserved": self.reserved,
            "total": self.total,
            "device": self.device,
        }


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    training: Training
    memory: MemoryEstimate
    time: StepTime | None  # None with a bare parameter count
    n_gpus: int
    seq_len: int | None
    model_params: float
    model_flops_per_step: float | None
    hardware_flops_per_step: float | None
    peak_flops_per_s: float
    memory_pp_rank: int = 0  # the pipeline rank whose memory `memory` is (the most)
    pipeline_stages: tuple[int, ...] | None = None  # layers per pipeline rank (pp > 1)
    calibration: str | None = None  # what the device's compute curve was fitted on
    # parameters a token passes through (a mixture of experts: fewer than model_params;
    # the FLOPs count these). None with a bare parameter count
    active_params: float | None = None

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def step_time_s(self) -> float | None:
        return None if self.time is None else self.time.step_s

    @property
    def tokens_per_s(self) -> float | None:
        if self.time is None or self.seq_len is None:
            return None
        return self.training.global_batch * self.seq_len / self.time.step_s

    def _per_gpu_rate(self, flops: float | None) -> float | None:
        if self.time is None or flops is None:
            return None
        return flops / (self.time.step_s * self.n_gpus)

    @property
    def mfu(self) -> float | None:
        rate = self._per_gpu_rate(self.model_flops_per_step)
        return None if rate is None else rate / self.peak_flops_per_s

    @property
    def hfu(self) -> float | None:
        rate = self._per_gpu_rate(self.hardware_flops_per_step)
        return None if rate is None else rate / self.peak_flops_per_s

    @property
    def bubble_fraction(self) -> float | None:
        return None if self.time is None else self.time.bubble_s / self.time.step_s

    def to_dict(self) -> dict[str, Any]:
        """The JSON object `meshforge plan --json` prints."""
        hw = self._per_gpu_rate(self.hardware_flops_per_step)
        model = self._per_gpu_rate(self.model_flops_per_step)
        time = self.time
        batch = time is not None  # a bare parameter count: the batch plays no part
        return {
            "layout": {
                **self.layout.to_dict(),
                "micro_batch": self.training.micro_batch,
                "recompute": self.training.recompute,
                "pp_schedule": self.layout.pp_schedule,
                "microbatches": self.training.microbatches(self.layout.dp) if batch else None,
            },
            "fits": self.fits,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": None if hw is None else hw / 1e12,
            "model_tflops_per_gpu": None if model is None else model / 1e12,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "bubble_fraction": self.bubble_fraction,
            "exposed_comm_fraction": None if time is None else time.exposed_comm_s / time.step_s,
            "memory_per_gpu_bytes": self.memory.to_dict(),
            "memory_pp_rank": self.memory_pp_rank,
            "pipeline_stages": list(self.pipeline_stages) if self.pipeline_stages else None,
            # the pipeline rank whose compute sets the pace (None: no time model)
            "slowest_pp_rank": None if time is None else time.slowest_pp_rank,
            "memory_convention": self.memory.convention,
            "time_breakdown_s": None if time is None else time.to_dict(),
            "training": {
                "global_batch": self.training.global_batch if batch else None,
                "precision": self.training.precision,
                "optimizer": self.training.optimizer,
                "sdpa": self.training.sdpa,
            },
            "model_params": self.model_params,
            "model_active_params": self.active_params,
            "n_gpus": self.n_gpus,
            "calibration": self.calibration,
        }


def evaluate(
    model: Model,
    layout: Layout,
    training: Training,
    cluster: Cluster,
    convention: str = "meshforge",
    schedule: str = "1f1b",
    framework: Framework = Framework(),
) -> Prediction:
    """Memory and (given a GPT shape) step time of one layout; ConfigError if invalid
    (`schedule`: the trainer's pipeline schedule, for its micro-batch rules;
    `framework`: the trainer that runs it, timing.Framework, meshforge's by default)."""
    shape = model if isinstance(model, GPTShape) else None
    check_layout(layout, training, shape, schedule)
    if layout.world_size != cluster.n_gpus:
        raise ConfigError(
            f"dp={layout.dp} x tp={layout.tp} x pp={layout.pp}"
            + (f" x cp={layout.cp}" if layout.cp > 1 else "")
            + f" = {layout.world_size} "
            f"does not equal --gpus {cluster.n_gpus}"
        )
    precision = training.precision
    peak = cluster.device.peak(precision)
    if shape is None:
        total_params = float(model)  # type: ignore[arg-type]
        if total_params <= 0:
            raise ConfigError(f"--params must be > 0, got {total_params}")
        rank_params = total_params / (layout.tp * layout.pp)
        memory = _rank_memory(rank_params, 0.0, 0.0, None, layout, training, cluster, convention)
        return Prediction(
            layout, training, memory, None, cluster.n_gpus, None, total_params, None, None, peak,
            calibration=cluster.device.calibration,
        )  # fmt: skip
    count = gpt_param_count(shape)
    total_params = float(count.total)
    # ZB-V holds stages r and 2pp-1-r: the first rank both ends of the model
    zbv = schedule == "zbv" and layout.pp > 1
    stages = pipeline_ranks(shape.n_layers, layout.pp, layout.virtual_stages, zbv)
    # With uneven stages any rank can hold the most. Among ranks holding the same share
    # the first does (later ones keep fewer micro-batches in flight), so one of each.
    distinct = {(r.layers, r.embedding, r.head): r for r in reversed(stages)}.values()
    per_rank = {
        r.pp_rank: _stage_memory(shape, layout, training, cluster, convention, r, schedule)
        for r in distinct
    }
    memory_rank = max(per_rank, key=lambda r: (per_rank[r].total, -r))
    flops = microbatch_flops(shape, training.micro_batch)
    n_micro = training.global_batch / training.micro_batch  # micro-batches in the whole job
    return Prediction(
        layout=layout,
        training=training,
        memory=per_rank[memory_rank],
        time=step_time(shape, layout, training, cluster, framework=framework),
        n_gpus=cluster.n_gpus,
        seq_len=shape.seq_len,
        model_params=total_params,
        model_flops_per_step=n_micro * flops.model(shape.n_layers),
        hardware_flops_per_step=n_micro * flops.hardware(shape.n_layers, training.recompute),
        peak_flops_per_s=peak,
        calibration=cluster.device.calibration,
        memory_pp_rank=memory_rank,
        pipeline_stages=tuple(r.layers for r in stages) if layout.pp > 1 else None,
        active_params=float(count.active_or_total),
    )


def _stage_memory(
    shape: GPTShape,
    layout: Layout,
    training: Training,
    cluster: Cluster,
    convention: str,
    stages: RankStages,
    schedule: str = "1f1b",
) -> MemoryEstimate:
    """The memory of the pipeline rank holding `stages` (the whole model without pp),
    under the trainer's pipeline `schedule` (GPipe keeps every micro-batch)."""
    rank = rank_params(shape, layout.tp, stages)
    activations = rank_activation_bytes(
        shape,
        stages,
        training.micro_batch,
        layout.tp,
        layout.pp,
        layout.virtual_stages,
        layout.sequence_parallel,
        training.recompute,
        training.precision,
        training.sdpa,
        training.microbatches(layout.dp),
        schedule,
        cp=layout.cp,
        cp_method=layout.cp_method,
    )
    return _rank_memory(
        rank.total, rank.block, rank.root, activations, layout, training, cluster, convention,
        expert_block=rank.expert_block, layers=stages.layers,
    )  # fmt: skip


def _rank_memory(
    rank_params: float,
    block: float,
    root: float,
    activations: float | None,
    layout: Layout,
    training: Training,
    cluster: Cluster,
    convention: str,
    expert_block: float = 0.0,
    layers: int = 0,
) -> MemoryEstimate:
    """The memory of one rank that holds `rank_params` parameters (after tensor and
    pipeline sharding) and keeps `activations` bytes for its backward (None: unknown,
    with a bare parameter count).

    With experts (`expert_block`: one block's routed experts, all E of them, within
    `block`; `layers` blocks on the rank) and expert parallelism, the rank holds E/ep of
    them, whose states ZeRO shards over the dp/ep ranks holding the same experts; the
    rest (attention, router, shared experts, embeddings) as before, over dp."""
    precision, zero = training.precision, layout.zero
    microbatches = training.microbatches(layout.dp) if activations is not None else 1
    experts = layers * expert_block
    held_experts = experts / layout.ep
    dense = rank_params - experts
    # cp replicates the weights: their states shard over the dp x cp ranks holding them
    states = model_state_bytes(dense, zero, layout.grad_dp, precision, convention,
                               training.optimizer)  # fmt: skip
    if held_experts > 0:
        expert_states = model_state_bytes(
            held_experts, zero, layout.grad_edp, precision, convention, training.optimizer
        )
        states = {k: states[k] + expert_states[k] for k in states}
    held = dense + held_experts
    held_block = block - expert_block + expert_block / layout.ep
    buffers = comm_buffer_bytes(held, zero, convention)
    working = working_bytes(held, zero, precision, held_block, root, microbatches)
    allocated = states["total"] + buffers + working + (activations or 0.0)
    return MemoryEstimate(
        params=states["params"],
        grads=states["grads"],
        optimizer=states["optimizer"],
        comm_buffers=buffers,
        working=working,
        activations=activations,
        margin=FRAGMENTATION_MARGIN * allocated,
        reserved=cluster.device.reserved_bytes,
        device=cluster.device.memory_bytes,
        convention=convention,
    )


def predict_run(
    shape: GPTShape,
    layout: Layout,
    global_batch: int,
    micro_batch: int,
    precision: str,
    recompute: str,
    profile: MachineProfile | Cluster,
    *,
    optimizer: str = "adamw",
    sdpa: bool = True,
    convention: str = "meshforge",
    schedule: str = "1f1b",
) -> Prediction:
    """What meshforge predicts for a run of `shape` with `layout` on a measured machine.

    `profile` is usually the run's own MachineProfile (all ranks on one host); a
    Cluster is accepted for a planned multi-node run. `recompute` is the config's
    train.activation_checkpointing (none | selective | full)."""
    cluster = profile
    if isinstance(profile, MachineProfile):
        cluster = profile.to_cluster(layout.world_size)
    training = Training(
        global_batch=global_batch,
        micro_batch=micro_batch,
        precision=precision,
        recompute=recompute,
        optimizer=optimizer,
        sdpa=sdpa,
    )
    return evaluate(shape, layout, training, cluster, convention, schedule)
