"""Pipeline parallelism for meshforge's models, on torch.distributed.pipelining.

Batch rule: the pipeline's micro-batches ARE the gradient-accumulation micro-batches.
A step on one data-parallel rank consumes n_microbatches x micro_batch sequences in one
`Pipeline.step`; no accumulation loop runs around it. Each micro-batch's loss is its
mean over tokens; the backward runs on loss / n_microbatches, so the gradients equal
those of the mean loss over the step's sequences, exactly as world 1 accumulating
loss / n_microbatches would get (data parallelism then averages over dp ranks).

Stages are contiguous layer ranges (`layer_split`); stage 0 also holds the embeddings,
the last one ln_f and the head. A rank holds 1 stage (gpipe, 1f1b), `virtual_stages`
stages in loop order rank + k*pp (interleaved_1f1b) or 2 in a V, [rank, 2pp-1-rank]
(zbv), so that ZB-V's first and last stage share rank 0.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import FORWARD, RECV_F, RESHARD, SEND_F, UNSHARD
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_ctx

from meshforge.layout.schedule import interleaved_accepts, min_microbatches, stages_per_rank
from meshforge.layout.stages import layer_split
from meshforge.models.moe import counting_routes

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv")
_FORWARD_ACTIONS = (FORWARD, SEND_F, RECV_F, UNSHARD, RESHARD)


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {SCHEDULES}")


def stage_ids(pp_rank: int, pp: int, schedule: str, virtual_stages: int) -> list[int]:
    """The global stage indices this pp rank holds, in execution order; must match the
    stage->rank map torch's schedule builds ("loop" or, for ZB-V, "v")."""
    _check_schedule(schedule)
    k = stages_per_rank(schedule, virtual_stages)
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(k)]


def split_stage(model: nn.Module, stage_id: int, n_stages: int) -> nn.Module:
    """A deep copy of `model` (meta is fine: nothing is allocated) with only stage
    `stage_id`'s blocks, under their original names so `init_weights` and checkpoints
    see the same keys as the full model. `model` has the stage layout of
    models/registry.py: embed, blocks (keyed by layer index), ln_f, head."""
    every = {id(p) for _, p in model.named_parameters(remove_duplicate=False)}
    if n_stages > 1 and len(every) < len(list(model.named_parameters(remove_duplicate=False))):
        # e.g. embedding and head would live on different ranks as one Parameter
        raise ValueError(
            "pipeline parallelism needs untied parameters (model.tie_embeddings: false)"
        )
    keep = {str(i) for i in layer_split(len(model.blocks), n_stages)[stage_id]}
    part = copy.deepcopy(model)
    for name in list(part.blocks.keys()):
        if name not in keep:
            del part.blocks[name]
    if stage_id != 0:
        part.embed = None
    if stage_id != n_stages - 1:
        part.ln_f = None
        part.head = None
    return part


def check_microbatches(schedule: str, pp: int, virtual_stages: int, n_microbatches: int) -> None:
    """Raise ValueError where torch's schedule would refuse `n_microbatches` (the same
    rules ParallelDims checks before launch)."""
    _check_schedule(schedule)
    m = n_microbatches
    if m < min_microbatches(schedule, pp):
        raise ValueError(
            f"{schedule} at pp={pp} needs at least {min_microbatches(schedule, pp)} "
            f"micro-batches, got {m}"
        )
    if schedule == "interleaved_1f1b" and not interleaved_accepts(m, pp):
        raise ValueError(
            f"interleaved_1f1b at pp={pp}: n_microbatches={m} must be a multiple of "
            f"max(1, n_microbatches // pp) = {max(1, m // pp)} (e.g. a multiple of pp)"
        )


