"""``report.html``: one self-contained page about a run, or two runs overlaid.

The page fetches nothing: the plots are inline SVG drawn here, the style sheet is
inline, there is no script (hover read-outs are SVG ``<title>``s), and a
Content-Security-Policy forbids every load, so it reads the same from a laptop, a CI
artefact or a cluster's shared disk. Every text taken from a run is escaped.

What it reads, each part optional (a plot without data says why in its place):
RUN_DIR/report.json (absent while the run runs), metrics.jsonl (the latest row of
each step: a resumed run's later segment replaces the rows it trained again),
config.yaml, and system/*.jsonl (one file per node). Plots, by figure id: plot-loss,
plot-throughput, plot-memory, plot-breakdown, plot-network, plot-step-time, drawn by
report/svg.py. A mixture-of-experts run (report.json's or the rows' `moe` section) adds
a "Mixture of experts" section: its routing settings and hottest experts, and the plots
plot-moe-tokens (tokens per expert per layer over the run, a heatmap), plot-moe-load
(max/mean expert load of each layer by step) and plot-moe-drops (dropped fraction and
auxiliary loss by step).
"""

from __future__ import annotations

import html
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from meshforge.errors import ConfigError, DataError, MeshforgeError
from meshforge.fileio import write_text_atomic
from meshforge.observe.console import headline_label, moe_summary_text, segment_text
from meshforge.observe.metrics import latest_rows
from meshforge.observe.metrics import number as _number
from meshforge.observe.metrics import series as _series
from meshforge.redact import redact_text
from meshforge.report.svg import Line, bar_chart, heatmap, line_chart, stack_chart, tick
from meshforge.rundir.records import read_jsonl
from meshforge.rundir.report import read_report, report_path
from meshforge.units import format_bytes, format_duration, format_percent

if TYPE_CHECKING:
    from meshforge.cost.tco import Tco

RUN_COLORS = ("#1f77b4", "#e8730c")  # run A, run B
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf")
STRAGGLER = "#d62728"
BREAKDOWN = (
    ("data_s", "data", "#8c8c8c"),
    ("compute_s", "compute", "#4c72b0"),
    ("comm_s", "comm", "#dd8452"),
    ("bubble_s", "bubble", "#8172b3"),
    ("other_s", "other", "#c9c9c9"),
)
_esc = html.escape


# ---------------------------------------------------------------- the run's records


@dataclass
class Run:
    path: Path
    name: str
    status: str
    report: dict[str, Any]  # {} when there is no report.json yet
    rows: list[dict[str, Any]]  # metrics.jsonl, one row per step
    config: dict[str, Any]
    config_text: str | None
    system: dict[str, list[dict[str, Any]]]  # host label -> samples
    notes: list[str]  # what could not be read


def load_run(run_dir: str | Path) -> Run:
    """The records of RUN_DIR; DataError when it is not a run directory."""
    path = Path(run_dir)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "no such run directory"
        raise DataError(f"{path}: {what}")
    metrics, report_file = path / "metrics.jsonl", report_path(path)
    if not metrics.is_file() and not report_file.is_file():
        raise DataError(f"{path}: no metrics.jsonl nor report.json (not a meshforge run directory)")
    report = (read_report(path) or {}) if report_file.is_file() else {}
    rows = latest_rows(_read_rows(metrics)) if metrics.is_file() else []
    config_path = path / "config.yaml"
    config_text = config_path.read_text(errors="replace") if config_path.is_file() else None
    if config_text is not None:  # a run of an older meshforge may have recorded a credential
        config_text = redact_text(config_text)
    try:
        config = yaml.safe_load(config_text or "") or {}
    except yaml.YAMLError:
        config = {}
    config = config if isinstance(config, dict) else {}
    system, notes = _read_system(path / "system")
    name = report.get("name") or config.get("name") or path.resolve().name
    status = str(report.get("status") or "unknown") if report else _status_without_report(path)
    return Run(path, str(name), status, report, rows, config, config_text, system, notes)


def _read_rows(path: Path) -> list[dict[str, Any]]:
    try:
        return read_jsonl(path)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DataError(f"{path}: {exc}") from None


def _read_system(folder: Path) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    hosts: dict[str, list[dict[str, Any]]] = {}
    notes: list[str] = []
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        try:
            samples = read_jsonl(path)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            notes.append(f"system/{path.name} skipped: {exc}")
            continue
        if samples:
            label = str(samples[0].get("host") or path.stem)
            hosts[label if label not in hosts else f"{label} ({path.stem})"] = samples
    return hosts, notes


def _status_without_report(path: Path) -> str:
    from meshforge.runtime.runlock import is_held

    held = is_held(path)  # never called by the holder: it writes report.json first
    if held is None:
        return "no report.json"
    return "running" if held else "ended without report.json"


# ---------------------------------------------------------------- series from rows


def _per_rank(rows: list[dict[str, Any]], key: str) -> dict[int, tuple[list, list]]:
    out: dict[int, tuple[list, list]] = {}
    for row in rows:
        values = row.get(key)
        if not isinstance(values, list):
            continue
        for rank, value in enumerate(values):
            if (number := _number(value)) is not None:
                xs, ys = out.setdefault(rank, ([], []))
                xs.append(row["step"])
                ys.append(number)
    return out


def _values(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [v for v in (_number(r.get(key)) for r in rows) if v is not None]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


def _scalar(value: Any) -> float | None:
    return None if isinstance(value, list | dict) else _number(value)


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _stragglers(run: Run) -> dict[int, str]:
    """Rank -> what named it a straggler (report.json's slowdown, or logged steps)."""
    named: dict[int, str] = {}
    for row in run.rows:
        for rank in _list(row.get("stragglers")):
            if isinstance(rank, int):
                named[rank] = "straggler"
    for entry in _list(run.report.get("stragglers")):
        if isinstance(entry, dict) and isinstance(entry.get("rank"), int):
            slowdown = _number(entry.get("slowdown"))
            named[entry["rank"]] = f"straggler {slowdown:.2f}x" if slowdown else "straggler"
    return named


def _unit(max_value: float, units: Sequence[tuple[float, str]]) -> tuple[float, str]:
    """The largest unit that keeps `max_value` >= 1 of it: (scale to multiply by, name)."""
    for size, name in units:
        if max_value >= size:
            return 1.0 / size, name
    return 1.0 / units[-1][0], units[-1][1]


BYTES = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))
SECONDS = ((1.0, "s"), (1e-3, "ms"))


