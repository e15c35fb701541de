"""The metrics of a run, every `observe.log_every` steps: one row of metrics.jsonl,
reduced over the ranks only at those steps (the loop synchronises no more than the
layout needs), with the checks made at the same time: stragglers, waiting for data,
memory advice. The logger owns the sinks (metrics.jsonl, TensorBoard, W&B, the
Prometheus exporter; observe/sinks.py) and the node's system sampler, opened on a
stack that closes them however the run ends."""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from meshforge.observe.console import TrainingProgress, status_text
from meshforge.observe.expert_load import hot_expert_cause
from meshforge.observe.memhealth import memory_advice
from meshforge.observe.memory import peak_memory_bytes
from meshforge.observe.metrics import JsonlSink, is_tail
from meshforge.observe.peak import PeakFlops, detect_peak_flops
from meshforge.observe.sampler import SystemSampler, sampler_path
from meshforge.observe.sinks import Guarded, Sinks, open_sinks
from meshforge.observe.straggler import RANK_FIGURES, StragglerWatch, rank_figures
from meshforge.redact import redact_url
from meshforge.rundir.records import read_jsonl
from meshforge.runtime.agree import host_of_rank
from meshforge.runtime.dist import Runtime
from meshforge.train.exposed_comm import CommMeasure
from meshforge.train.moe_load import ExpertLoad
from meshforge.train.step import StepResult

if TYPE_CHECKING:
    from meshforge.config import JobConfig
    from meshforge.train.engine import Engine

log = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(
        self,
        cfg: JobConfig,
        run_dir: Path,
        rt: Runtime,
        engine: Engine,
        comm: CommMeasure,
        stragglers: StragglerWatch,
        flops_per_token: float,
        warn: Callable[[str], None],
    ) -> None:
        self.cfg, self.run_dir, self.rt, self.engine = cfg, run_dir, rt, engine
        self.device, self.dims = rt.device, engine.dims
        self.comm, self.stragglers, self.warn = comm, stragglers, warn
        self.flops_per_token = flops_per_token
        self.tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
        self.rows: list[dict[str, Any]] = []  # this segment's logged rows (rank 0's view)
        self.last_loss: float | None = None
        self.memory_advice: dict[str, str] = {}  # the newest advice of each kind
        self.pipeline_times: list[tuple[float, float]] = []  # (busy, wall) of steady steps
        self.sampler: SystemSampler | None = None  # the node's, on its first rank
        self.peak = PeakFlops(None, "unknown", str(self.device))
        self.progress: TrainingProgress | None = None
        self.segment: int | None = None
        self._jsonl: Guarded | None = None
        self._sinks: Sinks | None = None
        self._interval_t0, self._interval_steps = time.perf_counter(), 0
        self._step = 0  # the last step counted
        self._wait0, self._first_interval, self._slow_data_warned = 0.0, True, False
        # a mixture of experts' routing: taken after every step, reduced per row
        self.expert_load = ExpertLoad(
            engine.parts, engine.dims, engine.mesh, rt.rank, cfg.model.n_layers
        )

    # -- the run's start ---------------------------------------------------------------------
    def open(
        self,
        stack: contextlib.ExitStack,
        progress: TrainingProgress,
        resumed_from: int | None,
        segment: int | None,
    ) -> None:
        """The sinks and, on the node's first rank, the system sampler, closed by
        `stack`; the peak FLOP/s that MFU divides by."""
        o, rt = self.cfg.observe, self.rt
        self.progress, self.segment = progress, segment
        self._step = resumed_from or 0
        if rt.is_main:
            path = self.run_dir / "metrics.jsonl"
            self._jsonl = Guarded("metrics.jsonl", JsonlSink(path), self.warn)
        self.peak = detect_peak_flops(
            self.device, self.cfg.precision.dtype, torch.get_num_threads()
        )
        here = host_of_rank()
        logged = None  # what an earlier segment logged to W&B, which cannot take it again
        if rt.rank == 0 and o.wandb is not None and resumed_from is not None:
            logged = _last_logged_step(self.run_dir / "metrics.jsonl")
        sinks = open_sinks(self.cfg, self.run_dir, rt.rank, rt.env.local_rank, here, self.warn,
                           resumed_from, logged)  # fmt: skip
        stack.callback(sinks.close)
        self._sinks = sinks
        for text in _where(sinks, self.run_dir):
            log.info(text)
            if rt.is_main:
                progress.log(text)
        if o.system and rt.env.local_rank == 0:
            path = sampler_path(self.run_dir, here.get("node"), here["host"])
            self.sampler = SystemSampler(
                path, o.sample_every_s, host=here, warn=self.warn, on_sample=sinks.write_system
            ).start()
            stack.callback(self.sampler.close)
            if sinks.exporter is not None:
                sinks.exporter.sampler = self.sampler
        self._interval_t0, self._interval_steps = time.perf_counter(), 0
        # pushed last, so it runs first when the segment ends: the sinks are still open
        stack.push(self._end_of_segment)

    def _end_of_segment(self, exc_type: type[BaseException] | None, *_: Any) -> bool:
        """The loop is over: on a normal end or an agreed stop every rank is here (a
        collective is safe); after an error some may not be, and nothing is reduced."""
        if exc_type is None:
            self.flush_tail()
        return False

    def flush_tail(self) -> None:
        """Collective: the counts of the steps after the segment's last logged row (a
        stop between two `log_every` steps), as a `moe_tail` record of metrics.jsonl at
        the last step that ran, so report.json's run-long `moe` counts cover every step
        trained. Only the MoE counts: the interval's other figures are not measured."""
        if not self._interval_steps:
            return
        moe = self.expert_load.interval(self.device)
        if moe is None:
            return
        tail: dict[str, Any] = {
            "step": self._step,
            "time": time.time(),
            "moe_tail": True,
            "interval_steps": self._interval_steps,
            "moe": moe,
        }
        if self.segment is not None:
            tail["segment"] = self.segment
        self._interval_steps = 0
        if not self.rt.is_main:
            return
        self.rows.append(tail)
        if self._jsonl is not None:
            self._jsonl.call("write", tail)

    # -- every step ----------------------------------------------------------------------------
    def count(self, result: StepResult, steady: bool) -> None:
        """A step ran (a steady one: not the segment's first)."""
        self._interval_steps += 1
        self._step += 1
        if result.busy_s is not None and steady:
            self.pipeline_times.append((result.busy_s, result.wall_s or 0.0))

    # -- every log_every steps -------------------------------------------------------------
    def row(
        self, step: int, result: StepResult, t0: float, data_s: float, step_s: float,
        wait_s: float,
    ) -> dict[str, Any]:  # fmt: skip
        """Collective: the row of the interval ending at `step`, with every rank's
        figures. `t0`: when the step began; `step_s`: its time on this rank;
        `wait_s`: the loader's total wait for batches so far."""
        self._step = step
        first = self._first_interval
        steady = not first  # the first interval includes start-up
        comm = self.comm.interval(self._interval_steps, steady)
        ps = self.dims.parameter_server  # servers run no model: judge the workers
        own_s, stragglers, ranks = self.stragglers.exchange(
            first or ps, rank_figures(self.device, step_s)
        )
        if ps and not first:
            stragglers = self.stragglers.judge(own_s[: self.dims.dp])
        self._first_interval = False
        strategy = self.engine.strategy
        loss = strategy.reduce_loss(result.loss_sum / self.dims.microbatches).item()
        strategy.sync()
        now = time.perf_counter()
        interval_s = now - self._interval_t0
        tokens_per_s = self._interval_steps * self.tokens_per_step / interval_s
        row = self._row(step, loss, result, now - t0, data_s, tokens_per_s)
        row.update(comm)
        moe = self.expert_load.interval(self.device)
        if moe is not None:
            row["moe"] = moe
        # the share of the interval's wall time spent waiting for batches
        row["data_wait_fraction"] = (wait_s - self._wait0) / max(interval_s, 1e-9)
        self._wait0 = wait_s
        if steady:
            self._check_data_wait(row["data_wait_fraction"])
        self.comm.close_interval(interval_s / self._interval_steps, steady)
        self._interval_t0, self._interval_steps = now, 0
        self.last_loss = loss
        row["own_s_per_rank"] = [round(v, 4) for v in own_s]
        self._add_rank_figures(row, ranks)
        if stragglers:
            row["stragglers"] = stragglers
            causes = {r: hot_expert_cause(r, self.dims, moe) for r in stragglers}
            causes = {r: c for r, c in causes.items() if c}
            if causes:
                row["straggler_causes"] = {str(r): c for r, c in causes.items()}
            named = ", ".join(
                f"{r} ({self.stragglers.named[r]:.2f}x the median"
                + (f"; {causes[r]}" if r in causes else "")
                + ")"
                for r in stragglers
            )
            self.warn(f"straggler: rank(s) {named} of their own work per step")
        return row

    def write(self, row: dict[str, Any]) -> None:
        """The row to every sink and to the progress line."""
        self.rows.append(row)
        if self._jsonl is not None:
            self._jsonl.call("write", row)
        if self._sinks is not None:
            self._sinks.write(row)
        progress = self.progress
        if progress is not None:
            progress.update(row["step"], row)
        if not self.rt.is_main or progress is None or progress.live:  # else it is logged
            log.info("step %d/%d | %s", row["step"], self.cfg.train.steps, status_text(row, None))

    # -- parts of a row ----------------------------------------------------------------------
    def _row(
        self, step: int, loss: float, result: StepResult, step_s: float, data_s: float,
        tokens_per_s: float,
    ) -> dict[str, Any]:  # fmt: skip
        """This rank's (rank 0's) view of a logged step."""
        optimizers = self.engine.optimizers
        comm_s = self.comm.exposed_s(result)
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
            "lr": optimizers.lr_at(step - 1),
            "grad_norm": None if result.grad_norm is None else float(result.grad_norm),
            "tokens_per_s": tokens_per_s,
            "mfu": self._mfu(tokens_per_s),
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
        if optimizers.scaler is not None:
            row["loss_scale"] = float(optimizers.scaler.get_scale())
        if self.segment is not None:  # a step trained again later has a newer row
            row["segment"] = self.segment
        return row

    def _mfu(self, tokens_per_s: float) -> float | None:
        if not self.peak.flops_per_s:
            return None
        # per device that runs the model: parameter servers run none of its FLOPs
        per_device = tokens_per_s * self.flops_per_token / self.dims.compute_ranks
        return per_device / self.peak.flops_per_s

    def _check_data_wait(self, share: float) -> None:
        """Warn once when waiting for batches takes more than data.wait_warning."""
        d = self.cfg.data
        if share > d.wait_warning and not self._slow_data_warned:
            self._slow_data_warned = True
            self.warn(
                f"waiting for data: {share:.0%} of the step time "
                f"(data.wait_warning {d.wait_warning:.0%}) reading "
                f"{redact_url(d.source)}; more data.readers or data.prefetch, or "
                "faster storage (meshforge bench io)"
            )

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
                self.warn(f"memory: {text}")
            self.memory_advice[kind] = text


