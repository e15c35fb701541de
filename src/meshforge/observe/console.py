"""The rank-0 console: a live progress bar while training, a summary table after.

On a terminal, ``TrainingProgress`` draws a rich progress bar; when stdout is
a pipe or a file (CI logs, ``logs/rank-0.log``) it prints one plain status line
per update instead, so the log still shows progress. Other ranks pass
``enabled=False`` and every method does nothing.
"""

from __future__ import annotations

import math
import time
from types import TracebackType
from typing import Any, Self

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table
from rich.text import Text

from meshforge.units import format_bytes, format_count, format_duration, format_percent


def _num(metrics: dict[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def mfu_text(mfu: float | None) -> str:
    """MFU as a percentage; above 100% the peak it divides by is wrong (on CPU, a peak
    measured while the machine was busy), and it says so instead of showing a number."""
    if mfu is not None and mfu > 1.0:
        return f"{format_percent(mfu)} (above 100%: the measured peak is too low; --recalibrate)"
    return format_percent(mfu)


def status_text(metrics: dict[str, Any], eta_s: float | None) -> str:
    parts = []
    loss, lr, grad_norm = _num(metrics, "loss"), _num(metrics, "lr"), _num(metrics, "grad_norm")
    parts.append(f"loss {loss:.4f}" if loss is not None else "loss n/a")
    if lr is not None:
        parts.append(f"lr {lr:.2e}")
    if grad_norm is not None:
        parts.append(f"gnorm {grad_norm:.3f}")
    tokens = _num(metrics, "tokens_per_s")
    parts.append(f"{tokens:,.0f} tok/s" if tokens is not None else "tok/s n/a")
    parts.append(f"MFU {mfu_text(_num(metrics, 'mfu'))}")
    step_time = _num(metrics, "step_time_s")
    parts.append(f"step {step_time:.3f} s" if step_time is not None else "step n/a")
    if step_time:
        shares = [
            f"{label} {100 * value / step_time:.0f}%"
            for key, label in (("data_s", "data"), ("comm_s", "comm"))
            if (value := _num(metrics, key)) is not None
        ]
        if shares:
            parts.append(" ".join(shares))
    parts.append(f"ETA {format_duration(eta_s)}")
    return " | ".join(parts)


class TrainingProgress:
    """Live progress of a training run on rank 0; a no-op elsewhere."""

    def __init__(
        self,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
        title: str = "training",
        console: Console | None = None,
    ) -> None:
        self.total_steps = total_steps
        self.start_step = start_step
        self.enabled = enabled
        self.title = title
        self._console = console if console is not None else Console()
        self._progress: Progress | None = None
        self._task_id: Any = None
        self._started_at = time.monotonic()

    @property
    def live(self) -> bool:
        """Whether a live bar is drawn (enabled, on a terminal)."""
        return self.enabled and self._console.is_terminal

    def __enter__(self) -> Self:
        if not self.enabled:
            return self
        self._started_at = time.monotonic()
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                console=self._console,
                transient=False,
            )
            self._progress.start()
            self._task_id = self._progress.add_task(
                self.title, total=self.total_steps, completed=self.start_step, status=""
            )
        else:
            self._console.print(
                f"{self.title}: steps {self.start_step}..{self.total_steps}",
                markup=False,
                highlight=False,
            )
        return self

    def _eta_s(self, step: int) -> float | None:
        done = step - self.start_step
        elapsed = time.monotonic() - self._started_at
        if done <= 0 or elapsed <= 0:
            return None
        return max(0, self.total_steps - step) * elapsed / done

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        """Show ``step`` (steps completed so far) and the latest metrics."""
        if not self.enabled:
            return
        status = status_text(metrics, self._eta_s(step))
        if self._progress is not None:
            self._progress.update(self._task_id, completed=step, status=status)
        else:
            line = f"{self.title} step {step}/{self.total_steps} | {status}"
            self._console.print(line, markup=False, highlight=False, soft_wrap=True)

    def log(self, message: str) -> None:
        """Print a line above the bar (or in sequence with the status lines)."""
        if not self.enabled:
            return
        self._console.print(message, markup=False, highlight=False, soft_wrap=True)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _layout_text(layout: Any) -> str:
    if isinstance(layout, dict):
        return " ".join(f"{k}={v}" for k, v in layout.items())
    return "n/a" if layout is None else str(layout)


def _per_rank(values: Any) -> list[tuple[str, Any]]:
    """(rank label, value) pairs from a per-rank list or a {rank: value} dict."""
    if isinstance(values, dict):
        return [(str(rank), value) for rank, value in values.items()]
    if isinstance(values, list | tuple):
        return [(str(rank), value) for rank, value in enumerate(values)]
    return [] if values is None else [("all", values)]


def _model_state_text(states: Any) -> str:
    lines = []
    for rank, state in _per_rank(states):
        if isinstance(state, dict):
            parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in state.items())
        else:
            parts = format_bytes(state)
        lines.append(f"rank {rank}: {parts}")
    return "\n".join(lines) or "n/a"


