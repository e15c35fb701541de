"""A parallel layout and the rules that make it valid for a model and a batch.

Rank order follows torchtitan and Megatron-LM: tensor parallel innermost (a TP
group is contiguous, so it stays on one node when it fits), data parallel next,
pipeline stages outermost. Global rank = tp_rank + tp·(dp_rank + dp·pp_rank).

Expert parallelism borrows its ranks from data parallelism (layout/dims.py): an expert
group is `ep` consecutive data-parallel ranks (stride tp in global ranks), each holding
E/ep of a MoE layer's routed experts; dp/ep ranks (stride tp·ep) hold the same experts
and shard their states by ZeRO. ep does not change the world size.

Context parallelism (cp > 1) splits each sequence over cp ranks, between tensor and data
parallelism as in Megatron-Core (tp-cp-dp-pp): a cp group is cp ranks tp apart, and
world = pp x dp x cp x tp. Weights are replicated over cp: gradients are reduced (and
ZeRO shards states) over the dp x cp ranks holding the same weights, which are
contiguous in steps of tp. cp takes no share of the batch (m = B/(b·dp)). Methods
(CP_METHODS): allgather (Llama 3), ring (ring attention, Megatron-Core's p2p), alltoall
(DeepSpeed-Ulysses). Any of them from flags; `plan --config` keeps to what meshforge's
trainer builds (plan.jobs.job.JobPlan.trainer_cp).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from meshforge.errors import ConfigError
from meshforge.layout import LayoutRequest, ModelShape, Names, check, first_problem
from meshforge.plan.core.flops import GPTShape

ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE = ("none", "selective", "full")
CP_METHODS = ("allgather", "ring", "alltoall")
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
    ep: int = 1  # expert parallel: a divisor of dp and of the routed experts
    cp: int = 1  # context parallel: the sequence split over cp ranks (module docstring)
    cp_method: str = "allgather"  # how the cp ranks exchange K and V (CP_METHODS)

    @property
    def edp(self) -> int:
        """Data-parallel ranks holding the same experts (dp / ep)."""
        return self.dp // self.ep

    @property
    def grad_edp(self) -> int:
        """Ranks holding the same experts, over which their gradients are reduced and
        ZeRO shards them: edp x cp (cp replicates the experts too)."""
        return self.edp * self.cp

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def grad_dp(self) -> int:
        """Ranks holding the same weights, over which gradients are reduced and ZeRO
        shards: dp x cp (cp replicates the weights)."""
        return self.dp * self.cp

    @property
    def cp_stride(self) -> int:
        return self.tp

    @property
    def pp_schedule(self) -> str:
        if self.pp == 1:
            return "none"
        return "interleaved_1f1b" if self.virtual_stages > 1 else "1f1b"  # the job's names

    # strides of each group in global ranks (see module docstring)
    @property
    def dp_stride(self) -> int:
        return self.tp * self.cp

    @property
    def pp_stride(self) -> int:
        return self.tp * self.cp * self.dp

    @property
    def ep_stride(self) -> int:
        """An expert group's ranks are consecutive data-parallel ranks."""
        return self.tp * self.cp

    @property
    def edp_stride(self) -> int:
        """The ranks holding the same experts are ep data-parallel ranks apart."""
        return self.tp * self.cp * self.ep

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


# how `meshforge plan` and `cost` name the fields the layout rules talk about
FLAG_NAMES = Names(
    {
        "dp": "--dp",
        "tp": "--tp",
        "pp": "--pp",
        "ep": "--ep",
        "cp": "--cp",
        "experts": "--experts",
        "zero": "--zero",
        "virtual_stages": "--virtual-stages",
        "sequence_parallel": "--sequence-parallel",
        "n_layers": "--layers",
        "d_model": "--hidden",
        "n_heads": "--heads",
        "kv_heads": "--kv-heads",
        "vocab_size": "--vocab",
        "seq_len": "--seq",
        "global_batch": "--global-batch",
        "micro_batch": "--micro-batch",
    },
    style="flags",
)


