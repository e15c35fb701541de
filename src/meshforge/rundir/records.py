"""Reading a run directory's JSON-lines files (metrics, segments, restarts, system
samples): the whole file, tolerant of the line a crash cut, or its tail while a run
writes it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a JSON-lines file; a truncated last line is ignored.

    A malformed line anywhere else is real corruption and raises ValueError
    naming the line."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):
                break  # the line a crash interrupted
            raise ValueError(f"{path}:{number}: not a JSON object: {err}") from None
        if not isinstance(record, dict):
            raise ValueError(
                f"{path}:{number}: expected a JSON object, got {type(record).__name__}"
            )
        records.append(record)
    return records


TAIL_BYTES = 64 * 1024
_MAX_TAIL_BYTES = 8 * 1024 * 1024  # a row wider than this is not waited for


def tail_rows(path: Path, max_bytes: int = TAIL_BYTES) -> list[dict[str, Any]]:
    """The JSON objects on the complete lines of the last `max_bytes` of a JSON-lines file,
    in order. A line cut by the window or by a writer mid-line is skipped; the window
    doubles until it holds a whole row (up to 8 MiB)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            while True:
                start = max(0, size - max_bytes)
                f.seek(start)
                lines = f.read(size - start).split(b"\n")
                if start > 0:
                    lines = lines[1:]  # begins mid-line
                rows = []
                for line in lines:
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(row, dict):
                        rows.append(row)
                if rows or start == 0 or max_bytes >= _MAX_TAIL_BYTES:
                    return rows
                max_bytes *= 2
    except OSError:
        return []
