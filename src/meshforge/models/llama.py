"""A Llama-style decoder: RMSNorm, rotary position embeddings, a SwiGLU MLP,
grouped-query attention (`n_kv_heads`) and an output head of its own (tied only
when `tie_embeddings=True`, as Llama 3.2 1B/3B are). No biases, no dropout, no
position table. It takes its own arguments (`LlamaArgs`), never the job's config.

It follows the GPT's conventions (models/gpt.py), so that the same pipeline split,
checkpoints and layouts apply: `embed` (token embedding), `blocks` keyed by layer
index, `ln_f` and `head`, any of which a pipeline stage may drop; `init_weights`
gives each parameter its full-model value whatever slice this process holds.

Rotary embeddings use the "rotate half" arrangement of Hugging Face's
LlamaForCausalLM (the first half of each head's dimensions pairs with the second),
so an exported checkpoint loads there with no permutation of q and k. The angles
are computed in each attention call from the sequence length (a few thousand
multiply-adds beside the projections): nothing to materialise after a meta build,
nothing a pipeline stage must be handed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshforge.models.attention import Documents, attend
from meshforge.models.gpt import DecoderLM, SwiGLU
from meshforge.models.moe import MoE, MoEArgs


@dataclass(frozen=True)
class LlamaArgs:
    """The Llama-style model's hyper-parameters: `n_kv_heads` key/value heads (GQA;
    `n_heads` for none), a SwiGLU MLP `ffn_hidden` wide, the rotary base
    `rope_theta`, the RMSNorm epsilon `norm_eps`."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    seq_len: int
    ffn_hidden: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    head_dim: int | None = None  # per-head width; d_model // n_heads when None
    moe: MoEArgs | None = None  # a mixture-of-experts feed-forward after moe.dense_layers


def rotary(
    x: torch.Tensor, theta: float, dims: int, seq: int, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) in fp32: of shape (seq, dims) for positions 0..seq-1, or of shape
    (b, 1, seq, dims) for `positions` (b, seq) (positions inside documents)."""
    inv = 1.0 / theta ** (torch.arange(0, dims, 2, device=x.device, dtype=torch.float32) / dims)
    if positions is None:
        angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv)
    else:  # one row of angles per sequence, broadcast over the heads
        angles = (positions.to(torch.float32)[..., None] * inv).unsqueeze(1)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (b, heads, s, d) rotated: x*cos + rotate_half(x)*sin, in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))


class Attention(nn.Module):
    def __init__(self, cfg: LlamaArgs) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim or cfg.d_model // cfg.n_heads
        q, kv = cfg.n_heads * self.head_dim, cfg.n_kv_heads * self.head_dim
        self.q = nn.Linear(cfg.d_model, q, bias=False)
        self.k = nn.Linear(cfg.d_model, kv, bias=False)
        self.v = nn.Linear(cfg.d_model, kv, bias=False)
        self.proj = nn.Linear(q, cfg.d_model, bias=False)
        self.theta = cfg.rope_theta

    # what computes attention from q, k, v: a parallel layer may give an instance its
    # own (models/attention.py; context parallelism)
    attend = staticmethod(attend)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        # "-1": the heads this shard holds (a tensor-parallel rank has whole heads)
        q, k, v = (
            lin(x).view(b, s, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v)
        )
        positions = None if docs is None else docs.positions
        cos, sin = rotary(x, self.theta, self.head_dim, s, positions)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # grouped-query attention: attend repeats each key/value head for its query heads
        y = self.attend(q, k, v, docs)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaArgs, layer: int = 0) -> None:
        super().__init__()
        self.ln1 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ln2 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp: nn.Module
        if cfg.moe is not None and layer >= cfg.moe.dense_layers:
            self.mlp = MoE(cfg.d_model, cfg.moe)
        else:
            self.mlp = SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        # docs by keyword: a tensor-parallel plan prepares attn's positional input only
        x = x + self.attn(self.ln1(x), docs=docs)
        return x + self.mlp(self.ln2(x))


class TokenEmbedding(nn.Module):
    def __init__(self, cfg: LlamaArgs) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids -> vectors; `positions` are taken as the GPT's embeddings take them,
        and left to the rotary embedding in attention."""
        return self.tok(idx)


class Llama(DecoderLM):
    """Initialised as the GPT is (DecoderLM.init_weights): matrices N(0, 0.02), the
    two residual projections of each block N(0, 0.02/sqrt(2L)), RMSNorm weights 1."""

    def __init__(self, cfg: LlamaArgs) -> None:
        blocks = [LlamaBlock(cfg, i) for i in range(cfg.n_layers)]
        super().__init__(
            cfg, TokenEmbedding(cfg), blocks, nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        )
