"""A user's own model, as a job file names it (`model: {name: "user_models:tiny_lm"}`):
imported by the tests from this directory (the gloo pool's workers have it on their
path; CLI runs get it through PYTHONPATH)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class MixBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Token ids -> logits, with the stage layout a pipeline can cut (embed, blocks
    keyed by index, ln_f, head; forward skips what a stage does not hold)."""

    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleDict({str(i): MixBlock(width) for i in range(layers)})
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx) if self.embed is not None else idx
        for block in self.blocks.values():
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        return self.head(x) if self.head is not None else x


def tiny_lm(vocab: int = 256, width: int = 32, layers: int = 4) -> TinyLM:
    return TinyLM(vocab, width, layers)


def tp_plan(model, tp_mesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Megatron's MLP split of every block; the head stays whole (replicated logits)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if sequence_parallel or loss_parallel:
        raise ValueError("this plan keeps activations and logits replicated")
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def not_a_module(**kwargs):
    return {"weights": 1}


def flat_lm(vocab: int = 256, width: int = 16) -> nn.Module:
    """A model without the stage layout: no pipeline can cut it."""
    return nn.Sequential(nn.Embedding(vocab, width), nn.Linear(width, vocab))


def returns_a_tuple(**kwargs):
    class Pair(TinyLM):
        def forward(self, idx):
            return super().forward(idx), None

    return Pair(256, 16, 2)


def broken(**kwargs):
    raise RuntimeError("no GPU here")
