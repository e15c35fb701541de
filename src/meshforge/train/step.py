"""Step strategies: how one optimizer step runs for a kind of layout.

The training loop asks a strategy for one step and gets the losses, the gradient
norm and timings back; it never asks which ZeRO stage, TP or PP degree it runs.

  AccumulatingStep  dp / ZeRO / TP: forward+backward per micro-batch, gradient
                    reduction only on the last one (no_sync), or after it when
                    parallel.comm.overlap is off.
  PipelinedStep     pp > 1: the step's micro-batches are the pipeline's
                    micro-batches, run by a torch.distributed.pipelining schedule.
  WorkerStep,       parallel.mode: parameter_server (train/ps_step.py, built by
  ServerStep        Engine.build): workers push gradients, servers update.

Both then unscale (fp16), take the global gradient norm over the dp, tp and pp
groups, clip, and step the optimizers at the step's learning rate.

Under context parallelism (parallel.cp > 1) the cp ranks of a data-parallel rank read
the same micro-batches; AccumulatingStep keeps this rank's tokens of each and the
positions and attention mask that go with them (parallel/context_parallel.py
`ContextSplit`), and the loss is the mean over its tokens (the mean over the dp x cp
ranks is then world 1's).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshforge.config import JobConfig
from meshforge.data.corpus import end_of_text_id
from meshforge.layout import ParallelDims
from meshforge.models.attention import documents_of
from meshforge.models.moe import set_aux_loss_scale
from meshforge.observe.memory import SavedActivations
from meshforge.parallel.context_parallel import ContextSplit, ContextStage
from meshforge.parallel.parallelize import (
    ModelParts,
    grad_norm_and_clip,
    loss_context,
    loss_parallel_enabled,
)
from meshforge.train.optim import Optimizers

Batch = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # sum of the micro-batch mean losses (zero where not computed)
    grad_norm: torch.Tensor | None
    micro_s: list[float] = field(default_factory=list)  # forward+backward per micro-batch
    busy_s: float | None = None  # pipeline: this rank's stage compute time in the step
    wall_s: float | None = None  # pipeline: the schedule's wall time
    activation_bytes: int | None = None  # saved for backward by one micro-batch's forward
    tp_comm_s: float | None = None  # in tensor-parallel collectives (profiled steps only)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class StepStrategy:
    def __init__(
        self,
        cfg: JobConfig,
        dims: ParallelDims,
        mesh: DeviceMesh,
        parts: ModelParts,
        optimizers: Optimizers,
        device: torch.device,
    ) -> None:
        self.cfg, self.dims, self.mesh = cfg, dims, mesh
        self.parts, self.optimizers, self.device = parts, optimizers, device
        self.loss_parallel = loss_parallel_enabled(cfg, dims)
        self.pp_group = mesh["pp"].get_group() if dims.pp_enabled else None
        # bytes one micro-batch's forward saves for backward: counted once (the shapes
        # do not change), since counting hooks every saved tensor of the pass
        self.activation_bytes: int | None = None
        self.flight = None  # observe/flight.py FlightRecorder, set by the trainer
        # data.document_masking: the token after which a new document starts (None: off)
        d = cfg.data
        self.eot_id = end_of_text_id(d.source, d.cache_dir) if d.document_masking else None
        # parallel.cp > 1: this rank's share of every sequence (None: whole sequences)
        self.context = ContextSplit.of(mesh["cp"]) if dims.cp_enabled else None

    def _phase(self, name: str) -> None:
        if self.flight is not None:
            self.flight.set_phase(name)

    # -- shared pieces ---------------------------------------------------------------------
    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def autocast(self) -> contextlib.AbstractContextManager:
        dtype = self.parts.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Cross-entropy on vocabulary-sharded logits under tensor parallel."""
        return loss_context(self.loss_parallel)

    @property
    def computes_loss(self) -> bool:
        """Whether this rank sees the loss (under pp only the last stage does)."""
        return True

    def reduce_loss(self, local: torch.Tensor) -> torch.Tensor:
        """Mean over the data-parallel replicas of a per-rank loss; collective over the
        world (ranks that do not compute the loss contribute zero)."""
        value = local.detach().float().clone()
        if not self.computes_loss:
            value.zero_()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        # one copy per tp rank of the last stage; the cp ranks each hold the mean of
        # the same number of tokens
        holders = self.dims.dp * self.dims.cp * self.dims.tp
        return value / holders

    def server_counters(self) -> dict[str, Any] | None:
        """A parameter server's counters for the report (train/ps_step.py); else None."""
        return None

    # -- one optimizer step -----------------------------------------------------------------
    def step(self, step: int, micro_batches: Batch, measure: bool) -> StepResult:
        self.optimizers.set_lr(step)
        # every micro-batch's loss is divided by their count: so is its auxiliary loss
        set_aux_loss_scale(1.0 / len(micro_batches))
        self._phase("forward_backward")
        result = self.forward_backward(micro_batches, measure)
        self._phase("optimizer")
        self.optimizers.unscale()
        clip = self.cfg.train.grad_clip
        if clip > 0 or measure:  # the norm costs collectives: only when needed
            result.grad_norm = grad_norm_and_clip(self.parts, clip, self.pp_group)
        self.optimizers.step()
        return result

    def forward_backward(self, micro_batches: Batch, measure: bool) -> StepResult:
        raise NotImplementedError

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class AccumulatingStep(StepStrategy):
    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model = self.parts.callables[0]
        with self.autocast():
            if self.context is not None:  # this rank's tokens, positions and mask
                x, y, docs = self.context.shard(x, y, self.eot_id)
                logits = model(x, docs=docs)
            elif self.eot_id is None:
                logits = model(x)
            else:  # attention kept inside the documents packed into each row of x
                logits = model(x, docs=documents_of(x, self.eot_id))
        return cross_entropy(logits, y)

    def forward_backward(self, micro_batches: Batch, measure: bool) -> StepResult:
        accum = len(micro_batches)
        micro_s: list[float] = []
        loss_sum = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            tm = time.perf_counter()
            with self.parts.gradient_sync(i == accum - 1), self.loss_context():
                self._phase("forward")
                if measure and i == 0 and self.activation_bytes is None:
                    with SavedActivations() as saved:
                        loss = self._loss(x, y)
                    self.activation_bytes = saved.bytes
                else:
                    loss = self._loss(x, y)
                self._phase("backward")
                self.optimizers.scale(loss / accum).backward()
            if i == accum - 1:  # timed with the last micro-batch: the step's exposed reduction
                self.parts.reduce_gradients()
            if measure:
                self.sync()
                micro_s.append(time.perf_counter() - tm)
            loss_sum += _plain(loss.detach())
        return StepResult(
            loss_sum, None, micro_s, activation_bytes=self.activation_bytes if measure else None
        )

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.loss_context():
            return _plain(self._loss(x.to(self.device), y.to(self.device)))