def _breakdown_text(breakdown: Any) -> str:
    if not isinstance(breakdown, dict) or not breakdown:
        return "n/a"
    return " · ".join(f"{k} {format_percent(v)}" for k, v in breakdown.items())


def _loss_text(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, int | float) else "n/a"


def segment_text(segment: dict[str, Any]) -> str:
    """One segment of a run (report.json's `segments`, rundir/segments.py) in a line:
    `steps 11-20 on 1 rank (dp=1 tp=1 pp=1 zero=0): completed`."""
    begun, last = segment.get("start_step") or 0, segment.get("end_step") or 0
    steps = f"steps {begun + 1}-{last}" if last > begun else f"no step (at step {last})"
    layout = segment.get("layout") if isinstance(segment.get("layout"), dict) else {}
    dims = " ".join(f"{k}={layout[k]}" for k in ("dp", "tp", "pp", "zero") if k in layout)
    if (layout.get("ep") or 1) > 1:
        dims += f" ep={layout['ep']}"
    world = segment.get("world_size")
    ranks = f" on {world} rank{'' if world == 1 else 's'}" if world is not None else ""
    why = str(segment.get("ended") or "unknown")
    if segment.get("signal"):
        why += f" ({segment['signal']})"
    tokens, mfu = _num(segment, "tokens_per_s"), _num(segment, "mfu")
    rates = "" if tokens is None else f"; {tokens:,.0f} tok/s, MFU {mfu_text(mfu)}"
    return f"{steps}{ranks}" + (f" ({dims})" if dims else "") + f": {why}{rates}"


def headline_label(report: dict[str, Any]) -> str:
    """What report.json's tokens/s and MFU are taken over, when not the whole run:
    " (segment 2, the last layout logged)"; "" when every segment counts."""
    segments = [s for s in report.get("segments") or [] if isinstance(s, dict)]
    counted = report.get("headline_segments")
    if len(segments) < 2 or not isinstance(counted, list) or not counted:
        return ""
    if len(counted) >= len(segments):
        return ""
    which = ", ".join(str(n) for n in counted)
    return f" (segment{'s' if len(counted) > 1 else ''} {which}, the last layout logged)"


def _segments_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """A run trained in more than one segment (resumed, restarted, extended): each one,
    and the steps trained in all (steps trained twice count twice)."""
    segments = [s for s in report.get("segments") or [] if isinstance(s, dict)]
    if len(segments) < 2:
        return []
    return [
        ("segments", "\n".join(segment_text(s) for s in segments)),
        ("steps trained", str(report.get("steps_trained", "n/a"))),
    ]


