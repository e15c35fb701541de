"""A decoder-only GPT that fits on a screen: pre-LayerNorm blocks, causal attention
through scaled_dot_product_attention, a GELU MLP, and an output head tied to the
token embedding (or its own, with `tie_embeddings=False`).

It takes its own arguments (`GPTArgs`), never the job's config: models/registry.py
translates a job's `model:` section into them.

It knows nothing about how it is parallelised, but is ready to be cut:
- q, k and v are separate projections, so a column-wise split gives each tensor-
  parallel rank whole heads; attention takes its head count from the shard.
- blocks live in a ModuleDict keyed by layer index, so a pipeline stage that holds
  layers 4-7 still names them `blocks.4` ... `blocks.7`.
- a stage may drop the embeddings (`embed = None`) or the head (`ln_f`, `head`);
  forward skips what is absent.
- `init_weights` gives every parameter the values it would have in the full model,
  whatever slice of it this process holds (see its docstring)."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.models.attention import Documents, attend


@dataclass(frozen=True)
class GPTArgs:
    """The GPT's hyper-parameters: the MLP is `mlp_ratio` x `d_model` wide; dropout
    applies to the embeddings and the attention weights; `tie_embeddings` shares the
    token embedding with the output head."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    mlp_ratio: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.head_dim = d_model // n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    # what computes attention from q, k, v: a parallel layer may give an instance its
    # own (models/attention.py; context parallelism)
    attend = staticmethod(attend)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        # (b, s, heads*head_dim) -> (b, heads, s, head_dim); "-1": the heads this shard holds
        q, k, v = (
            lin(x).view(b, s, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v)
        )
        p = self.dropout if self.training else 0.0
        y = self.attend(q, k, v, docs, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, d_model: int, ratio: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, ratio * d_model)
        self.proj = nn.Linear(ratio * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class SwiGLU(nn.Module):
    """The Llama family's MLP (and a mixture of experts' shared experts): proj(silu(gate
    x) * up x), no biases."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: GPTArgs) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads, cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg.d_model, cfg.mlp_ratio)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        # docs by keyword: a tensor-parallel plan prepares attn's positional input only
        x = x + self.attn(self.ln1(x), docs=docs)
        return x + self.mlp(self.ln2(x))


class Embeddings(nn.Module):
    """Token + learned position embeddings, then dropout; `positions` (b, s) when given
    (positions inside documents), else 0..s-1."""

    def __init__(self, cfg: GPTArgs) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device) if positions is None else positions
        return self.drop(self.tok(idx) + self.pos(pos))


class DecoderArgs(Protocol):
    """What DecoderLM reads of a model's own arguments (GPTArgs, LlamaArgs)."""

    vocab_size: int
    d_model: int
    n_layers: int
    seq_len: int
    tie_embeddings: bool


class DecoderLM(nn.Module):
    """What every decoder-only model here shares (the GPT and the Llama-style model):
    `embed`, `blocks` keyed by layer index, `ln_f` and `head`, any of which a pipeline
    stage may drop (forward skips what is absent); the tied head; per-parameter
    initialisation; sampling.

    `cfg` is the model's own arguments (GPTArgs, LlamaArgs; see DecoderArgs)."""

    def __init__(
        self, cfg: DecoderArgs, embed: nn.Module, blocks: list[nn.Module], ln_f: nn.Module
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed: nn.Module | None = embed
        self.blocks = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        self.ln_f: nn.Module | None = ln_f
        self.head: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tie_weights()
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights(seed=torch.initial_seed())

    def tie_weights(self) -> None:
        """Share the token embedding with the output head (when configured and both
        are on this module). Call again after anything that replaces parameters."""
        if self.cfg.tie_embeddings and self.embed is not None and self.head is not None:
            self.head.weight = self.embed.tok.weight

    def forward(self, idx: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        """Token ids (b, s) -> logits (b, s, vocab); a pipeline stage without the
        embeddings takes hidden states, one without the head returns them.

        `docs` (models/attention.py, from the ids by `documents_of`): the documents
        packed into each sequence; attention stays inside each one and positions
        restart at 0 in each. None: one causal sequence per row."""
        if docs is None:
            x = self.embed(idx) if self.embed is not None else idx
            for block in self.blocks.values():
                x = block(x)
        else:
            x = self.embed(idx, positions=docs.positions) if self.embed is not None else idx
            for block in self.blocks.values():
                x = block(x, docs=docs)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.head is not None:
            x = self.head(x)
        return x

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)),
        norm weights 1, biases 0.

        Each parameter draws from its own generator seeded by (seed, name), so its
        values do not depend on which other parameters this process holds or in which
        order they are visited: a tensor-parallel shard, an FSDP shard or a pipeline
        stage gets exactly the slice of the full model that world 1 would build."""
        for name, p in self.named_parameters():
            full = init_value(name, tuple(p.shape), self.cfg.n_layers, seed)
            copy_full_into(p, full)
        for m in self.modules():  # state that is not a parameter (a router's bias)
            if m is not self and hasattr(m, "reset_buffers"):
                m.reset_buffers()

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0
    ) -> torch.Tensor:
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.seq_len :])[:, -1, :].float()
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


class GPT(DecoderLM):
    def __init__(self, cfg: GPTArgs) -> None:
        blocks = [Block(cfg) for _ in range(cfg.n_layers)]
        super().__init__(cfg, Embeddings(cfg), blocks, nn.LayerNorm(cfg.d_model))


def init_value(name: str, shape: tuple[int, ...], n_layers: int, seed: int) -> torch.Tensor:
    """The full (unsharded) initial value of one parameter, on CPU in fp32."""
    if len(shape) == 1:
        is_norm_weight = ".ln" in f".{name}" and name.endswith("weight")
        return torch.ones(shape) if is_norm_weight else torch.zeros(shape)
    std = 0.02 / math.sqrt(2 * n_layers) if name.endswith("proj.weight") else 0.02
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.empty(shape).normal_(0.0, std, generator=g)


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the slice of `full` that `param` holds: all of it for a plain tensor, the
    local shard for a DTensor (tensor parallel, FSDP, or both)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # src_data_rank=None: every rank built the same `full`; take the local slice, no comm.
        local = distribute_tensor(
            full, param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)
