"""The engine of a run, assembled in one place: layout -> mesh -> model parts ->
optimizers -> step strategy. The trainer (and a test, or a later capability such
as a parameter server) builds one and asks it for steps; nothing else wires these
pieces together."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from meshforge.config import JobConfig
from meshforge.parallel.dims import ParallelDims
from meshforge.parallel.parallelize import ModelParts, build_gpt, param_digest
from meshforge.train.optim import Optimizers
from meshforge.train.step import StepStrategy, make_step


@dataclass
class Engine:
    cfg: JobConfig
    dims: ParallelDims
    mesh: DeviceMesh
    parts: ModelParts
    optimizers: Optimizers
    strategy: StepStrategy
    rank: int

    @classmethod
    def build(cls, cfg: JobConfig, rank: int, world_size: int, device: torch.device) -> Engine:
        """Collective: every rank builds its engine at the same time. The default
        process group must be initialised."""
        dims = cfg.dims(world_size)
        mesh = dims.build_mesh(device)
        parts = build_gpt(cfg, dims, mesh, device)
        optimizers = Optimizers(cfg, parts, mesh["dp"], device)
        strategy = make_step(cfg, dims, mesh, parts, optimizers, device)
        return cls(cfg, dims, mesh, parts, optimizers, strategy, rank)

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    def param_digest(self) -> str:
        """sha256 of the full parameters in name order, on global rank 0 ("" elsewhere).
        Collective."""
        coords = self.dims.coords(self.rank)
        return param_digest(self.parts, holder=coords["dp"] == 0 and coords["tp"] == 0)
