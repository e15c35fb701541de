"""The training loop: set up a run, then ask the step strategy for one optimizer
step at a time; log, validate and checkpoint around it.

The loop never knows the layout. `ParallelDims` says which ranks do what,
`build_model_parts` places the model, `Optimizers` owns the optimizer, learning rate and
loss scaler, the step strategy (train/step.py) runs a step, the `Checkpointer`
saves and resumes. Metrics are reduced and written every `log_every` steps only,
so the loop does not synchronise more than the parallel layout needs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshforge.config import JobConfig, parse_steps
from meshforge.data.corpus import load_tokens
from meshforge.data.loader import DistributedBatchLoader, NoBatches, val_batches
from meshforge.errors import ConfigError
from meshforge.models.registry import blocks_of, build_model
from meshforge.observe import comm_bytes
from meshforge.observe.comm_time import measure_tp_comm
from meshforge.observe.console import TrainingProgress, status_text
from meshforge.observe.flight import FlightRecorder
from meshforge.observe.memhealth import cuda_memory_stats, memory_advice
from meshforge.observe.memory import peak_memory_bytes, tensor_bytes
from meshforge.observe.metrics import JsonlSink
from meshforge.observe.peak import PeakFlops, detect_peak_flops
from meshforge.observe.sampler import SystemSampler, sampler_path
from meshforge.observe.sinks import Guarded, Sinks, open_sinks
from meshforge.observe.straggler import RANK_FIGURES, StragglerWatch, rank_figures
from meshforge.observe.trace import StepTracer
from meshforge.parallel.activation_checkpointing import apply_activation_checkpointing
from meshforge.plan.core.flops import (
    FACTORY_FLOPS_CONVENTION,
    FLOPS_CONVENTION,
    ParamCount,
    gpt_param_count,
    shape_of,
    training_flops_per_token,
)
from meshforge.rundir.failures import recorded_failures
from meshforge.rundir.records import read_jsonl
from meshforge.rundir.restarts import append_restart, restart_cause
from meshforge.rundir.segments import close_segment, mark_first_step, open_segment
from meshforge.runtime.agree import host_of_rank
from meshforge.runtime.control import StopControl, set_collective_timeout
from meshforge.runtime.dist import Runtime
from meshforge.train import faults
from meshforge.train.calibration import measure_profile
from meshforge.train.checkpoint import Checkpointer
from meshforge.train.engine import Engine
from meshforge.train.report import build_report, write_report
from meshforge.train.step import StepResult, cross_entropy
from meshforge.train.timing import RunTiming, launched_at, process_start

log = logging.getLogger(__name__)


class Trainer:
    def __init__(
        self, cfg: JobConfig, run_dir: Path, rt: Runtime, flight: FlightRecorder | None = None
    ) -> None:
        cfg.check_trainable()
        self.cfg, self.run_dir, self.rt = cfg, Path(run_dir), rt
        self.device = rt.device
        self.dims = cfg.dims(rt.world_size)
        self.dp = self.dims.dp
        self.accum = self.dims.microbatches
        t = cfg.train

        torch.manual_seed(t.seed)  # identical random streams (dropout) on every rank
        d = cfg.data
        self.splits = load_tokens(
            d.source,
            d.val_fraction,
            seq_len=cfg.model.seq_len,
            vocab_size=cfg.model.vocab_size,
            cache_dir=d.cache_dir,
        )
        if self.splits.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"model.vocab_size={cfg.model.vocab_size} is smaller than the data's "
                f"vocabulary ({self.splits.vocab_size})"
            )
        self.engine = Engine.build(cfg, rt.rank, rt.world_size, self.device)
        self.mesh, self.dp_rank = self.engine.mesh, self.engine.dp_rank
        self.parts, self.optimizers = self.engine.parts, self.engine.optimizers
        self.strategy = self.engine.strategy
        self.checkpointer = Checkpointer(
            self.run_dir / "checkpoints", self.optimizers, cfg.checkpoint.keep, self._warn
        )
        if cfg.model.is_factory:  # a user's model: 6 FLOPs per parameter and token
            n = self.parts.n_params
            self.params = ParamCount(n, 0, n)
            self.flops_per_token = 6.0 * n
            self.flops_convention = FACTORY_FLOPS_CONVENTION
        else:
            shape = shape_of(cfg.model)
            self.params = gpt_param_count(shape)
            self.flops_per_token = training_flops_per_token(shape)
            self.flops_convention = FLOPS_CONVENTION
        self.tokens_per_step = t.global_batch * cfg.model.seq_len
        self.progress: TrainingProgress | None = None
        # what this rank is doing (observe/flight.py); a disabled one when not given
        self.flight = flight or FlightRecorder(run_dir, rt.rank, rt.world_size, enabled=False)
        self.strategy.flight = self.flight
        self.stop = StopControl(rt.world_size)  # SIGTERM, Ctrl-C: checkpoint, leave together
        self.stopped: dict[str, Any] | None = None
        self.stragglers = StragglerWatch(
            rt.world_size, cfg.observe.straggler_margin, cfg.observe.straggler_intervals
        )
        # bytes handed to torch.distributed per step, and by the host's interfaces
        comm_bytes.install()
        self.reducer_bytes = 0  # DDP's C++ reducer all-reduces past any Python call
        comm = cfg._parallel().comm
        if self.parts.wrapper == "ddp" and comm.compression == "none" and comm.overlap:
            self.reducer_bytes = comm_bytes.ddp_reducer_bytes(self.parts.parameters())
        self.comm_samples: list[dict[str, float]] = []  # per logged interval, steady only
        self.tp_comm_s: float | None = None  # latest profiled TP collective time
        # its share of the profiled step's forward+backward (the profiler slows the step
        # it watches: the share, not the seconds, carries over to the other steps)
        self.tp_comm_share: float | None = None
        self.sampler: SystemSampler | None = None  # the node's, on its first rank
        self.memory_advice: dict[str, str] = {}  # the newest advice of each kind
        self.segment: int | None = None  # this segment's number (rundir/segments.py), rank 0
        # start-up, shutdown (train/timing.py); rank 0's marks are the report's
        self.timing = RunTiming(launched_at(), process_start(), rt.up_at)

    # -- what the report and checkpoints record ------------------------------------------
    def layout(self) -> dict[str, Any]:
        c = self.cfg
        return {
            **self.dims.as_dict(),
            "grad_accum": self.accum,
            "micro_batch": c.train.micro_batch,
            "dtype": c.precision.dtype,
            "activation_checkpointing": c.train.activation_checkpointing,
        }

    def trainer_state(self, step: int, last_loss: float | None) -> dict[str, Any]:
        scaler = self.optimizers.scaler
        return {
            "step": step,
            "world_size": self.rt.world_size,
            "layout": self.layout(),
            "lr": self.optimizers.lr_at(max(0, step - 1)),
            "lr_horizon": self.optimizers.lr_horizon,  # fixed when the run started
            "scaler": scaler.state_dict() if scaler is not None else None,
            "data": {"seed": self.cfg.train.seed, "next_step": step},
            "loss": last_loss,
        }

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state resident on this rank now."""
        params = list(self.parts.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        out = {
            "params": tensor_bytes(params),
            "grads": tensor_bytes(grads),
            "optimizer": tensor_bytes(self.optimizers.state_bytes()),
        }
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
        return out

    # -- helpers ------------------------------------------------------------------------------
    def _warn(self, message: str) -> None:
        log.warning(message)
        if self.progress is not None:
            self.progress.log(f"warning: {message}")
        elif self.rt.is_main:
            print(f"meshforge: warning: {message}", file=sys.stderr, flush=True)

    def _record_restart(self, resumed_from: int | None) -> None:
        """After an elastic restart: which attempt, where it resumed, and how many steps
        the failed attempt had done beyond that (redone now), in health/restarts.jsonl."""
        attempt = self.flight.attempt
        if attempt == 0:
            return
        previous = self.flight.previous or {}
        reached = previous.get("step") if previous.get("attempt") == attempt - 1 else None
        since = previous.get("started", 0.0)
        failures = [r for r in recorded_failures(self.run_dir / "health") if r["time"] >= since]
        cause = restart_cause(failures, self.rt.world_size)
        entry = {
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
            "cause": {"rank": cause.get("rank"), "error": cause.get("error")},
            "attempt": attempt,
            "time": time.time(),
            # when the previous attempt failed: its first recorded error (a rank killed
            # without a word leaves its peers' broken connections), else the last flight
            # record of this rank's previous attempt
            "failed_at": min((r["time"] for r in failures), default=previous.get("time")),
            "resumed_from": resumed_from or 0,
            "reached_before": reached,
            "steps_redone": None if reached is None else max(0, reached - (resumed_from or 0)),
        }
        append_restart(self.run_dir, entry)
        self._warn(
            f"restart {attempt}: resumed from step {entry['resumed_from']}"
            + (f", redoing {entry['steps_redone']} step(s)" if reached is not None else "")
        )

    def _record_resumed(self) -> None:
        """After an elastic restart, at the first step: when training resumed (the
        restart's gap ends here), beside the restart's entry in health/restarts.jsonl."""
        if self.flight.attempt == 0:
            return
        entry = {"run_id": os.environ.get("TORCHELASTIC_RUN_ID"), "attempt": self.flight.attempt,
                 "kind": "resumed", "resumed_at": self.timing.first_step_at}  # fmt: skip
        append_restart(self.run_dir, entry)

    def _resume(self) -> int | None:
        state = self.checkpointer.resume(self.rt.is_main)
        if state is None:
            return None
        scaler = self.optimizers.scaler
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        # the schedule keeps the horizon the run started with (checkpoints written before
        # it was recorded: this launch's train.steps, as they were resumed then)
        self.optimizers.lr_horizon = int(state.get("lr_horizon") or self.cfg.train.steps)
        return int(state["step"])

    def _reference_compute_s(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """Forward+backward time of one micro-batch with no communication at all.

        Measured on a local, unwrapped replica so the real model's gradients stay
        untouched; only for layouts that hold the whole model (tp = pp = 1), and
        skipped when it would not comfortably fit."""
        if self.dims.tp_enabled or self.dims.pp_enabled:
            return None
        full_bytes = self.params.total * 4 * 4  # params + grads + activation headroom
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if full_bytes > 0.2 * free:
                return None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.train.seed)
            replica = build_model(self.cfg.model).to(self.device)
            blocks = blocks_of(replica)
            apply_activation_checkpointing(blocks, self.cfg.train.activation_checkpointing)
            times = []
            for _ in range(3):
                self.strategy.sync()
                t0 = time.perf_counter()
                with self.strategy.autocast():
                    logits = replica(x)
                cross_entropy(logits, y).backward()
                self.strategy.sync()
                times.append(time.perf_counter() - t0)
            del replica
        return min(times[1:])

    def _validate(self) -> float:
        """Mean loss over `eval_batches` validation batches of `global_batch` sequences:
        the same sequences under every layout, so the value is comparable across them.
        Each rank evaluates its dp slice, a micro-batch at a time (a pipeline step's
        worth under pp)."""
        c = self.cfg
        batches = []  # a parameter server's: it only joins the reduction
        if self.engine.reads_data:
            batches = val_batches(
                self.splits.val,
                c.model.seq_len,
                c.train.global_batch,
                c.train.eval_batches,
                self.dp_rank,
                self.dp,
                c.train.seed,
            )
        chunk = c.train.micro_batch * (self.accum if self.dims.pp_enabled else 1)
        self.parts.train(False)
        total = torch.zeros((), device=self.device)
        count = 0
        for x, y in batches:
            for i in range(0, x.shape[0], chunk):
                total += self.strategy.eval_loss(x[i : i + chunk], y[i : i + chunk])
                count += 1
        self.parts.train(True)
        return self.strategy.reduce_loss(total / max(count, 1)).item()

    # -- the run ------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        c, rt = self.cfg, self.rt
        t = c.train
        self.timing.ready_at = time.time()
        sink = None
        if rt.is_main:
            sink = Guarded("metrics.jsonl", JsonlSink(self.run_dir / "metrics.jsonl"), self._warn)
        peak = detect_peak_flops(self.device, c.precision.dtype, torch.get_num_threads())
        # the sharded-optimizer timing runs on the dp mesh when it spans the world
        self.machine_profile = None  # the planner does not model a parameter server
        if not self.dims.parameter_server and not c.model.is_factory:
            whole = not (self.dims.tp_enabled or self.dims.pp_enabled)
            group = self.mesh["dp"] if whole else None
            # the run's own layout timed: its whole step (tp 1, or a pipeline of
            # tensor-parallel stages), or its model under tensor parallelism alone
            self.machine_profile = measure_profile(
                self.device, c.precision.dtype, group, c, layout_mesh=self.mesh
            )
        resumed_from = self._resume()
        start = resumed_from or 0
        if rt.is_main:
            self._record_restart(resumed_from)
            self.segment = open_segment(
                self.run_dir,
                start_step=start,
                steps=t.steps,
                lr_horizon=self.optimizers.lr_horizon,
                world_size=rt.world_size,
                layout=self.layout(),
                run_id=os.environ.get("TORCHELASTIC_RUN_ID"),
                attempt=self.flight.attempt,
            )
        loader: DistributedBatchLoader | NoBatches = NoBatches(start)  # a parameter server
        if self.engine.reads_data:
            loader = DistributedBatchLoader(
                self.splits.train,
                c.model.seq_len,
                t.global_batch,
                t.micro_batch,
                self.dp_rank,
                self.dp,
                t.seed,
                start,
                c.data.prefetch,
                readers=c.data.readers,
            )
        rows: list[dict[str, Any]] = []
        pipeline_times: list[tuple[float, float]] = []  # (busy, wall) of steady steps
        last_loss: float | None = None
        last_saved = resumed_from
        ref_compute_s: float | None = None
        state_bytes: dict[str, int] | None = None
        tp_sampled = False
        started = time.perf_counter()
        progress = TrainingProgress(t.steps, start, rt.is_main, c.name)
        tracer = StepTracer(self.run_dir, rt.rank, parse_steps(c.observe.trace_steps), self.device)
        with loader, progress, contextlib.ExitStack() as observers:
            self.progress = progress
            sinks = self._start_observers(observers, resumed_from)
            if resumed_from is not None:
                progress.log(f"resumed from checkpoint at step {resumed_from}")
            if rt.is_main and self.machine_profile is not None:
                progress.log(_profile_line(self.machine_profile.details))
            interval_t0, interval_steps = time.perf_counter(), 0
            wait0, slow_data_warned = loader.total_wait_s, False
            marks = _comm_marks()
            fl, first_interval = self.flight, True
            slow = faults.slow_factor(rt.rank)
            for step in range(start, t.steps):
                logging_step = (step + 1) % c.observe.log_every == 0 or step + 1 == t.steps
                self.stop.begin_step()
                tracer.begin(step + 1)
                t0 = time.perf_counter()
                fl.set_phase("data")
                batch = next(loader)
                data_s = loader.last_wait_s
                self.stragglers.add_data_wait(data_s)
                fl.set_phase("forward")
                faults.maybe_oom(step + 1, rt.rank)
                if step == start:
                    # every rank starts together: a peer still measuring the machine (its
                    # first run there) would slow this rank's communication-free reference
                    # and hide the exposed time
                    dist.barrier()
                    self.timing.first_step_at = time.time()
                    if rt.is_main:
                        self._record_resumed()
                        if self.segment is not None:
                            mark_first_step(self.run_dir, self.segment, self.timing.first_step_at)
                if ref_compute_s is None and step == start and self._needs_reference():
                    x0, y0 = batch.micro_batches[0]
                    ref_compute_s = self._reference_compute_s(
                        x0.to(self.device), y0.to(self.device)
                    )
                    t0 = time.perf_counter() - data_s
                # one profiler at a time: a traced step leaves the TP sample to a later one
                sample_tp = self.dims.tp_enabled and not tracer.traces(step + 1)
                if logging_step and sample_tp and not tp_sampled and step > start:
                    # one profiled step per run: the time in tensor-parallel collectives
                    result, tp_comm_s = measure_tp_comm(
                        functools.partial(self.strategy.step, step, batch.micro_batches, True),
                        self.device,
                    )
                    result.tp_comm_s, tp_sampled = tp_comm_s, True
                    self.tp_comm_s = tp_comm_s
                    busy = sum(result.micro_s) or (result.wall_s or 0.0)
                    self.tp_comm_share = min(1.0, tp_comm_s / busy) if busy > 0 else None
                else:
                    result = self.strategy.step(step, batch.micro_batches, logging_step)
                if slow > 1:
                    _busy(time.perf_counter() - t0, slow - 1)
                if result.busy_s is not None and step > start:
                    pipeline_times.append((result.busy_s, result.wall_s or 0.0))
                if step + 1 == t.steps:
                    state_bytes = self.model_state_bytes()
                self.optimizers.zero_grad()
                step_s = time.perf_counter() - t0
                interval_steps += 1

                if logging_step:
                    fl.set_phase("metrics")
                    steady = not first_interval  # the first interval includes start-up
                    comm = self._comm_interval(marks, interval_steps, steady)
                    ps = self.dims.parameter_server  # servers run no model: judge workers
                    own_s, stragglers, ranks = self.stragglers.exchange(
                        first_interval or ps, rank_figures(self.device, step_s)
                    )
                    if ps and not first_interval:
                        stragglers = self.stragglers.judge(own_s[: self.dp])
                    first_interval = False
                    loss_value = self.strategy.reduce_loss(result.loss_sum / self.accum).item()
                    self.strategy.sync()
                    now = time.perf_counter()
                    tokens_per_s = interval_steps * self.tokens_per_step / (now - interval_t0)
                    row = self._metrics_row(
                        step + 1, loss_value, result, now - t0, data_s, tokens_per_s, peak,
                        ref_compute_s,
                    )  # fmt: skip
                    row.update(comm)
                    # the share of the interval's wall time spent waiting for batches
                    wait = loader.total_wait_s - wait0
                    row["data_wait_fraction"] = wait / max(now - interval_t0, 1e-9)
                    wait0 = loader.total_wait_s
                    share = row["data_wait_fraction"]
                    if steady and share > c.data.wait_warning and not slow_data_warned:
                        slow_data_warned = True
                        self._warn(
                            f"waiting for data: {share:.0%} of the step time "
                            f"(data.wait_warning {c.data.wait_warning:.0%}) reading "
                            f"{c.data.source}; more data.readers or data.prefetch, or "
                            "faster storage (meshforge bench io)"
                        )
                    if steady:
                        self.comm_samples[-1]["step_s"] = (now - interval_t0) / interval_steps
                    interval_t0, interval_steps = now, 0
                    marks = _comm_marks()
                    last_loss = loss_value
                    row["own_s_per_rank"] = [round(v, 4) for v in own_s]
                    self._add_rank_figures(row, ranks)
                    if stragglers:
                        row["stragglers"] = stragglers
                        self._warn(
                            "straggler: rank(s) "
                            + ", ".join(
                                f"{r} ({self.stragglers.named[r]:.2f}x the median)"
                                for r in stragglers
                            )
                            + " of their own work per step"
                        )
                    if t.eval_every and (step + 1) % t.eval_every == 0:
                        fl.set_phase("eval")
                        row["val_loss"] = self._validate()
                    rows.append(row)
                    if sink is not None:
                        sink.call("write", row)
                    sinks.write(row)
                    progress.update(step + 1, row)
                    if not rt.is_main or progress.live:  # else the printed line is logged
                        log.info("step %d/%d | %s", step + 1, t.steps, status_text(row, None))

                done = step + 1
                tracer.end(done)
                fl.progress(done, step_s)
                every = c.checkpoint.every
                stop = self.stop.end_step()  # the same answer on every rank
                if done == t.steps or stop:
                    self.timing.last_step_at = time.time()
                if (every and done % every == 0) or done == t.steps or stop:
                    fl.set_phase("checkpoint")
                    cpu0, wall0 = time.process_time(), time.perf_counter()
                    self.checkpointer.save(done, self.trainer_state(done, last_loss))
                    if done == t.steps or stop:
                        self.timing.final_checkpoint_s = time.perf_counter() - wall0
                    # rank 0 writes more of a checkpoint: not a sign of a slow rank
                    self.stragglers.exclude(time.process_time() - cpu0)
                    last_saved = done
                    faults.maybe_kill_after_checkpoint(done, rt.rank)
                faults.maybe_crash(done, rt.rank)
                faults.maybe_kill(done, rt.rank)
                faults.maybe_hang(done, rt.rank)
                if step == start and c.runtime.step_timeout_s:
                    set_collective_timeout(c.runtime.step_timeout_s)  # start-up is over
                if stop:
                    self.stopped = {"step": done, "signal": self.stop.requested_by}
                    progress.log(f"stopped after step {done} (checkpoint written)")
                    break
            tracer.close()
            fl.set_phase("report")
            if state_bytes is None:  # resumed from the final checkpoint, or stopped
                state_bytes = self.model_state_bytes()
            val_loss = rows[-1].get("val_loss") if rows and rows[-1]["step"] == t.steps else None
            if val_loss is None and t.eval_every and self.stopped is None:
                val_loss = self._validate()
        self.progress = None
        digest = self.engine.param_digest()
        per_rank = {
            "host": host_of_rank(),
            "state": state_bytes,
            "peak": peak_memory_bytes(self.device),
            "pipeline": _bubble_of(pipeline_times),
            "parameter_server": self.strategy.server_counters(),
            "comm": _comm_summary(self.comm_samples, self.rt.env.local_rank == 0),
            "cuda_memory": cuda_memory_stats(self.device),
        }
        gathered: list[Any] = [None] * rt.world_size
        dist.all_gather_object(gathered, per_rank)
        if rt.is_main:  # every rank has written its trace before the gather
            tracer.merge(rt.world_size)
        report = None
        if rt.is_main:
            stopped = self.stopped or {}
            close_segment(
                self.run_dir,
                self.segment,
                stopped.get("step", max(start, t.steps)),
                "stopped" if self.stopped else "completed",
                wall_s=time.perf_counter() - started,
                **({"signal": stopped["signal"]} if stopped.get("signal") else {}),
            )
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
                segment=self.segment,
            )
            write_report(self.run_dir, report)
        return report or {}

    def _metrics_row(
        self,
        step: int,
        loss: float,
        result: StepResult,
        step_s: float,
        data_s: float,
        tokens_per_s: float,
        peak: PeakFlops,
        ref_compute_s: float | None,
    ) -> dict[str, Any]:
        """One row of metrics.jsonl: this rank's (rank 0's) view of a logged step."""
        comm_s = self._exposed_comm_s(result.micro_s, ref_compute_s, result.busy_s)
        bubble_s = None
        if result.busy_s is not None and result.wall_s is not None:
            bubble_s = max(0.0, result.wall_s - result.busy_s)
            fwd_bwd_s = result.wall_s
            compute_s = max(0.0, result.busy_s - (comm_s or 0.0))
        else:
            fwd_bwd_s = sum(result.micro_s)
            compute_s = max(0.0, fwd_bwd_s - (comm_s or 0.0))
        row = {
            "step": step,
            "time": time.time(),
            "loss": loss,
            "lr": self.optimizers.lr_at(step - 1),
            "grad_norm": None if result.grad_norm is None else float(result.grad_norm),
            "tokens_per_s": tokens_per_s,
            "mfu": self._mfu(tokens_per_s, peak),
            "step_time_s": step_s,
            "data_s": data_s,
            "compute_s": compute_s,
            "comm_s": comm_s,
            "bubble_s": bubble_s,
            "other_s": max(0.0, step_s - data_s - fwd_bwd_s),
            "peak_memory_bytes": peak_memory_bytes(self.device),
            "activation_bytes": result.activation_bytes,
        }
        if result.tp_comm_s is not None:
            row["tp_comm_s"] = result.tp_comm_s
        if self.optimizers.scaler is not None:
            row["loss_scale"] = float(self.optimizers.scaler.get_scale())
        if self.segment is not None:  # a step trained again later has a newer row
            row["segment"] = self.segment
        return row

    # -- observing ----------------------------------------------------------------------------
    def _start_observers(self, stack: contextlib.ExitStack, resumed_from: int | None) -> Sinks:
        """The node's system sampler (its first rank) and this process's sinks, closed
        by `stack` however the run ends."""
        o, rt = self.cfg.observe, self.rt
        here = host_of_rank()
        logged = None  # what an earlier segment logged to W&B, which cannot take it again
        if rt.rank == 0 and o.wandb is not None and resumed_from is not None:
            logged = _last_logged_step(self.run_dir / "metrics.jsonl")
        sinks = open_sinks(self.cfg, self.run_dir, rt.rank, rt.env.local_rank, here, self._warn,
                           resumed_from, logged)  # fmt: skip
        stack.callback(sinks.close)
        where = []
        if sinks.exporter is not None:
            where.append(f"Prometheus metrics at {sinks.exporter.url}")
        if any(g.name == "TensorBoard" for g in sinks.guarded):
            where.append(f"TensorBoard: tensorboard --logdir {self.run_dir / 'tensorboard'}")
        if sinks.wandb is not None:
            w = sinks.wandb.where
            where.append(
                f"Weights & Biases: offline run in {w} (upload it: wandb sync {w}/offline-run-*)"
                if isinstance(w, Path)
                else f"Weights & Biases: {w}"
            )
        for text in where:
            log.info(text)
            if rt.is_main and self.progress is not None:
                self.progress.log(text)
        if o.system and rt.env.local_rank == 0:
            path = sampler_path(self.run_dir, here.get("node"), here["host"])
            self.sampler = SystemSampler(
                path, o.sample_every_s, host=here, warn=self._warn, on_sample=sinks.write_system
            ).start()
            stack.callback(self.sampler.close)
            if sinks.exporter is not None:
                sinks.exporter.sampler = self.sampler
        return sinks

    def _add_rank_figures(self, row: dict[str, Any], ranks: list[list[float]]) -> None:
        """Every rank's step time and memory in the row, with memory advice when a
        threshold is crossed (warned once per distinct advice)."""
        cols = {name: [r[i] for r in ranks] for i, name in enumerate(RANK_FIGURES)}
        row["step_time_s_per_rank"] = [round(v, 5) for v in cols["step_s"]]
        row["memory_bytes_per_rank"] = [int(v) for v in cols["memory"]]
        row["peak_memory_bytes_per_rank"] = [int(v) for v in cols["peak"]]
        cuda = self.device.type == "cuda"
        if cuda:
            row["reserved_bytes_per_rank"] = [int(v) for v in cols["reserved"]]
        per_rank = [
            {
                "rank": rank,
                "allocated_bytes": int(cols["memory"][rank]) if cuda else None,
                "reserved_bytes": int(cols["reserved"][rank]) if cuda else None,
                "alloc_retries": int(cols["retries"][rank]),
                "ooms": int(cols["ooms"][rank]),
            }
            for rank in range(len(ranks))
        ]
        host = self.sampler.latest if self.sampler is not None else None
        advice = memory_advice(per_rank, host, self.cfg.observe.fragmentation_threshold)
        if advice:
            row["memory_advice"] = advice
        for text in advice:  # the same advice with new figures replaces the old
            kind = re.sub(r"[\d.,%]+", "#", text)
            if kind not in self.memory_advice:
                self._warn(f"memory: {text}")
            self.memory_advice[kind] = text

    # -- communication ----------------------------------------------------------------------
    def _no_peers(self) -> bool:
        """Nothing to communicate: one data-parallel rank and no parameter server."""
        return self.dp == 1 and not self.dims.parameter_server

    def _needs_reference(self) -> bool:
        """Whether exposed data-parallel communication is measured against a replica:
        the whole model on this rank (tp = pp = 1), data-parallel peers, and no other
        micro-batch of the step runs without communication (DDP's no_sync ones do;
        FSDP gathers parameters in every one)."""
        if self._no_peers() or self.dims.tp_enabled or self.dims.pp_enabled:
            return False
        if not self.engine.reads_data:  # a parameter server: no model to time
            return False
        return not (self.parts.wrapper == "ddp" and self.accum > 1)

    def comm_method(self) -> str:
        """How this layout's exposed communication is measured (report.json says so)."""
        if self.dims.pp_enabled:
            return "pipeline: stage waits, point-to-point transfers included, are the bubble" + (
                "; tensor-parallel collectives profiled" if self.dims.tp_enabled else ""
            )
        if self.dims.tp_enabled:
            return "tensor-parallel collectives profiled in one sampled step"
        if self._no_peers():
            return "none: no data-parallel peers"
        if self.dims.parameter_server:
            return (
                "worker's forward+backward with its push and pull, minus a "
                "communication-free replica's forward+backward"
            )
        if self._needs_reference():
            return "forward+backward minus a communication-free replica's, per micro-batch"
        return "synchronising micro-batch minus the step's no_sync micro-batches"

    def _exposed_comm_s(
        self, micro_s: list[float], ref_s: float | None, busy_s: float | None = None
    ) -> float | None:
        """Communication time of a logged step not hidden behind compute.

        Data parallel (tp = pp = 1): the step's forward+backward time minus the same
        work without communication: the step's no_sync micro-batches under DDP with
        accumulation, else a local replica timed at start (FSDP gathers parameters in
        every micro-batch). Tensor parallel: the share of the profiled step's
        forward+backward spent in its collectives, applied to this step's.
        Pipelines: their waits are the bubble, reported apart."""
        if self.dims.tp_enabled:
            if self.tp_comm_share is None:
                return 0.0 if self.dims.pp_enabled else None
            return self.tp_comm_share * (sum(micro_s) or busy_s or 0.0)
        if self.dims.pp_enabled:
            return 0.0
        if self._no_peers():
            return 0.0
        if not micro_s:
            return None
        if not self._needs_reference():
            ref_s = statistics.fmean(micro_s[:-1])
        if ref_s is None:
            return None
        return max(0.0, sum(micro_s) - len(micro_s) * ref_s)

    def _comm_interval(
        self, marks: tuple[int, int | None], steps: int, steady: bool
    ) -> dict[str, Any]:
        """Bytes per step of the logged interval just ended: this rank's payload to
        torch.distributed and, from the host's first rank, the host's interfaces."""
        payload0, tx0 = marks
        payload = (comm_bytes.payload_bytes() - payload0) / steps + self.reducer_bytes
        out: dict[str, Any] = {"comm_bytes": payload}
        tx = comm_bytes.host_tx_bytes()
        if tx is not None and tx0 is not None:
            out["net_tx_bytes"] = (tx - tx0) / steps
        if steady:
            self.comm_samples.append({"payload": payload, "tx": out.get("net_tx_bytes")})
        return out

    def _mfu(self, tokens_per_s: float, peak: PeakFlops) -> float | None:
        if not peak.flops_per_s:
            return None
        # per device that runs the model: parameter servers run none of its FLOPs
        per_device = tokens_per_s * self.flops_per_token / self.dims.compute_ranks
        return per_device / peak.flops_per_s