# ---------------------------------------------------------------- the six plots

PLOTS = {  # id: (title, what it shows, why it may have nothing to show)
    "plot-loss": (
        "Loss",
        "Training loss of each logged step, and validation loss where the run evaluated.",
        "no loss in metrics.jsonl (no step was logged)",
    ),
    "plot-throughput": (
        "Throughput and MFU",
        "Tokens per second over the whole job, and model FLOPs utilisation (achieved over "
        "peak FLOPs), by step.",
        "no tokens_per_s nor mfu in metrics.jsonl",
    ),
    "plot-memory": (
        "Memory per rank",
        "Memory of each rank by step (solid: now, dashed: peak).",
        "no memory in metrics.jsonl nor report.json",
    ),
    "plot-breakdown": (
        "Time breakdown",
        "Where each step's time went on rank 0: waiting for data, compute, exposed "
        "communication, pipeline bubble, other (optimizer, logging, time no phase claims).",
        "no step timings (data_s, compute_s, comm_s) in metrics.jsonl",
    ),
    "plot-network": (
        "Network",
        "Bytes per second each host received (solid) and sent (dashed), summed over its "
        "interfaces but loopback, which is shown apart where it carried traffic "
        "(system/*.jsonl).",
        "no system/*.jsonl samples and no net_tx_bytes in metrics.jsonl",
    ),
    "plot-step-time": (
        "Step time per rank",
        "Each rank's wall time of the step; stragglers named by the run are thick and red. "
        "The first logged step (start-up) is left out.",
        "no per-rank step times (step_time_s_per_rank, own_s_per_rank) in metrics.jsonl",
    ),
}


PLOT_IDS = tuple(PLOTS)


@dataclass(frozen=True)
class Plot:
    id: str
    svgs: list[str]  # empty: the figure says why
    caption: str | None = None  # None: PLOTS' caption
    notes: tuple[str, ...] = ()


def _plot(plot_id: str, *svgs: str | None, caption: str | None = None, notes=()) -> Plot:
    return Plot(plot_id, [s for s in svgs if s], caption, tuple(notes))


def _tag(i: int, runs: list[Run]) -> str:
    return "" if len(runs) == 1 else "AB"[i] + " "


def _color(i: int, runs: list[Run], k: int = 0, n: int = 1) -> str:
    """Series k of n of run i: the palette for one run, shades of A's/B's colour for two."""
    if len(runs) == 1:
        return PALETTE[k % len(PALETTE)]
    base = RUN_COLORS[i]
    mix = 0.6 * k / (n - 1) if n > 1 else 0.0  # towards white
    channels = (int(base[j : j + 2], 16) for j in (1, 3, 5))
    return "#" + "".join(f"{round(c + (255 - c) * mix):02x}" for c in channels)


def _rank_lines(
    per_rank: dict[int, tuple[list, list]],
    i: int,
    runs: list[Run],
    *,
    scale: float = 1.0,
    dashed: bool = False,
    legend: bool = True,
) -> list[Line]:
    """One line per rank; stragglers thick and red; beyond 8 ranks one legend entry."""
    lines, tag, stragglers = [], _tag(i, runs), _stragglers(runs[i])
    for k, rank in enumerate(sorted(per_rank)):
        xs, ys = per_rank[rank][0], [y * scale for y in per_rank[rank][1]]
        if rank in stragglers:
            label = f"{tag}rank {rank} ({stragglers[rank]})"
            lines.append(Line(label if legend else None, xs, ys, STRAGGLER, dashed, 2.8))
        elif len(per_rank) > 8:
            label = f"{tag}ranks 0-{max(per_rank)}" if legend and k == 0 else None
            color = RUN_COLORS[i] if len(runs) > 1 else "#7f7f7f"
            lines.append(Line(label, xs, ys, color, dashed, 1.0))
        else:
            label = f"{tag}rank {rank}" if legend else None
            lines.append(Line(label, xs, ys, _color(i, runs, k, len(per_rank)), dashed))
    return lines


def _plot_loss(runs: list[Run]) -> Plot:
    lines = []
    for i, run in enumerate(runs):
        tag, color = _tag(i, runs), _color(i, runs)
        val_color = PALETTE[1] if len(runs) == 1 else color
        lines.append(Line(f"{tag}train loss", *_series(run.rows, "loss"), color))
        val = _series(run.rows, "val_loss")
        lines.append(Line(f"{tag}val loss", *val, val_color, dashed=True, markers=True))
    return _plot("plot-loss", line_chart(lines, "step", "loss (cross-entropy)"))


def _plot_throughput(runs: list[Run]) -> Plot:
    tokens, mfu = [], []
    for i, run in enumerate(runs):
        tag, color = _tag(i, runs), _color(i, runs)
        tokens.append(Line(f"{tag}tokens/s", *_series(run.rows, "tokens_per_s"), color))
        mfu.append(Line(f"{tag}MFU", *_series(run.rows, "mfu", 100.0), color))
    tokens_svg = line_chart(tokens, "step", "tokens/s", title="throughput", zero=True)
    mfu_svg = line_chart(mfu, "step", "MFU (%)", title="model FLOPs utilisation", zero=True)
    notes = [
        f"no {what} logged"
        for what, svg in (("MFU", mfu_svg), ("tokens/s", tokens_svg))
        if svg is None and (tokens_svg or mfu_svg)
    ]
    return _plot("plot-throughput", tokens_svg, mfu_svg, notes=notes)


