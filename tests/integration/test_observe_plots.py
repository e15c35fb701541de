"""report.png: four panels from metrics.jsonl rows, whatever rows there are."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import run_python
from meshforge.report.plots import plot_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _row(step: int) -> dict:
    return {
        "step": step,
        "loss": 5.0 - 0.1 * step,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "tokens_per_s": 1000.0 + step,
        "mfu": None,
        "step_time_s": 0.5,
        "data_s": 0.05,
        "compute_s": 0.35,
        "comm_s": 0.05,
        "other_s": 0.05,
        "peak_memory_bytes": 300_000_000,
    }


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_a_full_run_writes_a_png(tmp_path: Path) -> None:
    rows = [_row(s) for s in range(10, 210, 10)]
    for row in rows[4::5]:
        row["val_loss"] = row["loss"] + 0.2
    out = tmp_path / "report.png"
    plot_report(rows, out)
    _assert_png(out)
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    "rows",
    [
        [_row(1)],
        [{"step": 1, "loss": 2.0}],
        [{"step": 1}, {"step": 2, "loss": None, "peak_memory_bytes": [1, 2]}],
        [{"loss": float("nan")}, {"loss": 1.0, "val_loss": 1.1}],
        [{"step": 3, "loss": 2.0}, {"step": 3, "val_loss": 2.1}, {"step": 1, "loss": 3.0}],
        [],
    ],
    ids=[
        "one-record",
        "only-loss",
        "nulls-and-per-rank",
        "no-step-key",
        "unsorted-val-rows",
        "empty",
    ],
)
def test_sparse_or_odd_records_still_plot(tmp_path: Path, rows: list[dict]) -> None:
    out = tmp_path / "sub" / "report.png"
    plot_report(rows, out)
    _assert_png(out)


def test_only_plots_imports_matplotlib() -> None:
    code = (
        "import sys\n"
        "import meshforge.observe.peak, meshforge.observe.memory\n"
        "import meshforge.observe.metrics, meshforge.observe.console\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'\n"
    )
    proc = run_python(["-c", code])
    assert proc.returncode == 0, proc.stderr
