"""Learning-rate schedule: linear warm-up, then cosine decay to min_lr_ratio * lr over
the schedule's horizon, then min_lr_ratio * lr for every step past it.

The horizon is fixed when a run starts (its first `train.steps`, kept in checkpoints:
train/optim.py), so a run extended past it trains on at the final learning rate: the
learning rate never jumps back up when `train.steps` grows."""

from __future__ import annotations

import math


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based) of a
    schedule of `total` steps."""
    if step >= total:  # past the horizon (an extended run): the schedule's final value
        return min_ratio
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