def _parallel_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The pipeline bubble (measured beside the formula) and the TP collective time."""
    rows = []
    pipe = report.get("pipeline")
    if isinstance(pipe, dict) and isinstance(pipe.get("bubble_measured"), int | float):
        rows.append(
            (
                "pipeline bubble",
                f"{format_percent(pipe['bubble_measured'])} measured (mean over ranks), "
                f"{format_percent(pipe.get('bubble_formula'))} by the formula "
                f"({pipe.get('schedule')}, {pipe.get('microbatches')} micro-batches)",
            )
        )
    tp = report.get("tp_comm")
    if isinstance(tp, dict) and isinstance(tp.get("seconds"), int | float):
        share = tp.get("fraction_of_step")
        layout = report.get("layout") or {}
        tp_on, cp_on = ((layout.get(k, 1) or 1) > 1 for k in ("tp", "cp"))
        label = {(True, True): "tp + cp collectives", (False, True): "cp K/V exchange"}.get(
            (tp_on, cp_on), "tensor-parallel comm"
        )
        rows.append(
            (
                label,
                f"{1e3 * tp['seconds']:.1f} ms in a profiled step"
                + (f" ({format_percent(share)} of a median step)" if share is not None else "")
                + "; its share of that step's compute is counted as exposed communication",
            )
        )
    return rows


def moe_summary_text(moe: dict[str, Any]) -> str:
    """report.json's `moe` section in a line: the worst layer's max/mean expert load over
    the run, the dropped fraction and the last auxiliary loss."""
    worst = _num(moe, "max_load")
    layers, balance = moe.get("layers"), moe.get("load_max_over_mean")
    where = ""
    if isinstance(layers, list) and isinstance(balance, list) and worst in balance:
        index = balance.index(worst)
        where = f" (layer {layers[index]})" if index < len(layers) else ""
    aux = _num(moe, "aux_loss")
    return (
        "max/mean load " + ("n/a" if worst is None else f"{worst:.2f}{where}")
        + f", dropped {format_percent(_num(moe, 'dropped_fraction'))}"
        + (f", aux loss {aux:.4f}" if aux is not None else "")
    )  # fmt: skip


def _moe_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    moe = report.get("moe")
    return [("experts", moe_summary_text(moe))] if isinstance(moe, dict) else []


def _steps_text(report: dict[str, Any]) -> str:
    """The job's steps; for a stopped run the step it stopped after, of those."""
    steps = report.get("steps", "n/a")
    at = (report.get("stopped") or {}).get("step")
    return f"{at} of {steps} (stopped)" if isinstance(at, int) else str(steps)


def print_summary(report: dict[str, Any], console: Console | None = None) -> None:
    """Print the fields of ``report.json`` a user reads first, as one table."""
    console = console if console is not None else Console()
    tokens = report.get("tokens_per_s")
    step_time = report.get("step_time_s")
    peaks = _per_rank(report.get("peak_memory_bytes"))
    resumed = report.get("resumed_from")
    rows = [
        ("status", str(report.get("status", "n/a"))),
        ("steps", _steps_text(report)),
        ("world size", str(report.get("world_size", "n/a"))),
        ("layout", _layout_text(report.get("layout"))),
        ("parameters", format_count(report.get("model_params"))),
        ("first loss", _loss_text(report.get("first_loss"))),
        ("final loss", _loss_text(report.get("final_loss"))),
        (
            "tokens/s",
            (f"{tokens:,.0f}" if isinstance(tokens, int | float) else "n/a")
            + headline_label(report),
        ),
        ("MFU", mfu_text(_num(report, "mfu")) + headline_label(report)),
        (
            "step time (median)",
            f"{step_time:.3f} s" if isinstance(step_time, int | float) else "n/a",
        ),
        ("time breakdown", _breakdown_text(report.get("time_breakdown"))),
        *_parallel_rows(report),
        ("model state per rank", _model_state_text(report.get("model_state_bytes"))),
        (
            "peak memory per rank",
            "\n".join(f"rank {r}: {format_bytes(v)}" for r, v in peaks) or "n/a",
        ),
        *_moe_rows(report),
        ("resumed from step", "no" if resumed is None else str(resumed)),
        *_segments_rows(report),
    ]
    table = Table(title="run summary", show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value")
    for field, value in rows:
        table.add_row(field, Text(value))  # Text: values are data, never rich markup
    console.print(table)
