"""Parameter counts and training FLOPs of meshforge's models (pure Python, no torch).

family "gpt" (models/gpt.py): learned token and position embeddings, pre-LayerNorm
blocks (QKV and output projections with bias, a GELU MLP of width mlp_ratio*h with
bias), a final LayerNorm, and an output head tied to the token embedding (or
untied: `tie_embeddings=False`).

family "llama" (models/llama.py): a token embedding only (rotary positions have no
parameters), blocks of two RMSNorms, q and output projections h x h, k and v
projections h x (n_kv_heads * head_dim) for grouped-query attention, a SwiGLU MLP
of three h x f matrices, no biases; a final RMSNorm and a head of its own (unless
tied). `head_dim` (model.head_dim) sets the width of a head: q and the attention
output are n_heads * head_dim wide (d_model / n_heads when it is not given).

A llama with a mixture of experts (model.moe) keeps its first `dense_layers` layers
dense; every later layer has, instead of the SwiGLU of width f, a router (an h x E
matrix), E routed experts and S shared experts, each a SwiGLU of three h x F matrices.
A token passes through its top K routed experts and the S shared ones: the model holds
all E + S experts (its total parameters, what memory counts), a token multiplies by
K + S of them (its active parameters, what FLOPs count). Per-layer figures of a model
whose layers differ (dense and MoE) are means over its layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshforge.errors import ConfigError
from meshforge.layout.stages import RankStages, pipeline_ranks


@dataclass(frozen=True)
class GPTShape:
    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    seq_len: int
    mlp_ratio: int = 4
    tie_embeddings: bool = True
    family: str = "gpt"  # gpt | llama
    n_kv_heads: int | None = None  # llama: key/value heads (None: n_heads)
    ffn_hidden: int | None = None  # llama: SwiGLU width (None: 8/3 h rounded up to 64)
    head_dim: int | None = None  # llama: width of one head (None: d_model / n_heads)
    # mixture of experts (llama; experts 0: a dense model): routed experts per MoE layer,
    # the routed experts each token passes through, the width of each expert's SwiGLU,
    # experts every token passes through, and the dense layers before the first MoE one
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0

    @property
    def mlp_width(self) -> int:
        if self.ffn_hidden is not None:  # llama's SwiGLU; a GPT of a non-integer ratio
            return self.ffn_hidden
        if self.family == "gpt":
            return self.mlp_ratio * self.d_model
        return -(-int(8 * self.d_model / 3) // 64) * 64

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def q_width(self) -> int:
        """Width of the q projection's output (and of the attention output's input)."""
        return self.n_heads * self.head_size

    @property
    def kv_width(self) -> int:
        """Width of the k (and of the v) projection's output."""
        return (self.n_kv_heads or self.n_heads) * self.head_size

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        """Layers with a mixture of experts (0 for a dense model)."""
        return self.n_layers - self.dense_layers if self.is_moe else 0

    @property
    def moe_share(self) -> float:
        """The share of the layers that are mixture-of-experts layers."""
        return self.moe_layers / self.n_layers

    def attention_matrices(self) -> float:
        h = self.d_model
        if self.family == "gpt":
            return 4 * h * h
        return 2 * h * self.q_width + 2 * h * self.kv_width

    def _ffn_matrices(self, routed: int) -> float:
        """Mean over the layers of the feed-forward's matrices, with `routed` routed
        experts counted in each MoE layer (E: held, K: multiplied by per token)."""
        h, f = self.d_model, self.mlp_width
        dense = 2 * h * f if self.family == "gpt" else 3 * h * f
        if not self.is_moe:
            return dense
        expert = 3 * h * self.expert_ffn
        moe = (routed + self.shared_experts) * expert + h * self.experts  # + the router
        return ((self.n_layers - self.moe_layers) * dense + self.moe_layers * moe) / self.n_layers

    def block_matrices(self) -> float:
        """Weight-matrix parameters of one block (what memory holds; with experts, all
        of them, as a mean over the layers)."""
        return self.attention_matrices() + self._ffn_matrices(self.experts)

    def active_block_matrices(self) -> float:
        """Weight-matrix parameters one token multiplies by in one block (what FLOPs
        count): with experts, the router, the top-k routed and the shared experts."""
        return self.attention_matrices() + self._ffn_matrices(self.top_k)

    def expert_block_params(self) -> float:
        """Routed experts' parameters of one block (mean over the layers): what expert
        parallelism splits; the router and shared experts are held like the rest."""
        return self.moe_share * self.experts * 3 * self.d_model * self.expert_ffn

    @property
    def active_mlp_width(self) -> float:
        """The feed-forward width one token passes through (mean over the layers): the
        MLP's, or (K + S)·F in a MoE layer. What the memory-bound kernels and the saved
        activations scale with."""
        if not self.is_moe:
            return self.mlp_width
        moe = (self.top_k + self.shared_experts) * self.expert_ffn
        return (1 - self.moe_share) * self.mlp_width + self.moe_share * moe

    def block_vectors(self) -> tuple[float, float]:
        """(split, replicated) 1-D parameters of one block under tensor parallelism:
        column-parallel biases are split, row-parallel biases and norms replicated."""
        h, f = self.d_model, self.mlp_width
        if self.family == "gpt":
            return 3 * h + f, h + h + 4 * h  # qkv + fc biases; proj biases + 2 LayerNorms
        return 0, 2 * h  # two RMSNorm weights

    @property
    def position_params(self) -> int:
        return self.seq_len * self.d_model if self.family == "gpt" else 0

    @property
    def final_norm_params(self) -> int:
        return 2 * self.d_model if self.family == "gpt" else self.d_model


