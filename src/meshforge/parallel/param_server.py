"""Parameter server: the sharding plan, the models each role holds, the staleness
rule, and the point-to-point protocol between workers and servers.

Ranks. The first `dp` ranks are workers (global rank 0, which writes the metrics and
the report, among them); the last `parallel.ps.servers` ranks are servers. A worker
holds a full replica of the model and reads the data a data-parallel rank of the same
index would read in collective mode. Server j holds the parameters the plan gives it,
under their full model names, and the AdamW state of exactly those: the optimizer state
a collective run saves, key for key, so checkpoints move between the modes.

Plan. Whole parameters, balanced by bytes: largest first (ties by name) to the server
holding the fewest bytes so far (ties to the lowest index). Every rank computes the
same plan from the model config; a tied output head goes with the embedding it shares.

Messages. One flat fp32 tensor (the parameters' dtype; bf16 is autocast) per
(worker, server) pair and direction: a header of two int64 (step, parameter version)
and one float (a gradient norm), then the shard's gradients (a push) or parameters (a
reply), in plan order. The step is the message tag, so a push of step s only ever
meets a receive for step s.

Versions and staleness. A server counts its parameter versions: one per update it
makes. Each reply carries the version it sends; the worker's next push carries that
version back, so the server knows the push's staleness: its current version minus the
version the gradient was computed on. Asynchronous servers drop a push staler than
`parallel.ps.max_staleness` (see `admits`); the worker still gets the current
parameters back and goes on. Versions and the drop decision are per server (per
shard): every push reaches every server, and each decides for its own parameters.

Receiving in arrival order. gloo has any-source receives (`dist.recv` without `src`),
but no way to poll a posted receive (a gloo receive completes only in `wait`); NCCL
has no any-source receive, but its work can be polled. The server's `Inbox` uses the
first on gloo and the second elsewhere; both yield a step's pushes as they arrive.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshforge.config import JobConfig
from meshforge.errors import ConfigError
from meshforge.layout import ParallelDims
from meshforge.models.gpt import init_value
from meshforge.models.registry import family_model
from meshforge.observe import comm_bytes
from meshforge.parallel.activation_checkpointing import apply_activation_checkpointing
from meshforge.parallel.parallelize import ModelParts

HEADER = 5  # floats: int64 step, int64 version (4 floats), one float norm
PULL_TAG = 2**30  # the parameters sent after a checkpoint loads (steps never get here)


# -- the plan --------------------------------------------------------------------------
def shard_by_bytes(sizes: dict[str, int], servers: int) -> list[list[str]]:
    """Parameter names per server: whole parameters, largest first (ties by name) to the
    server with the fewest bytes so far (ties to the lowest index); names sorted."""
    loads = [0] * servers
    owned: list[list[str]] = [[] for _ in range(servers)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        j = min(range(servers), key=lambda i: (loads[i], i))
        owned[j].append(name)
        loads[j] += sizes[name]
    return [sorted(names) for names in owned]


@dataclass(frozen=True)
class ShardPlan:
    """Which server owns which parameter, and where each sits in a message."""

    workers: int
    servers: int
    shapes: dict[str, tuple[int, ...]]  # canonical names (named_parameters) -> shape
    aliases: dict[str, str]  # another name of a shared parameter -> its canonical name
    owned: list[list[str]]  # per server, sorted

    @classmethod
    def for_model(cls, cfg: JobConfig, dims: ParallelDims) -> ShardPlan:
        with torch.device("meta"):
            model = family_model(cfg.model)
        canonical = {id(p): n for n, p in model.named_parameters()}
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        aliases = {
            n: canonical[id(p)]
            for n, p in model.named_parameters(remove_duplicate=False)
            if canonical[id(p)] != n
        }
        sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
        if dims.servers > len(sizes):
            raise ConfigError(
                f"parallel.ps.servers={dims.servers} is more than the model's "
                f"{len(sizes)} parameters (each server holds whole parameters)"
            )
        return cls(dims.dp, dims.servers, shapes, aliases, shard_by_bytes(sizes, dims.servers))

    def server_rank(self, j: int) -> int:
        return self.workers + j

    def numel(self, j: int) -> int:
        return sum(math.prod(self.shapes[n]) for n in self.owned[j])

    def aliases_of(self, j: int) -> dict[str, str]:
        mine = set(self.owned[j])
        return {a: n for a, n in self.aliases.items() if n in mine}


# -- what each role holds ----------------------------------------------------------------
class ParameterShard(nn.Module):
    """The parameters one server owns, under their full model names (nested modules
    named like the GPT's), so `state_dict` and `get_state_dict` key them exactly as a
    collective run does; a shared parameter is registered under each of its names."""

    def __init__(self, params: dict[str, torch.Tensor], aliases: dict[str, str]) -> None:
        super().__init__()
        for name, value in params.items():
            self._place(name, nn.Parameter(value))
        self.aliases = aliases
        self.tie_weights()

    def _place(self, name: str, param: nn.Parameter) -> None:
        *path, leaf = name.split(".")
        module: nn.Module = self
        for part in path:
            if not isinstance(getattr(module, part, None), nn.Module):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        setattr(module, leaf, param)

    def tie_weights(self) -> None:
        """Register each alias again (a loaded state dict may have split a shared pair)."""
        for alias, name in self.aliases.items():
            self._place(alias, self.get_parameter(name))


def build_worker_replica(cfg: JobConfig, device: torch.device) -> ModelParts:
    """A worker's full, unwrapped replica: the values world 1 would initialise."""
    t = cfg.train
    with torch.device("meta"):
        model = family_model(cfg.model)
    apply_activation_checkpointing(list(model.blocks.values()), t.activation_checkpointing)
    if t.compile:
        for block in model.blocks.values():
            block.compile()
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(t.seed)
    return ModelParts([model], [model], "none", cfg.precision.dtype)


def build_server_shard(cfg: JobConfig, plan: ShardPlan, j: int, device: torch.device) -> ModelParts:
    """Server j's parameters, initialised to the values a full model would have."""
    n_layers, seed = cfg.model.n_layers, cfg.train.seed
    params = {n: init_value(n, plan.shapes[n], n_layers, seed).to(device) for n in plan.owned[j]}
    shard = ParameterShard(params, plan.aliases_of(j))
    return ModelParts([shard], [shard], "none", cfg.precision.dtype)  # type: ignore[list-item]


def owned_params(parts: ModelParts, names: list[str]) -> list[nn.Parameter]:
    module = parts.modules[0]
    return [module.get_parameter(n) for n in names]


# -- the staleness rule and the servers' counters ------------------------------------------
def admits(staleness: int, max_staleness: int, sync: bool) -> bool:
    """Whether a push computed `staleness` versions ago is applied. Synchronous servers
    apply every push (it is never stale); asynchronous ones drop what is staler than
    max_staleness."""
    return sync or staleness <= max_staleness


@dataclass
class ServerCounters:
    """What one server did: pushes received, applied and dropped, the parameter
    versions it made, and the staleness of the pushes it applied."""

    pushes: int = 0
    applied: int = 0
    dropped: int = 0
    versions: int = 0
    max_staleness_applied: int = 0
    staleness: dict[int, int] = field(default_factory=dict)  # applied pushes by staleness

    def record(self, staleness: int, applied: bool) -> None:
        self.pushes += 1
        if not applied:
            self.dropped += 1
            return
        self.applied += 1
        self.max_staleness_applied = max(self.max_staleness_applied, staleness)
        self.staleness[staleness] = self.staleness.get(staleness, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "pushes": self.pushes,
            "applied": self.applied,
            "dropped": self.dropped,
            "versions": self.versions,
            "max_staleness_applied": self.max_staleness_applied,
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
        }


def summarise(per_server: list[dict[str, Any]], dims: ParallelDims) -> dict[str, Any]:
    """report.json's `parameter_server`: the settings, each server's counters, and their
    totals (a push reaches every server, so it counts once per server)."""
    hist: dict[str, int] = {}
    for c in per_server:
        for k, v in c["staleness"].items():
            hist[k] = hist.get(k, 0) + v
    return {
        "servers": dims.servers,
        "workers": dims.dp,
        "sync": dims.ps_sync,
        "max_staleness": dims.max_staleness,
        "pushes": sum(c["pushes"] for c in per_server),
        "applied": sum(c["applied"] for c in per_server),
        "dropped": sum(c["dropped"] for c in per_server),
        "max_staleness_applied": max((c["max_staleness_applied"] for c in per_server), default=0),
        "staleness": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
        "per_server": per_server,
    }


# -- messages ----------------------------------------------------------------------------
def new_message(numel: int, device: torch.device) -> torch.Tensor:
    return torch.empty(HEADER + numel, dtype=torch.float32, device=device)


def write_header(msg: torch.Tensor, step: int, version: int, norm: float = 0.0) -> None:
    msg[:4].view(torch.int64).copy_(torch.tensor([step, version], dtype=torch.int64))
    msg[4] = norm


def read_header(msg: torch.Tensor) -> tuple[int, int, float]:
    """(step, version, norm) of a message."""
    step, version = msg[:4].view(torch.int64).tolist()
    return step, version, float(msg[4])


def pack_grads(msg: torch.Tensor, params: list[nn.Parameter]) -> torch.Tensor:
    offset = HEADER
    for p in params:
        n = p.numel()
        if p.grad is None:
            msg[offset : offset + n].zero_()
        else:
            msg[offset : offset + n].copy_(p.grad.reshape(-1))
        offset += n
    return msg


def pack_params(msg: torch.Tensor, params: list[nn.Parameter]) -> torch.Tensor:
    offset = HEADER
    for p in params:
        n = p.numel()
        msg[offset : offset + n].copy_(p.detach().reshape(-1))
        offset += n
    return msg


def views(flat: torch.Tensor, params: list[nn.Parameter]) -> list[torch.Tensor]:
    """`flat` (a message's payload) cut into tensors shaped like `params`."""
    out, offset = [], 0
    for p in params:
        n = p.numel()
        out.append(flat[offset : offset + n].view_as(p))
        offset += n
    return out


@torch.no_grad()
def unpack_params(msg: torch.Tensor, params: list[nn.Parameter]) -> None:
    for p, value in zip(params, views(msg[HEADER:], params), strict=True):
        p.copy_(value)


# -- the two ends --------------------------------------------------------------------------
def exchange(
    sends: list[tuple[torch.Tensor, int]], receives: list[tuple[torch.Tensor, int]], tag: int
) -> None:
    """Post every send, then every receive (so a backend that serialises a rank's
    point-to-point operations still makes progress), and wait for all of them."""
    for m, _ in sends:
        comm_bytes.add("isend", m)
    works = [dist.isend(m, dst=r, tag=tag) for m, r in sends]
    works += [dist.irecv(m, src=r, tag=tag) for m, r in receives]
    for w in works:
        w.wait()


class Inbox:
    """A server's receiving end: the pushes of one step, in arrival order."""

    def __init__(self, workers: int, numel: int, device: torch.device) -> None:
        self.workers, self.numel, self.device = workers, numel, device
        self.any_source = dist.get_backend() == "gloo"

    def arrivals(self, step: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(worker rank, message) for each worker's push of `step`, as they arrive;
        no receive stays posted once every worker's push is in."""
        if self.any_source:
            for _ in range(self.workers):
                msg = new_message(self.numel, self.device)
                src = dist.recv(msg, tag=step)
                yield src, msg
            return
        pending = {}
        for w in range(self.workers):
            msg = new_message(self.numel, self.device)
            pending[w] = (dist.irecv(msg, src=w, tag=step), msg)
        idle_s = 0.0
        while pending:
            done = [w for w, (work, _) in pending.items() if work.is_completed()]
            if not done:
                idle_s = min(1e-3, idle_s * 2 or 1e-5)
                time.sleep(idle_s)
                continue
            idle_s = 0.0
            for w in done:
                work, msg = pending.pop(w)
                work.wait()
                yield w, msg
