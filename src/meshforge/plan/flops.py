"""Parameter counts and training FLOPs of meshforge's GPT (pure Python, no torch).

The GPT is the one in `meshforge.models.gpt`: learned token and position
embeddings, pre-LayerNorm blocks (QKV and output projections with bias, a GELU
MLP of width mlp_ratio*h with bias), a final LayerNorm, and an output head tied
to the token embedding.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPTShape:
    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    seq_len: int
    mlp_ratio: int = 4


@dataclass(frozen=True)
class ParamCount:
    total: int
    embedding: int  # token + position embeddings (the head is tied, so not counted twice)
    non_embedding: int


def gpt_param_count(shape: GPTShape) -> ParamCount:
    h, L, r = shape.d_model, shape.n_layers, shape.mlp_ratio
    attn = h * 3 * h + 3 * h + h * h + h  # qkv + out projection, with biases
    mlp = h * r * h + r * h + r * h * h + h  # fc + proj, with biases
    norms = 2 * (2 * h)  # two LayerNorms per block (weight + bias)
    per_block = attn + mlp + norms
    embedding = shape.vocab_size * h + shape.seq_len * h
    non_embedding = L * per_block + 2 * h  # + final LayerNorm
    return ParamCount(embedding + non_embedding, embedding, non_embedding)


def training_flops_per_token(shape: GPTShape) -> float:
    """6·Ψ_nonembedding + 6·l·s·h (REFERENCES.md, the PaLM/torchtitan MFU convention).

    The 6·l·s·h term counts causal attention scores and their weighted sum
    (forward + backward, half the s x s matrix)."""
    params = gpt_param_count(shape)
    return 6.0 * params.non_embedding + 6.0 * shape.n_layers * shape.seq_len * shape.d_model
