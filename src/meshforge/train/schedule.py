"""Learning-rate schedule: linear warm-up, then cosine decay to min_lr_ratio * lr over
the schedule's horizon; past the horizon, the value at its last step.

The horizon is fixed when a run starts (its first `train.steps`, kept in checkpoints:
train/optim.py), so a run extended past it trains on at the learning rate its schedule
ended with: the learning rate never jumps when `train.steps` grows. In a schedule that
decays that is (about) lr x min_lr_ratio; in one whose warm-up is as long as the
horizon (the cosine never runs) it is the peak the warm-up reached."""

from __future__ import annotations

import math


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based) of a
    schedule of `total` steps; every step past the end has the last step's value."""
    step = min(step, max(0, total - 1))  # past the horizon (an extended run): no jump
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
