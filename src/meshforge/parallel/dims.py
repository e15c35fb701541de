"""The layout of a job: dp x tp x pp degrees, their validation, and the one N-D mesh.

`ParallelDims` is the only place that knows ranks and groups. Everything else
asks it: the data-parallel rank and size (which samples a rank reads), the tensor-
and pipeline-parallel sub-meshes, and the groups over which the loss, the gradient
norm and the metrics are reduced.

Rank order follows torchtitan and Megatron-LM: tensor parallel innermost (a TP
group is contiguous, so it stays inside a node when it fits), data parallel next,
pipeline stages outermost. The mesh is `("pp", "dp", "tp")`;
global rank = tp_rank + tp * (dp_rank + dp * pp_rank).

Under `parallel.mode: parameter_server` there is no mesh: the first `dp` ranks are
workers (data parallel replicas, global rank 0 among them) and the last `servers`
ranks hold the parameters and optimizer state (parallel/param_server.py).

Validation is plain Python (no torch import) so `meshforge train` refuses a bad
layout before any worker starts; each error names the fields involved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshforge.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from meshforge.config import JobConfig

MESH_DIMS = ("pp", "dp", "tp")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv")


def stages_per_rank(schedule: str, virtual_stages: int) -> int:
    """Pipeline stages each pipeline rank holds: v for interleaved, two for the V shape."""
    if schedule == "interleaved_1f1b":
        return virtual_stages
    if schedule == "zbv":
        return 2
    return 1


def min_microbatches(schedule: str, pp: int) -> int:
    """The fewest micro-batches per step torch.distributed.pipelining accepts: 1F1B
    needs one per stage; GPipe, interleaved 1F1B and ZB-V run with fewer, with a
    bigger bubble (ZB-V plans its warm-up for 2p-1 and idles the missing slots)."""
    return pp if schedule == "1f1b" else 1


def interleaved_accepts(microbatches: int, pp: int) -> bool:
    """torch's rule for interleaved 1F1B (ScheduleInterleaved1F1B): with
    rounds = max(1, m // pp), m must be a multiple of rounds. Every m < 2pp and every
    multiple of pp passes; at pp=4, m=9 does not."""
    rounds = max(1, microbatches // pp)
    return microbatches % rounds == 0


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    tp: int
    pp: int
    zero: int = 0
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int = 1  # per data-parallel rank per optimizer step
    # parallel.mode: parameter_server: the last `servers` ranks, after dp workers
    servers: int = 0
    ps_sync: bool = True
    max_staleness: int = 0

    # -- construction and validation ----------------------------------------------
    @classmethod
    def from_config(cls, cfg: JobConfig, world_size: int) -> ParallelDims:
        """The layout of `cfg` on `world_size` ranks; ConfigError naming the fields if
        it cannot train there."""
        p = cfg._parallel()
        if p.mode == "parameter_server":
            return cls._parameter_server(cfg, world_size)
        check_model_split(cfg)
        model_ranks = p.tp * p.pp
        if world_size % model_ranks:
            raise ConfigError(
                f"world size {world_size} is not divisible by parallel.tp={p.tp} x "
                f"parallel.pp={p.pp} = {model_ranks}"
            )
        dp = world_size // model_ranks
        if p.dp != "auto" and p.dp != dp:
            raise ConfigError(
                f"parallel.dp={p.dp} x parallel.tp={p.tp} x parallel.pp={p.pp} = "
                f"{p.dp * model_ranks} does not equal the world size {world_size}"
            )
        t = cfg.train
        if t.global_batch % (dp * t.micro_batch):
            raise ConfigError(
                f"train.global_batch={t.global_batch} is not divisible by "
                f"dp={dp} x train.micro_batch={t.micro_batch}"
            )
        m = t.global_batch // (dp * t.micro_batch)
        if p.pp > 1 and m < min_microbatches(p.pp_schedule, p.pp):
            raise ConfigError(
                f"parallel.pp_schedule={p.pp_schedule} with parallel.pp={p.pp} needs at least "
                f"{min_microbatches(p.pp_schedule, p.pp)} micro-batches per step; "
                f"train.global_batch / (dp x train.micro_batch) = {t.global_batch} / "
                f"({dp} x {t.micro_batch}) = {m}"
            )
        if p.pp > 1 and p.pp_schedule == "interleaved_1f1b" and not interleaved_accepts(m, p.pp):
            raise ConfigError(
                f"parallel.pp_schedule=interleaved_1f1b cannot run {m} micro-batches per step "
                f"at parallel.pp={p.pp}: make train.global_batch / (dp x train.micro_batch) "
                f"a multiple of {p.pp}"
            )
        return cls(
            dp=dp,
            tp=p.tp,
            pp=p.pp,
            zero=p.zero,
            sequence_parallel=p.sequence_parallel,
            pp_schedule=p.pp_schedule,
            virtual_stages=p.virtual_stages,
            microbatches=m,
        )

    @classmethod
    def _parameter_server(cls, cfg: JobConfig, world_size: int) -> ParallelDims:
        """Workers train full replicas (dp = workers, as data parallel); the last
        `parallel.ps.servers` ranks serve. check_comm has refused zero, tp, pp and comm."""
        from meshforge.config import ParameterServerConfig

        p = cfg._parallel()
        ps = p.ps or ParameterServerConfig()
        check_model_split(cfg)
        workers = world_size - ps.servers
        if workers < 1:
            raise ConfigError(
                f"parallel.ps.servers={ps.servers} leaves no worker in world size {world_size}"
            )
        if p.dp != "auto" and p.dp != workers:
            raise ConfigError(
                f"parallel.dp={p.dp} does not equal the workers of world size {world_size}: "
                f"{world_size} - parallel.ps.servers={ps.servers} = {workers}"
            )
        if cfg.precision.dtype == "fp16":
            raise ConfigError(
                "precision.dtype=fp16 with parallel.mode=parameter_server is not supported "
                "(its loss scaler would have to agree across workers); use bf16"
            )
        t = cfg.train
        if t.global_batch % (workers * t.micro_batch):
            raise ConfigError(
                f"train.global_batch={t.global_batch} is not divisible by "
                f"workers={workers} x train.micro_batch={t.micro_batch} "
                f"(world size {world_size} - parallel.ps.servers={ps.servers} workers)"
            )
        return cls(
            dp=workers,
            tp=1,
            pp=1,
            microbatches=t.global_batch // (workers * t.micro_batch),
            servers=ps.servers,
            ps_sync=ps.sync,
            max_staleness=ps.max_staleness,
        )

    # -- degrees --------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp + self.servers

    @property
    def parameter_server(self) -> bool:
        return self.servers > 0

    @property
    def compute_ranks(self) -> int:
        """Ranks that run the model: the world, or the workers of a parameter server."""
        return self.dp * self.tp * self.pp

    def is_server(self, rank: int) -> bool:
        return rank >= self.compute_ranks

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def n_stages(self) -> int:
        return self.pp * stages_per_rank(self.pp_schedule, self.virtual_stages)

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
            "dp": (rank // self.tp) % self.dp,
            "pp": rank // (self.tp * self.dp),
        }

    # -- the mesh ----------------------------------------------------------------------
    def build_mesh(self, device: torch.device) -> DeviceMesh:
        """One DeviceMesh over the world with named dimensions ("pp", "dp", "tp");
        a dimension of size 1 is kept so every layout names the same dimensions."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.parameter_server:
            raise ValueError("a parameter-server layout has no device mesh")

        return init_device_mesh(device.type, (self.pp, self.dp, self.tp), mesh_dim_names=MESH_DIMS)


def _check_factory_split(cfg: JobConfig) -> None:
    """A user's factory model: the layout rules that do not need its shape."""
    m, p = cfg.model, cfg._parallel()
    if p.mode == "parameter_server":
        raise ConfigError(
            f"parallel.mode=parameter_server initialises meshforge's gpt and llama only, "
            f"not model.name={m.name}"
        )
    if p.tp > 1 and m.tp_plan is None:
        raise ConfigError(
            f"parallel.tp={p.tp} with model.name={m.name}: name the model's tensor-parallel "
            "plan in model.tp_plan ('package.module:function')"
        )
    if p.tp == 1 and m.tp_plan is not None:
        raise ConfigError("model.tp_plan applies to parallel.tp > 1")
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1")
    if p.zero == 1 and (p.pp > 1 or p.tp > 1):
        raise ConfigError(
            f"parallel.zero=1 with parallel.tp={p.tp}, parallel.pp={p.pp} is not supported "
            "(torch's ZeroRedundancyOptimizer takes plain tensors only); use zero: 2 or 3"
        )
    if cfg.precision.dtype == "fp16" and (p.pp > 1 or p.tp > 1):
        raise ConfigError("precision.dtype=fp16 needs tp=1 and pp=1; use bf16")


def check_model_split(cfg: JobConfig) -> None:
    """The rules that depend only on the model and the layout's degrees."""
    m, p = cfg.model, cfg._parallel()
    if m.is_factory:
        _check_factory_split(cfg)
        return
    if m.n_heads % p.tp:
        raise ConfigError(f"parallel.tp={p.tp} does not divide model.n_heads={m.n_heads}")
    if m.kv_heads % p.tp:  # each rank holds whole key/value heads
        raise ConfigError(f"parallel.tp={p.tp} does not divide model.n_kv_heads={m.kv_heads}")
    # tp | n_heads | d_model, so tp also divides d_model and the GPT's MLP width
    if m.mlp_hidden % p.tp:
        raise ConfigError(f"parallel.tp={p.tp} does not divide the MLP width {m.mlp_hidden}")
    if m.vocab_size % p.tp:
        raise ConfigError(
            f"parallel.tp={p.tp} does not divide model.vocab_size={m.vocab_size} "
            "(the embedding and output head are split over the vocabulary)"
        )
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1")
    if p.sequence_parallel and m.seq_len % p.tp:
        raise ConfigError(
            f"parallel.sequence_parallel: parallel.tp={p.tp} does not divide "
            f"model.seq_len={m.seq_len}"
        )
    if p.virtual_stages > 1 and p.pp_schedule != "interleaved_1f1b":
        holds = "always holds 2 stages per rank" if p.pp_schedule == "zbv" else "holds 1"
        raise ConfigError(
            f"parallel.virtual_stages={p.virtual_stages} applies to "
            f"parallel.pp_schedule=interleaved_1f1b only ({p.pp_schedule} {holds})"
        )
    if p.pp > 1 and p.pp_schedule == "interleaved_1f1b" and p.virtual_stages < 2:
        raise ConfigError(
            "parallel.pp_schedule=interleaved_1f1b needs parallel.virtual_stages >= 2"
        )
    chunks = p.pp * stages_per_rank(p.pp_schedule, p.virtual_stages) if p.pp > 1 else 1
    if chunks > m.n_layers:  # uneven stages are fine (plan.stages.layer_split), empty ones not
        raise ConfigError(
            f"parallel.pp={p.pp} x {stages_per_rank(p.pp_schedule, p.virtual_stages)} "
            f"stage(s) per rank ({p.pp_schedule}) = {chunks} stages is more than "
            f"model.n_layers={m.n_layers}"
        )
    if p.pp > 1 and m.tie_embeddings:
        raise ConfigError(
            f"model.tie_embeddings=true shares the embedding with the output head, which "
            f"parallel.pp={p.pp} puts on different stages; set model.tie_embeddings: false"
        )
    if p.zero == 1 and (p.pp > 1 or p.tp > 1):
        raise ConfigError(
            f"parallel.zero=1 with parallel.tp={p.tp}, parallel.pp={p.pp} is not supported "
            "(torch's ZeroRedundancyOptimizer takes plain tensors only); use zero: 2 or 3"
        )
    if cfg.precision.dtype == "fp16" and (p.pp > 1 or p.tp > 1):
        raise ConfigError(
            f"precision.dtype=fp16 with parallel.tp={p.tp}, parallel.pp={p.pp} is not supported "
            "(torch's loss scalers take gradients on one mesh only); use bf16"
        )
    if cfg.train.compile and (p.pp > 1 or p.tp > 1):
        raise ConfigError("train.compile=true is supported with tp=1 and pp=1 only")