def layout_shape(shape: GPTShape) -> ModelShape:
    """The planner's shape as the layout rules read it."""
    return ModelShape(
        n_layers=shape.n_layers,
        d_model=shape.d_model,
        n_heads=shape.n_heads,
        kv_heads=shape.n_kv_heads or shape.n_heads,
        mlp_hidden=shape.mlp_width,
        vocab_size=shape.vocab_size,
        seq_len=shape.seq_len,
        tie_embeddings=shape.tie_embeddings,
        experts=shape.experts,
    )


def check_layout(
    layout: Layout, training: Training, shape: GPTShape | None, schedule: str = "1f1b"
) -> None:
    """Raise ConfigError naming the first layout rule (layout/rules.py's structural
    ones) the layout breaks, in the command line's flags. `schedule`: the trainer's
    parallel.pp_schedule when the layout is a job's; v > 1 means interleaved."""
    request = LayoutRequest(
        tp=layout.tp,
        pp=layout.pp,
        ep=layout.ep,
        dp=layout.dp,
        zero=layout.zero,
        sequence_parallel=layout.sequence_parallel,
        pp_schedule="interleaved_1f1b" if layout.virtual_stages > 1 else schedule,
        virtual_stages=layout.virtual_stages,
        global_batch=training.global_batch,
        micro_batch=training.micro_batch,
    )
    lay_shape = None if shape is None else layout_shape(shape)
    first_problem(check(request, lay_shape, FLAG_NAMES, trainer=False))
    _check_experts(layout, shape)
    _check_context(layout, shape)


def _check_context(layout: Layout, shape: GPTShape | None) -> None:
    """Context parallelism's rules in flags: the sequence splits into 2·cp chunks (each
    rank a head and a tail chunk, so the causal work is balanced); Ulysses' all-to-all
    hands each rank whole heads, so the heads of a tensor-parallel rank divide by cp."""
    cp, method = layout.cp, layout.cp_method
    if cp < 1:
        raise ConfigError(f"--cp must be >= 1, got {cp}")
    if method not in CP_METHODS:
        raise ConfigError(f"--cp-method must be one of {', '.join(CP_METHODS)}, got {method!r}")
    if cp == 1:
        return
    if shape is None:
        raise ConfigError(f"--cp {cp} needs a model shape (a sequence to split), not --params")
    if layout.ep > 1:
        raise ConfigError(f"--cp {cp} with --ep {layout.ep}: not modelled by the planner")
    if shape.seq_len % (2 * cp):
        raise ConfigError(
            f"--seq {shape.seq_len} is not divisible by 2 x --cp {cp} (head-tail chunks)"
        )
    if method == "alltoall" and shape.n_heads % (cp * layout.tp):
        raise ConfigError(
            f"--cp-method alltoall needs --heads {shape.n_heads} divisible by --cp {cp}"
            + (f" x --tp {layout.tp}" if layout.tp > 1 else "")
        )


def _check_experts(layout: Layout, shape: GPTShape | None) -> None:
    """Expert parallelism's structural rules in flags (the trainer's own, such as ZeRO-1
    with ep, are layout/rules.py's and apply to a job: plan/jobs/job.py)."""
    ep = layout.ep
    if ep == 1:
        return
    if shape is None:
        raise ConfigError(f"--ep {ep} needs a model shape with experts (--experts), not --params")
    if not shape.is_moe:
        raise ConfigError(
            f"--ep {ep} needs a mixture-of-experts model (--experts), not a dense one"
        )
    if shape.experts % ep:
        raise ConfigError(f"--ep {ep} does not divide --experts {shape.experts}")


def is_valid(layout: Layout, training: Training, shape: GPTShape | None) -> bool:
    try:
        check_layout(layout, training, shape)
    except ConfigError:
        return False
    return True