class PipelinedStep(StepStrategy):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from meshforge.parallel.pipeline import Pipeline, stage_ids

        d = self.dims
        pp_rank = self.mesh["pp"].get_local_rank()
        self.stage_ids = stage_ids(pp_rank, d.pp, d.pp_schedule, d.virtual_stages)
        self.holds_last = d.n_stages - 1 in self.stage_ids
        self.holds_first = 0 in self.stage_ids

        parts = self.parts.callables
        if self.context is not None:  # the stages take this rank's tokens, hidden states
            parts = [ContextStage(part, self.context) for part in parts]
        self.pipeline = Pipeline(
            parts,
            self.stage_ids,
            d.n_stages,
            self.mesh["pp"].get_group(),
            self.device,
            d.pp_schedule,
            d.microbatches,
            cross_entropy,
            loss_parallel=self.loss_parallel,
        )

    @property
    def computes_loss(self) -> bool:
        return self.holds_last

    def forward_backward(self, micro_batches: Batch, measure: bool) -> StepResult:
        x = torch.cat([mb[0] for mb in micro_batches]).to(self.device, non_blocking=True)
        y = torch.cat([mb[1] for mb in micro_batches]).to(self.device, non_blocking=True)
        if self.context is not None:  # this rank's tokens (its stages know their positions)
            x, y, _ = self.context.shard(x, y)
        with self.autocast():  # the pipeline enters loss_parallel itself
            loss_sum = self.pipeline.step(x, y)
        self.parts.reduce_gradients()  # expert weights' (the wrappers reduce the rest)
        if loss_sum is None:
            loss_sum = torch.zeros((), device=self.device)
        return StepResult(
            _plain(loss_sum.detach()),
            None,
            busy_s=self.pipeline.busy_s,
            wall_s=self.pipeline.wall_s,
        )

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean loss of a pipeline step's worth of rows (m micro-batches)."""
        x, y = x.to(self.device), y.to(self.device)
        if self.context is not None:
            x, y, _ = self.context.shard(x, y)
        with self.autocast():
            loss_sum = self.pipeline.evaluate(x, y)
        if loss_sum is None:
            return torch.zeros((), device=self.device)
        return _plain(loss_sum) / self.dims.microbatches


def make_step(
    cfg: JobConfig,
    dims: ParallelDims,
    mesh: DeviceMesh,
    parts: ModelParts,
    optimizers: Optimizers,
    device: torch.device,
) -> StepStrategy:
    kind = PipelinedStep if dims.pp_enabled else AccumulatingStep
    return kind(cfg, dims, mesh, parts, optimizers, device)