def _profile_line(details: dict[str, Any]) -> str:
    """Where the machine figures behind report.json's `predicted` come from."""
    load = details.get("load_average")
    then = f", load average {load:.1f}" if load is not None else ""
    if details.get("cached"):
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(details.get("measured_at") or 0))
        return (
            f"machine profile from the cache (measured {when}{then}; now "
            f"{os.getloadavg()[0]:.1f}; --recalibrate measures again)"
        )
    return f"machine profile measured{then}; cached for later runs of this job and layout"


def _last_logged_step(path: Path) -> int | None:
    """The newest step in metrics.jsonl (None when there is none to read)."""
    try:
        steps = [r.get("step") for r in read_jsonl(path)]
    except (OSError, ValueError):
        return None
    return max((int(s) for s in steps if isinstance(s, int | float)), default=None)


def _comm_marks() -> tuple[int, int | None]:
    return comm_bytes.payload_bytes(), comm_bytes.host_tx_bytes()


def _comm_summary(samples: list[dict[str, Any]], host_first_rank: bool) -> dict[str, Any] | None:
    """Medians over the steady logged intervals: payload bytes per step of this rank;
    on the host's first rank, the host's transmitted bytes per step and per second."""
    if not samples:
        return None
    payload = statistics.median(s["payload"] for s in samples)
    out: dict[str, Any] = {"payload_bytes_per_step": payload}
    tx = [s for s in samples if s.get("tx") is not None]
    if host_first_rank and tx:
        out["net_tx_bytes_per_step"] = statistics.median(s["tx"] for s in tx)
        rates = [s["tx"] / s["step_s"] for s in tx if s.get("step_s")]
        out["net_tx_bytes_per_s"] = statistics.median(rates) if rates else None
    return out


def _bubble_of(times: list[tuple[float, float]]) -> dict[str, float] | None:
    """This rank's pipeline idle fraction over the steady steps: 1 - busy / wall."""
    if not times:
        return None
    busy = sum(b for b, _ in times)
    wall = sum(w for _, w in times)
    return {"busy_s": busy, "wall_s": wall, "bubble": max(0.0, 1.0 - busy / wall) if wall else 0.0}


def _busy(seconds: float, factor: float) -> None:
    """Burn `factor` x `seconds` of processor time (the `slow` fault: a slow device)."""
    end = time.process_time() + seconds * factor
    x = 0
    while time.process_time() < end:
        x += 1
