"""One layout, evaluated: memory per GPU, step time, throughput, MFU and HFU.

`evaluate` is what `meshforge plan` and the layout search call; `predict_run` is
the trainer's entry: the same model, for its own run on a measured machine.

MFU and HFU use Megatron-LM's FLOP counting (all matmuls, full s x s attention,
logits; HFU adds recomputation), so they compare with the published Megatron and
Korthikanti tables. meshforge's run reports use the 6·Ψ + 6·l·s·h convention
(`flops.training_flops_per_token`), which reads a few percent lower.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshforge.errors import ConfigError
from meshforge.plan.flops import GPTShape, gpt_param_count, microbatch_flops, params_per_rank
from meshforge.plan.hardware import Cluster
from meshforge.plan.layout import Layout, Training, check_layout
from meshforge.plan.memory import (
    FRAGMENTATION_MARGIN,
    activation_memory_bytes,
    comm_buffer_bytes,
    model_state_bytes,
    working_bytes,
)
from meshforge.plan.profile import MachineProfile
from meshforge.plan.timing import StepTime, step_time

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
        return {
            "layout": {
                **self.layout.to_dict(),
                "micro_batch": self.training.micro_batch,
                "recompute": self.training.recompute,
                "pp_schedule": self.layout.pp_schedule,
                "microbatches": self.training.microbatches(self.layout.dp),
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
            "memory_convention": self.memory.convention,
            "time_breakdown_s": None if time is None else time.to_dict(),
            "training": {
                "global_batch": self.training.global_batch,
                "precision": self.training.precision,
                "optimizer": self.training.optimizer,
                "sdpa": self.training.sdpa,
            },
            "model_params": self.model_params,
            "n_gpus": self.n_gpus,
        }


def evaluate(
    model: Model,
    layout: Layout,
    training: Training,
    cluster: Cluster,
    convention: str = "meshforge",
) -> Prediction:
    """Memory and (given a GPT shape) step time of one layout; ConfigError if invalid."""
    shape = model if isinstance(model, GPTShape) else None
    check_layout(layout, training, shape)
    if layout.world_size != cluster.n_gpus:
        raise ConfigError(
            f"dp={layout.dp} x tp={layout.tp} x pp={layout.pp} = {layout.world_size} "
            f"does not equal --gpus {cluster.n_gpus}"
        )
    precision, zero = training.precision, layout.zero
    if shape is None:
        total_params = float(model)  # type: ignore[arg-type]
        if total_params <= 0:
            raise ConfigError(f"--params must be > 0, got {total_params}")
        rank_params, block, root = total_params / (layout.tp * layout.pp), 0.0, 0.0
    else:
        total_params = float(gpt_param_count(shape).total)
        rank = params_per_rank(shape, layout.tp, layout.pp)
        rank_params, block, root = rank.total, rank.block, rank.root
    states = model_state_bytes(
        rank_params, zero, layout.dp, precision, convention, training.optimizer
    )
    buffers = comm_buffer_bytes(rank_params, zero, convention)
    m = training.microbatches(layout.dp) if shape is not None else 1
    working = working_bytes(rank_params, zero, precision, block, root, m)
    activations = None
    if shape is not None:
        activations = activation_memory_bytes(
            shape,
            training.micro_batch,
            layout.tp,
            layout.pp,
            layout.virtual_stages,
            layout.sequence_parallel,
            training.recompute,
            precision,
            training.sdpa,
            training.microbatches(layout.dp),
        )
    allocated = states["total"] + buffers + working + (activations or 0.0)
    memory = MemoryEstimate(
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
    peak = cluster.device.peak(precision)
    if shape is None:
        return Prediction(
            layout, training, memory, None, cluster.n_gpus, None, total_params, None, None, peak
        )
    flops = microbatch_flops(shape, training.micro_batch)
    n_micro = training.global_batch / training.micro_batch  # micro-batches in the whole job
    return Prediction(
        layout=layout,
        training=training,
        memory=memory,
        time=step_time(shape, layout, training, cluster),
        n_gpus=cluster.n_gpus,
        seq_len=shape.seq_len,
        model_params=total_params,
        model_flops_per_step=n_micro * flops.model(shape.n_layers),
        hardware_flops_per_step=n_micro * flops.hardware(shape.n_layers, training.recompute),
        peak_flops_per_s=peak,
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
    return evaluate(shape, layout, training, cluster, convention)
