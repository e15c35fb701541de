"""The engine of a run, assembled in one place: layout -> mesh -> model parts ->
optimizers -> step strategy; under parallel.mode: parameter_server, a worker's
replica or a server's shard instead (train/ps_step.py). The trainer (and a test)
builds one and asks it for steps; nothing else wires these pieces together."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from meshforge.config import JobConfig
from meshforge.layout import ParallelDims
from meshforge.parallel.mesh import build_mesh, gradient_mesh
from meshforge.parallel.parallelize import ModelParts, build_model_parts, param_digest
from meshforge.train.optim import Optimizers
from meshforge.train.ps_step import build_parameter_server
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
        dims = cfg.dims(world_size, device.type)
        if dims.parameter_server:
            return ParameterServerEngine.build_ps(cfg, dims, rank, device)
        mesh = build_mesh(dims, device)
        parts = build_model_parts(cfg, dims, mesh, device)
        optimizers = Optimizers(cfg, parts, gradient_mesh(mesh, dims), device)
        strategy = make_step(cfg, dims, mesh, parts, optimizers, device)
        return cls(cfg, dims, mesh, parts, optimizers, strategy, rank)

    @property
    def dp_rank(self) -> int | None:
        return self.mesh["dp"].get_local_rank()

    @property
    def reads_data(self) -> bool:
        """Whether this rank trains on data (a parameter server does not)."""
        return True

    def param_digest(self) -> str:
        """sha256 of the full parameters in name order, on global rank 0 ("" elsewhere).
        Collective."""
        coords = self.dims.coords(self.rank)
        holder = coords["dp"] == 0 and coords["cp"] == 0 and coords["tp"] == 0
        return param_digest(self.parts, holder=holder)


@dataclass
class ParameterServerEngine(Engine):
    """parallel.mode: parameter_server (train/ps_step.py): no mesh; a worker holds a
    replica, a server a shard of the parameters and of the optimizer state."""

    @classmethod
    def build_ps(
        cls, cfg: JobConfig, dims: ParallelDims, rank: int, device: torch.device
    ) -> ParameterServerEngine:
        parts, optimizers, strategy, _ = build_parameter_server(cfg, dims, rank, device)
        return cls(cfg, dims, None, parts, optimizers, strategy, rank)  # type: ignore[arg-type]

    @property
    def dp_rank(self) -> int | None:
        """A worker's index, which says what it reads; None on a server."""
        return None if self.dims.is_server(self.rank) else self.rank

    @property
    def reads_data(self) -> bool:
        return not self.dims.is_server(self.rank)

    def param_digest(self) -> str:
        """Over the servers' parameters: under asynchronous training a worker's replica
        may be older than what the servers hold."""
        return param_digest(self.parts, holder=self.dims.is_server(self.rank))
