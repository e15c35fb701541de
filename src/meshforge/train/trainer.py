"""The training loop: one object that owns a run from setup to report.

Order of a step: wait for the prefetched batch, forward/backward each
micro-batch (gradient reduction only on the last), unscale and clip, optimizer
and schedule step. Metrics are reduced and written every `log_every` steps only,
so the loop does not synchronise more than the parallel layout needs.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from meshforge.config import JobConfig
from meshforge.data.corpus import load_tokens
from meshforge.data.loader import DistributedBatchLoader, val_batches
from meshforge.errors import ConfigError
from meshforge.models.gpt import GPT, shape_of
from meshforge.observe.console import TrainingProgress
from meshforge.observe.machine import measure_profile
from meshforge.observe.memory import peak_memory_bytes
from meshforge.observe.metrics import JsonlSink
from meshforge.observe.peak import PeakFlops, detect_peak_flops
from meshforge.parallel.activation_checkpointing import apply_activation_checkpointing
from meshforge.parallel.data_parallel import (
    DataParallelModel,
    OptimizerSettings,
    all_reduce_mean,
    build_mesh,
)
from meshforge.plan.flops import gpt_param_count, training_flops_per_token
from meshforge.runtime.dist import Runtime
from meshforge.train import checkpoint as ckpt
from meshforge.train import faults
from meshforge.train.report import build_report, write_report
from meshforge.train.schedule import lr_factor

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: JobConfig, run_dir: Path, rt: Runtime) -> None:
        cfg.check_trainable()
        self.cfg, self.run_dir, self.rt = cfg, Path(run_dir), rt
        self.device = rt.device
        self.dp = cfg.resolve_dp(rt.world_size)
        self.accum = cfg.grad_accum_steps(self.dp)
        self.ckpt_root = self.run_dir / "checkpoints"
        t = cfg.train

        torch.manual_seed(t.seed)  # identical initial weights on every rank
        self.splits = load_tokens(cfg.data.source, cfg.data.val_fraction, seq_len=cfg.model.seq_len)
        if self.splits.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"model.vocab_size={cfg.model.vocab_size} is smaller than the data's "
                f"vocabulary ({self.splits.vocab_size})"
            )
        module = GPT(cfg.model).to(self.device)
        apply_activation_checkpointing(module.blocks, t.activation_checkpointing)
        if t.compile:  # per block, in place (parameter names unchanged), before sharding
            for block in module.blocks:
                block.compile()
        self.mesh = build_mesh(self.device, self.dp)
        fused = self.device.type == "cuda"
        opt = OptimizerSettings(t.lr, t.weight_decay, (t.beta1, t.beta2), fused=fused)
        self.par = DataParallelModel(
            module, cfg.parallel.zero, self.mesh, opt, cfg.precision.dtype, cfg.parallel.bucket_mb
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.par.optimizer, lambda s: lr_factor(s, t.warmup, t.steps, t.min_lr_ratio)
        )
        self.scaler = None
        if cfg.precision.dtype == "fp16":
            init = cfg.precision.initial_loss_scale
            if cfg.parallel.zero >= 2:  # sharded gradients: inf checks are all-reduced
                self.scaler = ShardedGradScaler(self.device.type, init_scale=init)
            else:
                self.scaler = torch.amp.GradScaler(self.device.type, init_scale=init)
        shape = shape_of(cfg.model)
        self.params = gpt_param_count(shape)
        self.flops_per_token = training_flops_per_token(shape)
        self.tokens_per_step = t.global_batch * cfg.model.seq_len
        self.progress: TrainingProgress | None = None

    # -- helpers ------------------------------------------------------------------
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _autocast(self):
        dtype = self.par.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def _loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            logits = model(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))

    def _snapshot(self, step: int, last_loss: float | None) -> ckpt.Snapshot:
        state = {
            "step": step,
            "world_size": self.rt.world_size,
            "layout": self.layout(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "data": {"seed": self.cfg.train.seed, "next_step": step},
            "loss": last_loss,
        }
        return ckpt.Snapshot(self.par.module.state_dict(), self.par.optimizer_state(), state)

    def layout(self) -> dict[str, Any]:
        c = self.cfg
        return {
            "dp": self.dp,
            "zero": c.parallel.zero,
            "tp": c.parallel.tp,
            "pp": c.parallel.pp,
            "grad_accum": self.accum,
            "micro_batch": c.train.micro_batch,
            "dtype": c.precision.dtype,
            "activation_checkpointing": c.train.activation_checkpointing,
        }

    def _resume(self) -> int | None:
        found = [None]
        if self.rt.is_main:
            hit = ckpt.find_latest_valid(self.ckpt_root, warn=self._warn)
            found = [str(hit[1]) if hit else None]
        dist.broadcast_object_list(found, src=0)
        if found[0] is None:
            return None
        self.par.ensure_optimizer_state()
        snap = self._snapshot(0, None)
        state = ckpt.load(Path(found[0]), snap)
        self.scheduler.load_state_dict(state["scheduler"])
        # load_state_dict restores the schedule's position, not the optimizer's current lr.
        for group, lr in zip(
            self.par.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True
        ):
            group["lr"] = lr
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        return int(state["step"])

    def _warn(self, message: str) -> None:
        log.warning(message)
        if self.progress is not None:
            self.progress.log(f"warning: {message}")
        elif self.rt.is_main:
            print(f"meshforge: warning: {message}", file=sys.stderr, flush=True)

    def _reference_compute_s(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """Forward+backward time of one micro-batch with no communication at all.

        Measured on a local, unwrapped replica so the real model's gradients stay
        untouched; skipped when the full model would not comfortably fit."""
        full_bytes = self.params.total * 4 * 4  # params + grads + activation headroom
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if full_bytes > 0.2 * free:
                return None
        with torch.random.fork_rng(devices=[]):
            replica = GPT(self.cfg.model).to(self.device)
            apply_activation_checkpointing(replica.blocks, self.cfg.train.activation_checkpointing)
            times = []
            for _ in range(3):
                self._sync()
                t0 = time.perf_counter()
                self._loss(replica, x, y).backward()
                self._sync()
                times.append(time.perf_counter() - t0)
            del replica
        return min(times[1:])

    def _validate(self) -> float:
        c = self.cfg
        batches = val_batches(
            self.splits.val,
            c.model.seq_len,
            c.train.micro_batch * self.dp,
            c.train.eval_batches,
            self.mesh.get_local_rank(),
            self.dp,
            c.train.seed,
        )
        model = self.par.model if c.parallel.zero >= 2 else self.par.module
        model.eval()
        total = torch.zeros((), device=self.device)
        with torch.no_grad():
            for x, y in batches:
                total += self._loss(model, x.to(self.device), y.to(self.device))
        model.train()
        return all_reduce_mean(total / len(batches)).item()

    # -- the run ------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        c, rt = self.cfg, self.rt
        t = c.train
        sink = JsonlSink(self.run_dir / "metrics.jsonl") if rt.is_main else None
        peak = detect_peak_flops(self.device, c.precision.dtype, torch.get_num_threads())
        self.machine_profile = measure_profile(self.device, c.precision.dtype, self.mesh, c)
        resumed_from = self._resume()
        start = resumed_from or 0
        dp_rank = self.mesh.get_local_rank()
        loader = DistributedBatchLoader(
            self.splits.train,
            c.model.seq_len,
            t.global_batch,
            t.micro_batch,
            dp_rank,
            self.dp,
            t.seed,
            start,
            c.data.prefetch,
        )
        rows: list[dict[str, Any]] = []
        last_loss: float | None = None
        last_saved = resumed_from
        ref_compute_s: float | None = None
        started = time.perf_counter()
        progress = TrainingProgress(t.steps, start, rt.is_main, c.name)
        with loader, progress:
            self.progress = progress
            if resumed_from is not None:
                progress.log(f"resumed from checkpoint at step {resumed_from}")
            interval_t0, interval_steps = time.perf_counter(), 0
            for step in range(start, t.steps):
                logging_step = (step + 1) % c.observe.log_every == 0 or step + 1 == t.steps
                t0 = time.perf_counter()
                batch = next(loader)
                data_s = loader.last_wait_s
                if ref_compute_s is None and self.accum == 1 and step == start:
                    x0, y0 = batch.micro_batches[0]
                    ref_compute_s = self._reference_compute_s(
                        x0.to(self.device), y0.to(self.device)
                    )
                    t0 = time.perf_counter() - data_s
                loss_sum, grad_norm, micro_s = self._train_step(batch.micro_batches, logging_step)
                if step + 1 == t.steps:
                    state_bytes = self.par.model_state_bytes()
                self.par.optimizer.zero_grad(set_to_none=True)
                interval_steps += 1

                if logging_step:
                    loss_value = all_reduce_mean(loss_sum / self.accum).item()
                    self._sync()
                    now = time.perf_counter()
                    step_s = now - t0
                    tokens_per_s = interval_steps * self.tokens_per_step / (now - interval_t0)
                    interval_t0, interval_steps = now, 0
                    comm_s = self._exposed_comm_s(micro_s, ref_compute_s)
                    fwd_bwd_s = sum(micro_s)
                    row = {
                        "step": step + 1,
                        "loss": loss_value,
                        "lr": self.scheduler.get_last_lr()[0],
                        "grad_norm": float(grad_norm),
                        "tokens_per_s": tokens_per_s,
                        "mfu": self._mfu(tokens_per_s, peak),
                        "step_time_s": step_s,
                        "data_s": data_s,
                        "compute_s": max(0.0, fwd_bwd_s - (comm_s or 0.0)),
                        "comm_s": comm_s,
                        "other_s": max(0.0, step_s - data_s - fwd_bwd_s),
                        "peak_memory_bytes": peak_memory_bytes(self.device),
                    }
                    if self.scaler is not None:
                        row["loss_scale"] = float(self.scaler.get_scale())
                    last_loss = loss_value
                    if t.eval_every and (step + 1) % t.eval_every == 0:
                        row["val_loss"] = self._validate()
                    rows.append(row)
                    if sink is not None:
                        sink.write(row)
                    progress.update(step + 1, row)

                done = step + 1
                every = c.checkpoint.every
                if (every and done % every == 0) or done == t.steps:
                    snap = self._snapshot(done, last_loss)
                    ckpt.save(self.ckpt_root, done, snap, c.checkpoint.keep)
                    last_saved = done
                    faults.maybe_kill_after_checkpoint(done, rt.rank)
                faults.maybe_crash(done, rt.rank)
            if start >= t.steps:  # resumed from the final checkpoint: nothing left to do
                state_bytes = self.par.model_state_bytes()
            val_loss = rows[-1].get("val_loss") if rows and rows[-1]["step"] == t.steps else None
            if val_loss is None and t.eval_every:
                val_loss = self._validate()
        self.progress = None
        digest = self.par.param_digest()
        per_rank = {"state": state_bytes, "peak": peak_memory_bytes(self.device)}
        gathered: list[Any] = [None] * rt.world_size
        dist.all_gather_object(gathered, per_rank)
        report = None
        if rt.is_main:
            report = build_report(
                trainer=self,
                rows=rows,
                per_rank=gathered,
                peak=peak,
                resumed_from=resumed_from,
                last_checkpoint=last_saved,
                val_loss=val_loss,
                digest=digest,
                wall_s=time.perf_counter() - started,
                data_wait_s=loader.total_wait_s,
            )
            write_report(self.run_dir, report)
        return report or {}

    def _train_step(
        self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], measure: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[float]]:
        """One optimizer step. Returns the summed micro-batch losses, the gradient norm
        (computed when clipping or measuring) and, when measuring, each micro-batch's
        forward+backward seconds."""
        t = self.cfg.train
        micro_s: list[float] = []
        loss_sum = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            tm = time.perf_counter()
            with self.par.gradient_sync(i == self.accum - 1):
                loss = self._loss(self.par.model, x, y)
                scaled = loss / self.accum
                if self.scaler is not None:
                    scaled = self.scaler.scale(scaled)
                scaled.backward()
            if measure:
                self._sync()
                micro_s.append(time.perf_counter() - tm)
            loss_sum += loss.detach()
        if self.scaler is not None:
            self.scaler.unscale_(self.par.optimizer)
        grad_norm = None  # the norm costs a collective under FSDP: only when needed
        if t.grad_clip > 0 or measure:
            grad_norm = self.par.grad_norm_and_clip(t.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.par.optimizer)
            self.scaler.update()
        else:
            self.par.optimizer.step()
        self.scheduler.step()
        return loss_sum, grad_norm, micro_s

    def _exposed_comm_s(self, micro_s: list[float], ref_s: float | None) -> float | None:
        """Exposed gradient-reduction time of a step: the synchronising micro-batch's time
        minus the same work without communication (the other micro-batches of the step,
        or the replica reference when there is only one)."""
        if not micro_s:
            return None
        if len(micro_s) > 1:
            ref_s = statistics.fmean(micro_s[:-1])
        if ref_s is None:
            return None
        return max(0.0, micro_s[-1] - ref_s)

    def _mfu(self, tokens_per_s: float, peak: PeakFlops) -> float | None:
        if not peak.flops_per_s:
            return None
        per_device = tokens_per_s * self.flops_per_token / self.rt.world_size
        return per_device / peak.flops_per_s
