"""Quantities as people read them: bytes, counts, shares and durations (stdlib only,
so every layer, the data inspector and the viewers included, can use them)."""

from __future__ import annotations

import math


def format_bytes(n: float | None) -> str:
    if isinstance(n, bool) or not isinstance(n, int | float):
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop always returns


def format_count(n: float | None) -> str:
    if isinstance(n, bool) or not isinstance(n, int | float):
        return "n/a"
    for threshold, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= threshold:
            return f"{n / threshold:.2f}{suffix}"
    return f"{n:.0f}"


def format_percent(fraction: float | None) -> str:
    if isinstance(fraction, bool) or not isinstance(fraction, int | float):
        return "n/a"
    return f"{100 * fraction:.1f}%"


def format_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