def _plot_memory(runs: list[Run]) -> Plot:
    now = [_per_rank(run.rows, "memory_bytes_per_rank") for run in runs]
    peak = [_per_rank(run.rows, "peak_memory_bytes_per_rank") for run in runs]
    rank0 = [_series(run.rows, "peak_memory_bytes") for run in runs]  # older runs: rank 0's
    if any(now) or any(peak):
        top = max(
            [y for series in now + peak for _, ys in series.values() for y in ys]
            + [y for i, (_, ys) in enumerate(rank0) if not now[i] and not peak[i] for y in ys],
            default=0,
        )
        scale, unit = _unit(top, BYTES)
        lines, notes = [], []
        for i, run in enumerate(runs):
            lines += _rank_lines(now[i], i, runs, scale=scale)
            lines += _rank_lines(peak[i], i, runs, scale=scale, dashed=True, legend=not now[i])
            if not now[i] and not peak[i]:
                xs, ys = rank0[i]
                label = f"{_tag(i, runs)}rank 0 peak"
                lines.append(Line(label, xs, [y * scale for y in ys], _color(i, runs), True))
                notes.append(f"{_tag(i, runs)}{run.name}: no memory per rank logged")
        extra = [("peak", "#555555", True)] if any(now) and any(peak) else []
        svg = line_chart(lines, "step", f"memory ({unit})", zero=True, legend_extra=extra)
        return _plot("plot-memory", svg, notes=notes)
    peaks = [run.report.get("peak_memory_bytes") for run in runs]
    peaks = [p if isinstance(p, list) else [] for p in peaks]
    if any(peaks):  # older runs: report.json's peak of each rank
        scale, unit = _unit(max(_number(p) or 0 for p in peaks), BYTES)
        ranks = max(len(p) for p in peaks)
        groups = [
            (f"{_tag(i, runs)}peak", _color(i, runs), [(_number(v) or 0) * scale for v in p])
            for i, p in enumerate(peaks)
        ]
        svg = bar_chart([str(r) for r in range(ranks)], groups, "rank", f"peak memory ({unit})")
        caption = "Peak memory of each rank over the run (report.json; no memory by step)."
        return _plot("plot-memory", svg, caption=caption)
    scale, unit = _unit(max((y for _, ys in rank0 for y in ys), default=0), BYTES)
    lines = [
        Line(f"{_tag(i, runs)}rank 0 peak", xs, [y * scale for y in ys], _color(i, runs))
        for i, (xs, ys) in enumerate(rank0)
    ]
    svg = line_chart(lines, "step", f"peak memory ({unit})", zero=True)
    return _plot("plot-memory", svg, caption="Peak memory of rank 0 by step (no per-rank memory).")


def _breakdown(rows: list[dict[str, Any]]) -> tuple[list, list[list[float]]]:
    """Steps and, per phase, seconds; time no phase claims goes to "other"."""
    xs, columns = [], [[] for _ in BREAKDOWN]
    for row in rows:
        parts = [_number(row.get(key)) or 0.0 for key, _, _ in BREAKDOWN]
        total = _number(row.get("step_time_s"))
        if not any(parts):
            continue
        if total is not None and _number(row.get("other_s")) is None:
            parts[-1] = max(0.0, total - sum(parts))
        xs.append(row["step"])
        for column, part in zip(columns, parts, strict=True):
            column.append(part)
    return xs, columns


def _plot_breakdown(runs: list[Run]) -> Plot:
    found = [_breakdown(run.rows) for run in runs]
    top = max((sum(c) for _, cols in found for c in zip(*cols, strict=True)), default=0.0)
    scale, unit = _unit(top, SECONDS)
    svgs = []
    for i, (run, (xs, columns)) in enumerate(zip(runs, found, strict=True)):
        layers = [
            (label, color, [v * scale for v in column])
            for (_, label, color), column in zip(BREAKDOWN, columns, strict=True)
        ]
        title = f"{_tag(i, runs)}{run.name}" if len(runs) > 1 else None
        y_label = f"time per step ({unit})"
        svgs.append(stack_chart(xs, layers, "step", y_label, title=title, y_max=top * scale))
    return _plot("plot-breakdown", *svgs)


def _is_loopback(interface: str) -> bool:
    return interface == "lo" or interface.startswith("lo:")


def _host_rates(samples: list[dict[str, Any]], loopback: bool) -> tuple[list, list, list]:
    """Sample times, and rx and tx bytes/s summed over the host's non-loopback interfaces
    (or over its loopback: how ranks on one machine talk to each other)."""
    times, rx, tx = [], [], []
    for sample in samples:
        t, net = _number(sample.get("time")), sample.get("net")
        if t is None or not isinstance(net, dict):
            continue
        ifaces = [v for n, v in net.items() if isinstance(v, dict) and _is_loopback(n) == loopback]
        times.append(t)
        rx.append(sum(_number(v.get("rx_bytes_per_s")) or 0.0 for v in ifaces))
        tx.append(sum(_number(v.get("tx_bytes_per_s")) or 0.0 for v in ifaces))
    return times, rx, tx


def _system_network(run: Run) -> list[tuple[str, list, list, list]]:
    """(host label, seconds since the run's first sample, rx, tx) per host and link kind."""
    found = []
    for host, samples in run.system.items():
        for loopback in (False, True):
            times, rx, tx = _host_rates(samples, loopback)
            if times and (not loopback or any(rx + tx)):
                found.append((host + (" loopback" if loopback else ""), times, rx, tx))
    start = min((times[0] for _, times, _, _ in found), default=0.0)
    return [(host, [t - start for t in times], rx, tx) for host, times, rx, tx in found]


