"""Small SVG charts for report.html, drawn as text: line charts, bar charts and stacked
areas with axes, ticks, a legend and hover read-outs (SVG ``<title>``), no script and no
library. A line keeps at most MAX_POINTS points: each bucket of a long series keeps its
lowest and highest point, so a spike survives."""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MAX_POINTS = 600
_esc = html.escape

W, PLOT_H, LEFT, RIGHT, BOTTOM = 760, 220, 72, 18, 44


@dataclass(frozen=True)
class Line:
    label: str | None  # None: not in the legend
    xs: Sequence[float]
    ys: Sequence[float]
    color: str
    dashed: bool = False
    width: float = 1.6
    markers: bool = False


def _downsample(xs: Sequence[float], ys: Sequence[float]) -> tuple[list, list]:
    """At most MAX_POINTS points: each bucket keeps its lowest and highest, in order."""
    n = len(xs)
    if n <= MAX_POINTS:
        return list(xs), list(ys)
    size = math.ceil(n / (MAX_POINTS // 2))
    keep: list[int] = []
    for start in range(0, n, size):
        bucket = range(start, min(n, start + size))
        keep += sorted({min(bucket, key=ys.__getitem__), max(bucket, key=ys.__getitem__)})
    return [xs[i] for i in keep], [ys[i] for i in keep]


def _nice(lo: float, hi: float, zero: bool = False) -> tuple[float, float, list[float]]:
    """A round axis range around [lo, hi] and its ticks (steps of 1, 2, 2.5 or 5 x 10^k)."""
    if zero:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    if hi - lo <= 0:
        pad = abs(hi) * 0.1 or 1.0
        lo, hi = (lo, hi + pad) if zero and lo == 0 else (lo - pad, hi + pad)
    raw = (hi - lo) / 5
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw * 0.999)
    lo, hi = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    return lo, hi, [lo + i * step for i in range(round((hi - lo) / step) + 1)]


def tick(value: float) -> str:
    value = round(value, 12)
    for size, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e4, "k")):
        if abs(value) >= size:
            size = 1e3 if suffix == "k" else size
            return f"{value / size:.4g}{suffix}"
    return f"{value:.4g}"


def _header(title: str | None, legend: list[tuple[str, str, bool]]) -> tuple[list[str], float]:
    """Panel title and legend rows above the plot area; returns (parts, plot top)."""
    parts, x, y = [], float(LEFT), 14.0
    if title:
        parts.append(f'<text x="{LEFT}" y="{y}" class="title">{_esc(title)}</text>')
        x += 9 + 7.5 * len(title)
    for label, color, dashed in legend:
        width = 36 + 6.6 * len(label)
        if x + width > W - RIGHT and x > LEFT:
            x, y = float(LEFT), y + 16
        dash = ' stroke-dasharray="5 3"' if dashed else ""
        parts.append(
            f'<path d="M{x:.0f},{y - 4}h20" stroke="{color}" stroke-width="3"{dash}/>'
            f'<text x="{x + 24:.0f}" y="{y}">{_esc(label)}</text>'
        )
        x += width
    return parts, y + 14


def _frame(
    top: float,
    x_range: tuple[float, float, list[float]],
    y_range: tuple[float, float, list[float]],
    x_label: str,
    y_label: str,
) -> tuple[list[str], Callable[[float], float], Callable[[float], float]]:
    """Grid, ticks and axis labels; returns the parts and the data -> pixel maps."""
    (x0, x1, xticks), (y0, y1, yticks) = x_range, y_range
    bottom, right = top + PLOT_H, W - RIGHT

    def sx(x: float) -> float:
        return LEFT + (x - x0) / ((x1 - x0) or 1) * (right - LEFT)

    def sy(y: float) -> float:
        return bottom - (y - y0) / ((y1 - y0) or 1) * PLOT_H

    parts = []
    for t in yticks:
        y = sy(t)
        parts.append(
            f'<path class="grid" d="M{LEFT},{y:.1f}H{right}"/>'
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_esc(tick(t))}</text>'
        )
    for t in xticks:
        x = sx(t)
        parts.append(
            f'<path class="grid" d="M{x:.1f},{top}V{bottom}"/>'
            f'<text x="{x:.1f}" y="{bottom + 15}" text-anchor="middle">{_esc(tick(t))}</text>'
        )
    parts.append(
        f'<path class="axis" d="M{LEFT},{top}V{bottom}H{right}"/>'
        f'<text x="{(LEFT + right) / 2}" y="{bottom + 34}" text-anchor="middle">'
        f"{_esc(x_label)}</text>"
        f'<text transform="translate(16,{top + PLOT_H / 2}) rotate(-90)" text-anchor="middle">'
        f"{_esc(y_label)}</text>"
    )
    return parts, sx, sy