def pipeline_bubble(times: list[tuple[float, float]]) -> dict[str, float] | None:
    """This rank's pipeline idle fraction over the steady steps: 1 - busy / wall."""
    if not times:
        return None
    busy = sum(b for b, _ in times)
    wall = sum(w for _, w in times)
    return {"busy_s": busy, "wall_s": wall, "bubble": max(0.0, 1.0 - busy / wall) if wall else 0.0}


def _where(sinks: Sinks, run_dir: Path) -> list[str]:
    """Where the user can watch the run, one line per sink that says."""
    where = []
    if sinks.exporter is not None:
        where.append(f"Prometheus metrics at {sinks.exporter.url}")
    if any(g.name == "TensorBoard" for g in sinks.guarded):
        where.append(f"TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}")
    if sinks.wandb is not None:
        w = sinks.wandb.where
        where.append(
            f"Weights & Biases: offline run in {w} (upload it: wandb sync {w}/offline-run-*)"
            if isinstance(w, Path)
            else f"Weights & Biases: {w}"
        )
    return where


def _last_logged_step(path: Path) -> int | None:
    """The newest step in metrics.jsonl (None when there is none to read)."""
    try:
        steps = [r.get("step") for r in read_jsonl(path) if not is_tail(r)]  # W&B has no tails
    except (OSError, ValueError):
        return None
    return max((int(s) for s in steps if isinstance(s, int | float)), default=None)