def _plot_network(runs: list[Run]) -> Plot:
    notes = [note for run in runs for note in run.notes]
    if any(run.system for run in runs):
        per_run = [_system_network(run) for run in runs]
        top = max((v for found in per_run for *_, rx, tx in found for v in rx + tx), default=0)
        scale, unit = _unit(top, BYTES)
        lines = []
        for i, found in enumerate(per_run):
            for k, (host, times, rx, tx) in enumerate(found):
                color = _color(i, runs, k, len(found))
                lines.append(Line(f"{_tag(i, runs)}{host}", times, [v * scale for v in rx], color))
                lines.append(Line(None, times, [v * scale for v in tx], color, dashed=True))
        legend = [("rx", "#555555", False), ("tx", "#555555", True)]
        x_label = "seconds since the first sample"
        svg = line_chart(lines, x_label, f"{unit}/s", zero=True, legend_extra=legend)
        notes += [
            f"{_tag(i, runs)}{r.name}: no system/*.jsonl"
            for i, r in enumerate(runs)
            if not r.system
        ]
        return _plot("plot-network", svg, notes=notes)
    rates = []  # an older run: what rank 0's host sent per step
    for run in runs:
        pairs = [
            (r["step"], _number(r.get("net_tx_bytes")), _number(r.get("step_time_s")))
            for r in run.rows
        ]
        rates.append([(step, sent / s) for step, sent, s in pairs if sent is not None and s])
    scale, unit = _unit(max((v for pairs in rates for _, v in pairs), default=0), BYTES)
    lines = [
        Line(
            f"{_tag(i, runs)}tx (rank 0's host)",
            [x for x, _ in pairs],
            [v * scale for _, v in pairs],
            _color(i, runs),
        )
        for i, pairs in enumerate(rates)
    ]
    caption = (
        "Bytes per second rank 0's host sent during each step (net_tx_bytes / "
        "step_time_s; this run has no system/*.jsonl samples)."
    )
    svg = line_chart(lines, "step", f"sent {unit}/s", zero=True)
    return _plot("plot-network", svg, caption=caption, notes=notes)


def _plot_step_time(runs: list[Run]) -> Plot:
    found, notes = [], []
    for i, run in enumerate(runs):
        steady = run.rows[1:] if len(run.rows) > 1 else run.rows
        per_rank = _per_rank(steady, "step_time_s_per_rank")
        if not per_rank and (per_rank := _per_rank(steady, "own_s_per_rank")):
            notes.append(
                f"{_tag(i, runs)}{run.name}: no step_time_s_per_rank logged; drawn: "
                "own_s_per_rank, each rank's own work in the step without waiting for others"
            )
        found.append(per_rank)
    top = max((y for per_rank in found for _, ys in per_rank.values() for y in ys), default=0)
    scale, unit = _unit(top, SECONDS)
    lines = [
        line
        for i, per_rank in enumerate(found)
        for line in _rank_lines(per_rank, i, runs, scale=scale)
    ]
    svg = line_chart(lines, "step", f"step time ({unit})", zero=True)
    return _plot("plot-step-time", svg, notes=notes)


def _figure(plot: Plot) -> str:
    title, caption, why = {**PLOTS, **MOE_PLOTS}[plot.id]
    body = "".join(plot.svgs) or f'<p class="nodata">no data recorded: {_esc(why)}</p>'
    notes = "".join(f'<br><span class="note">{_esc(n)}</span>' for n in plot.notes)
    return (
        f'<figure id="{plot.id}"><h3>{_esc(title)}</h3>{body}'
        f"<figcaption>{_esc(plot.caption or caption)}{notes}</figcaption></figure>"
    )


# ---------------------------------------------------------------- figures and tables