def _svg(parts: list[str], height: float, label: str) -> str:
    return (
        f'<svg viewBox="0 0 {W} {height:.0f}" width="{W}" height="{height:.0f}" role="img" '
        f'aria-label="{_esc(label)}">{"".join(parts)}</svg>'
    )


def line_chart(
    lines: list[Line],
    x_label: str,
    y_label: str,
    *,
    title: str | None = None,
    zero: bool = False,
    legend_extra: Sequence[tuple[str, str, bool]] = (),
) -> str | None:
    """Lines over a shared x axis; None when no line has a point."""
    lines = [ln for ln in lines if ln.xs]
    if not lines:
        return None
    xs = [x for ln in lines for x in ln.xs]
    ys = [y for ln in lines for y in ln.ys]
    legend = [(ln.label, ln.color, ln.dashed) for ln in lines if ln.label] + list(legend_extra)
    parts, top = _header(title, legend)
    grid, sx, sy = _frame(
        top, _nice(min(xs), max(xs)), _nice(min(ys), max(ys), zero), x_label, y_label
    )
    parts += grid
    for ln in lines:
        lx, ly = _downsample(ln.xs, ln.ys)
        dash = ' stroke-dasharray="6 4"' if ln.dashed else ""
        d = "M" + "L".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(lx, ly, strict=True))
        name = _esc(ln.label or "")
        parts.append(
            f'<path class="data" d="{d}" stroke="{ln.color}" stroke-width="{ln.width}"{dash}>'
            f"<title>{name}</title></path>"
        )
        if ln.markers or len(lx) <= 2:
            parts += [
                f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{ln.color}">'
                f"<title>{name}: {_esc(x_label)} {tick(x)}, {tick(y)}</title></circle>"
                for x, y in zip(lx, ly, strict=True)
            ]
    return _svg(parts, top + PLOT_H + BOTTOM, title or y_label)


def bar_chart(
    categories: list[str],
    groups: list[tuple[str, str, list[float | None]]],
    x_label: str,
    y_label: str,
) -> str | None:
    """Grouped bars: one group per category, one bar per (label, colour, values)."""
    if not any(v is not None for _, _, values in groups for v in values):
        return None
    top_value = max(v for _, _, values in groups for v in values if v is not None)
    parts, top = _header(None, [(label, color, False) for label, color, _ in groups])
    n = len(categories)
    grid, sx, sy = _frame(
        top, (-0.5, n - 0.5, []), _nice(0, top_value, zero=True), x_label, y_label
    )
    parts += grid
    slot = min(60.0, (sx(1) - sx(0)) * 0.8 / len(groups))
    for i, category in enumerate(categories):
        cx = sx(i)
        parts.append(
            f'<text x="{cx:.1f}" y="{top + PLOT_H + 15}" text-anchor="middle">'
            f"{_esc(category)}</text>"
        )
        for g, (label, color, values) in enumerate(groups):
            value = values[i] if i < len(values) else None
            if value is None:
                continue
            x, y = cx - slot * len(groups) / 2 + g * slot, sy(value)
            parts.append(
                f'<path class="data" d="M{x:.1f},{sy(0):.1f}V{y:.1f}h{slot * 0.9:.1f}'
                f'V{sy(0):.1f}Z" fill="{color}"><title>{_esc(label)} {_esc(category)}: '
                f"{tick(value)}</title></path>"
            )
    return _svg(parts, top + PLOT_H + BOTTOM, y_label)


def stack_chart(
    xs: list[float],
    layers: list[tuple[str, str, list[float]]],
    x_label: str,
    y_label: str,
    *,
    title: str | None = None,
    y_max: float | None = None,
) -> str | None:
    """Stacked areas (bars when there is one x) of aligned layers, bottom layer first."""
    if not xs:
        return None
    keep, most = range(len(xs)), MAX_POINTS // 2  # an area's outline walks its xs twice
    if len(xs) > most:  # layers must stay aligned: one evenly spaced subset for all
        keep = sorted({round(i * (len(xs) - 1) / (most - 1)) for i in range(most)})
    xs = [xs[i] for i in keep]
    layers = [(label, color, [ys[i] for i in keep]) for label, color, ys in layers]
    totals = [sum(col) for col in zip(*(ys for _, _, ys in layers), strict=True)]
    parts, top = _header(title, [(label, color, False) for label, color, _ in layers])
    x_range = _nice(xs[0] - 0.5, xs[0] + 0.5) if len(xs) == 1 else _nice(min(xs), max(xs))
    grid, sx, sy = _frame(top, x_range, _nice(0, y_max or max(totals), zero=True), x_label, y_label)
    parts += grid
    base = [0.0] * len(xs)
    for label, color, ys in layers:
        upper = [b + y for b, y in zip(base, ys, strict=True)]
        if len(xs) == 1:
            half = (sx(x_range[1]) - sx(x_range[0])) / 8
            d = f"M{sx(xs[0]) - half:.1f},{sy(base[0]):.1f}V{sy(upper[0]):.1f}h{2 * half:.1f}"
            d += f"V{sy(base[0]):.1f}Z"
        else:
            edge = [f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, upper, strict=True)]
            back = [f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs[::-1], base[::-1], strict=True)]
            d = "M" + "L".join(edge + back) + "Z"
        parts.append(
            f'<path class="data" d="{d}" fill="{color}"><title>{_esc(label)}</title></path>'
        )
        base = upper
    return _svg(parts, top + PLOT_H + BOTTOM, title or y_label)


