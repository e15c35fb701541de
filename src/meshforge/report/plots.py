"""``report.png``: loss, throughput, peak memory and time breakdown of a run.

Drawn with matplotlib's Agg canvas directly (no pyplot), so it needs no
display and leaves no global backend state behind in the training process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from meshforge.fileio import atomic_writer
from meshforge.observe.metrics import latest_rows
from meshforge.observe.metrics import number as _number
from meshforge.observe.metrics import series as _series

_BREAKDOWN = (
    ("data_s", "data"),
    ("compute_s", "compute"),
    ("comm_s", "comm"),
    ("other_s", "other"),
)
_COLORS = ("#8c8c8c", "#4c72b0", "#dd8452", "#c9c9c9")


def _no_data(ax: Axes) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")


def _line_panel(ax: Axes, rows: list[dict], key: str, title: str, scale: float = 1.0) -> None:
    ax.set_title(title)
    ax.set_xlabel("step")
    steps, values = _series(rows, key, scale)
    if steps:
        ax.plot(steps, values, marker="o" if len(steps) < 3 else None)
    else:
        _no_data(ax)


def _loss_panel(ax: Axes, rows: list[dict]) -> None:
    ax.set_title("loss")
    ax.set_xlabel("step")
    train = _series(rows, "loss")
    val = _series(rows, "val_loss")
    if train[0]:
        ax.plot(*train, label="train", marker="o" if len(train[0]) < 3 else None)
    if val[0]:
        ax.plot(*val, label="val", marker="o", linestyle="--")
    for step in _segment_starts(rows):
        ax.axvline(step, color="#8c8c8c", linestyle=":", linewidth=1)
    if train[0] or val[0]:
        ax.legend()
    else:
        _no_data(ax)


def _segment_starts(rows: list[dict[str, Any]]) -> list[float]:
    """Where a later segment's rows take over (a resume or restart): its first step - 1."""
    starts = []
    for before, row in zip(rows, rows[1:], strict=False):
        if row.get("segment") is not None and row.get("segment") != before.get("segment"):
            starts.append(float(before["step"]))
    return starts


def _breakdown_fractions(row: dict[str, Any]) -> list[float] | None:
    parts = [_number(row.get(key)) or 0.0 for key, _ in _BREAKDOWN]
    total = _number(row.get("step_time_s")) or sum(parts)
    if total <= 0 or not any(parts):
        return None
    fractions = [p / total for p in parts]
    # Time not attributed to a named phase is "other".
    fractions[-1] += max(0.0, 1.0 - sum(fractions))
    return fractions


def _breakdown_panel(ax: Axes, rows: list[dict]) -> None:
    ax.set_title("time breakdown (fraction of step)")
    ax.set_xlabel("step")
    steps, stacks = [], []
    for row in rows:
        fractions = _breakdown_fractions(row)
        if fractions is not None:
            steps.append(row["step"])
            stacks.append(fractions)
    if not steps:
        _no_data(ax)
        return
    labels = [label for _, label in _BREAKDOWN]
    columns = [list(c) for c in zip(*stacks, strict=True)]
    if len(steps) == 1:
        bottom = 0.0
        for values, label, color in zip(columns, labels, _COLORS, strict=True):
            ax.bar(steps, values, bottom=bottom, label=label, color=color)
            bottom += values[0]
    else:
        ax.stackplot(steps, *columns, labels=labels, colors=_COLORS)
    ax.set_ylim(0, max(1.0, max(sum(s) for s in stacks)))
    ax.legend(loc="lower right", fontsize="small")


def plot_report(records: list[dict[str, Any]], out_png: str | os.PathLike[str]) -> None:
    """Write a 2x2 figure of ``metrics.jsonl`` rows to ``out_png`` (atomically): the
    latest row of each step, with a dotted line where a later segment took over."""
    rows = latest_rows(records)
    figure = Figure(figsize=(12, 8), layout="constrained")
    FigureCanvasAgg(figure)
    (loss_ax, tput_ax), (mem_ax, time_ax) = figure.subplots(2, 2)
    _loss_panel(loss_ax, rows)
    _line_panel(tput_ax, rows, "tokens_per_s", "throughput (tokens/s)")
    _line_panel(mem_ax, rows, "peak_memory_bytes", "peak memory (MB)", scale=1e-6)
    _breakdown_panel(time_ax, rows)

    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_writer(out, "wb") as f:
        figure.savefig(f, format="png", dpi=100)
