"""Memory per GPU: model states, activations, buffers and a stated margin.

Two conventions for model states (params, grads, optimizer states):

* ``meshforge`` (default): what meshforge's own implementation holds *at rest,
  between steps* (after the optimizer step, before gradients are zeroed). Master
  parameters are always fp32; bf16/fp16 are autocast (DDP, ZeRO-1) or FSDP2
  ``MixedPrecisionPolicy(param_dtype=bf16|fp16, reduce_dtype=fp32)`` (ZeRO-2/3), so
  AdamW costs 4 + 4 + 8 bytes per parameter in every precision:

  ====== ============================================== =====================
  stage  implementation                                 params/grads/optimizer
  ====== ============================================== =====================
  0      DDP                                            4Ψ / 4Ψ / 8Ψ
  1      DDP + ZeroRedundancyOptimizer                  4Ψ / 4Ψ / 8Ψ/N_d
  2      FSDP2, reshard_after_forward=False             4Ψ/N_d each ... 8Ψ/N_d
  3      FSDP2 per block, reshard_after_forward=True    4Ψ/N_d each ... 8Ψ/N_d
  ====== ============================================== =====================

  Stages 2 and 3 differ only while a step runs (see ``working_bytes``).

* ``zero-paper``: exactly the ZeRO paper's accounting (Rajbhandari et al.,
  1910.02054, §V): 2 + 2 + K bytes with K = 12 for mixed-precision Adam, 4 + 4 + 8
  for fp32, so numbers compare with DeepSpeed's.
"""

from __future__ import annotations

from meshforge.errors import ConfigError
from meshforge.layout.stages import RankStages, pipeline_ranks
from meshforge.plan.core.flops import GPTShape

CONVENTIONS = ("meshforge", "zero-paper")
FRAGMENTATION_MARGIN = 0.10  # caching-allocator fragmentation, as a share of allocated bytes


def dtype_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def _optimizer_state_bytes(optimizer: str, mixed: bool, convention: str) -> int:
    """K: optimizer bytes per parameter. AdamW keeps two fp32 moments, SGD one momentum;
    the ZeRO paper also counts the fp32 master copy in K under mixed precision."""
    moments = 2 if optimizer == "adamw" else 1
    master = 4 if (mixed and convention == "zero-paper") else 0
    return 4 * moments + master


def model_state_bytes(
    params: float,
    zero: int,
    dp: int,
    precision: str = "fp32",
    convention: str = "meshforge",
    optimizer: str = "adamw",
) -> dict[str, float]:
    """Bytes of model states one rank holds, for `params` parameters on that rank
    (Ψ/(tp·pp) under model parallelism), sharded over `dp` data-parallel ranks.

    Returns {"params", "grads", "optimizer", "total"}. See the module docstring for
    the two conventions; ZeRO table (1910.02054 §V): DP (2+2+K)Ψ; ZeRO-1 4Ψ + KΨ/N_d;
    ZeRO-2 2Ψ + (2+K)Ψ/N_d; ZeRO-3 (2+2+K)Ψ/N_d."""
    if convention not in CONVENTIONS:
        raise ConfigError(
            f"--memory-convention must be one of {', '.join(CONVENTIONS)}, got {convention!r}"
        )
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"--zero must be one of 0, 1, 2, 3, got {zero}")
    if dp < 1:
        raise ConfigError(f"--dp must be >= 1, got {dp}")
    if params <= 0:
        raise ConfigError(f"--params must be > 0, got {params}")
    mixed = precision != "fp32"
    if convention == "zero-paper":
        p_bytes = g_bytes = dtype_bytes(precision)
        shard_params, shard_grads = zero >= 3, zero >= 2
    else:
        p_bytes = g_bytes = 4  # fp32 master params and fp32 grads in every precision
        shard_params = shard_grads = zero >= 2  # FSDP2 holds params and grads sharded at rest
    k = _optimizer_state_bytes(optimizer, mixed, convention)
    p = p_bytes * params / (dp if shard_params else 1)
    g = g_bytes * params / (dp if shard_grads else 1)
    o = k * params / (dp if zero >= 1 else 1)
    return {"params": p, "grads": g, "optimizer": o, "total": p + g + o}


def comm_buffer_bytes(
    params: float,
    zero: int,
    convention: str = "meshforge",
    gradient_as_bucket_view: bool = True,
) -> float:
    """Resident communication buffers beyond the model states (stages 0 and 1).

    meshforge builds DDP with gradient_as_bucket_view=True: the gradients *are* views
    into DDP's buckets, so the buckets cost nothing beyond the 4Ψ of gradients.
    Without it DDP keeps one more fp32 copy of the gradients (4Ψ). FSDP2 allocates
    per collective instead (working_bytes). The ZeRO paper counts no buffers."""
    if convention == "zero-paper" or zero >= 2 or gradient_as_bucket_view:
        return 0.0
    return 4.0 * params


