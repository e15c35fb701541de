"""report.json of a run (schema in DESIGN.md); its page, report.html, is report/html.py's.

The report covers the whole run, every segment of it (rundir/segments.py): the first
loss is the run's first step's; rates, step time and the time breakdown are medians
and sums over the rows of the layout the run ended with (the last segment and those
right before it with the same layout and world size, `headline_segments`; each one's
first logged interval, which includes its start-up, left out): a run extended under
another layout reports the speed of the layout it ended with; and `segments` lists
each launch or restart with its steps, layout, world size, why it ended and its own
tokens/s and MFU. Per-rank figures
(memory, model state, communication bytes, stragglers) are the last segment's: its
layout is the one they describe."""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshforge.observe.expert_load import moe_summary
from meshforge.observe.metrics import is_tail, latest_rows
from meshforge.observe.peak import PeakFlops
from meshforge.redact import redact_tree
from meshforge.rundir.records import read_jsonl
from meshforge.rundir.report import read_report_or_none, report_path, write_report
from meshforge.rundir.restarts import restarts_of_run
from meshforge.rundir.segments import launch_first_step, segments_of
from meshforge.runtime.agree import count_nodes
from meshforge.train.timing import RunTiming

if TYPE_CHECKING:
    from meshforge.config import JobConfig
    from meshforge.layout import ParallelDims
    from meshforge.plan.core.flops import ParamCount
    from meshforge.plan.jobs.machine_fit import MeasuredProfile

log = logging.getLogger(__name__)


