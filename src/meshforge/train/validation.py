"""Validation loss: every `train.eval_every` steps and at the end of a run.

The mean loss over `eval_batches` batches of `global_batch` sequences: the same
sequences under every layout, so the value is comparable across them. Each rank
evaluates its dp slice, a micro-batch at a time (a pipeline step's worth under pp).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from meshforge.data.loader import val_batches

if TYPE_CHECKING:
    from meshforge.config import JobConfig
    from meshforge.train.engine import Engine


class Validation:
    def __init__(
        self, cfg: JobConfig, tokens: Any, engine: Engine, dp_rank: int | None, device: torch.device
    ) -> None:
        self.cfg, self.tokens, self.engine = cfg, tokens, engine
        self.dp_rank, self.device = dp_rank, device
        self.every = cfg.train.eval_every

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def final(self, rows: list[dict[str, Any]], stopped: bool) -> float | None:
        """The run's validation loss: the last logged step's when it was the last
        step, else measured now (not after a stop: the user asked to leave)."""
        steps = self.cfg.train.steps
        val = rows[-1].get("val_loss") if rows and rows[-1]["step"] == steps else None
        if val is None and self.every and not stopped:
            val = self.run()
        return val

    def run(self) -> float:
        """Collective: every rank calls it at the same step."""
        c, dims = self.cfg, self.engine.dims
        strategy, parts = self.engine.strategy, self.engine.parts
        batches = []  # a parameter server's: it only joins the reduction
        if self.engine.reads_data:
            batches = val_batches(
                self.tokens,
                c.model.seq_len,
                c.train.global_batch,
                c.train.eval_batches,
                self.dp_rank,
                dims.dp,
                c.train.seed,
            )
        chunk = c.train.micro_batch * (dims.microbatches if dims.pp_enabled else 1)
        parts.train(False)
        total = torch.zeros((), device=self.device)
        count = 0
        for x, y in batches:
            for i in range(0, x.shape[0], chunk):
                total += strategy.eval_loss(x[i : i + chunk], y[i : i + chunk])
                count += 1
        parts.train(True)
        return strategy.reduce_loss(total / max(count, 1)).item()
