"""Learning-rate schedule: linear warm-up, then cosine decay to min_lr_ratio * lr."""

from __future__ import annotations

import math


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
