"""The load of a mixture-of-experts model's experts, as the run sees it.

Every training forward of a `MoE` layer (models/moe.py) counts the token assignments
its router made to each expert (before any capacity drop), the assignments dropped
and its auxiliary loss. `ExpertLoad` takes those counts after each step:

- under `load_balance: bias` it sums the step's counts over the data-parallel ranks
  (and the context-parallel ranks, each holding some of every sequence's tokens) and
  moves each layer's routing bias (DeepSeek-V3), the same update world 1 makes;
- every `log_every` steps it reduces the interval's counts over the world (each layer
  counted once per data-parallel rank: by tensor-parallel rank 0 of the stage that
  holds it; under context parallelism each cp rank counts its own tokens, and the
  auxiliary loss, the same on every cp rank, is averaged over the forwards of all)
  into the row's `moe` section of metrics.jsonl.

observe/expert_load.py reads those rows (report.json's `moe` section, a straggler's
cause).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from meshforge.layout import ParallelDims
from meshforge.models.moe import MoE
from meshforge.observe.expert_load import max_over_mean
from meshforge.parallel.parallelize import ModelParts


class ExpertLoad:
    def __init__(
        self, parts: ModelParts, dims: ParallelDims, mesh: Any, rank: int, n_layers: int
    ) -> None:
        self.dims, self.n_layers = dims, n_layers
        self.layers: dict[int, MoE] = {}
        for module in parts.modules:
            for name, m in module.named_modules():
                if isinstance(m, MoE):
                    self.layers[int(name.split(".")[1])] = m  # blocks.{i}.mlp
        first = next(iter(self.layers.values()), None)
        self.enabled = first is not None and mesh is not None
        self.experts = first.args.experts if first is not None else 0
        self.bias = first is not None and first.args.load_balance == "bias"
        self.counts_rank = dims.coords(rank)["tp"] == 0  # one copy of each tp group's counts
        # the ranks whose tokens make up the step's batch: dp, and each sequence's cp ranks
        replicas = "dp_cp" if dims.cp_enabled else "dp"
        many = dims.dp * dims.cp > 1
        self.dp_group = mesh[replicas].get_group() if self.enabled and many else None
        self._interval: dict[int, list[Any]] = {}

    def after_step(self) -> None:
        """Take this step's counts from every local layer; under bias balancing, move
        each layer's bias by the step's load over every data-parallel rank."""
        if not self.enabled:
            return
        taken = {i: m.take_stats() for i, m in self.layers.items()}
        for i, stats in taken.items():
            if stats is None:
                continue
            load, dropped, aux, forwards = stats
            acc = self._interval.get(i)
            if acc is None:
                self._interval[i] = [load.clone(), dropped.clone(), aux.clone(), forwards]
            else:
                acc[0] += load
                acc[1] += dropped
                acc[2] = acc[2] + aux
                acc[3] += forwards
            if self.bias:
                step_load = load.detach().float().clone()
                if self.dp_group is not None:
                    dist.all_reduce(step_load, group=self.dp_group)
                self.layers[i].update_bias(step_load)

    def interval(self, device: torch.device) -> dict[str, Any] | None:
        """Collective over the world: the `moe` section of the row ending this interval."""
        if not self.enabled:
            return None
        n, e = self.n_layers, self.experts
        table = torch.zeros((n, e + 3), dtype=torch.float64, device=device)
        if self.counts_rank:
            for i, (load, dropped, aux, forwards) in self._interval.items():
                table[i, :e] = load.double()
                table[i, e] = float(dropped)
                table[i, e + 1] = float(aux)
                table[i, e + 2] = forwards
        self._interval = {}
        dist.all_reduce(table)
        rows = table.cpu()
        layers = [i for i in range(n) if rows[i, e + 2] > 0]
        if not layers:
            return None
        tokens = [[int(v) for v in rows[i, :e].tolist()] for i in layers]
        assigned = sum(sum(t) for t in tokens)
        dropped = int(sum(rows[i, e] for i in layers))
        forwards = float(sum(rows[i, e + 2] for i in layers))
        balance = [max_over_mean(t) for t in tokens]
        out: dict[str, Any] = {
            "layers": layers,
            "tokens_per_expert": tokens,
            "load_max_over_mean": [round(b, 4) for b in balance],
            "max_load": round(max(balance), 4),
            "dropped": dropped,
            "dropped_fraction": dropped / assigned if assigned else 0.0,
        }
        first = next(iter(self.layers.values()), None)
        if first is None or first.args.load_balance == "aux_loss":
            out["aux_loss"] = float(sum(rows[i, e + 1] for i in layers)) / forwards
        return out
