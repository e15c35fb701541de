"""The training loop: set up a run, then ask the step strategy for one optimizer
step at a time; log, validate and checkpoint around it.

The loop never knows the layout. The `Engine` (train/engine.py) holds the mesh, the
model parts, the optimizers and the step strategy; the work around a step is done by
components that own their cadence: `MetricsLogger` (train/metrics_logger.py: rows
every `log_every` steps, sinks, stragglers, data waits, memory advice), `CommMeasure`
(train/exposed_comm.py), `Validation` (train/validation.py), `CheckpointCadence`
(train/cadence.py), `RunHistory` (train/history.py: segments and restarts) and
`FaultHooks` (train/faults.py). The machine is measured for the planner before `fit`
(train/calibration.py `calibrate`); the report is built from a `RunSummary`
(train/report.py). Metrics are reduced every `log_every` steps only, so the loop does
not synchronise more than the parallel layout needs.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshforge.config import JobConfig, parse_steps
from meshforge.data.corpus import load_tokens
from meshforge.data.loader import DistributedBatchLoader, NoBatches
from meshforge.errors import ConfigError
from meshforge.observe.console import TrainingProgress
from meshforge.observe.flight import FlightRecorder
from meshforge.observe.memhealth import cuda_memory_stats
from meshforge.observe.memory import peak_memory_bytes, tensor_bytes
from meshforge.observe.straggler import StragglerWatch
from meshforge.observe.trace import StepTracer
from meshforge.plan.core.flops import (
    FACTORY_FLOPS_CONVENTION,
    FLOPS_CONVENTION,
    ParamCount,
    gpt_param_count,
    shape_of,
    training_flops_per_token,
)
from meshforge.plan.jobs.machine_fit import MeasuredProfile
from meshforge.runtime.agree import host_of_rank
from meshforge.runtime.control import StopControl, set_collective_timeout
from meshforge.runtime.dist import Runtime
from meshforge.train.cadence import CheckpointCadence
from meshforge.train.calibration import profile_line
from meshforge.train.checkpoint import Checkpointer
from meshforge.train.engine import Engine
from meshforge.train.exposed_comm import CommMeasure
from meshforge.train.faults import FaultHooks
from meshforge.train.history import RunHistory
from meshforge.train.metrics_logger import MetricsLogger, pipeline_bubble
from meshforge.train.report import RunSummary, build_report, write_report
from meshforge.train.timing import RunTiming, launched_at, process_start
from meshforge.train.validation import Validation

log = logging.getLogger(__name__)


class Trainer:
    def __init__(
        self, cfg: JobConfig, run_dir: Path, rt: Runtime, flight: FlightRecorder | None = None
    ) -> None:
        cfg.check_trainable()
        self.cfg, self.run_dir, self.rt = cfg, Path(run_dir), rt
        self.device = rt.device
        self.dims = cfg.dims(rt.world_size, rt.device.type)
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
        self.dp_rank = self.engine.dp_rank
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
        self.progress: TrainingProgress | None = None
        # what this rank is doing (observe/flight.py); a disabled one when not given
        self.flight = flight or FlightRecorder(run_dir, rt.rank, rt.world_size, enabled=False)
        self.strategy.flight = self.flight
        self.stop = StopControl(rt.world_size)  # SIGTERM, Ctrl-C: checkpoint, leave together
        self.stopped: dict[str, Any] | None = None
        # start-up, shutdown (train/timing.py); rank 0's marks are the report's
        self.timing = RunTiming(launched_at(), process_start(), rt.up_at)
        # the components around the step, each owning its cadence
        self.stragglers = StragglerWatch(
            rt.world_size, cfg.observe.straggler_margin, cfg.observe.straggler_intervals
        )
        # bytes handed to torch.distributed per step, exposed communication time
        self.comm = CommMeasure(cfg, self.engine, self.device, self.params.total)
        self.metrics = MetricsLogger(cfg, self.run_dir, rt, self.engine, self.comm,
                                     self.stragglers, self.flops_per_token, self._warn)  # fmt: skip
        self.validation = Validation(cfg, self.splits.val, self.engine, self.dp_rank, self.device)
        self.history = RunHistory(self.run_dir, rt.world_size, rt.is_main, self.flight.attempt,
                                  self.flight.previous, self._warn)  # fmt: skip
        self.cadence = CheckpointCadence(self.checkpointer, cfg.checkpoint.every, t.steps,
                                         self.trainer_state, self.stragglers, self.timing,
                                         self.flight)  # fmt: skip
        self.faults = FaultHooks(rt.rank)
        self.timing.ready_at = time.time()

    # -- what the report and checkpoints record ------------------------------------------
    def layout(self) -> dict[str, Any]:
        c = self.cfg
        return {
            **self.dims.as_dict(),
            "grad_accum": self.dims.microbatches,
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

    def _warn(self, message: str) -> None:
        log.warning(message)
        if self.progress is not None:
            self.progress.log(f"warning: {message}")
        elif self.rt.is_main:
            print(f"meshforge: warning: {message}", file=sys.stderr, flush=True)

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

    def _loader(self, start: int) -> DistributedBatchLoader | NoBatches:
        """This rank's batches from step `start` on (none for a parameter server)."""
        c, t = self.cfg, self.cfg.train
        if not self.engine.reads_data:
            return NoBatches(start)
        return DistributedBatchLoader(
            self.splits.train,
            c.model.seq_len,
            t.global_batch,
            t.micro_batch,
            self.dp_rank,
            self.dims.dp,
            t.seed,
            start,
            c.data.prefetch,
            readers=c.data.readers,
        )

    # -- the run ------------------------------------------------------------------------------
    def fit(self, machine_profile: MeasuredProfile | None = None) -> dict[str, Any]:
        """Train from the newest checkpoint (or step 0) to `train.steps`, or until asked
        to stop; rank 0 returns the report (written to report.json), the others {}.
        `machine_profile`: this machine measured for the planner (`calibrate`)."""
        c, rt, t, fl = self.cfg, self.rt, self.cfg.train, self.flight
        resumed_from = self._resume()
        start = resumed_from or 0
        self.history.begin(resumed_from, t.steps, self.optimizers.lr_horizon, self.layout())
        self.cadence.last_saved = resumed_from
        loader = self._loader(start)
        state_bytes: dict[str, int] | None = None
        started = time.perf_counter()
        progress = TrainingProgress(t.steps, start, rt.is_main, c.name)
        tracer = StepTracer(self.run_dir, rt.rank, parse_steps(c.observe.trace_steps), self.device)
        with loader, progress, contextlib.ExitStack() as observers:
            self.progress = progress
            self.metrics.open(observers, progress, resumed_from, self.history.segment)
            if resumed_from is not None:
                progress.log(f"resumed from checkpoint at step {resumed_from}")
            if rt.is_main and machine_profile is not None:
                progress.log(profile_line(machine_profile.details))
            for step in range(start, t.steps):
                done = step + 1
                logging_step = done % c.observe.log_every == 0 or done == t.steps
                self.stop.begin_step()
                tracer.begin(done)
                t0 = time.perf_counter()
                fl.set_phase("data")
                batch = next(loader)
                data_s = loader.last_wait_s
                self.stragglers.add_data_wait(data_s)
                fl.set_phase("forward")
                self.faults.before_forward(done)
                if step == start:
                    self._first_step()
                    if self.comm.reference(batch.micro_batches):
                        t0 = time.perf_counter() - data_s  # the replica's time is not the step's
                may_profile = step > start and not tracer.traces(done)
                result = self.comm.run_step(step, batch.micro_batches, logging_step, may_profile)
                self.faults.slow_down(time.perf_counter() - t0)
                self.metrics.count(result, steady=step > start)
                self.metrics.expert_load.after_step()
                if done == t.steps:
                    state_bytes = self.model_state_bytes()
                self.optimizers.zero_grad()
                step_s = time.perf_counter() - t0
                if logging_step:
                    fl.set_phase("metrics")
                    row = self.metrics.row(done, result, t0, data_s, step_s, loader.total_wait_s)
                    if self.validation.due(done):
                        fl.set_phase("eval")
                        row["val_loss"] = self.validation.run()
                    self.metrics.write(row)
                tracer.end(done)
                fl.progress(done, step_s)
                stop = self.stop.end_step()  # the same answer on every rank
                if self.cadence.after_step(done, stop, self.metrics.last_loss):
                    self.faults.after_checkpoint(done)
                self.faults.after_step(done)
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
            val_loss = self.validation.final(self.metrics.rows, self.stopped is not None)
        self.progress = None
        return self._finish(
            tracer, state_bytes, resumed_from, val_loss, machine_profile,
            wall_s=time.perf_counter() - started, data_wait_s=loader.total_wait_s,
        )  # fmt: skip

    def _first_step(self) -> None:
        """Every rank starts together: a peer still measuring the machine (its first run
        there) would slow this rank's communication-free reference and hide the exposed
        time."""
        dist.barrier()
        self.timing.first_step_at = time.time()
        self.history.first_step(self.timing.first_step_at)

    def _finish(
        self,
        tracer: StepTracer,
        state_bytes: dict[str, int],
        resumed_from: int | None,
        val_loss: float | None,
        machine_profile: MeasuredProfile | None,
        wall_s: float,
        data_wait_s: float,
    ) -> dict[str, Any]:
        """Collective: every rank's figures to rank 0, which closes the segment and
        writes report.json."""
        rt, steps = self.rt, self.cfg.train.steps
        digest = self.engine.param_digest()
        per_rank = {
            "host": host_of_rank(),
            "state": state_bytes,
            "peak": peak_memory_bytes(self.device),
            "pipeline": pipeline_bubble(self.metrics.pipeline_times),
            "parameter_server": self.strategy.server_counters(),
            "comm": self.comm.summary(rt.env.local_rank == 0),
            "cuda_memory": cuda_memory_stats(self.device),
        }
        gathered: list[Any] = [None] * rt.world_size
        dist.all_gather_object(gathered, per_rank)
        if not rt.is_main:
            return {}
        tracer.merge(rt.world_size)  # every rank has written its trace before the gather
        start = resumed_from or 0
        stopped_at = (self.stopped or {}).get("step", max(start, steps))
        self.history.end(stopped_at, self.stopped, wall_s)
        report = build_report(
            self.summary(machine_profile),
            rows=self.metrics.rows,
            per_rank=gathered,
            resumed_from=resumed_from,
            last_checkpoint=self.cadence.last_saved,
            val_loss=val_loss,
            digest=digest,
            wall_s=wall_s,
            data_wait_s=data_wait_s,
            segment=self.history.segment,
        )
        write_report(self.run_dir, report)
        return report

    def summary(self, machine_profile: MeasuredProfile | None = None) -> RunSummary:
        """What the report says of this run beside its rows and per-rank figures."""
        return RunSummary(
            cfg=self.cfg,
            run_dir=self.run_dir,
            world_size=self.rt.world_size,
            device=str(self.device),
            backend=self.rt.backend,
            layout=self.layout(),
            dims=self.dims,
            params=self.params,
            flops_per_token=self.flops_per_token,
            flops_convention=self.flops_convention,
            peak=self.metrics.peak,
            comm_method=self.comm.method(),
            memory_advice=list(self.metrics.memory_advice.values()),
            stragglers=dict(self.stragglers.named),
            lr_horizon=self.optimizers.lr_horizon,
            attempt=self.flight.attempt,
            timing=self.timing,
            machine_profile=machine_profile,
            stopped=self.stopped,
        )