def working_bytes(
    params: float,
    zero: int,
    precision: str,
    block_params: float = 0.0,
    root_params: float = 0.0,
    microbatches: int = 1,
) -> float:
    """Transient copies of parameters and gradients that exist only while a step runs.

    * stages 0/1 with bf16/fp16: autocast's low-precision copy of each weight, saved
      for backward: 2Ψ.
    * stage 2: the whole model's unsharded params in param_dtype (kept from the first
      forward to the last backward of the step), plus one block's unsharded grads and
      their fp32 reduce-scatter input.
    * stage 3: two blocks unsharded (the current one and the prefetched next one),
      the root module (embeddings, final norm) unsharded, and one block's grads.
    * stages 2/3 with gradient accumulation (m > 1): meshforge turns gradient sync
      off until the last micro-batch, so FSDP2 accumulates the unsharded gradients
      of the whole model, in fp32: 4Ψ more.
    `block_params`/`root_params` are per rank (after tensor/pipeline sharding); with
    a bare parameter count they are unknown and count as 0."""
    pb = dtype_bytes(precision)
    if zero <= 1:
        return 2.0 * params if precision != "fp32" else 0.0
    grad_staging = block_params * (pb + (4 if pb != 4 else 0))
    accumulated = 4.0 * params if microbatches > 1 else 0.0
    if zero == 2:
        return pb * params + grad_staging + accumulated
    return pb * (2.0 * block_params + root_params) + grad_staging + accumulated


# -- activations (Korthikanti et al., 2205.05198, §4) --------------------------


def activation_bytes_per_layer(
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    sdpa: bool = False,
    mlp_ratio: int = 4,
    kv_seq: int | None = None,
) -> float:
    """Activation bytes one transformer layer keeps for backward, 16-bit activations.

    no parallelism            s·b·h·(34 + 5·a·s/h)
    tensor parallel           s·b·h·(10 + 24/t + 5·a·s/(h·t))
    tensor + sequence par.    s·b·h/t·(34 + 5·a·s/h)
    TP + selective recompute  s·b·h·(10 + 24/t)
    TP + SP + selective       34·s·b·h/t
    full recompute            2·s·b·h (the layer input; /t with SP)

    For MLP ratio r the 24 is 8 + 4r and the 34 is 18 + 4r (the MLP keeps its input,
    GELU input and output, and a dropout mask). sdpa drops the 5·a·s/h term
    (softmax, its dropout mask and output are never materialised).

    `kv_seq`: the keys a query attends over, where it differs from `seq` (context
    parallelism: seq is a rank's s/cp tokens, kv_seq all s; the eager scores are
    (s/cp) x s per head)."""
    s, b, h, a, t = seq, micro_batch, hidden, heads, tp
    keys = s if kv_seq is None else kv_seq
    if recompute not in ("none", "selective", "full"):
        raise ConfigError(f"--recompute must be none, selective or full, got {recompute!r}")
    sbh = s * b * h
    if recompute == "full":
        return 2.0 * sbh / (t if sequence_parallel else 1)
    sharded = 8 + 4 * mlp_ratio  # 24 at r = 4
    scores = 0.0 if (sdpa or recompute == "selective") else 5.0 * a * keys / h
    if sequence_parallel:
        return sbh / t * (10 + sharded + scores)
    return sbh * (10 + sharded / t + scores / t)


def layers_in_flight(
    n_layers: int, pp: int, virtual_stages: int, schedule: str, m: int, pp_rank: int = 0
) -> float:
    """Layer-micro-batches of activations pipeline rank `pp_rank` holds at peak, with
    its real share of the layers (stages.pipeline_ranks: L_r, uneven splits differ by
    one layer per stage). See `_rank_layers_in_flight`."""
    ranks = pipeline_ranks(n_layers, pp, virtual_stages if schedule != "gpipe" else 1)
    return _rank_layers_in_flight(ranks[pp_rank], pp, virtual_stages, schedule, m)


