"""A parallel layout and the rules that make it valid for a model and a batch.

Rank order follows torchtitan and Megatron-LM: tensor parallel innermost (a TP
group is contiguous, so it stays on one node when it fits), data parallel next,
pipeline stages outermost. Global rank = tp_rank + tp·(dp_rank + dp·pp_rank).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from meshforge.errors import ConfigError
from meshforge.plan.flops import GPTShape

ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Layout:
    """How one job is spread: degrees, ZeRO stage, and the pipeline schedule."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    virtual_stages: int = 1  # v > 1 means interleaved 1F1B
    sequence_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def pp_schedule(self) -> str:
        if self.pp == 1:
            return "none"
        return "interleaved_1f1b" if self.virtual_stages > 1 else "1f1b"  # the job's names

    # strides of each group in global ranks (see module docstring)
    @property
    def dp_stride(self) -> int:
        return self.tp

    @property
    def pp_stride(self) -> int:
        return self.tp * self.dp

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Training:
    """The training shape: what the user asks for, independent of the layout."""

    global_batch: int  # sequences per optimizer step, whole job
    micro_batch: int = 1  # sequences per forward/backward on one rank
    precision: str = "bf16"
    recompute: str = "none"  # activation checkpointing: none | selective | full
    optimizer: str = "adamw"
    sdpa: bool = True  # fused attention (SDPA/flash): no s x s activations kept

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise ConfigError(f"--global-batch must be >= 1, got {self.global_batch}")
        if self.micro_batch < 1:
            raise ConfigError(f"--micro-batch must be >= 1, got {self.micro_batch}")
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
            )
        if self.recompute not in RECOMPUTE:
            raise ConfigError(
                f"--recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}"
            )
        if self.optimizer not in ("adamw", "sgd"):
            raise ConfigError(f"--optimizer must be adamw or sgd, got {self.optimizer!r}")

    def microbatches(self, dp: int) -> int:
        """m = B / (b·N_d): micro-batches per data-parallel rank per step."""
        return self.global_batch // (self.micro_batch * dp)


def check_layout(
    layout: Layout, training: Training, shape: GPTShape | None, schedule: str = "1f1b"
) -> None:
    """Raise ConfigError naming the first rule the layout breaks. `schedule`: the
    trainer's parallel.pp_schedule when the layout is a job's (its micro-batch rules are
    torch.distributed.pipelining's, parallel/dims.py: 1F1B needs pp micro-batches, GPipe
    and ZB-V one; interleaved, v > 1, one and torch's multiple rule)."""
    from meshforge.parallel.dims import interleaved_accepts, min_microbatches

    for name in ("dp", "tp", "pp", "virtual_stages"):
        value = getattr(layout, name)
        if value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if layout.zero not in ZERO_STAGES:
        raise ConfigError(f"--zero must be one of 0, 1, 2, 3, got {layout.zero}")
    if layout.sequence_parallel and layout.tp == 1:
        raise ConfigError("--sequence-parallel needs --tp > 1")
    if layout.virtual_stages > 1 and layout.pp == 1:
        raise ConfigError("--virtual-stages > 1 needs --pp > 1")
    if shape is None:
        return  # a bare parameter count: model-state maths only, the batch does not matter
    b, dp = training.micro_batch, layout.dp
    if training.global_batch % (dp * b):
        raise ConfigError(
            f"--global-batch {training.global_batch} is not divisible by dp={dp} x micro-batch={b}"
        )
    m = training.microbatches(dp)
    interleaved = layout.virtual_stages > 1
    if interleaved:
        schedule = "interleaved_1f1b"
    least = min_microbatches(schedule, layout.pp)
    if layout.pp > 1 and m < least:
        raise ConfigError(
            f"a {schedule} pipeline needs at least {least} micro-batches per step at "
            f"pp={layout.pp}, global-batch/(dp x micro-batch) gives {m}"
        )
    if interleaved and not interleaved_accepts(m, layout.pp):
        raise ConfigError(
            f"interleaved pipeline: micro-batches ({m}) must be a multiple of "
            f"max(1, micro-batches // pp) = {max(1, m // layout.pp)} (e.g. of pp={layout.pp})"
        )
    if shape.n_heads % layout.tp:
        raise ConfigError(f"--tp {layout.tp} does not divide --heads {shape.n_heads}")
    if shape.d_model % shape.n_heads:
        raise ConfigError(f"--heads {shape.n_heads} does not divide --hidden {shape.d_model}")
    stages = layout.pp * layout.virtual_stages
    if stages > shape.n_layers:  # uneven stages are fine (stages.layer_split), empty ones not
        raise ConfigError(
            f"--pp {layout.pp} x --virtual-stages {layout.virtual_stages} = {stages} pipeline "
            f"stages is more than --layers {shape.n_layers}"
        )
    if layout.sequence_parallel and shape.seq_len % layout.tp:
        raise ConfigError(f"--sequence-parallel needs --tp {layout.tp} to divide --seq")


def is_valid(layout: Layout, training: Training, shape: GPTShape | None) -> bool:
    try:
        check_layout(layout, training, shape)
    except ConfigError:
        return False
    return True
