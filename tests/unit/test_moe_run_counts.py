"""report.json's run-long `moe` counts: every step that ran (a segment stopped between
two logged steps writes its `moe_tail`), and the expert-parallel degree per segment."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

from meshforge.layout import ParallelDims
from meshforge.observe.expert_load import moe_summary
from meshforge.observe.metrics import latest_rows
from meshforge.train.metrics_logger import MetricsLogger
from meshforge.train.report import run_history


def _moe(tokens: list[int]) -> dict[str, Any]:
    return {"layers": [0], "tokens_per_expert": [tokens], "dropped": 0, "aux_loss": 0.1}


def _cfg() -> Any:
    moe = SimpleNamespace(
        experts=2, top_k=1, router="softmax", load_balance="aux_loss", capacity_factor=None
    )
    return SimpleNamespace(model=SimpleNamespace(moe=moe))


class _Load:
    """ExpertLoad's interface: the pending interval's counts."""

    def __init__(self) -> None:
        self.calls = 0

    def interval(self, device: Any) -> dict[str, Any]:
        self.calls += 1
        return _moe([3, 1])


def _logger(main: bool = True) -> tuple[MetricsLogger, list[dict[str, Any]]]:
    written: list[dict[str, Any]] = []
    m = MetricsLogger.__new__(MetricsLogger)
    m.rt = SimpleNamespace(is_main=main)
    m.device = "cpu"
    m.rows, m.segment, m.expert_load = [], 2, _Load()
    m._jsonl = SimpleNamespace(call=lambda name, row: written.append(row))
    m._interval_steps, m._step = 0, 5  # resumed from step 5
    m.pipeline_times = []
    return m, written


def _step(m: MetricsLogger) -> None:
    m.count(SimpleNamespace(busy_s=None), steady=True)


def test_a_stop_between_logged_steps_writes_the_pending_counts() -> None:
    m, written = _logger()
    with contextlib.ExitStack() as stack:
        stack.push(m._end_of_segment)
        for _ in range(2):  # steps 6 and 7; the row at step 10 never comes
            _step(m)
    assert written == [
        {"step": 7, "time": written[0]["time"], "moe_tail": True, "interval_steps": 2,
         "moe": _moe([3, 1]), "segment": 2}
    ]  # fmt: skip
    assert m.rows == written


def test_nothing_pending_or_an_error_writes_no_tail() -> None:
    m, written = _logger()
    m._end_of_segment(None, None, None)  # the last step was logged
    assert written == [] and m.expert_load.calls == 0
    _step(m)
    m._end_of_segment(RuntimeError, RuntimeError("x"), None)  # the ranks may not be here
    assert written == [] and m.expert_load.calls == 0
    # every rank reduces; only rank 0 writes
    other, written = _logger(main=False)
    _step(other)
    other._end_of_segment(None, None, None)
    assert other.expert_load.calls == 1 and written == [] and other.rows == []


def test_tails_count_in_the_moe_section_only() -> None:
    records = [
        {"step": 5, "segment": 1, "loss": 2.0, "moe": _moe([4, 6])},
        {"step": 7, "segment": 1, "moe_tail": True, "moe": _moe([1, 3])},
        {"step": 10, "segment": 2, "loss": 1.5, "moe": _moe([5, 1])},
    ]
    rows = latest_rows(records)
    assert [r["step"] for r in rows] == [5, 10] and rows[-1]["loss"] == 1.5
    with_tails = latest_rows(records, tails=True)
    assert [r["step"] for r in with_tails] == [5, 7, 10]
    summary = moe_summary(_cfg(), ParallelDims(dp=1, tp=1, pp=1), with_tails)
    assert summary is not None and summary["tokens_per_expert"] == [[10, 10]]
    # a segment resumed from an earlier checkpoint trains step 7 again: the tail goes
    resumed = [*records[:2], {"step": 6, "segment": 2, "loss": 1.9, "moe": _moe([2, 2])}]
    assert [r["step"] for r in latest_rows(resumed, tails=True)] == [5, 6]


def test_run_history_keeps_tails_out_of_the_figures(tmp_path) -> None:
    import json

    rows = [
        {"step": 5, "segment": 1, "loss": 2.0, "tokens_per_s": 100.0, "moe": _moe([4, 6])},
        {"step": 10, "segment": 1, "loss": 1.8, "tokens_per_s": 200.0, "moe": _moe([4, 6])},
        {"step": 12, "segment": 1, "moe_tail": True, "moe": _moe([1, 3])},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    history = run_history(tmp_path)
    assert [r["step"] for r in history["rows"]] == [5, 10]
    assert [r["step"] for r in history["steady"]] == [10]
    assert [r["step"] for r in history["moe_rows"]] == [5, 10, 12]


def _segment(n: int, start: int, end: int, ep: int | None) -> dict[str, Any]:
    layout = {"dp": 2, "tp": 1, "pp": 1} | ({"ep": ep} if ep else {})
    return {"segment": n, "start_step": start, "end_step": end, "layout": layout}


def test_ep_is_per_segment_when_the_layout_changed() -> None:
    rows = [{"step": 10, "segment": 1, "moe": _moe([1, 1])}]
    mixed = moe_summary(_cfg(), ParallelDims(dp=1, tp=1, pp=1), rows, [_segment(1, 0, 10, 2),
                        _segment(2, 10, 20, None)])  # fmt: skip
    assert mixed is not None and mixed["ep"] is None
    assert [(s["segment"], s["start_step"], s["end_step"], s["ep"]) for s in
            mixed["ep_per_segment"]] == [(1, 0, 10, 2), (2, 10, 20, 1)]  # fmt: skip
    # one ep over every segment that trained (a segment that trained nothing aside)
    same = moe_summary(_cfg(), ParallelDims(dp=1, tp=1, pp=1), rows, [_segment(1, 0, 10, 2),
                       _segment(2, 10, 10, None)])  # fmt: skip
    assert same is not None and same["ep"] == 2
