"""metrics.jsonl: one flushed line per record, and a crash mid-line loses only that line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from meshforge.observe.metrics import JsonlSink, read_jsonl


def test_each_write_is_one_line_on_disk_before_close(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.write({"step": 1, "loss": 2.5})
    assert path.read_text() == '{"step": 1, "loss": 2.5}\n'  # flushed, not buffered
    sink.write({"step": 2, "loss": 2.0})
    sink.close()
    assert read_jsonl(path) == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}]


def test_a_truncated_last_line_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    with JsonlSink(path) as sink:
        for step in range(3):
            sink.write({"step": step})
    with open(path, "a") as f:
        f.write('{"step": 3, "lo')  # the process died here
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2]


def test_appending_after_a_crash_drops_the_broken_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "lo')
    with JsonlSink(path) as sink:
        sink.write({"step": 1, "loss": 1.0})
    assert read_jsonl(path) == [{"step": 0}, {"step": 1, "loss": 1.0}]


def test_a_file_that_is_all_one_broken_line_is_cut_to_empty(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "lo')
    assert read_jsonl(path) == []
    with JsonlSink(path) as sink:
        sink.write({"step": 0})
    assert read_jsonl(path) == [{"step": 0}]


def test_corruption_before_the_last_line_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=":2:"):
        read_jsonl(path)


def test_tensors_numpy_scalars_and_non_finite_values_become_strict_json(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    with JsonlSink(path) as sink:
        sink.write(
            {
                "loss": torch.tensor(1.5),
                "tokens": np.int64(7),
                "per_rank": np.array([1, 2]),
                "grad_norm": float("nan"),
                "mfu": None,
            }
        )
    line = path.read_text().strip()
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}")) == {
        "loss": 1.5,
        "tokens": 7,
        "per_rank": [1, 2],
        "grad_norm": None,
        "mfu": None,
    }
