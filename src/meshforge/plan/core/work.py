"""The compute of one micro-batch on one rank: matmuls through the device's curve,
fused attention at its own rate, memory-bound kernels from the bytes they move.

Per transformer layer and per micro-batch of b sequences of s tokens (t the
tensor-parallel degree; h_n = h/t with sequence parallelism, else h: the width each
rank normalises and adds; f the MLP width; e the bytes of an activation, 2 in
bf16/fp16 and 4 in fp32):

  matmuls     2·b·s·(weight-matrix parameters of a block)/t forward, twice that
              backward, through t(W) = W/(f_max·peak) + t0 (efficiency.py)
  attention   eager: 4·b·s²·h/t forward (QK^T and AV, the full s x s, batched
              matmuls through the curve) plus the bytes of the s x s tensors below;
              sdpa (FlashAttention-2): the causal half, 2·b·s²·h/t forward and 2.5x that
              backward (Dao 2023, arXiv 2307.08691, §3: five matmuls backward against
              two forward), at the GPU's FlashAttention fraction of peak (efficiency.py)
  elementwise bytes per token below, ÷ (bandwidth_fraction × memory bandwidth)

Bytes per token and layer (each kernel reads its inputs and writes its outputs once;
backward reads the output gradient and what the forward saved and writes the input
gradient; Megatron's fused kernels: bias+GELU, bias+dropout+add, scale+mask+softmax):

  kernel                      forward                 backward
  2 norms (LN / RMSNorm)      2·2e·h_n                2·3e·h_n
  2 residual adds (+dropout)  2·(3e [+1 mask])·h_n    2·(3e [+1])·h_n
  GELU (gpt)                  2e·f/t                  3e·f/t
  SwiGLU (llama)              3e·f/t                  5e·f/t
  rotary on q, k (llama)      2e·(q + kv)/t           2e·(q + kv)/t
  MoE permute + unpermute     2e·(K+1)·h/t            2e·(K+1)·h/t
  eager s x s, per head·s²    4e [+2e+1 dropout]      6e [+3e+1 dropout]

With a mixture of experts f is the width a token passes through, (K + S)·F in a MoE
layer (a mean over the layers), and the matmuls are the active ones
(flops.GPTShape.active_block_matrices); the experts' grouped GEMMs run through the same
curve as the dense matmuls (the shipped curves have t0 = 0, so their smaller size costs
nothing more: an optimistic bound for many small experts).

Dropout (p = 0.1 in Megatron's GPT) is on for family gpt, off for llama (as the
Llama models train). The head of the last stage: final norm (2e | 3e)·h_n, logits and
cross-entropy (2e + 12 | e + 4)·V/t (16-bit logits written and read, an fp32 softmax
kept for the backward, its gradient written); the embedding of stage 0:
forward 2e·h (plus the position add for gpt, 3e·h), backward (e + 8)·h (a 16-bit
gradient read, fp32 rows accumulated). Recomputation repeats forward work inside the
backward: full, the whole layer forward; selective, the attention core (Korthikanti et
al. 2205.05198).

Context parallelism (cp > 1): a rank runs s/cp tokens of each sequence through every
matmul and memory-bound kernel; its queries attend over all s keys, and the head-tail
split (each rank a chunk from each end) gives every rank 1/cp of the causal work: the
attention core is 2·b·(s/cp)·s·q/t forward with sdpa (4·b·(s/cp)·s·q/t eager).

A measured profile's curve (scope "all") already holds the memory-bound kernels: it
times each layer's Megatron-convention hardware FLOPs (flops.py) through the curve.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshforge.plan.core.efficiency import matmul_unit_flops
from meshforge.plan.core.flops import GPTShape, microbatch_flops


@dataclass(frozen=True)
class PassSeconds:
    forward_s: float
    backward_s: float  # recomputation included

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class MicrobatchWork:
    """Seconds of one micro-batch on one rank, per piece of the model."""

    layer: PassSeconds  # one transformer layer
    embedding: PassSeconds  # the first stage's embedding lookup
    head: PassSeconds  # the last stage's final norm, logits and loss
    fraction_of_peak: float  # f(W) of the matmul curve at this size
    memory_bound_fraction: float  # share of a layer's time in memory-bound kernels
    # the attention core (QK^T, softmax, AV) of one layer, forward and backward (what ring
    # attention's K/V transfers hide under)
    attention: PassSeconds = PassSeconds(0.0, 0.0)


def _eager_s2_bytes(e: float, dropout: bool) -> tuple[float, float]:
    fwd = 4 * e + (2 * e + 1 if dropout else 0)
    bwd = 6 * e + (3 * e + 1 if dropout else 0)
    return fwd, bwd


def layer_bytes(
    shape: GPTShape,
    tp: int,
    sp: bool,
    e: float,
    micro_batch: int,
    sdpa: bool,
    kv_seq: int | None = None,
):
    """(forward, backward, attention-core forward) bytes one layer moves per
    micro-batch on one rank, outside its matmuls (table in the module docstring).
    `kv_seq`: the keys each query attends over (context parallelism: all s, where
    shape.seq_len is the rank's s/cp)."""
    h, f, t = shape.d_model, shape.active_mlp_width, tp
    h_n = h / t if sp else h
    dropout = shape.family == "gpt"
    mask = 1.0 if dropout else 0.0
    fwd = 2 * 2 * e * h_n + 2 * (3 * e + mask) * h_n
    bwd = 2 * 3 * e * h_n + 2 * (3 * e + mask) * h_n
    if shape.family == "gpt":
        fwd += 2 * e * f / t
        bwd += 3 * e * f / t
    else:
        rotary = 2 * e * (shape.q_width + shape.kv_width) / t
        fwd += 3 * e * f / t + rotary
        bwd += 5 * e * f / t + rotary
        # a MoE layer permutes each token's K copies to its experts and sums them back
        # (read h, write K·h; read K·h, write h), the same again backward
        permute = shape.moe_share * 2 * e * (shape.top_k + 1) * h / t
        fwd += permute
        bwd += permute
    tokens = micro_batch * shape.seq_len
    core = 0.0
    if not sdpa:
        keys = shape.seq_len if kv_seq is None else kv_seq
        s2 = micro_batch * (shape.n_heads / t) * shape.seq_len * keys
        core_f, core_b = _eager_s2_bytes(e, dropout)
        core = s2 * core_f
        fwd, bwd = fwd * tokens + core, bwd * tokens + s2 * core_b
        return fwd, bwd, core
    return fwd * tokens, bwd * tokens, core


def microbatch_work(
    shape: GPTShape,
    tp: int,
    sequence_parallel: bool,
    micro_batch: int,
    precision: str,
    recompute: str,
    sdpa: bool,
    device,
    cp: int = 1,
) -> MicrobatchWork:
    """Seconds of one micro-batch, per layer / embedding / head, on one rank of `device`
    (a hardware.DeviceSpec); `cp`: the context-parallel degree (module docstring)."""
    full_seq = shape.seq_len
    if cp > 1:
        shape = replace(shape, seq_len=full_seq // cp)  # the rank's tokens
    b, s, h, t = micro_batch, shape.seq_len, shape.d_model, tp
    peak, curve = device.peak(precision), device.curve
    unit = matmul_unit_flops(b, s, h, shape.active_mlp_width / h, t)
    frac = curve.fraction(unit, peak)
    flops = microbatch_flops(shape, b)
    if cp > 1:  # queries of s/cp tokens against all s keys: the core x cp
        core_all = flops.attention_core_forward * cp
        flops = replace(flops, attention_core_forward=core_all,
                        layer_forward=flops.layer_forward + core_all * (cp - 1) / cp)  # fmt: skip
    if curve.scope == "all":  # a measured machine: Megatron-convention FLOPs over the curve
        rate = peak * frac
        core = 3.0 * flops.attention_core_forward if recompute == "selective" else 0.0
        extra = flops.layer_forward if recompute == "full" else core
        layer = PassSeconds(flops.layer_forward / t / rate,
                            (2 * flops.layer_forward + extra) / t / rate)  # fmt: skip
        head = PassSeconds(flops.logits_forward / t / rate, 2 * flops.logits_forward / t / rate)
        core_s = flops.attention_core_forward / t / rate
        return MicrobatchWork(layer, PassSeconds(0.0, 0.0), head, frac, 0.0,
                              PassSeconds(core_s, 2 * core_s))  # fmt: skip

    e = 2.0 if precision in ("bf16", "fp16") else 4.0
    bw = curve.bandwidth_fraction * device.memory_bandwidth_bytes_per_s
    mm_rate = peak * frac
    mm_fwd = 2.0 * b * s * shape.active_block_matrices() / t / mm_rate  # experts: active
    fwd_b, bwd_b, core_b = layer_bytes(shape, t, sequence_parallel, e, b, sdpa, full_seq)
    if sdpa:
        attn_rate = curve.attention_fraction * peak
        # the causal half of 4·b·s²·h (with cp: of 4·b·(s/cp)·s·h, balanced by head-tail)
        core_fwd = 2.0 * b * s * full_seq * shape.q_width / t / attn_rate
        core_bwd = 2.5 * core_fwd
    else:
        core_fwd = flops.attention_core_forward / t / mm_rate + core_b / bw
        core_bwd = 2.0 * flops.attention_core_forward / t / mm_rate
    fwd = mm_fwd + core_fwd + (fwd_b - core_b) / bw
    bwd = 2 * mm_fwd + core_bwd + bwd_b / bw  # bwd_b holds the s x s bytes when eager
    if recompute == "full":
        bwd += fwd
    elif recompute == "selective":
        bwd += core_fwd
    memory_s = (fwd_b + bwd_b) / bw

    h_n = h / t if sequence_parallel else h
    v_t = shape.vocab_size / t
    tokens = b * s
    logits = flops.logits_forward / t / mm_rate
    head = PassSeconds(
        logits + tokens * (2 * e * h_n + (2 * e + 12) * v_t) / bw,
        2 * logits + tokens * (3 * e * h_n + (e + 4) * v_t) / bw,
    )
    position = 3 * e * h if shape.family == "gpt" else 0.0
    embedding = PassSeconds(tokens * (2 * e * h + position) / bw, tokens * (e + 8) * h / bw)
    layer = PassSeconds(fwd, bwd)
    return MicrobatchWork(layer, embedding, head, frac, memory_s / (fwd + bwd),
                          PassSeconds(core_fwd, core_bwd))  # fmt: skip