def shape_of(model: Any) -> GPTShape:
    """The shape of a job's `model` section (config.ModelConfig, or a JobConfig); a
    user's factory model has no shape the planner knows: ConfigError."""
    m = getattr(model, "model", model)
    if m.is_factory:
        raise ConfigError(
            f"model.name={m.name} is a user's factory: the planner models meshforge's "
            "gpt and llama shapes only"
        )
    moe = getattr(m, "moe", None)
    experts = {}
    if moe is not None:
        experts = {
            "experts": moe.experts,
            "top_k": moe.top_k,
            "expert_ffn": moe.expert_ffn,
            "shared_experts": moe.shared_experts,
            "dense_layers": moe.dense_layers,
        }
    return GPTShape(
        m.n_layers, m.d_model, m.n_heads, m.vocab_size, m.seq_len, m.mlp_ratio,
        m.tie_embeddings, m.name, m.n_kv_heads, m.ffn_hidden, getattr(m, "head_dim", None),
        **experts,
    )  # fmt: skip


@dataclass(frozen=True)
class ParamCount:
    total: int
    embedding: int  # token + position embeddings, + the output head when it is not tied
    non_embedding: int
    # parameters one token passes through: total less the routed experts it is not sent
    # to (None: not known, e.g. a user's factory model, where it is taken as total)
    active: int | None = None

    @property
    def active_or_total(self) -> int:
        return self.total if self.active is None else self.active


def gpt_param_count(shape: GPTShape) -> ParamCount:
    h, L = shape.d_model, shape.n_layers
    per_block = shape.block_matrices() + sum(shape.block_vectors())
    embedding = shape.vocab_size * h + shape.position_params
    if not shape.tie_embeddings:  # an output head of its own
        embedding += shape.vocab_size * h
    non_embedding = int(L * per_block + shape.final_norm_params)
    idle = L * (shape.block_matrices() - shape.active_block_matrices())  # experts not routed to
    total = embedding + non_embedding
    return ParamCount(total, embedding, non_embedding, int(total - idle))