_HEAT_LOW, _HEAT_HIGH = (0xF7, 0xFB, 0xFF), (0x08, 0x30, 0x6B)  # white to dark blue


def _heat(fraction: float) -> str:
    f = min(1.0, max(0.0, fraction))
    return "#" + "".join(
        f"{round(lo + (hi - lo) * f):02x}" for lo, hi in zip(_HEAT_LOW, _HEAT_HIGH, strict=True)
    )


def _every(n: int, most: int) -> int:
    """Label every k-th of n categories so that at most `most` labels are drawn."""
    return max(1, math.ceil(n / most))


def heatmap(
    rows: list[str],
    columns: list[str],
    values: list[list[float]],
    x_label: str,
    y_label: str,
    *,
    title: str | None = None,
    hover: Callable[[int, int, float], str] | None = None,
    legend: str = "",
) -> str | None:
    """A grid of cells (row i, column j) shaded from white (the smallest value) to dark
    blue (the largest), with the value in the cell where it fits and a hover read-out (`hover(i, j,
    value)`, default "row, column: value"). Rows are drawn top-down in the given order."""
    if not rows or not columns or not any(values):
        return None
    low = min((v for row in values for v in row), default=0)
    high = max((v for row in values for v in row), default=0)
    span = (high - low) or 1.0
    parts, top = _header(title, [])
    top += 14  # the colour scale's line
    cell_h = max(4.0, min(28.0, PLOT_H / len(rows)))
    right = W - RIGHT
    cell_w = (right - LEFT) / len(columns)
    bottom = top + cell_h * len(rows)
    first = f"{legend} {tick(low)}".strip()
    scale_parts = [f'<text x="{LEFT}" y="{top - 6}">{_esc(first)}</text>']
    x = LEFT + 9 + 6.6 * len(first)
    for k in range(10):
        scale_parts.append(
            f'<path d="M{x + 14 * k:.0f},{top - 16}h14v12h-14Z" fill="{_heat(k / 9)}"/>'
        )
    scale_parts.append(f'<text x="{x + 146:.0f}" y="{top - 6}">{_esc(tick(high))}</text>')
    parts += scale_parts
    row_every, column_every = _every(len(rows), 24), _every(len(columns), 32)
    small = cell_w < 30 or cell_h < 14
    for i, row in enumerate(rows):
        y = top + i * cell_h
        if i % row_every == 0:
            parts.append(
                f'<text x="{LEFT - 6}" y="{y + cell_h / 2 + 4:.1f}" text-anchor="end">'
                f"{_esc(row)}</text>"
            )
        for j, value in enumerate(values[i][: len(columns)]):
            x = LEFT + j * cell_w
            shade = (value - low) / span
            text = hover(i, j, value) if hover else f"{row}, {columns[j]}: {tick(value)}"
            parts.append(
                # a 1-pixel gap between cells (no stroke: a stroked data path is unfilled)
                f'<path class="data" d="M{x:.1f},{y:.1f}h{cell_w - 1:.1f}v{cell_h - 1:.1f}'
                f'h{1 - cell_w:.1f}Z" fill="{_heat(shade)}">'
                f"<title>{_esc(text)}</title></path>"
            )
            if not small:
                ink = "#fff" if shade > 0.55 else "#222"
                parts.append(
                    f'<text x="{x + cell_w / 2:.1f}" y="{y + cell_h / 2 + 4:.1f}" '
                    f'text-anchor="middle" style="fill:{ink}">{_esc(tick(value))}</text>'
                )
    for j, column in enumerate(columns):
        if j % column_every == 0:
            parts.append(
                f'<text x="{LEFT + (j + 0.5) * cell_w:.1f}" y="{bottom + 15:.1f}" '
                f'text-anchor="middle">{_esc(column)}</text>'
            )
    parts.append(
        f'<path class="axis" d="M{LEFT},{top}V{bottom:.1f}H{right}"/>'
        f'<text x="{(LEFT + right) / 2}" y="{bottom + 34:.1f}" text-anchor="middle">'
        f"{_esc(x_label)}</text>"
        f'<text transform="translate(16,{(top + bottom) / 2:.1f}) rotate(-90)" '
        f'text-anchor="middle">{_esc(y_label)}</text>'
    )
    return _svg(parts, bottom + BOTTOM, title or y_label)
