"""``metrics.jsonl``: one JSON object per logged step, safe against crashes.

Each record is written as one line and flushed at once, so a run that dies
loses at most the line being written. ``read_jsonl`` ignores such a truncated
last line; ``JsonlSink`` drops it before appending, so a resumed run never
glues its first record onto a broken one. ``tail_rows`` reads only the end of a
growing file (a live run's latest steps, for `meshforge top` and `diagnose`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

# the readers of a run directory's JSON-lines files (its metrics too) live with its files
from meshforge.rundir.records import TAIL_BYTES, read_jsonl, tail_rows  # noqa: F401


def _plain(value: Any) -> Any:
    """``value`` as plain JSON values: tensors and numpy values as numbers or lists,
    paths as strings, and NaN or infinity as null (strict JSON has neither, and
    a diverged loss must not make the file unreadable to other tools)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "tolist") and callable(value.tolist):
        return _plain(value.tolist())  # torch tensors, numpy arrays and scalars
    return value


def _drop_partial_last_line(path: Path) -> None:
    """Cut a last line left without its newline by a crash mid-write."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        chunk = 1 << 16
        pos = size
        while pos > 0:
            start = max(0, pos - chunk)
            f.seek(start)
            newline = f.read(pos - start).rfind(b"\n")
            if newline >= 0:
                f.truncate(start + newline + 1)
                return
            pos = start
        f.truncate(0)


class JsonlSink:
    """Appends records to a JSON-lines file, one flushed line per ``write``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            _drop_partial_last_line(self.path)
        self._file = open(self.path, "a", encoding="utf-8")  # closed in close()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(_plain(record), allow_nan=False)
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def latest_rows(records: list[dict[str, Any]], tails: bool = False) -> list[dict[str, Any]]:
    """One row per step, in step order: the latest row of each step.

    A run resumed from an earlier checkpoint trains some steps again. Each row carries
    the number of the segment that wrote it (rundir/segments.py): where a new segment's
    rows begin, they replace every earlier segment's row from that step on, whole, so a
    step trained twice reads as its latest training and the steps a crashed segment did
    beyond the checkpoint its successor resumed from (abandoned, never to be trained
    from) are left out. Rows of one segment for the same step (or rows without a
    segment, as older runs wrote them) are merged, later values winning. A record
    without a numeric step keeps its place by its index.

    A `moe_tail` record (the expert counts of the steps after a segment's last logged
    row, written when it ends: train/metrics_logger.py) is no row of figures: left out
    unless `tails`, after the segments' replacement, so an abandoned one goes too."""
    merged: dict[float, dict[str, Any]] = {}
    segment: Any = None
    for index, record in enumerate(records):
        step = record.get("step")
        numeric = isinstance(step, int | float) and not isinstance(step, bool)
        key = float(step) if numeric and math.isfinite(step) else float(index)
        values = {k: v for k, v in record.items() if v is not None and k != "step"}
        if numeric and values.get("segment") not in (None, segment):
            segment = values["segment"]  # a new segment: it trains from here on
            merged = {k: row for k, row in merged.items() if k < key}
        earlier = merged.get(key)
        if earlier is not None and earlier.get("segment") != values.get("segment"):
            earlier = None
        merged[key] = {**(earlier or {"step": step if numeric else key}), **values}
    return [merged[k] for k in sorted(merged) if tails or not is_tail(merged[k])]


def is_tail(record: dict[str, Any]) -> bool:
    """A `moe_tail` record of metrics.jsonl: expert counts only, no figures."""
    return record.get("moe_tail") is True


def number(value: Any) -> float | None:
    """A finite float, or None for missing, null, NaN and non-numbers."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        numbers = [n for n in (number(v) for v in value) if n is not None]
        return max(numbers) if numbers else None  # per-rank list: the largest
    if isinstance(value, dict):
        return number(list(value.values()))
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def series(rows: list[dict[str, Any]], key: str, scale: float = 1.0) -> tuple[list, list]:
    """(steps, values) of the rows where `key` holds a number (scaled)."""
    steps, values = [], []
    for row in rows:
        value = number(row.get(key))
        if value is not None:
            steps.append(row["step"])
            values.append(value * scale)
    return steps, values