class Pipeline:
    """This rank's stages of a pipeline and the schedule that drives them.

    `parts` are the stage modules (from `split_stage`, after TP/FSDP are applied), in the
    order of `stage_ids`. After each `step`, `busy_s` is the seconds this rank spent in
    its stages' forward, backward (input and weight) and loss computations, `wall_s`
    the step's wall-clock seconds, `bubble` = 1 - busy_s / wall_s. The first step also
    pays torch's one-time shape inference, so read the bubble from later steps."""

    def __init__(
        self,
        parts: list[nn.Module],
        stage_ids: list[int],
        n_stages: int,
        group: ProcessGroup,
        device: torch.device,
        schedule: str,
        n_microbatches: int,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        *,
        loss_parallel: bool = False,
    ) -> None:
        """loss_parallel: the last stage's logits are vocabulary-sharded DTensors; the
        whole step then runs under DTensor's loss_parallel() (forward and backward)."""
        pp = torch.distributed.get_world_size(group)
        per_rank = stages_per_rank(schedule, len(parts))
        if len(parts) != len(stage_ids) or len(parts) != per_rank or n_stages != pp * per_rank:
            raise ValueError(
                f"{schedule}: got {len(parts)} parts for stages {stage_ids} of {n_stages} "
                f"at pp={pp}; expected {per_rank} per rank"
            )
        check_microbatches(schedule, pp, len(parts), n_microbatches)
        self.parts = parts
        self.device = device
        self.n_microbatches = n_microbatches
        self.loss_parallel = loss_parallel
        self._sync = device.type != "cpu"  # accelerator work is async: time it on the host
        self.busy_s = 0.0
        self.wall_s = 0.0
        self._losses: list[Tensor] = []
        self._in_schedule = False
        self.stages = [
            PipelineStage(part, sid, n_stages, device, group=group)
            for part, sid in zip(parts, stage_ids, strict=True)
        ]
        for st in self.stages:
            # instance attributes shadow the methods, so every schedule calls the timed ones
            st.forward_one_chunk = self._timed(st.forward_one_chunk, starts_run=True)
            st.backward_one_chunk = self._timed(st.backward_one_chunk)
            st.backward_weight_one_chunk = self._timed(st.backward_weight_one_chunk)
        self.has_first = any(st.is_first for st in self.stages)
        self.has_last = any(st.is_last for st in self.stages)

        def scaled_loss(logits: Tensor, targets: Tensor) -> Tensor:
            if not self._in_schedule:
                # torch's first-step shape inference: not a micro-batch, not compute to count
                return loss_fn(logits, targets) / n_microbatches
            t0 = self._now()
            loss = loss_fn(logits, targets)
            self._losses.append(loss.detach())
            # scale the loss, not the grads (scale_grads=False below): the backward is
            # world 1's loss/m, and no .grad is rescaled after the fact
            out = loss / n_microbatches
            self.busy_s += self._now() - t0
            return out

        kw: dict[str, Any] = {"loss_fn": scaled_loss, "scale_grads": False}
        if schedule == "gpipe":
            self.schedule: Any = ScheduleGPipe(self.stages[0], n_microbatches, **kw)
        elif schedule == "1f1b":
            self.schedule = Schedule1F1B(self.stages[0], n_microbatches, **kw)
        elif schedule == "interleaved_1f1b":
            self.schedule = ScheduleInterleaved1F1B(self.stages, n_microbatches, **kw)
        else:
            self.schedule = ScheduleZBVZeroBubble(self.stages, n_microbatches, **kw)

    def _now(self) -> float:
        if self._sync:
            torch.accelerator.synchronize(self.device)
        return time.perf_counter()

    def _timed(self, fn: Callable[..., Any], starts_run: bool = False) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if starts_run:
                # shape inference is over once the first real chunk runs
                self._in_schedule = True
            t0 = self._now()
            try:
                with counting_routes(starts_run):  # a micro-batch's forward: its routes count
                    return fn(*args, **kwargs)
            finally:
                self.busy_s += self._now() - t0

        return run

    @property
    def bubble(self) -> float:
        return 1.0 - self.busy_s / self.wall_s if self.wall_s > 0 else 0.0

    def step(self, x: Tensor | None, y: Tensor | None) -> Tensor | None:
        """One optimizer step's forward+backward over all micro-batches. x (token ids)
        is needed where stage 0 lives, y (targets) where the last stage lives; both
        hold n_microbatches * micro_batch rows. Gradients are accumulated into .grad
        (zero them before). Returns the detached sum of the micro-batch mean losses on
        the rank holding the last stage, else None."""
        return self._run(x, y, train=True)

    @torch.no_grad()
    def evaluate(self, x: Tensor | None, y: Tensor | None) -> Tensor | None:
        """Forward only (validation), same inputs and return as `step`. torch
        re-infers the stage shapes at each switch between train and eval."""
        return self._run(x, y, train=False)

    def _run(self, x: Tensor | None, y: Tensor | None, train: bool) -> Tensor | None:
        args: tuple[Tensor, ...] = ()
        kwargs: dict[str, Any] = {}
        if self.has_first:
            if x is None:
                raise ValueError("this rank holds stage 0: it needs the inputs x")
            self._check_rows(x)
            args = (x.to(self.device),)
        if self.has_last:
            if y is None:
                raise ValueError("this rank holds the last stage: it needs the targets y")
            self._check_rows(y)
            kwargs["target"] = y.to(self.device)
        self.busy_s = 0.0
        self._losses = []
        self._in_schedule = False
        ctx = loss_parallel_ctx() if self.loss_parallel else contextlib.nullcontext()
        t0 = self._now()
        with ctx:
            if train:
                # return_outputs=False: nobody needs every micro-batch's logits kept;
                # the shape inference's forward on placeholders routes nothing that counts
                with counting_routes(False):
                    self.schedule.step(*args, return_outputs=False, **kwargs)
            else:
                self._eval(args, kwargs)
        self.wall_s = self._now() - t0
        self._in_schedule = False
        if not self.has_last:
            return None
        if len(self._losses) != self.n_microbatches:
            raise RuntimeError(
                f"{len(self._losses)} losses for {self.n_microbatches} micro-batches"
            )
        return torch.stack([_full(loss) for loss in self._losses]).sum()

    def _eval(self, args: tuple[Tensor, ...], kwargs: dict[str, Any]) -> None:
        order = getattr(self.schedule, "pipeline_order_with_comms", None)
        if order is None:  # single-stage schedules skip their backward themselves
            self.schedule.eval(*args, return_outputs=False, **kwargs)
            return
        # torch 2.13's multi-stage eval() still walks the backward actions, and ZB-V's
        # same-rank hand-off there asserts that backward is on: run the schedule's
        # forward actions only, in their order (a subsequence adds no waits)
        fwd = {
            r: [a for a in acts if a.computation_type in _FORWARD_ACTIONS]
            for r, acts in order.items()
        }
        self.schedule.pipeline_order_with_comms = fwd
        try:
            self.schedule.eval(*args, return_outputs=False, **kwargs)
        finally:
            self.schedule.pipeline_order_with_comms = order

    def _check_rows(self, t: Tensor) -> None:
        if t.shape[0] % self.n_microbatches:
            raise ValueError(
                f"{t.shape[0]} rows do not split into {self.n_microbatches} equal micro-batches"
            )


def _full(t: Tensor) -> Tensor:
    # under loss parallel the loss is a replicated DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t