FLOPS_CONVENTION = (
    "6·N_matmul + 12·l·s·h per token (PaLM / torchtitan): every matmul incl. the output "
    "head, full attention scores; recomputation not counted"
)
# A user's factory model has no shape meshforge knows: every parameter is taken as a
# matmul weight, and the attention scores (if any) are not counted.
FACTORY_FLOPS_CONVENTION = (
    "6·Ψ per token (a user's model: every parameter taken as a matmul weight, attention "
    "scores not counted); recomputation not counted"
)


def training_flops_per_token(shape: GPTShape) -> float:
    """Model FLOPs of training on one token: 6·N_matmul + 12·l·s·h (FLOPS_CONVENTION).

    N_matmul = l·(weight-matrix parameters of a block) + V·h: every matmul, the output
    head included whether it is tied or not (a tied head is still a matmul); the
    embedding look-ups, biases and norms are not matmuls. For GQA the k and v
    projections are h x (n_kv_heads·head_dim). 12·l·s·h is the attention scores QK^T
    and their weighted sum AV over the full s x s matrix (2 matmuls x 2·s·h FLOPs per
    token forward, x 3 with backward), with no halving for the causal mask.

    With a mixture of experts N_matmul counts the active matrices (the router, the top-k
    routed and the shared experts: `GPTShape.active_block_matrices`), and with
    model.head_dim the attention width is n_heads·head_dim rather than h.

    This is PaLM's 6N + 12·L·H·Q·T (Chowdhery et al., arXiv 2204.02311, appendix B)
    and torchtitan's `get_num_flop_per_token` (6·non-embedding params, head included,
    + 12·l·h·q·t). It is also what `microbatch_flops(...).model` counts per token, so
    `plan` and the run reports share one MFU: both are Megatron-LM's model FLOPs
    (Korthikanti 72·B·l·s·h²·(1 + s/(6h) + V/(12·h·l)) for a GPT with r = 4)."""
    n_matmul = shape.n_layers * shape.active_block_matrices() + shape.vocab_size * shape.d_model
    return 6.0 * n_matmul + 12.0 * shape.n_layers * shape.seq_len * shape.q_width


# -- Megatron-LM conventions (model and hardware FLOPs) ------------------------
#
# Megatron counts every matmul of a step, with the full s x s attention product
# and the output logits (the model FLOPs: FLOPS_CONVENTION above), and reports
# "hardware" FLOPs that include recomputation. The planner reports MFU and HFU in
# this convention so that its predictions can be checked against the published
# Megatron tables and against meshforge's own run reports.


def megatron_full_recompute_flops(
    batch: int, seq: int, layers: int, hidden: int, vocab: int
) -> float:
    """Hardware FLOPs of one iteration with full recomputation.

    F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))  (Narayanan et al. 2104.04473, eq. 3)."""
    b, s, n, h, v = batch, seq, layers, hidden, vocab
    return 96.0 * b * s * n * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * n * h))


def korthikanti_model_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Model FLOPs of one iteration, no recomputation counted.

    72·B·l·s·h²·(1 + s/(6h) + V/(12·h·l))  (Korthikanti et al. 2205.05198, appendix A)."""
    b, s, n, h, v = batch, seq, layers, hidden, vocab
    return 72.0 * b * n * s * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * h * n))


def korthikanti_selective_hardware_flops(
    batch: int, seq: int, layers: int, hidden: int, vocab: int
) -> float:
    """Hardware FLOPs of one iteration with selective recomputation.

    72·B·l·s·h²·(1 + s/(3h) + V/(12·h·l))  (Korthikanti et al. 2205.05198, appendix A)."""
    b, s, n, h, v = batch, seq, layers, hidden, vocab
    return 72.0 * b * n * s * h * h * (1.0 + s / (3.0 * h) + v / (12.0 * h * n))


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one micro-batch of b sequences, split where the planner needs it."""

    layer_forward: float  # one transformer layer, forward only
    attention_core_forward: float  # the s x s part of layer_forward (QK^T and AV)
    logits_forward: float  # output projection onto the vocabulary

    def model(self, n_layers: float) -> float:
        """Forward + backward (backward = 2 x forward), nothing recomputed."""
        return 3.0 * (n_layers * self.layer_forward + self.logits_forward)

    def hardware(self, n_layers: float, recompute: str) -> float:
        """Model FLOPs plus recomputation, as Megatron-LM counts it.

        full: one more forward of every layer (Narayanan eq. 3: the 96 vs 72 factor);
        selective: the attention core once more at its full training cost, which is
        Korthikanti's accounting (s/(6h) becomes s/(3h))."""
        extra = 0.0
        if recompute == "full":
            extra = n_layers * self.layer_forward
        elif recompute == "selective":
            extra = n_layers * 3.0 * self.attention_core_forward
        return self.model(n_layers) + extra


