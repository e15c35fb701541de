"""Parameter-server steps (parallel.mode: parameter_server), and the optimizer
container both roles hand to the Checkpointer.

  WorkerStep  forward+backward over the step's micro-batches on the worker's full
              replica (as AccumulatingStep, without gradient reduction); then push
              each server its shard of the gradient and take the shard's parameters
              from its reply.
  ServerStep  no data and no loss: take every worker's push of the step. Synchronous:
              average the W gradients, take the global gradient norm (squares summed
              over the servers), clip, one AdamW step at the step's learning rate,
              reply with the new parameters: DDP's update, computed where the state
              lives. Asynchronous: each push as it arrives, clipped by its own norm
              (the worker sends its full gradient's norm), applied unless staler than
              parallel.ps.max_staleness (dropped then), answered with the current
              parameters.

Every rank runs the trainer's loop, so the world-wide collectives between steps (loss,
straggler exchange, stop control, checkpoints, the report) meet as in collective mode.
A server's step ends when every worker's push of that step is in; the step number is
the message tag, so a worker already at the next step waits for its reply there.
The protocol and the plan are in parallel/param_server.py.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshforge.config import JobConfig
from meshforge.layout import ParallelDims
from meshforge.observe import comm_bytes
from meshforge.parallel.parallelize import ModelParts
from meshforge.parallel.param_server import (
    HEADER,
    PULL_TAG,
    Inbox,
    ServerCounters,
    ShardPlan,
    admits,
    build_server_shard,
    build_worker_replica,
    exchange,
    new_message,
    owned_params,
    pack_grads,
    pack_params,
    read_header,
    unpack_params,
    views,
    write_header,
)
from meshforge.train.optim import Optimizers
from meshforge.train.schedule import lr_factor
from meshforge.train.step import AccumulatingStep, Batch, StepResult, StepStrategy


class ParameterServerOptimizers:
    """The Optimizers interface of a parameter-server rank. A server wraps the stock
    `Optimizers` over its ParameterShard (so its state is the collective run's, key for
    key); a worker has no optimizer and saves nothing. Loading a checkpoint ends with
    every server sending its loaded parameters to every worker."""

    scaler = None  # fp16 is refused under a parameter server (ParallelDims)

    def __init__(
        self,
        cfg: JobConfig,
        parts: ModelParts,
        plan: ShardPlan,
        rank: int,
        device: torch.device,
    ) -> None:
        self.cfg, self.parts, self.plan, self.rank, self.device = cfg, parts, plan, rank, device
        self.server = rank - plan.workers if rank >= plan.workers else None
        self.inner = Optimizers(cfg, parts, None, device) if self.server is not None else None
        # per server: the version of its parameters this worker holds (the last reply's)
        self.seen = [0] * plan.servers
        self.version = 0  # a server's parameter versions so far
        self.lr_horizon = cfg.train.steps

    @property
    def lr_horizon(self) -> int:
        """The schedule's length (train/optim.py); a server's optimizer follows it."""
        return self._lr_horizon

    @lr_horizon.setter
    def lr_horizon(self, steps: int) -> None:
        self._lr_horizon = steps
        if self.inner is not None:
            self.inner.lr_horizon = steps

    def lr_at(self, step: int) -> float:
        t = self.cfg.train
        return t.lr * lr_factor(step, t.warmup, self.lr_horizon, t.min_lr_ratio)

    def set_lr(self, step: int) -> None:
        if self.inner is not None:
            self.inner.set_lr(step)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss  # no loss scaling: fp16 is refused

    def step(self) -> None:
        assert self.inner is not None
        self.inner.step()

    def zero_grad(self) -> None:
        for p in self.parts.parameters():
            p.grad = None

    def ensure_state(self) -> None:
        if self.inner is not None:
            self.inner.ensure_state()

    def state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """A server's parameters and AdamW state; nothing from a worker (its replica is
        a copy of the servers' parameters, possibly older under asynchronous training)."""
        if self.inner is None:
            return {}, {}
        return self.inner.state_dicts()

    def load_state_dicts(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        """Collective: servers load their shards, then every worker pulls them."""
        if self.inner is not None:
            self.inner.load_state_dicts(model_sd, optim_sd)
        self.pull()

    def state_bytes(self) -> list[torch.Tensor]:
        return self.inner.state_bytes() if self.inner is not None else []

    # -- parameters to the workers -------------------------------------------------------
    def owned(self, j: int) -> list[nn.Parameter]:
        return owned_params(self.parts, self.plan.owned[j])

    def pull(self) -> None:
        """Collective over workers and servers: each server sends its parameters (and
        their version) to every worker, which takes them into its replica."""
        plan = self.plan
        if self.server is not None:
            msg = new_message(plan.numel(self.server), self.device)
            pack_params(msg, self.owned(self.server))
            write_header(msg, -1, self.version)
            exchange([(msg, w) for w in range(plan.workers)], [], PULL_TAG)
            return
        msgs = [new_message(plan.numel(j), self.device) for j in range(plan.servers)]
        exchange([], [(m, plan.server_rank(j)) for j, m in enumerate(msgs)], PULL_TAG)
        for j, msg in enumerate(msgs):
            unpack_params(msg, self.owned(j))
            self.seen[j] = read_header(msg)[1]


class WorkerStep(AccumulatingStep):
    optimizers: ParameterServerOptimizers

    def step(self, step: int, micro_batches: Batch, measure: bool) -> StepResult:
        opt, plan = self.optimizers, self.optimizers.plan
        self._phase("forward_backward")
        result = self.forward_backward(micro_batches, measure)
        self._phase("optimizer")  # the servers' update, seen from here: push and pull
        t0 = time.perf_counter()
        norm = 0.0
        if not self.dims.ps_sync:  # asynchronous servers clip each push by its own norm
            grads = [p.grad for p in self.parts.parameters() if p.grad is not None]
            norm = float(torch.nn.utils.get_total_norm(grads, 2.0, foreach=True))
        pushes, replies = [], []
        for j in range(plan.servers):
            n, dst = plan.numel(j), plan.server_rank(j)
            msg = pack_grads(new_message(n, self.device), opt.owned(j))
            write_header(msg, step, opt.seen[j], norm)
            pushes.append((msg, dst))
            replies.append((new_message(n, self.device), dst))
        exchange(pushes, replies, tag=step)
        for j, (msg, _) in enumerate(replies):
            unpack_params(msg, opt.owned(j))
            _, opt.seen[j], server_norm = read_header(msg)
            if j == 0 and self.dims.ps_sync:
                norm = server_norm  # the averaged gradient's, computed by the servers
        result.grad_norm = torch.tensor(norm)
        if measure and result.micro_s:  # like DDP's: the synchronising micro-batch holds it
            self.sync()
            result.micro_s[-1] += time.perf_counter() - t0
        return result


class ServerStep(StepStrategy):
    optimizers: ParameterServerOptimizers

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        opt = self.optimizers
        assert opt.server is not None
        self.index = opt.server
        self.params = opt.owned(self.index)
        self.numel = opt.plan.numel(self.index)
        self.workers = opt.plan.workers
        self.counters = ServerCounters()
        self.inbox = Inbox(self.workers, self.numel, self.device)
        self.group: dist.ProcessGroup | None = None  # the servers', when there are several

    @property
    def computes_loss(self) -> bool:
        return False

    def step(self, step: int, micro_batches: Batch, measure: bool) -> StepResult:
        self.optimizers.set_lr(step)
        self._phase("optimizer")
        norm = self._sync_step(step) if self.dims.ps_sync else self._async_step(step)
        return StepResult(torch.zeros((), device=self.device), norm)

    def _update(self) -> None:
        self.optimizers.step()
        self.optimizers.zero_grad()
        self.optimizers.version += 1
        self.counters.versions += 1

    def _reply(self, step: int, norm: float) -> torch.Tensor:
        msg = pack_params(new_message(self.numel, self.device), self.params)
        write_header(msg, step, self.optimizers.version, norm)
        return msg

    def _sync_step(self, step: int) -> torch.Tensor:
        pushes = [new_message(self.numel, self.device) for _ in range(self.workers)]
        exchange([], list(zip(pushes, range(self.workers), strict=True)), tag=step)
        total = pushes[0][HEADER:].clone()
        for msg in pushes[1:]:  # in worker order: the same sum every time
            total += msg[HEADER:]
        total /= self.workers
        for msg in pushes:
            self.counters.record(self.optimizers.version - read_header(msg)[1], applied=True)
        for p, g in zip(self.params, views(total, self.params), strict=True):
            p.grad = g
        norm = self._global_norm_and_clip()
        self._update()
        reply = self._reply(step, float(norm))
        exchange([(reply, w) for w in range(self.workers)], [], tag=step)
        return norm

    def _global_norm_and_clip(self) -> torch.Tensor:
        """grad_norm_and_clip over the servers: each holds whole parameters, so the
        squared norms add up."""
        sq = torch.zeros((), device=self.device)
        if self.params:
            grads = [p.grad for p in self.params]
            sq = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True).float() ** 2
        if self.group is not None:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=self.group)
        total = sq.sqrt()
        clip = self.cfg.train.grad_clip
        if clip > 0 and self.params:
            torch.nn.utils.clip_grads_with_norm_(self.params, clip, total, foreach=True)
        return total

    def _async_step(self, step: int) -> None:
        clip, sent = self.cfg.train.grad_clip, []
        for worker, msg in self.inbox.arrivals(step):
            _, seen, push_norm = read_header(msg)
            staleness = self.optimizers.version - seen
            applied = admits(staleness, self.dims.max_staleness, sync=False)
            self.counters.record(staleness, applied)
            if applied:
                coef = min(1.0, clip / (push_norm + 1e-6)) if clip > 0 else 1.0
                for p, g in zip(self.params, views(msg[HEADER:], self.params), strict=True):
                    p.grad = g.mul_(coef) if coef < 1.0 else g
                self._update()
            reply = self._reply(step, push_norm)
            comm_bytes.add("isend", reply)
            sent.append(dist.isend(reply, dst=worker, tag=step))
        for work in sent:
            work.wait()

    def forward_backward(self, micro_batches: Batch, measure: bool) -> StepResult:
        raise RuntimeError("a parameter server runs no forward or backward")

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.zeros((), device=self.device)

    def server_counters(self) -> dict[str, Any] | None:
        return self.counters.as_dict()


def build_parameter_server(
    cfg: JobConfig, dims: ParallelDims, rank: int, device: torch.device
) -> tuple[ModelParts, ParameterServerOptimizers, StepStrategy, ShardPlan]:
    """This rank's part of a parameter-server run: a worker's replica and WorkerStep,
    or a server's shard, its AdamW and ServerStep. Collective (the servers' group)."""
    plan = ShardPlan.for_model(cfg, dims)
    server = dims.is_server(rank)
    if server:
        parts = build_server_shard(cfg, plan, rank - dims.dp, device)
    else:
        parts = build_worker_replica(cfg, device)
    optimizers = ParameterServerOptimizers(cfg, parts, plan, rank, device)
    # the servers' own group, for the gradient norm of a synchronous step (new_group is
    # collective over the world: every rank makes it)
    group = None
    if dims.servers > 1:
        group = dist.new_group([plan.server_rank(j) for j in range(plan.servers)])
    kind = ServerStep if server else WorkerStep
    strategy = kind(cfg, dims, None, parts, optimizers, device)  # type: ignore[arg-type]
    if isinstance(strategy, ServerStep):
        strategy.group = group
    return parts, optimizers, strategy, plan
