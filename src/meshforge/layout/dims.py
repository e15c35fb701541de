"""`ParallelDims`: a checked layout, the only place that knows ranks and groups.

Everything else asks it: the data-parallel rank and size (which samples a rank reads),
the tensor- and pipeline-parallel degrees, and the pipeline's schedule and
micro-batches. It is built by `layout.rules.derive`, which refuses a layout that
cannot train; parallel/mesh.py builds the DeviceMesh from it.

Rank order follows torchtitan and Megatron-LM: tensor parallel innermost (a TP
group is contiguous, so it stays inside a node when it fits), data parallel next,
pipeline stages outermost. The mesh is `("pp", "dp", "tp")`;
global rank = tp_rank + tp * (dp_rank + dp * pp_rank).

Expert parallelism borrows its ranks from data parallelism (as torchtitan does): the
dp dimension is cut into ("edp", "ep"), ep innermost, so an expert group is `ep`
consecutive data-parallel ranks; `edp` = dp / ep ranks hold the same experts.
dp_rank = edp_rank * ep + ep_rank.

Context parallelism (`cp` > 1) is a dimension of its own between data and tensor
parallelism: the mesh is `("pp", "dp", "cp", "tp")` (`("pp", "edp", "ep", "cp", "tp")`
with experts) and global rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)).
The cp ranks of one dp rank read the same sequences and each keeps 1/cp of every one
(parallel/context_parallel.py); they hold the same weights, so gradients are reduced
(and ZeRO shards) over the flattened `"dp_cp"` dimension (torchtitan's dp_shard_cp).
With cp = 1 the mesh is exactly the one above, without "cp".

Under `parallel.mode: parameter_server` there is no mesh: the first `dp` ranks are
workers (data parallel replicas, global rank 0 among them) and the last `servers`
ranks hold the parameters and optimizer state (parallel/param_server.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshforge.layout.schedule import stages_per_rank

MESH_DIMS = ("pp", "dp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    tp: int
    pp: int
    ep: int = 1  # expert parallel: a divisor of dp (its ranks are data-parallel ranks)
    cp: int = 1  # context parallel: each rank holds 1/cp of every sequence
    cp_method: str = "allgather"  # how attention sees the other ranks' keys and values
    zero: int = 0
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int = 1  # per data-parallel rank per optimizer step
    # parallel.mode: parameter_server: the last `servers` ranks, after dp workers
    servers: int = 0
    ps_sync: bool = True
    max_staleness: int = 0

    # -- degrees --------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp + self.servers

    @property
    def parameter_server(self) -> bool:
        return self.servers > 0

    @property
    def compute_ranks(self) -> int:
        """Ranks that run the model: the world, or the workers of a parameter server."""
        return self.dp * self.cp * self.tp * self.pp

    def is_server(self, rank: int) -> bool:
        return rank >= self.compute_ranks

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def edp(self) -> int:
        """Data-parallel ranks that hold the same experts (dp / ep)."""
        return self.dp // self.ep

    @property
    def n_stages(self) -> int:
        return self.pp * stages_per_rank(self.pp_schedule, self.virtual_stages)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The sizes of the mesh's dimensions, in MESH_DIMS order (without cp)."""
        return (self.pp, self.dp, self.tp)

    def mesh_layout(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """The names and sizes of the mesh that parallel/mesh.py builds before
        flattening: ep cuts dp into ("edp", "ep"), cp > 1 adds "cp" inside dp."""
        names: tuple[str, ...] = ("pp", "edp", "ep") if self.ep_enabled else ("pp", "dp")
        shape: tuple[int, ...] = (
            (self.pp, self.edp, self.ep) if self.ep_enabled else (self.pp, self.dp)
        )
        if self.cp_enabled:
            names, shape = names + ("cp",), shape + (self.cp,)
        return names + ("tp",), shape + (self.tp,)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dp": self.dp, "zero": self.zero, "tp": self.tp, "pp": self.pp}
        if self.parameter_server:
            out.update(
                mode="parameter_server",
                servers=self.servers,
                workers=self.dp,
                sync=self.ps_sync,
                max_staleness=self.max_staleness,
            )
        if self.ep_enabled:
            out["ep"] = self.ep
        if self.cp_enabled:
            out.update(cp=self.cp, cp_method=self.cp_method)
        if self.tp_enabled:
            out["sequence_parallel"] = self.sequence_parallel
        if self.pp_enabled:
            out["pp_schedule"] = self.pp_schedule
            out["virtual_stages"] = stages_per_rank(self.pp_schedule, self.virtual_stages)
        return out

    # -- ranks (pure: the same arithmetic the mesh uses) ------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """This rank's position on each mesh dimension."""
        return {
            "tp": rank % self.tp,
            "cp": (rank // self.tp) % self.cp,
            "dp": (rank // (self.tp * self.cp)) % self.dp,
            "pp": rank // (self.tp * self.cp * self.dp),
        }