def microbatch_flops(shape: GPTShape, micro_batch: int) -> StepFlops:
    """Matmul FLOPs of one micro-batch, for any MLP width.

    Per layer forward: 2·b·s·(weight-matrix parameters of a block), for the GPT
    2·b·s·(3h² + h² + 2·r·h²) for the QKV, output and MLP matmuls,
    plus 4·b·s²·h for QK^T and AV; logits 2·b·s·V·h. With r = 4 and training = 3 x
    forward this is exactly Korthikanti's 72·b·l·s·h²·(1 + s/(6h) + V/(12·h·l)).
    With experts the block's matrices are the active ones, and the attention core is
    n_heads·head_dim wide."""
    b, s, h = micro_batch, shape.seq_len, shape.d_model
    attention_core = 4.0 * b * s * s * shape.q_width
    layer = 2.0 * b * s * shape.active_block_matrices() + attention_core
    logits = 2.0 * b * s * shape.vocab_size * h
    return StepFlops(layer, attention_core, logits)


@dataclass(frozen=True)
class RankParams:
    """Parameters one rank holds under tensor and pipeline parallelism."""

    total: float
    block: float  # one transformer block on this rank
    root: float  # embeddings / final norm / head on this rank (FSDP's root module)
    # the routed experts of one block on this rank, all E of them (within `block`): what
    # expert parallelism divides by ep
    expert_block: float = 0.0


def params_per_rank(
    shape: GPTShape,
    tp: int = 1,
    pp: int = 1,
    virtual_stages: int = 1,
    zbv: bool = False,
    pp_rank: int | None = None,
) -> RankParams:
    """Megatron-style split: weight matrices and column-parallel biases are divided by
    t; row-parallel biases and LayerNorms are replicated; the token embedding is
    vocab-parallel, the position embedding replicated. Pipeline rank `pp_rank` holds
    its stages' blocks (`stages.pipeline_ranks`: uneven splits differ by one layer);
    the rank with stage 0 also the embeddings, the rank with the last stage the final
    norm and the head (V·h/t, a copy of the tied embedding when they are on different
    ranks). `pp_rank=None`: the rank holding the most parameters."""
    ranks = pipeline_ranks(shape.n_layers, pp, virtual_stages, zbv)
    if pp_rank is None:
        return max((rank_params(shape, tp, r) for r in ranks), key=lambda p: p.total)
    return rank_params(shape, tp, ranks[pp_rank])


def rank_params(shape: GPTShape, tp: int, stages: RankStages) -> RankParams:
    """The parameters of the pipeline rank holding `stages` (see `params_per_rank`)."""
    h, t = shape.d_model, tp
    split, replicated = shape.block_vectors()
    block = (shape.block_matrices() + split) / t + replicated
    expert = shape.expert_block_params() / t  # experts split like the other matrices
    root = 0.0
    if stages.embedding:
        root += shape.vocab_size * h / t + shape.position_params
    if stages.head:
        root += shape.final_norm_params
        if not (shape.tie_embeddings and stages.embedding):  # the head is a matrix of its own
            root += shape.vocab_size * h / t
    return RankParams(stages.layers * block + root, block, root, expert)
