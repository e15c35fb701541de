"""The rank-0 console: a live bar on a terminal, plain progress lines in a log."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from meshforge.observe.console import TrainingProgress, print_summary

METRICS = {
    "loss": 2.3456,
    "lr": 3e-3,
    "grad_norm": 0.75,
    "tokens_per_s": 12345.6,
    "mfu": None,
    "step_time_s": 0.25,
    "data_s": 0.025,
    "comm_s": 0.05,
}


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=200), out


def test_without_a_terminal_every_update_prints_one_status_line() -> None:
    console, out = _console(terminal=False)
    with TrainingProgress(
        100, start_step=0, enabled=True, title="gpt-tiny", console=console
    ) as bar:
        bar.update(10, METRICS)
        bar.log("checkpoint saved at step 10")
        bar.update(20, {**METRICS, "mfu": 0.123})
    lines = out.getvalue().splitlines()
    assert lines[0] == "gpt-tiny: steps 0..100"
    assert lines[1].startswith("gpt-tiny step 10/100 | loss 2.3456 | lr 3.00e-03 | gnorm 0.750")
    assert "12,346 tok/s | MFU n/a | step 0.250 s | data 10% comm 20% | ETA " in lines[1]
    assert lines[2] == "checkpoint saved at step 10"
    assert "step 20/100" in lines[3] and "MFU 12.3%" in lines[3]


def test_plain_lines_reach_captured_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    with TrainingProgress(5, start_step=2, enabled=True, title="run") as bar:
        bar.update(3, {"loss": 1.0})
    printed = capsys.readouterr().out
    assert "run step 3/5 | loss 1.0000" in printed
    assert "MFU n/a" in printed


def test_a_disabled_progress_prints_nothing() -> None:
    console, out = _console(terminal=False)
    with TrainingProgress(10, start_step=0, enabled=False, title="x", console=console) as bar:
        bar.update(1, METRICS)
        bar.log("hello")
    assert out.getvalue() == ""


def test_on_a_terminal_the_live_bar_shows_step_and_metrics_and_stops() -> None:
    console, out = _console(terminal=True)
    progress = TrainingProgress(50, start_step=10, enabled=True, title="gpt", console=console)
    with progress as bar:
        assert bar.live
        bar.update(25, METRICS)
        bar.log("validation loss 2.1")
    text = out.getvalue()
    assert "25/50" in text and "loss 2.3456" in text and "MFU n/a" in text
    assert "validation loss 2.1" in text
    assert progress._progress is None


def test_eta_comes_from_the_steps_done_since_start(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("meshforge.observe.console.time.monotonic", lambda: now[0])
    console, out = _console(terminal=False)
    with TrainingProgress(100, start_step=50, enabled=True, title="r", console=console) as bar:
        now[0] = 110.0
        bar.update(60, {})  # 10 steps in 10 s, 40 to go
    assert out.getvalue().splitlines()[1].endswith("ETA 0:40")


def test_summary_table_lists_the_report_fields() -> None:
    report = {
        "status": "completed",
        "steps": 200,
        "world_size": 2,
        "layout": {"dp": 2, "zero": 2, "tp": 1, "pp": 1},
        "model_params": 1_234_567,
        "first_loss": 5.5,
        "final_loss": 2.25,
        "tokens_per_s": 4321.0,
        "mfu": None,
        "step_time_s": 0.5,
        "time_breakdown": {"compute": 0.8, "comm": 0.1, "data": 0.05, "bubble": 0.0, "other": 0.05},
        "model_state_bytes": [
            {"params": 4_000_000, "grads": 2_000_000, "optimizer": 4_000_000},
            {"params": 4_000_000, "grads": 2_000_000, "optimizer": 4_000_000},
        ],
        "peak_memory_bytes": [300 * 2**20, 310 * 2**20],
        "resumed_from": 20,
    }
    console, out = _console(terminal=False)
    print_summary(report, console=console)
    text = out.getvalue()
    for expected in [
        "completed",
        "dp=2 zero=2 tp=1 pp=1",
        "1.23M",
        "5.5000",
        "2.2500",
        "4,321",
        "MFU",
        "n/a",
        "0.500 s",
        "compute 80.0%",
        "rank 1: params 3.8 MiB, grads 1.9 MiB, optimizer 3.8 MiB",
        "rank 1: 310.0 MiB",
        "20",
    ]:
        assert expected in text, expected


def test_summary_survives_a_sparse_failed_report() -> None:
    console, out = _console(terminal=False)
    print_summary({"status": "failed", "layout": "[dp=2]"}, console=console)
    text = out.getvalue()
    assert "failed" in text and "[dp=2]" in text and "no" in text


def test_a_stopped_runs_summary_says_where_it_stopped() -> None:
    console, out = _console(terminal=False)
    report = {"status": "stopped", "steps": 12, "stopped": {"signal": "SIGINT", "step": 1}}
    print_summary(report, console=console)
    assert "1 of 12 (stopped)" in out.getvalue()


def test_an_mfu_above_one_says_its_peak_is_too_low():
    from meshforge.observe.console import mfu_text

    assert mfu_text(0.123) == "12.3%"
    assert mfu_text(None) == "n/a"
    above = mfu_text(1.37)
    assert above.startswith("137.0%") and "peak is too low" in above and "--recalibrate" in above
