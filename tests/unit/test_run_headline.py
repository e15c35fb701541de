"""report.json's headline (tokens/s, MFU, step time) after a run is extended under
another layout: the figures of the layout the run ended with, each segment's own in
`segments`, and the summary table and report.html saying so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console

from meshforge.observe.console import headline_label, print_summary, segment_text
from meshforge.rundir.segments import close_segment, open_segment
from meshforge.train.report import _tp_comm, history_figures, run_history

EP2 = {"dp": 2, "tp": 1, "pp": 1, "zero": 0, "ep": 2}
ONE = {"dp": 1, "tp": 1, "pp": 1, "zero": 0}


def _row(step: int, segment: int, tokens: float, mfu: float) -> dict[str, Any]:
    return {"step": step, "segment": segment, "loss": 5.0 - step / 10, "tokens_per_s": tokens,
            "mfu": mfu, "step_time_s": 1000.0 / tokens}  # fmt: skip


def _run(tmp_path: Path, layouts: list[tuple[dict[str, Any], int]]) -> Path:
    """Segments of 10 steps each, logged every 2; segment n runs at n * 1000 tokens/s."""
    tmp_path.mkdir(exist_ok=True)
    rows = []
    for n, (layout, world) in enumerate(layouts, start=1):
        start = (n - 1) * 10
        open_segment(tmp_path, start_step=start, steps=start + 10, lr_horizon=10,
                     world_size=world, layout=layout)  # fmt: skip
        close_segment(tmp_path, n, start + 10, "completed", wall_s=1.0)
        rows += [_row(s, n, 1000.0 * n, 0.1 * n) for s in range(start + 2, start + 11, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_a_run_extended_under_another_layout_reports_the_last_ones_speed(tmp_path) -> None:
    figures = history_figures(run_history(_run(tmp_path, [(EP2, 2), (ONE, 1)])))
    assert (figures["tokens_per_s"], figures["mfu"]) == (2000.0, 0.2)  # not blended
    assert figures["step_time_s"] == 0.5
    assert figures["headline_segments"] == [2] and figures["measured_steps"] == 4
    # each segment's own figures, over its steady rows
    own = [(s["segment"], s["tokens_per_s"], s["mfu"]) for s in figures["segments"]]
    assert own == [(1, 1000.0, 0.1), (2, 2000.0, 0.2)]
    assert "1,000 tok/s, MFU 10.0%" in segment_text(figures["segments"][0])
    assert headline_label(figures) == " (segment 2, the last layout logged)"
    console = Console(record=True, width=200)
    print_summary({**figures, "status": "completed"}, console=console)
    text = console.export_text()
    assert "2,000 (segment 2, the last layout logged)" in text
    assert "20.0% (segment 2, the last layout logged)" in text


def test_segments_of_one_layout_count_together(tmp_path) -> None:
    figures = history_figures(run_history(_run(tmp_path, [(EP2, 2), (ONE, 1), (ONE, 1)])))
    assert figures["headline_segments"] == [2, 3]
    assert figures["tokens_per_s"] == 2500.0 and figures["measured_steps"] == 8
    assert headline_label(figures) == " (segments 2, 3, the last layout logged)"
    same = history_figures(run_history(_run(tmp_path / "same", [(ONE, 1), (ONE, 1)])))
    assert same["headline_segments"] == [1, 2] and same["measured_steps"] == 8
    assert headline_label(same) == ""  # the whole run: nothing to say


def test_report_html_top_line_agrees(tmp_path) -> None:
    from meshforge.report.html import headline, load_run

    run_dir = _run(tmp_path, [(EP2, 2), (ONE, 1)])
    history = run_history(run_dir)
    report = {**history_figures(history), "status": "completed"}
    (run_dir / "report.json").write_text(json.dumps(report))
    run = load_run(run_dir)
    items = {name: text for name, _, text in headline(run)}
    assert items["tokens/s"] == "2,000 (segment 2, the last layout logged)"
    assert items["MFU"].startswith("20.0%")
    # while it runs (no report.json): the last segment's rows, its first left out
    (run_dir / "report.json").unlink()
    running = load_run(run_dir)
    items = {name: text for name, _, text in headline(running)}
    assert items["tokens/s"] == "2,000"


def test_a_segment_that_logged_only_its_start_up_shows_the_headline_figures(tmp_path) -> None:
    """A resumed segment with one logged row (its start-up interval): the headline falls
    back to that row, and so does the segment's own entry, so the two agree."""
    run = _run(tmp_path, [(EP2, 2)])
    open_segment(run, start_step=10, steps=12, lr_horizon=10, world_size=1, layout=ONE)
    close_segment(run, 2, 12, "completed", wall_s=1.0)
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(_row(12, 2, 4888.0, 0.2)) + "\n")
    figures = history_figures(run_history(run))
    assert figures["headline_segments"] == [2]
    assert figures["tokens_per_s"] == 4888.0
    assert figures["segments"][1]["tokens_per_s"] == 4888.0
    assert figures["segments"][1]["mfu"] == 0.2


def test_the_profiled_collectives_are_the_last_segments_own():
    """report.json's `tp_comm` (tp's and cp's collectives in one profiled step): a run
    resumed under another layout shows its last segment's profile, or none, never an
    earlier layout's."""
    first = [{"step": 3, "segment": 1, "tp_comm_s": 0.5}, {"step": 4, "segment": 1}]
    assert _tp_comm(first, 1.0) == {"step": 3, "seconds": 0.5, "fraction_of_step": 0.5}
    resumed = [*first, {"step": 5, "segment": 2}, {"step": 6, "segment": 2}]
    assert _tp_comm(resumed, 1.0) is None
    profiled = [*resumed[:-1], {"step": 6, "segment": 2, "tp_comm_s": 0.1}]
    assert _tp_comm(profiled, 0.5) == {"step": 6, "seconds": 0.1, "fraction_of_step": 0.2}