@dataclass
class RunSummary:
    """What the report says of the run beside its rows and per-rank figures: the
    trainer fills it in at the end of `fit` (Trainer.summary)."""

    cfg: JobConfig
    run_dir: Path
    world_size: int
    device: str
    backend: str
    layout: dict[str, Any]
    dims: ParallelDims
    params: ParamCount
    flops_per_token: float
    flops_convention: str  # what flops_per_token and mfu count
    peak: PeakFlops
    comm_method: str  # how exposed communication was measured
    memory_advice: list[str]
    stragglers: dict[int, float]  # rank -> worst slowdown seen
    lr_horizon: int
    attempt: int  # the elastic attempt
    timing: RunTiming
    machine_profile: MeasuredProfile | None = None
    stopped: dict[str, Any] | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def time_breakdown(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """Fractions of the logged steps' time spent on data, compute, exposed comm, other."""
    total = sum(r.get("step_time_s") or 0.0 for r in rows)
    if total <= 0:
        return None
    parts = {
        "data": sum(r.get("data_s") or 0.0 for r in rows),
        "compute": sum(r.get("compute_s") or 0.0 for r in rows),
        "exposed_comm": sum(r.get("comm_s") or 0.0 for r in rows),
        "pipeline_bubble": sum(r.get("bubble_s") or 0.0 for r in rows),
    }
    parts["other"] = max(0.0, total - sum(parts.values()))
    return {k: v / total for k, v in parts.items()}


def run_history(
    run_dir: Path, own_rows: list[dict[str, Any]] | None = None, segment: int | None = None
) -> dict[str, Any]:
    """The run's metrics over every segment: `rows` (the latest row of each step, in step
    order), `steady` (those rows without each segment's first logged interval, which
    includes its start-up; all rows when nothing else is left), `headline` (the steady
    rows of the last segment that logged and of the segments right before it that ran
    its layout; all their rows when that leaves none), `moe_rows` (`rows` with
    the segments' `moe_tail` records: the expert counts of the steps after a segment's
    last logged row) and `segments`. The
    segment's own rows stand in when metrics.jsonl could not be written or read."""
    try:
        records = read_jsonl(Path(run_dir) / "metrics.jsonl")
    except (OSError, ValueError):
        records = []
    if own_rows and not any(r.get("segment") == segment for r in records):
        records = [*records, *own_rows]
    rows = latest_rows(records)
    first_logged: dict[Any, Any] = {}  # segment -> the first step it logged
    for r in records:
        if not is_tail(r):
            first_logged.setdefault(r.get("segment"), r.get("step"))
    steady = [r for r in rows if first_logged.get(r.get("segment")) != r.get("step")]
    segments = segments_of(Path(run_dir), records)
    # the headline's rows: the last segment's, with the segments before it that ran the
    # same layout on as many ranks (a run extended under another layout runs at that
    # layout's speed: the earlier layout's figures would blur it)
    last = rows[-1].get("segment") if rows else None
    same = {last, *_same_layout_as(segments, last)}
    headline = [r for r in steady if r.get("segment") in same]
    return {
        "rows": rows,
        "steady": steady or rows,
        "headline": headline or [r for r in rows if r.get("segment") in same],
        "moe_rows": latest_rows(records, tails=True),
        "segments": segments,
    }


def _same_layout_as(segments: list[dict[str, Any]], number: Any) -> list[Any]:
    """The segments right before segment `number` that ran its layout and world size
    (back to the first that did not)."""
    index = next((i for i, s in enumerate(segments) if s.get("segment") == number), None)
    if index is None:
        return []
    key = (segments[index].get("layout"), segments[index].get("world_size"))
    out = []
    for s in reversed(segments[:index]):
        if (s.get("layout"), s.get("world_size")) != key:
            break
        out.append(s.get("segment"))
    return out


def history_figures(history: dict[str, Any]) -> dict[str, Any]:
    """report.json's whole-run figures from `run_history`: plain values, no torch. The
    rates, step time and breakdown are those of the layout the run ended with (the last
    segment's and the ones before it under the same layout; `headline_segments` lists
    them); each segment's own tokens/s and MFU are in `segments`."""
    rows, segments = history["rows"], history["segments"]
    headline = history.get("headline", history["steady"])
    walls = [s.get("wall_s") for s in segments]
    for s in segments:  # each segment's own rates, over its steady rows (as the headline:
        # its start-up interval when that is all it logged)
        own = [r for r in history["steady"] if r.get("segment") == s.get("segment")] or [
            r for r in rows if r.get("segment") == s.get("segment")
        ]
        s["tokens_per_s"] = _median([r.get("tokens_per_s") for r in own])
        s["mfu"] = _median([r.get("mfu") for r in own])
    return {
        "first_loss": rows[0].get("loss") if rows else None,
        "final_loss": rows[-1].get("loss") if rows else None,
        "tokens_per_s": _median([r.get("tokens_per_s") for r in headline]),
        "mfu": _median([r.get("mfu") for r in headline]),
        "step_time_s": _median([r.get("step_time_s") for r in headline]),
        "time_breakdown": time_breakdown(headline),
        "data_wait_fraction": _median([r.get("data_wait_fraction") for r in headline]),
        # the logged steps the medians and the breakdown are taken over, and their segment
        "measured_steps": len(headline),
        "headline_segments": sorted({r.get("segment") for r in headline} - {None}),
        "steps_trained": sum(max(0, s["end_step"] - s["start_step"]) for s in segments),
        "segments": segments,
        "wall_time_s": sum(w for w in walls if w is not None) if segments else None,
    }


def build_report(
    summary: RunSummary,
    *,
    rows: list[dict[str, Any]],
    per_rank: list[dict[str, Any]],
    resumed_from: int | None,
    last_checkpoint: int | None,
    val_loss: float | None,
    digest: str,
    wall_s: float,
    data_wait_s: float,
    segment: int | None = None,
) -> dict[str, Any]:
    cfg, peak = summary.cfg, summary.peak
    history = run_history(summary.run_dir, rows, segment)
    figures = history_figures(history)
    steady = history["headline"]  # the last segment's, as the per-rank figures are
    report: dict[str, Any] = {
        "status": "completed",
        "name": cfg.name,
        "steps": cfg.train.steps,
        "world_size": summary.world_size,
        "nodes": count_nodes([r.get("host") for r in per_rank]),
        "hosts": [r.get("host") for r in per_rank],
        "device": summary.device,
        "backend": summary.backend,
        "layout": summary.layout,
        "model_params": summary.params.total,
        "model_params_non_embedding": summary.params.non_embedding,
        "flops_per_token": summary.flops_per_token,
        "flops_convention": summary.flops_convention,
        "first_loss": figures["first_loss"],
        "final_loss": figures["final_loss"],
        "val_loss": val_loss,
        "tokens_per_s": figures["tokens_per_s"],
        "mfu": figures["mfu"],
        "measured_steps": figures["measured_steps"],
        "headline_segments": figures["headline_segments"],
        "peak_flops": {
            "flops_per_s": peak.flops_per_s,
            "source": peak.source,
            "device": peak.device_name,
        },
        "step_time_s": figures["step_time_s"],
        "time_breakdown": figures["time_breakdown"],
        "data_wait_s": data_wait_s,  # this segment's
        "data_wait_fraction": figures["data_wait_fraction"],
        "model_state_bytes": [r["state"] for r in per_rank],
        "peak_memory_bytes": [r["peak"] for r in per_rank],
        # what one micro-batch's forward saved for backward on rank 0, the last segment's
        "activation_bytes": _activation_bytes(history["rows"]),
        "memory_health": {
            "advice": summary.memory_advice,
            "cuda": [r.get("cuda_memory") for r in per_rank] if summary.is_cuda else None,
        },
        "pipeline": pipeline_summary(summary.dims, per_rank),
        # tensor-parallel collectives in one profiled step (rank 0), seconds and share
        "tp_comm": _tp_comm(history["rows"], figures["step_time_s"]),
        "communication": communication(summary, steady, per_rank),
        "predicted": predicted_for(summary.cfg, summary.world_size, summary.machine_profile),
        "resumed_from": resumed_from,
        "last_checkpoint": last_checkpoint,
        "final_param_digest": digest,
        # every segment's, crashed ones up to their last logged step (this one's alone
        # when there is no segment record)
        "wall_time_s": figures["wall_time_s"] if figures["segments"] else wall_s,
        "lr_horizon": summary.lr_horizon,
        "steps_trained": figures["steps_trained"],
        "segments": figures["segments"],
        "stragglers": [
            {"rank": r, "host": (per_rank[r].get("host") or {}).get("host"), "slowdown": x}
            for r, x in sorted(summary.stragglers.items())
        ],
    }
    moe = moe_summary(cfg, summary.dims, history["moe_rows"], history["segments"])
    if moe is not None:
        # the parameters one token passes through: what flops_per_token counts
        moe["active_params"] = summary.params.active_or_total
        report["moe"] = moe
    report["restarts"] = restarts_of_this_run(summary.run_dir)
    # written last but one: report_at is as close to the write as it can be
    launch_first = None
    if summary.attempt > 0:  # an elastic restart: the launch started earlier
        launch_first = launch_first_step(summary.run_dir, os.environ.get("TORCHELASTIC_RUN_ID"))
    report["timing"] = summary.timing.as_dict(time.time(), report["restarts"], launch_first)
    if summary.dims.parameter_server:
        from meshforge.parallel.param_server import summarise

        servers = [r["parameter_server"] for r in per_rank if r.get("parameter_server")]
        report["parameter_server"] = summarise(servers, summary.dims)
    if summary.stopped is not None:
        report["status"] = "stopped"
        report["stopped"] = summary.stopped
    return redact_tree(report)  # no credential of a URL in report.json (meshforge.redact)


def _activation_bytes(rows: list[dict[str, Any]]) -> int | None:
    """The activation bytes the last segment measured (its first logged step's), or
    None when it logged none (an older run, a parameter server's)."""
    last = rows[-1].get("segment") if rows else None
    measured = [r["activation_bytes"] for r in rows
                if r.get("activation_bytes") and r.get("segment") == last]  # fmt: skip
    return int(measured[-1]) if measured else None


def communication(
    summary: RunSummary, steady: list[dict[str, Any]], per_rank: list[dict[str, Any]]
) -> dict[str, Any]:
    """Exposed communication (seconds per step and share of the step, with how it was
    measured), bytes per step per rank, and what each host sent on the wire."""
    p = summary.cfg._parallel()
    step_s = _median([r.get("step_time_s") for r in steady])
    exposed = _median([r.get("comm_s") for r in steady])
    comm = [r.get("comm") or {} for r in per_rank]
    hosts: list[dict[str, Any]] = []  # one per node: what its first rank read
    for rank, (r, c) in enumerate(zip(per_rank, comm, strict=True)):
        if "net_tx_bytes_per_step" in c:
            where = r.get("host") or {}
            hosts.append({
                "host": where.get("host"),
                "addr": where.get("addr"),
                "rank": rank,
                "tx_bytes_per_step": c["net_tx_bytes_per_step"],
                "tx_bytes_per_s": c.get("net_tx_bytes_per_s"),
            })  # fmt: skip
    rates = [h["tx_bytes_per_s"] for h in hosts if h.get("tx_bytes_per_s")]
    return {
        "mode": p.mode,
        "settings": comm_settings(p),
        "method": summary.comm_method,
        "exposed_s": exposed,
        "exposed_fraction": exposed / step_s if exposed is not None and step_s else None,
        "payload_bytes_per_step": [c.get("payload_bytes_per_step") for c in comm],
        "hosts": hosts,
        "achieved_bytes_per_s": _median(rates),
    }


def comm_settings(p: Any) -> dict[str, Any] | None:
    """The parallel.comm settings that apply to the layout (config.check_comm refuses
    the others), as they were in effect."""
    if p.mode != "collective":
        return None
    c = p.comm
    if p.is_ddp:
        out = {"bucket_mb": c.bucket_mb, "overlap": c.overlap, "compression": c.compression}
        if c.compression == "powersgd":
            out.update(powersgd_rank=c.powersgd_rank, powersgd_warmup=c.powersgd_warmup)
        return out
    if p.zero >= 2:
        return {"prefetch": c.prefetch, "reduce_dtype": c.reduce_dtype}
    return {}


def restarts_of_this_run(run_dir: Path) -> list[dict[str, Any]]:
    """The elastic restarts of the current launch (health/restarts.jsonl, this run id)."""
    return restarts_of_run(run_dir, os.environ.get("TORCHELASTIC_RUN_ID"))


def _tp_comm(rows: list[dict[str, Any]], step_time_s: float | None) -> dict[str, float] | None:
    """The last segment's profiled step: its TP (and cp) collective time, and its share
    of the median step (the profiled step itself runs slower under the profiler). None
    when the last segment profiled none (an earlier layout's figure is not this one's)."""
    last = rows[-1].get("segment") if rows else None
    sampled = [r for r in rows if r.get("tp_comm_s") is not None and r.get("segment") == last]
    if not sampled:
        return None
    seconds = sampled[-1]["tp_comm_s"]
    return {
        "step": sampled[-1]["step"],
        "seconds": seconds,
        "fraction_of_step": seconds / step_time_s if step_time_s else None,
    }


def pipeline_summary(dims: ParallelDims, per_rank: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The pipeline bubble measured on the run (each rank's idle share of the schedule's
    wall time, from the stages' own compute timings) beside the formula's value."""
    from meshforge.plan.core.timing import pipeline_bubble_fraction

    if not dims.pp_enabled:
        return None
    measured = [r["pipeline"]["bubble"] for r in per_rank if r.get("pipeline")]
    formula = pipeline_bubble_fraction(
        dims.pp_schedule, dims.pp, dims.microbatches, dims.virtual_stages
    )
    return {
        "schedule": dims.pp_schedule,
        "stages": dims.n_stages,
        "microbatches": dims.microbatches,
        "bubble_measured": statistics.fmean(measured) if measured else None,
        "bubble_measured_per_rank": measured,
        "bubble_formula": formula,
    }


def predicted_for(
    cfg: JobConfig, world_size: int, measured: MeasuredProfile | None
) -> dict[str, Any] | None:
    """What the planner predicts for this run, on the profile measured of this
    machine before `fit` (train/calibration.py `calibrate`; None if it has none)."""
    if measured is None:
        return None
    try:
        from meshforge.plan.jobs.job import predict_for_job

        predicted = predict_for_job(
            cfg,
            world_size,
            measured.profile,
            measured.runtime_bytes,
            measured.host,
        )
        predicted["measurement"] = measured.details
        return predicted
    except Exception as exc:  # a prediction must never fail a finished run
        log.warning("planner prediction failed: %s", exc)
        return {"error": str(exc)}


def write_failure_report(run_dir: Path, failure: dict[str, Any]) -> None:
    """report.json of a run whose workers failed: the last report's fields, the failure,
    and the whole-run figures up to the failure (its segment listed as crashed)."""
    _update_report(run_dir, {"status": "failed", "failure": failure})


def write_interrupted_report(
    run_dir: Path, signal_name: str, launched: float, name: str, steps: int
) -> bool:
    """The launcher's report after Ctrl-C (or SIGTERM) when its workers wrote none since
    `launched`: status `interrupted`, the signal, the newest checkpoint and the whole-run
    figures; the workers' open segment is closed as stopped. False when the workers'
    own report stands (they stopped with a checkpoint). Only a launcher that holds the
    run directory calls it, once its workers are gone."""
    run_dir = Path(run_dir)
    try:
        if report_path(run_dir).stat().st_mtime >= launched:
            status = (read_report_or_none(run_dir) or {}).get("status")
            if status in ("stopped", "completed"):
                return False
    except OSError:
        pass
    from meshforge.rundir.checkpoints import list_checkpoints
    from meshforge.rundir.segments import close_segment, open_segment_number
    from meshforge.train.timing import RunTiming, launched_at

    segment = open_segment_number(run_dir)
    if segment is not None:
        last = run_history(run_dir)["segments"][-1]
        close_segment(run_dir, segment, last["end_step"], "stopped", signal=signal_name)
    checkpoints = list_checkpoints(run_dir / "checkpoints")
    _update_report(run_dir, {
        "status": "interrupted",
        "name": name,
        "steps": steps,
        "stopped": {"signal": signal_name, "step": None},
        "last_checkpoint": checkpoints[-1][0] if checkpoints else None,
        # this launch's (an earlier launch's report may be underneath): its start, no
        # step timed; the launcher adds its exit (train/timing.py record_exit)
        "timing": RunTiming(launched_at()).as_dict(time.time(), []),
    })  # fmt: skip
    return True


def _update_report(run_dir: Path, fields: dict[str, Any]) -> None:
    """Rewrite report.json with the whole-run figures and `fields` over what it held."""
    run_dir = Path(run_dir)
    report = read_report_or_none(run_dir) or {}
    try:
        figures = history_figures(run_history(run_dir))
    except Exception as exc:  # the failure being reported matters more than its figures
        log.warning("no whole-run figures for the report: %s", exc)
        figures = {}
    if figures.get("segments"):
        report.update(figures)
    report.update(fields)
    write_report(run_dir, redact_tree(report))  # a failure's error text may quote a URL
