"""The load of a mixture-of-experts run's experts wherever a user looks: report.html's
"Mixture of experts" section, `meshforge top`'s experts line, `meshforge diagnose`
naming a straggler slowed by hot experts (and what to do), and the end-of-run table.

One real two-rank run of moe-tiny with ep=2 (trained once for the module); the
straggler is synthetic: a copy of the run with a straggler in report.json and its cause
in the metrics rows, as train/metrics_logger.py writes them."""

from __future__ import annotations

import json
import re
import shutil
import statistics
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from helpers import meshforge
from meshforge.health.diagnose import diagnose_run
from meshforge.observe.console import print_summary
from meshforge.report.html import build_html, hottest_experts
from meshforge.report.top import render_frame

JOB = {
    "name": "moe",
    "model": {"preset": "moe-tiny"},
    "data": {"source": "builtin:python-stdlib"},
    "parallel": {"ep": 2},
    "train": {"steps": 10, "global_batch": 8, "micro_batch": 2, "eval_every": 0, "warmup": 2},
    "observe": {"log_every": 5},
}
CAUSE = (
    "hot experts: its experts got 1.62x the mean share of the routed tokens; "
    "hottest: expert 3 of layer 1"
)


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(run directory, the train command's stdout)."""
    tmp = tmp_path_factory.mktemp("moe-observe")
    config = tmp / "moe.yaml"
    config.write_text(yaml.safe_dump(JOB))
    run_dir = tmp / "run"
    proc = meshforge(["train", str(config), "--nproc", "2", "--run-dir", str(run_dir)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, proc.stdout


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _report(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


def _copy(run_dir: Path, tmp_path: Path, report=None, rows=None) -> Path:
    """A copy of the run, report.json and each metrics row changed in place by the
    given functions."""
    out = tmp_path / "copy"
    shutil.copytree(run_dir, out, ignore=shutil.ignore_patterns("checkpoints"))
    report_json = _report(out)
    if report is not None:
        report(report_json)
    (out / "report.json").write_text(json.dumps(report_json))
    changed = _rows(out)
    for row in changed:
        if rows is not None:
            rows(row)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in changed))
    return out


def _figure(page: str, plot_id: str) -> str:
    found = re.search(rf'<figure id="{plot_id}">(.*?)</figure>', page, re.S)
    assert found, f"no figure {plot_id}"
    return found.group(1)


def test_the_run_records_expert_load(moe_run: tuple[Path, str]) -> None:
    run_dir, _ = moe_run
    moe = _report(run_dir)["moe"]
    assert (moe["experts"], moe["top_k"], moe["ep"], moe["layers"]) == (4, 2, 2, [0, 1])
    assert all(isinstance(r.get("moe"), dict) for r in _rows(run_dir))


def test_html_has_the_moe_section_and_its_plots(moe_run: tuple[Path, str]) -> None:
    run_dir, _ = moe_run
    page = build_html([run_dir])
    moe = _report(run_dir)["moe"]
    assert '<section id="moe"><h2>Mixture of experts</h2>' in page
    assert '<a href="#moe">' in page
    for plot_id in ("plot-moe-tokens", "plot-moe-load", "plot-moe-drops"):
        figure = _figure(page, plot_id)
        assert "<svg" in figure and "no data recorded" not in figure, plot_id
        assert re.search(r'<path class="data" d="M[\d.]+,[\d.]+', figure), plot_id
    # the heatmap: one cell per expert per layer, each with its count in its read-out
    cells = re.findall(r"<title>(layer \d+, expert \d+: [\d,]+ tokens)", page)
    assert len(cells) == 2 * 4
    assert f"layer 1, expert 0: {moe['tokens_per_expert'][1][0]:,} tokens" in cells
    # max/mean of each layer over the steps, and the aux loss (load_balance aux_loss)
    assert "layer 0</text>" in _figure(page, "plot-moe-load")
    assert "load-balancing auxiliary loss" in _figure(page, "plot-moe-drops")
    hottest = hottest_experts(moe)
    assert hottest and hottest[0] in page.replace("&#x27;", "'")
    assert f"max/mean load {moe['max_load']:.2f}" in page


def test_html_of_a_dense_run_has_no_moe_section(moe_run: tuple[Path, str], tmp_path: Path) -> None:
    dense = _copy(
        moe_run[0], tmp_path, report=lambda r: r.pop("moe"), rows=lambda row: row.pop("moe")
    )
    page = build_html([dense])
    assert "Mixture of experts" not in page and "plot-moe" not in page


def test_html_of_a_running_run_sums_the_rows(moe_run: tuple[Path, str], tmp_path: Path) -> None:
    running = _copy(moe_run[0], tmp_path)
    (running / "report.json").unlink()
    page = build_html([running])
    rows = _rows(running)
    total = sum(r["moe"]["tokens_per_expert"][0][2] for r in rows)
    assert f"layer 0, expert 2: {total:,} tokens" in page
    assert "<h2>Mixture of experts</h2>" in page


def test_top_shows_the_latest_rows_expert_load(moe_run: tuple[Path, str]) -> None:
    run_dir, _ = moe_run
    last_row = _rows(run_dir)[-1]
    last = last_row["moe"]
    worst = last["load_max_over_mean"].index(last["max_load"])
    frame = render_frame(run_dir)
    line = next(line for line in frame.splitlines() if line.startswith("experts:"))
    assert line == (
        f"experts: max/mean load {last['max_load']:.2f} (layer {last['layers'][worst]}), "
        f"dropped 0.0%, aux loss {last['aux_loss']:.4f} (step {last_row['step']})"
    )
    proc = meshforge(["top", str(run_dir), "--once"])
    assert proc.returncode == 0 and line in proc.stdout


def test_diagnose_names_a_straggler_slowed_by_hot_experts(
    moe_run: tuple[Path, str], tmp_path: Path
) -> None:
    def straggler(report: dict) -> None:
        report["stragglers"] = [{"rank": 1, "host": "vm", "slowdown": 1.7}]

    def cause(row: dict) -> None:
        row["stragglers"] = [1]
        row["straggler_causes"] = {"1": CAUSE}

    run = _copy(moe_run[0], tmp_path, report=straggler, rows=cause)
    d = diagnose_run(run)
    assert (d["verdict"], d["ranks"]) == ("straggler", [1])
    assert "1.70x the median" in d["summary"]
    assert f"cause: {CAUSE}" in d["summary"]
    assert d["cause"] == CAUSE
    assert d["evidence"]["straggler_causes"]["1"]["cause"] == CAUSE
    advice = " ".join(d["advice"])
    for hint in (
        "aux_loss_coeff (now 0.01",
        "load_balance: bias",
        "capacity_factor",
        "parallel.ep",
    ):
        assert hint in advice, hint
    proc = meshforge(["diagnose", str(run)])
    assert proc.stdout.splitlines()[0] == d["summary"]
    # the HTML report lists the cause under its straggler
    assert f"straggler rank 1</td><td>{CAUSE}" in build_html([run])


def test_diagnose_without_a_cause_gives_no_moe_advice(
    moe_run: tuple[Path, str], tmp_path: Path
) -> None:
    run = _copy(
        moe_run[0],
        tmp_path,
        report=lambda r: r.update(stragglers=[{"rank": 0, "host": "vm", "slowdown": 1.5}]),
    )
    d = diagnose_run(run)
    assert d["verdict"] == "straggler" and "cause:" not in d["summary"]
    assert d["cause"] is None and not any("aux_loss" in a for a in d["advice"])


def test_the_end_of_run_table_has_an_experts_line(moe_run: tuple[Path, str]) -> None:
    run_dir, stdout = moe_run
    moe = _report(run_dir)["moe"]
    console = Console(record=True, width=200)
    print_summary(_report(run_dir), console=console)
    line = next(line for line in console.export_text().splitlines() if "│ experts" in line)
    assert f"max/mean load {moe['max_load']:.2f}" in line
    assert "dropped 0.0%" in line and f"aux loss {moe['aux_loss']:.4f}" in line
    # and the table the train command printed at its end has it too
    assert re.search(r"│ experts\s+│ max/mean load", stdout)


def test_html_without_aux_loss_says_why_and_odd_sections_do_not_break_it(
    moe_run: tuple[Path, str], tmp_path: Path
) -> None:
    def bias(report: dict) -> None:
        report["moe"].update(load_balance="bias", aux_loss=None)

    def odd(row: dict) -> None:
        row["moe"].pop("aux_loss")
        if row["step"] == 5:  # a section cut short and garbled
            row["moe"] = {"layers": "x", "tokens_per_expert": [[1, "a"]], "max_load": None}

    run = _copy(moe_run[0], tmp_path, report=bias, rows=odd)
    page = build_html([run])
    drops = _figure(page, "plot-moe-drops")
    assert "no auxiliary loss (load_balance bias)" in drops
    assert drops.count("<svg") == 1  # dropped tokens; no aux loss plot
    assert "<h2>Mixture of experts</h2>" in page
    (run / "report.json").unlink()  # summed from the rows: the garbled one left out
    assert "layer 1, expert 0" in build_html([run])


def test_a_run_extended_under_another_layout_and_stopped_counts_every_step(
    moe_run: tuple[Path, str], tmp_path: Path
) -> None:
    """The ep=2 run extended on 1 rank (no expert parallelism) and stopped by SIGTERM
    between two logged steps: report.json's moe counts cover every step that ran (the
    stop writes the pending interval's), its ep is per segment, and the headline
    tokens/s and MFU are the new layout's, as report.html's top line says."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from helpers import REPO
    from meshforge.report.html import headline, load_run

    run_dir = tmp_path / "run"
    shutil.copytree(moe_run[0], run_dir)
    config = tmp_path / "moe.yaml"
    config.write_text(yaml.safe_dump(JOB))
    env = {k: v for k, v in os.environ.items() if k != "MESHFORGE_FAULT"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshforge", "train", str(config), "--nproc", "1",
         "--run-dir", str(run_dir), "--set", "parallel.ep=1", "--set", "train.steps=5000"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not any(r.get("segment") == 2 for r in _rows(run_dir)):  # step 15 logged
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    report = _report(run_dir)
    assert report["status"] == "stopped", out[-3000:]
    stopped = report["stopped"]["step"]
    rows = _rows(run_dir)
    if stopped % JOB["observe"]["log_every"]:  # between two logged steps: a tail record
        assert rows[-1]["moe_tail"] is True and rows[-1]["step"] == stopped
    moe = report["moe"]
    routed = JOB["train"]["global_batch"] * 64 * moe["top_k"]  # moe-tiny: seq_len 64
    assert [sum(t) for t in moe["tokens_per_expert"]] == [stopped * routed] * 2
    assert moe["ep"] is None
    assert [(s["segment"], s["start_step"], s["end_step"], s["ep"]) for s in
            moe["ep_per_segment"]] == [(1, 0, 10, 2), (2, 10, stopped, 1)]  # fmt: skip
    # the headline: segment 2's rows alone (its only row: its first), not a blend
    own = [r for r in rows if r.get("segment") == 2 and not r.get("moe_tail")]
    assert report["headline_segments"] == [2] and report["measured_steps"] == len(own)
    assert report["tokens_per_s"] == pytest.approx(statistics.median(
        r["tokens_per_s"] for r in own))  # fmt: skip
    assert [s["tokens_per_s"] for s in report["segments"]][0] == pytest.approx(
        next(r["tokens_per_s"] for r in rows if r["step"] == 10)
    )
    items = {name: text for name, _, text in headline(load_run(run_dir))}
    assert items["tokens/s"] == f"{report['tokens_per_s']:,.0f} (segment 2, the last layout logged)"
    assert "(segment 2, the last layout logged)" in out