def _seconds(value: float | None) -> str:
    if value is None:
        return "n/a"
    if value < 1e-3:
        return f"{value * 1e6:.0f} µs"
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def _usd(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"${value:.4f}" if abs(value) < 0.01 else f"${value:,.2f}"


def _last(values: list[float]) -> float | None:
    return values[-1] if values else None


def headline(run: Run, costs: Tco | None = None) -> list[tuple[str, float | None, str]]:
    """(figure, number for ratios, text): report.json's, or from the rows while it runs."""
    r = run.report
    steady = _last_segment_rows(run.rows)
    comm = r.get("communication") if isinstance(r.get("communication"), dict) else {}
    tokens = _first(_scalar(r.get("tokens_per_s")), _median(_values(steady, "tokens_per_s")))
    mfu = _first(_scalar(r.get("mfu")), _median(_values(steady, "mfu")))
    step_s = _first(_scalar(r.get("step_time_s")), _median(_values(steady, "step_time_s")))
    exposed = _first(_scalar(comm.get("exposed_s")), _median(_values(steady, "comm_s")))
    share = _first(
        _scalar(comm.get("exposed_fraction")),
        exposed / step_s if exposed is not None and step_s else None,
    )
    peak = _first(
        _number(r.get("peak_memory_bytes")),
        max(_values(run.rows, "peak_memory_bytes_per_rank"), default=None),
        max(_values(run.rows, "peak_memory_bytes"), default=None),
    )
    final = _first(_scalar(r.get("final_loss")), _last(_values(run.rows, "loss")))
    val = _first(_scalar(r.get("val_loss")), _last(_values(run.rows, "val_loss")))
    wall = _scalar(r.get("wall_time_s"))
    of_step = f" ({format_percent(share)} of the step)" if share is not None else ""
    label = headline_label(r)  # report.json's: over the layout the run ended with
    items = [
        ("tokens/s", tokens, ("n/a" if tokens is None else f"{tokens:,.0f}") + label),
        ("MFU", mfu, format_percent(mfu) + label),
        ("step time (median)", step_s, _seconds(step_s)),
        ("exposed communication per step", exposed, _seconds(exposed) + of_step),
        ("peak memory (largest rank)", peak, format_bytes(peak)),
        ("final train loss", final, "n/a" if final is None else f"{final:.4f}"),
        ("validation loss", val, "n/a" if val is None else f"{val:.4f}"),
        ("wall time", wall, _seconds(wall) if (wall or 0) < 60 else format_duration(wall)),
    ]
    moe = _moe(run)
    if moe is not None:
        worst = _number(moe.get("max_load"))
        items.append(("expert load max/mean (worst layer)", worst, moe_summary_text(moe)))
    return items + (_cost_items(run, costs) if costs is not None else [])


def _last_segment_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A running run's headline rows (no report.json yet): the last segment's, without
    its first (which includes its start-up) when it has more."""
    last = rows[-1].get("segment") if rows else None
    own = [r for r in rows if r.get("segment") == last]
    return own[1:] if len(own) > 1 else own


def _cost_items(run: Run, costs: Tco) -> list[tuple[str, float | None, str]]:
    from meshforge.cost.run import run_cost_from_report

    try:
        cost = run_cost_from_report(run.path, costs)
    except MeshforgeError as exc:
        return [("cost", None, f"n/a: {exc}")]
    return [
        ("GPU-hours", cost.gpu_hours, f"{cost.gpu_hours:.4g}"),
        (
            "cost owned / rented",
            cost.rented_usd,
            f"{_usd(cost.owned_usd)} / {_usd(cost.rented_usd)}",
        ),
        (
            "lost to synchronisation (owned / rented)",
            cost.sync_loss_rented_usd,
            f"{_usd(cost.sync_loss_owned_usd)} / {_usd(cost.sync_loss_rented_usd)}",
        ),
    ]


def _table(header: list[str] | None, rows: list[list[str]], numeric_from: int = 1) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header or [])
    body = "".join(
        "<tr>"
        + "".join(
            f"<td{' class=num' if j >= numeric_from else ''}>{_esc(cell)}</td>"
            for j, cell in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    head = f"<thead><tr>{head}</tr></thead>" if header else ""
    return f"<table>{head}<tbody>{body}</tbody></table>"


def _run_label(i: int, runs: list[Run]) -> str:
    return runs[i].name if len(runs) == 1 else f"{'AB'[i]}: {runs[i].name} ({runs[i].path.name})"


def _headline_table(runs: list[Run], costs: Tco | None) -> str:
    columns = [{label: (v, text) for label, v, text in headline(run, costs)} for run in runs]
    labels = list(dict.fromkeys(label for column in columns for label in column))
    if len(runs) == 1:
        return _table(["figure", "value"], [[k, columns[0][k][1]] for k in labels])
    rows = []
    for label in labels:
        (a, a_text), (b, b_text) = (c.get(label, (None, "n/a")) for c in columns)
        ratio = f"{b / a:.2f}x" if a and b is not None else "n/a"
        rows.append([label, a_text, b_text, ratio])
    return _table(["figure", _run_label(0, runs), _run_label(1, runs), "B/A"], rows)


def _layout(run: Run) -> dict[str, Any]:
    layout = run.report.get("layout")
    if isinstance(layout, dict):
        return layout
    # no report (running, or interrupted): what the config asked for, plain values only
    parallel = run.config.get("parallel")
    if not isinstance(parallel, dict):
        return {}
    train = run.config.get("train") or {}
    plain = {k: v for k, v in parallel.items() if not isinstance(v, dict | list) and v is not None}
    for key in ("micro_batch", "global_batch"):
        if isinstance(train, dict) and key in train:
            plain[key] = train[key]
    precision = run.config.get("precision") or {}
    if isinstance(precision, dict) and "dtype" in precision:
        plain["dtype"] = precision["dtype"]
    return {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in plain.items()}


def _about(run: Run) -> list[tuple[str, str]]:
    r, train = run.report, run.config.get("train") or {}
    steps_done = run.rows[-1]["step"] if run.rows else None
    steps = r.get("steps") or (train.get("steps") if isinstance(train, dict) else None)
    hosts = [h.get("host") for h in _list(r.get("hosts")) if isinstance(h, dict)]
    rows = [
        ("status", run.status),
        ("run directory", str(run.path)),
        (
            "steps logged / planned",
            f"{tick(steps_done) if steps_done is not None else 0}"
            f" / {steps if steps is not None else 'n/a'}",
        ),
        ("world size", str(r.get("world_size", "n/a"))),
        ("device / backend", f"{r.get('device', 'n/a')} / {r.get('backend', 'n/a')}"),
        ("hosts", ", ".join(dict.fromkeys(str(h) for h in hosts)) or "n/a"),
        (
            "resumed from step",
            str(r.get("resumed_from") if r.get("resumed_from") is not None else "no"),
        ),
    ]
    segments = [s for s in _list(r.get("segments")) if isinstance(s, dict)]
    if len(segments) > 1:  # resumed, restarted or extended: each launch, and why it ended
        rows += [(f"segment {i}", segment_text(s)) for i, s in enumerate(segments, start=1)]
    failure = r.get("failure")
    if isinstance(failure, dict):
        first = (
            failure.get("first_failure") if isinstance(failure.get("first_failure"), dict) else {}
        )
        rows.append(("failure", str(failure.get("summary") or first.get("error") or failure)))
    return rows


def _advice(run: Run) -> list[str]:
    health = run.report.get("memory_health")
    advice = list(_list(health.get("advice"))) if isinstance(health, dict) else []
    for row in run.rows:
        advice += [a for a in _list(row.get("memory_advice")) if isinstance(a, str)]
    return list(dict.fromkeys(str(a) for a in advice))


def _straggler_lines(run: Run) -> list[str]:
    lines = []
    for entry in _list(run.report.get("stragglers")):
        if isinstance(entry, dict):
            slowdown = _number(entry.get("slowdown"))
            how = f"{slowdown:.2f}x the median step" if slowdown else "slow"
            lines.append(f"rank {entry.get('rank')} on {entry.get('host') or 'n/a'}: {how}")
    flagged: dict[int, int] = {}
    for row in run.rows:
        for rank in _list(row.get("stragglers")):
            if isinstance(rank, int):
                flagged[rank] = flagged.get(rank, 0) + 1
    lines += [f"rank {rank} flagged on {n} logged step(s)" for rank, n in sorted(flagged.items())]
    return lines


def _run_section(i: int, runs: list[Run]) -> str:
    run, parts = runs[i], []
    parts.append(_table(None, [list(row) for row in _about(run)], numeric_from=9))
    for title, items in (("Memory advice", _advice(run)), ("Stragglers", _straggler_lines(run))):
        if items:
            parts.append(
                f"<h3>{title}</h3><ul>" + "".join(f"<li>{_esc(a)}</li>" for a in items) + "</ul>"
            )
    config = (
        f"<details><summary>config.yaml</summary><pre>{_esc(run.config_text)}</pre></details>"
        if run.config_text is not None
        else '<p class="nodata">no config.yaml in the run directory</p>'
    )
    status = "".join(c if c.isalnum() else "-" for c in run.status)
    return (
        f'<section class="run"><h2>{_esc(_run_label(i, runs))} '
        f'<span class="status status-{_esc(status)}">{_esc(run.status)}</span></h2>'
        f"{''.join(parts)}{config}</section>"
    )


# ---------------------------------------------------------------- mixture of experts

MOE_PLOTS = {  # id: (title, what it shows, why it may have nothing to show)
    "plot-moe-tokens": (
        "Tokens per expert",
        "The routed token assignments each expert of each MoE layer got over the run "
        "(summed over the data-parallel ranks; each token counts top_k times), shaded from "
        "the least (white) to the most loaded (dark blue). An even row is a balanced "
        "layer; a dark cell is a hot expert.",
        "no tokens_per_expert in report.json nor in the rows' moe section",
    ),
    "plot-moe-load": (
        "Expert load (max/mean)",
        "Each MoE layer's busiest expert over the mean expert, by logged interval (1.0: "
        "perfectly balanced). The busiest expert sets the pace of its expert-parallel group.",
        "no load_max_over_mean in the rows' moe section",
    ),
    "plot-moe-drops": (
        "Dropped tokens and auxiliary loss",
        "The share of routed token assignments dropped by the capacity factor (0 when "
        "routing is dropless), and the load-balancing auxiliary loss (load_balance aux_loss; "
        "1.0 is balanced), by logged interval.",
        "no moe section in metrics.jsonl",
    ),
}


def _ints(value: Any) -> list[int] | None:
    if not isinstance(value, list) or not value:
        return None
    numbers = [_number(v) for v in value]
    return None if any(n is None for n in numbers) else [int(n) for n in numbers]


def _moe(run: Run) -> dict[str, Any] | None:
    """The run's `moe` section: report.json's, else one summed from the rows (running)."""
    if isinstance(run.report.get("moe"), dict):
        return run.report["moe"]
    totals: dict[int, list[int]] = {}
    dropped, aux = 0, None
    for row in run.rows:
        section = row.get("moe")
        if not isinstance(section, dict):
            continue
        for layer, tokens in zip(
            _list(section.get("layers")), _list(section.get("tokens_per_expert")), strict=False
        ):
            if (counts := _ints(tokens)) is not None and _number(layer) is not None:
                acc = totals.setdefault(int(layer), [0] * len(counts))
                totals[int(layer)] = [a + c for a, c in zip(acc, counts, strict=False)]
        dropped += int(_number(section.get("dropped")) or 0)
        aux = _first(_scalar(section.get("aux_loss")), aux)
    if not totals:
        return None
    model = run.config.get("model") if isinstance(run.config.get("model"), dict) else {}
    settings = model.get("moe") if isinstance(model.get("moe"), dict) else {}
    parallel = run.config.get("parallel") if isinstance(run.config.get("parallel"), dict) else {}
    layers = sorted(totals)
    tokens = [totals[k] for k in layers]
    balance = [max(t) / (sum(t) / len(t)) if sum(t) else 0.0 for t in tokens]
    assigned = sum(sum(t) for t in tokens)
    return {
        **{k: settings.get(k) for k in ("experts", "top_k", "router", "load_balance")},
        "ep": parallel.get("ep"),
        "capacity_factor": settings.get("capacity_factor"),
        "layers": layers,
        "tokens_per_expert": tokens,
        "load_max_over_mean": [round(b, 4) for b in balance],
        "max_load": round(max(balance), 4),
        "dropped": dropped,
        "dropped_fraction": dropped / assigned if assigned else 0.0,
        "aux_loss": aux,
    }


def _moe_grid(moe: dict[str, Any]) -> tuple[list[int], list[list[int]]]:
    """(layers, tokens per expert of each) of a `moe` section, the unreadable left out."""
    layers, grid = [], []
    for layer, tokens in zip(
        _list(moe.get("layers")), _list(moe.get("tokens_per_expert")), strict=False
    ):
        if (counts := _ints(tokens)) is not None and _number(layer) is not None:
            layers.append(int(layer))
            grid.append(counts)
    return layers, grid


def hottest_experts(moe: dict[str, Any], limit: int = 3) -> list[str]:
    """The hottest expert of each layer, hottest first: "expert 3 of layer 1: 1.62x the
    layer's mean (on ep rank 1)"."""
    ep = int(_number(moe.get("ep")) or 1)
    found = []
    for layer, tokens in zip(*_moe_grid(moe), strict=True):
        mean = sum(tokens) / len(tokens)
        if not mean:
            continue
        expert = max(range(len(tokens)), key=tokens.__getitem__)
        where = f" (on ep rank {expert // max(1, len(tokens) // ep)})" if ep > 1 else ""
        found.append((tokens[expert] / mean, layer, expert, where))
    found.sort(key=lambda f: (-f[0], f[1]))
    return [
        f"expert {e} of layer {layer}: {ratio:.2f}x the layer's mean{where}"
        for ratio, layer, e, where in found[:limit]
    ]


def _moe_rows(run: Run) -> list[dict[str, Any]]:
    return [r for r in run.rows if isinstance(r.get("moe"), dict)]


def _moe_tokens_plot(runs: list[Run], sections: list[dict[str, Any] | None]) -> Plot:
    svgs = []
    for i, (run, moe) in enumerate(zip(runs, sections, strict=True)):
        if moe is None:
            continue
        layers, grid = _moe_grid(moe)
        experts = max((len(t) for t in grid), default=0)
        if not experts:
            continue
        grid = [t + [0] * (experts - len(t)) for t in grid]

        def hover(r: int, e: int, value: float, grid=grid, layers=layers) -> str:
            mean = sum(grid[r]) / len(grid[r]) or 1.0
            return (
                f"layer {layers[r]}, expert {e}: {value:,.0f} tokens "
                f"({value / mean:.2f}x the layer's mean)"
            )

        title = f"{_tag(i, runs)}{run.name}" if len(runs) > 1 else None
        svgs.append(
            heatmap(
                [f"layer {k}" for k in layers],
                [str(e) for e in range(experts)],
                grid,
                "expert",
                "MoE layer",
                title=title,
                hover=hover,
                legend="tokens:",
            )
        )
    return _plot("plot-moe-tokens", *svgs)


def _moe_load_plot(runs: list[Run]) -> Plot:
    lines: list[Line] = []
    steps: list[float] = []
    for i, run in enumerate(runs):
        per_layer: dict[int, tuple[list, list]] = {}
        worst: tuple[list, list] = ([], [])
        for row in _moe_rows(run):
            section = row["moe"]
            for layer, value in zip(
                _list(section.get("layers")), _list(section.get("load_max_over_mean")), strict=False
            ):
                if (v := _number(value)) is not None and _number(layer) is not None:
                    xs, ys = per_layer.setdefault(int(layer), ([], []))
                    xs.append(row["step"])
                    ys.append(v)
            if (v := _number(section.get("max_load"))) is not None:
                worst[0].append(row["step"])
                worst[1].append(v)
        steps += worst[0] + [x for xs, _ in per_layer.values() for x in xs]
        tag = _tag(i, runs)
        if per_layer and len(per_layer) <= 8:
            for k, layer in enumerate(sorted(per_layer)):
                color = _color(i, runs, k, len(per_layer))
                lines.append(Line(f"{tag}layer {layer}", *per_layer[layer], color))
        else:  # many layers: the worst of each interval
            lines.append(Line(f"{tag}worst layer", *worst, _color(i, runs)))
    if steps:
        lines.append(Line("balanced", [min(steps), max(steps)], [1.0, 1.0], "#8c8c8c", dashed=True))
    svg = line_chart(lines, "step", "max / mean tokens per expert", zero=True)
    return _plot("plot-moe-load", svg)


def _moe_drops_plot(runs: list[Run], sections: list[dict[str, Any] | None]) -> Plot:
    drops, aux, notes = [], [], []
    for i, run in enumerate(runs):
        rows = _moe_rows(run)
        tag, color = _tag(i, runs), _color(i, runs)
        dropped = [(r["step"], _scalar(r["moe"].get("dropped_fraction"))) for r in rows]
        dropped = [(x, 100.0 * y) for x, y in dropped if y is not None]
        losses = [(r["step"], _scalar(r["moe"].get("aux_loss"))) for r in rows]
        losses = [(x, y) for x, y in losses if y is not None]
        drops.append(Line(f"{tag}dropped", [x for x, _ in dropped], [y for _, y in dropped], color))
        aux.append(Line(f"{tag}aux loss", [x for x, _ in losses], [y for _, y in losses], color))
        moe = sections[i] or {}
        if rows and not losses:
            notes.append(
                f"{tag}{run.name}: no auxiliary loss (load_balance "
                f"{moe.get('load_balance') or 'is not aux_loss'})"
            )
    drop_svg = line_chart(
        drops, "step", "dropped (% of routed tokens)", title="dropped tokens", zero=True
    )
    aux_svg = line_chart(aux, "step", "aux loss", title="load-balancing auxiliary loss")
    return _plot("plot-moe-drops", drop_svg, aux_svg, notes=notes)


def _moe_plots(runs: list[Run]) -> list[Plot]:
    """The section's plots; none when no run is a mixture of experts."""
    sections = [_moe(run) for run in runs]
    if not any(sections) and not any(_moe_rows(run) for run in runs):
        return []
    return [
        _moe_tokens_plot(runs, sections),
        _moe_load_plot(runs),
        _moe_drops_plot(runs, sections),
    ]


def _moe_facts(run: Run, moe: dict[str, Any]) -> list[list[str]]:
    cf = moe.get("capacity_factor")
    settings = (
        f"{moe.get('experts', 'n/a')} experts, top-{moe.get('top_k', 'n/a')}, "
        f"{moe.get('router') or 'n/a'} router, {_moe_ep(moe)}, load_balance "
        f"{moe.get('load_balance') or 'n/a'}, "
        + (f"capacity factor {cf}" if cf is not None else "dropless (no capacity factor)")
    )
    hot = hottest_experts(moe)
    rows = [
        ["routing", settings],
        [
            "over the run",
            moe_summary_text(moe)
            + f" ({int(_number(moe.get('dropped')) or 0):,} token assignments dropped)",
        ],
        ["hottest experts", "; ".join(hot) if hot else "n/a"],
    ]
    causes: dict[str, str] = {}
    for row in run.rows:
        found = row.get("straggler_causes")
        if isinstance(found, dict):
            causes.update({str(k): str(v) for k, v in found.items()})
    rows += [[f"straggler rank {rank}", cause] for rank, cause in sorted(causes.items())]
    return rows


def _moe_ep(moe: dict[str, Any]) -> str:
    """`ep 2`, or per segment when they differ: `ep 2 (steps 0-10), 1 (steps 10-20)`."""
    ep = _number(moe.get("ep"))
    if ep is not None:
        return f"ep {int(ep)}"
    per = [s for s in _list(moe.get("ep_per_segment")) if isinstance(s, dict)]
    if not per:
        return "ep 1" if "ep" not in moe else "ep n/a"
    return "ep " + ", ".join(
        f"{s.get('ep')} (steps {s.get('start_step')}-{s.get('end_step')})" for s in per
    )


def _moe_section(runs: list[Run], plots: list[Plot]) -> str:
    if not plots:
        return ""
    parts = []
    for i, run in enumerate(runs):
        moe = _moe(run)
        label = f"<h3>{_esc(_run_label(i, runs))}</h3>" if len(runs) > 1 else ""
        if moe is None:
            parts.append(f'{label}<p class="nodata">not a mixture-of-experts run</p>')
            continue
        parts.append(label + _table(None, _moe_facts(run, moe), numeric_from=9))
    return (
        f'<section id="moe"><h2>Mixture of experts</h2>{"".join(parts)}'
        f"{''.join(_figure(p) for p in plots)}</section>"
    )


# ---------------------------------------------------------------- the page

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0 auto;max-width:1100px;padding:16px 24px;
color:#222;background:#fff}
h1{font-size:22px;margin:0 0 6px}h2{font-size:18px;margin:18px 0 6px}h3{font-size:15px;
margin:10px 0 4px}
table{border-collapse:collapse;margin:6px 0}th,td{border-bottom:1px solid #e3e3e3;
padding:3px 10px;text-align:left;vertical-align:top}td.num{text-align:right;
font-variant-numeric:tabular-nums}
.status{font-size:12px;padding:1px 8px;border-radius:9px;color:#fff;background:#777;
vertical-align:middle}.status-completed{background:#2e7d32}.status-failed{background:#c62828}
.status-running{background:#1565c0}.status-stopped{background:#ef6c00}
figure{margin:16px 0;border:1px solid #e3e3e3;border-radius:6px;padding:6px 12px 10px}
figcaption{color:#555;font-size:13px}.nodata{color:#777;font-style:italic}
.note{color:#8a5a00}nav a{margin-right:10px}
svg{display:block;max-width:100%;height:auto}svg text{font:11px system-ui,sans-serif;
fill:#333}svg text.title{font-weight:bold;font-size:12px}svg .grid{stroke:#ececec;fill:none}
svg .axis{stroke:#888;fill:none}svg path.data[stroke]{fill:none}
pre{background:#f6f6f6;padding:8px;overflow:auto;font-size:12px}
"""
# Nothing may load: not a script, a font, an image, a style sheet or a connection.
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


def build_html(run_dirs: Sequence[str | Path], cluster: str | Path | None = None) -> str:
    """The report page of one run, or of two runs overlaid (A, B)."""
    if not 1 <= len(run_dirs) <= 2:
        raise ConfigError(f"give one run directory, or two to compare (got {len(run_dirs)})")
    if len(run_dirs) == 2 and Path(run_dirs[0]).resolve() == Path(run_dirs[1]).resolve():
        raise ConfigError(f"{run_dirs[0]} and {run_dirs[1]} are the same run directory")
    runs = [load_run(d) for d in run_dirs]
    costs = None
    if cluster is not None:
        from meshforge.cost.cluster import load_cluster
        from meshforge.cost.tco import tco

        costs = tco(load_cluster(cluster))
    plots = [
        _plot_loss(runs),
        _plot_throughput(runs),
        _plot_memory(runs),
        _plot_breakdown(runs),
        _plot_network(runs),
        _plot_step_time(runs),
    ]
    if len(runs) == 1:
        title = f"meshforge report: {runs[0].name}"
    else:
        title = f"meshforge comparison: {_run_label(0, runs)} vs {_run_label(1, runs)}"
    moe_plots = _moe_plots(runs)
    nav = " ".join(f'<a href="#{p.id}">{_esc(PLOTS[p.id][0])}</a>' for p in plots)
    if moe_plots:
        nav += ' <a href="#moe">Mixture of experts</a>'
    layouts = [_layout(run) for run in runs]
    keys = list(dict.fromkeys(k for layout in layouts for k in layout))
    layout = _table(
        ["setting", *(_run_label(i, runs) for i in range(len(runs)))],
        [[k, *(str(lay.get(k, "n/a")) for lay in layouts)] for k in keys],
    )
    cost_note = f" Cost from cluster file {cluster}." if cluster is not None else ""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<link rel="icon" href="data:,">'
        f"<title>{_esc(title)}</title><style>{STYLE}</style></head><body>"
        f"<h1>{_esc(title)}</h1><nav>{nav}</nav>"
        f"<h2>Headline</h2>{_headline_table(runs, costs)}"
        f'<p class="nodata">Rates and step time: medians over the logged steps after the '
        f"first.{_esc(cost_note)}</p>"
        f"<h2>Layout</h2>{layout if keys else '<p class=nodata>no layout recorded</p>'}"
        f"{''.join(_run_section(i, runs) for i in range(len(runs)))}"
        f"<h2>Plots</h2>{''.join(_figure(p) for p in plots)}"
        f"{_moe_section(runs, moe_plots)}"
        "</body></html>\n"
    )


def default_out(run_dirs: Sequence[str | Path]) -> Path:
    """RUN_DIR/report.html; for two runs A B, A/compare-<B's directory name>.html."""
    first = Path(run_dirs[0])
    if len(run_dirs) == 1:
        return first / "report.html"
    return first / f"compare-{Path(run_dirs[1]).resolve().name}.html"


def write_html(
    run_dirs: Sequence[str | Path],
    out: str | Path | None = None,
    cluster: str | Path | None = None,
) -> Path:
    """Write the page (atomically) and return its path."""
    text = build_html(run_dirs, cluster)
    path = Path(out) if out is not None else default_out(run_dirs)
    if not path.parent.is_dir():
        raise ConfigError(f"cannot write {path}: folder {path.parent} does not exist")
    if path.is_dir():
        raise ConfigError(f"cannot write {path}: it is a directory")
    try:
        write_text_atomic(path, text)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path
