"""A decoder-only GPT that fits on a screen: pre-LayerNorm blocks, causal attention
through scaled_dot_product_attention, a GELU MLP, and an output head tied to the
token embedding. It knows nothing about how it is parallelised."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.config import ModelConfig
from meshforge.plan.flops import GPTShape


def shape_of(cfg: ModelConfig) -> GPTShape:
    return GPTShape(
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        vocab_size=cfg.vocab_size,
        seq_len=cfg.seq_len,
        mlp_ratio=cfg.mlp_ratio,
    )


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)
        # (b, s, h) -> (b, heads, s, head_dim)
        q, k, v = (t.view(b, s, self.n_heads, h // self.n_heads).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, d_model: int, ratio: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, ratio * d_model)
        self.proj = nn.Linear(ratio * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads, cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg.d_model, cfg.mlp_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2L).
        for name, p in self.named_parameters():
            if p.dim() == 1:
                is_norm_weight = ".ln" in f".{name}" and name.endswith("weight")
                nn.init.ones_(p) if is_norm_weight else nn.init.zeros_(p)
            elif name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * self.cfg.n_layers))
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (b, s) -> logits (b, s, vocab)."""
        s = idx.shape[1]
        pos = torch.arange(s, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        # Output head tied to the token embedding.
        return F.linear(self.ln_f(x), self.tok_emb.weight)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))

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
