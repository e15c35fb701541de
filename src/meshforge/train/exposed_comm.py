"""How much of a step is communication no compute hides, and how many bytes it moves.

`CommMeasure` is the trainer's one place for it. Data parallel (tp = pp = 1): a step's
forward+backward minus the same work with no communication, either the step's no_sync
micro-batches (DDP with accumulation) or a communication-free replica timed at the
first step (`reference`). Tensor and context parallel: one logged step is run under
the profiler (`run_step`), and the share of its forward+backward spent in their
(functional) collectives carries over to the other steps; under cp the data-parallel
reduction over dp x cp is not in it. Pipelines: their waits are the bubble, reported
apart. Bytes: what this rank hands torch.distributed per step and, on a host's first
rank, what the host's interfaces sent (observe/comm_bytes.py), over each logged interval.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch

from meshforge.models.registry import blocks_of, build_model
from meshforge.observe import comm_bytes
from meshforge.observe.comm_time import measure_tp_comm
from meshforge.parallel.activation_checkpointing import apply_activation_checkpointing
from meshforge.train.step import StepResult, cross_entropy

if TYPE_CHECKING:
    from meshforge.config import JobConfig
    from meshforge.train.engine import Engine


class CommMeasure:
    def __init__(self, cfg: JobConfig, engine: Engine, device: torch.device, params: int) -> None:
        self.cfg, self.engine, self.device = cfg, engine, device
        self.dims, self.parts = engine.dims, engine.parts
        self.params = params  # the model's parameter count (the replica's size)
        comm_bytes.install()
        self.reducer_bytes = 0  # DDP's C++ reducer all-reduces past any Python call
        comm = cfg._parallel().comm
        if self.parts.wrapper == "ddp" and comm.compression == "none" and comm.overlap:
            self.reducer_bytes = comm_bytes.ddp_reducer_bytes(self.parts.parameters())
        self.samples: list[dict[str, float]] = []  # per logged interval, steady only
        self.reference_s: float | None = None  # the replica's forward+backward
        self.tp_comm_s: float | None = None  # latest profiled TP collective time
        # its share of the profiled step's forward+backward (the profiler slows the step
        # it watches: the share, not the seconds, carries over to the other steps)
        self.tp_comm_share: float | None = None
        self.tp_sampled = False  # one profiled step per run
        self.marks = _marks()

    # -- which measurement the layout gets -------------------------------------------------
    def no_peers(self) -> bool:
        """Nothing to communicate: one data-parallel rank (and no cp peer) and no
        parameter server."""
        return self.dims.dp * self.dims.cp == 1 and not self.dims.parameter_server

    def needs_reference(self) -> bool:
        """Whether exposed data-parallel communication is measured against a replica:
        the whole model on this rank (tp = pp = 1), data-parallel peers, and no other
        micro-batch of the step runs without communication (DDP's no_sync ones do;
        FSDP gathers parameters in every one)."""
        if self.no_peers() or self.dims.tp_enabled or self.dims.pp_enabled:
            return False
        if self.dims.cp_enabled:  # a replica would attend over whole sequences
            return False
        if not self.engine.reads_data:  # a parameter server: no model to time
            return False
        return not (self.parts.wrapper == "ddp" and self.dims.microbatches > 1)

    def method(self) -> str:
        """How this layout's exposed communication is measured (report.json says so)."""
        if self.dims.pp_enabled:
            return "pipeline: stage waits, point-to-point transfers included, are the bubble" + (
                "; tensor-parallel collectives profiled" if self.dims.tp_enabled else ""
            )
        if self.dims.cp_enabled:
            return (
                f"context-parallel exchange ({self.dims.cp_method})"
                + (" and tensor-parallel collectives" if self.dims.tp_enabled else "")
                + " profiled in one sampled step (the data-parallel reduction not included)"
            )
        if self.dims.tp_enabled:
            return "tensor-parallel collectives profiled in one sampled step"
        if self.no_peers():
            return "none: no data-parallel peers"
        if self.dims.parameter_server:
            return (
                "worker's forward+backward with its push and pull, minus a "
                "communication-free replica's forward+backward"
            )
        if self.needs_reference():
            return "forward+backward minus a communication-free replica's, per micro-batch"
        return "synchronising micro-batch minus the step's no_sync micro-batches"

    # -- in the loop -----------------------------------------------------------------------
    def reference(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """At the first step, when the layout needs it: time a communication-free
        replica on the first micro-batch. True when it ran (the step's clock restarts)."""
        if self.reference_s is not None or not self.needs_reference():
            return False
        x, y = micro_batches[0]
        self.reference_s = self._replica_s(x.to(self.device), y.to(self.device))
        return True

    def run_step(
        self, step: int, micro_batches: list[Any], logging: bool, may_profile: bool
    ) -> StepResult:
        """One optimizer step; the first logged one that `may_profile` (not the run's
        first, not a traced one: one profiler at a time) runs under the profiler when
        the layout is tensor parallel."""
        strategy = self.engine.strategy
        # tensor and context parallel run their collectives as torch's functional ones
        profiled = self.dims.tp_enabled or self.dims.cp_enabled
        if not (logging and may_profile and profiled and not self.tp_sampled):
            return strategy.step(step, micro_batches, logging)
        result, tp_comm_s = measure_tp_comm(
            functools.partial(strategy.step, step, micro_batches, True), self.device
        )
        result.tp_comm_s = self.tp_comm_s = tp_comm_s
        self.tp_sampled = True
        busy = sum(result.micro_s) or (result.wall_s or 0.0)
        self.tp_comm_share = min(1.0, tp_comm_s / busy) if busy > 0 else None
        return result

    def exposed_s(self, result: StepResult) -> float | None:
        """Communication time of a logged step not hidden behind compute."""
        micro_s = result.micro_s
        if self.dims.tp_enabled or self.dims.cp_enabled:  # gloo's collectives block
            if self.tp_comm_share is None:
                return 0.0 if self.dims.pp_enabled else None
            return self.tp_comm_share * (sum(micro_s) or result.busy_s or 0.0)
        if self.dims.pp_enabled or self.no_peers():
            return 0.0
        if not micro_s:
            return None
        ref_s = self.reference_s
        if not self.needs_reference():
            ref_s = statistics.fmean(micro_s[:-1])
        if ref_s is None:
            return None
        return max(0.0, sum(micro_s) - len(micro_s) * ref_s)

    def interval(self, steps: int, steady: bool) -> dict[str, Any]:
        """Bytes per step of the logged interval just ended: this rank's payload to
        torch.distributed and, from the host's first rank, the host's interfaces."""
        payload0, tx0 = self.marks
        payload = (comm_bytes.payload_bytes() - payload0) / steps + self.reducer_bytes
        out: dict[str, Any] = {"comm_bytes": payload}
        tx = comm_bytes.host_tx_bytes()
        if tx is not None and tx0 is not None:
            out["net_tx_bytes"] = (tx - tx0) / steps
        if steady:
            self.samples.append({"payload": payload, "tx": out.get("net_tx_bytes")})
        return out

    def close_interval(self, step_s: float, steady: bool) -> None:
        """The interval's mean step time beside its bytes; the next interval starts."""
        if steady:
            self.samples[-1]["step_s"] = step_s
        self.marks = _marks()

    def summary(self, host_first_rank: bool) -> dict[str, Any] | None:
        """Medians over the steady logged intervals: payload bytes per step of this rank;
        on the host's first rank, the host's transmitted bytes per step and per second."""
        if not self.samples:
            return None
        payload = statistics.median(s["payload"] for s in self.samples)
        out: dict[str, Any] = {"payload_bytes_per_step": payload}
        tx = [s for s in self.samples if s.get("tx") is not None]
        if host_first_rank and tx:
            out["net_tx_bytes_per_step"] = statistics.median(s["tx"] for s in tx)
            rates = [s["tx"] / s["step_s"] for s in tx if s.get("step_s")]
            out["net_tx_bytes_per_s"] = statistics.median(rates) if rates else None
        return out

    def _replica_s(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """Forward+backward time of one micro-batch with no communication at all.

        Measured on a local, unwrapped replica so the real model's gradients stay
        untouched; only for layouts that hold the whole model (tp = pp = 1), and
        skipped when it would not comfortably fit."""
        if self.dims.tp_enabled or self.dims.pp_enabled:
            return None
        full_bytes = self.params * 4 * 4  # params + grads + activation headroom
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if full_bytes > 0.2 * free:
                return None
        strategy = self.engine.strategy
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.train.seed)
            replica = build_model(self.cfg.model).to(self.device)
            blocks = blocks_of(replica)
            apply_activation_checkpointing(blocks, self.cfg.train.activation_checkpointing)
            times = []
            for _ in range(3):
                strategy.sync()
                t0 = time.perf_counter()
                with strategy.autocast():
                    logits = replica(x)
                cross_entropy(logits, y).backward()
                strategy.sync()
                times.append(time.perf_counter() - t0)
            del replica
        return min(times[1:])


def _marks() -> tuple[int, int | None]:
    return comm_bytes.payload_bytes(), comm_bytes.host_tx_bytes()