def _rank_layers_in_flight(
    stages: RankStages, pp: int, virtual_stages: int, schedule: str, m: int
) -> float:
    """No pipeline: one micro-batch of all layers (accumulation runs them in turn).
    GPipe: all m micro-batches of the rank's L_r layers. 1F1B: rank r runs min(p-r, m)
    forwards before its first backward, so rank 0 holds p micro-batches of L/p = L
    layers on an even split. Interleaved 1F1B: rank r runs min(2(p-r-1) + (v-1)·p + 1,
    m·v) chunk forwards before its first backward (Megatron-LM's warm-up), each of
    L_r/v layers on average; rank 0 on an even split holds L·(1 + (p-1)/(p·v))
    (Korthikanti §4.2.3)."""
    layers, r = stages.layers, stages.pp_rank
    if pp == 1:
        return float(layers)
    if schedule == "gpipe":
        return float(layers * m)
    if virtual_stages > 1:
        v = virtual_stages
        chunks = min(2 * (pp - r - 1) + (v - 1) * pp + 1, m * v)
        return chunks * layers / v
    return float(min(pp - r, m) * layers)


def logits_bytes(seq: int, micro_batch: int, vocab: int, tp: int, precision: str) -> float:
    """Logits in the compute dtype plus the fp32 log-softmax the loss keeps: b·s·V/t each."""
    return seq * micro_batch * vocab / tp * (dtype_bytes(precision) + 4)


def activation_memory_bytes(
    shape: GPTShape,
    micro_batch: int,
    tp: int,
    pp: int,
    virtual_stages: int,
    sequence_parallel: bool,
    recompute: str,
    precision: str,
    sdpa: bool,
    microbatches: int,
    schedule: str = "1f1b",
    pp_rank: int | None = None,
    cp: int = 1,
    cp_method: str = "allgather",
) -> float:
    """Peak activation bytes on pipeline rank `pp_rank`; None: the rank holding the
    most (on an even split the first, or the last when its logits outweigh the first
    stage's extra micro-batches; on an uneven one it can be an interior rank, which
    holds one layer more). See `rank_activation_bytes`."""
    ranks = pipeline_ranks(shape.n_layers, pp, virtual_stages if schedule != "gpipe" else 1)
    args = (micro_batch, tp, pp, virtual_stages, sequence_parallel, recompute, precision, sdpa,
            microbatches, schedule, cp, cp_method)  # fmt: skip
    if pp_rank is not None:
        return rank_activation_bytes(shape, ranks[pp_rank], *args)
    return max(rank_activation_bytes(shape, stages, *args) for stages in ranks)


def activation_mlp_ratio(shape: GPTShape) -> float:
    """r of `activation_bytes_per_layer` (mean over the layers): the feed-forward width a
    token passes through over h; a MoE layer's (K + S)·F/h, plus K for the two 16-bit
    copies of the token's K dispatched vectors (the experts' input, permuted, and their
    output before the weighted sum: 4·K bytes per s·b·h, as 4r counts)."""
    h = shape.d_model
    return (shape.active_mlp_width + shape.moe_share * shape.top_k * h) / h


def rank_activation_bytes(
    shape: GPTShape,
    stages: RankStages,
    micro_batch: int,
    tp: int,
    pp: int,
    virtual_stages: int,
    sequence_parallel: bool,
    recompute: str,
    precision: str,
    sdpa: bool,
    microbatches: int,
    schedule: str = "1f1b",
    cp: int = 1,
    cp_method: str = "allgather",
) -> float:
    """Peak activation bytes on the pipeline rank holding `stages`.

    Korthikanti's byte counts assume 16-bit activations; fp32 doubles them. With full
    recomputation one layer's complete activations also live during its backward. The
    rank with the last stage adds the logits.

    Context parallelism (cp > 1): a rank holds s/cp tokens of each sequence, so every
    term per token (and the logits) divides by cp; eager attention's scores are
    (s/cp) x s. With the all-gather method one layer's gathered K and V of the whole
    sequence, 2·b·s·kv/t·e, also live while it runs (ring and all-to-all hold blocks of
    s/cp tokens only, not counted)."""
    scale = dtype_bytes(precision) / 2
    kw = dict(tp=tp, sequence_parallel=sequence_parallel, sdpa=sdpa,
              mlp_ratio=activation_mlp_ratio(shape))  # fmt: skip
    s, b, h, a = shape.seq_len // cp, micro_batch, shape.d_model, shape.n_heads
    kw["kv_seq"] = shape.seq_len
    per_layer = activation_bytes_per_layer(s, b, h, a, recompute=recompute, **kw)
    live_layer = 0.0
    if recompute == "full":
        live_layer = activation_bytes_per_layer(s, b, h, a, recompute="none", **kw)
    if cp > 1 and cp_method == "allgather":
        live_layer += 2.0 * 2 * b * shape.seq_len * shape.kv_width / tp  # 16-bit K and V
    layers = _rank_layers_in_flight(stages, pp, virtual_stages, schedule, microbatches)
    logits = logits_bytes(s, b, shape.vocab_size, tp, precision) if stages.head else 0.0
    return scale * (layers * per_layer + live_layer) + logits
