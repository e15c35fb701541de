"""report.html and `meshforge report`: one self-contained page per run, or two runs overlaid.

Two real two-rank runs (trained once for the module) are rendered in headless Chromium;
hand-made records feed build_html the keys and files the runs may not have yet (per-rank
step time and memory, system samples, stragglers, advice) and the awkward cases (a failed
run, a run without report.json, a resumed run, a long run)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from helpers import REPO, Job, assert_one_line_error, meshforge
from meshforge.report.html import PLOT_IDS, build_html, write_html
from meshforge.report.svg import MAX_POINTS, _downsample

CHROMIUM = Path("/usr/bin/chromium")
needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="/usr/bin/chromium is not installed (.ci/run installs it)"
)
REMOTE = re.compile(r"""(?:\b(?:src|href)\s*=\s*["']?|url\(\s*["']?)\s*(?:https?:)?//""", re.I)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two finished runs, A (DDP) and B (ZeRO-1): 2 ranks, 20 steps, validation every 10."""
    tmp = tmp_path_factory.mktemp("report")
    train = {"steps": 20, "eval_every": 10}
    a = Job(tmp, {"name": "alpha", "train": train}, name="alpha")
    b = Job(tmp, {"name": "beta", "train": train, "parallel": {"zero": 1}}, name="beta")
    a.train(2)
    b.train(2)
    return a.run_dir, b.run_dir


def _figure(page: str, plot_id: str) -> str:
    found = re.search(rf'<figure id="{plot_id}">(.*?)</figure>', page, re.S)
    assert found, f"no figure {plot_id}"
    return found.group(1)


def _assert_drawn(page: str, plot_id: str) -> None:
    figure = _figure(page, plot_id)
    assert "<svg" in figure and "no data recorded" not in figure, (plot_id, figure[:300])
    assert re.search(r'<path class="data" d="M[\d.]+,[\d.]+', figure), plot_id


def _chromium(tmp: Path, page: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--enable-logging=stderr", "--v=0",
         f"--user-data-dir={tmp / 'chromium-profile'}", *args, page.resolve().as_uri()],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _console(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "CONSOLE" in line]


# ---------------------------------------------------------------- a real run, in a browser


def test_training_writes_report_html_with_every_plot(runs: tuple[Path, Path]) -> None:
    page = (runs[0] / "report.html").read_text()
    assert "alpha" in page and "completed" in page
    for plot_id in PLOT_IDS:
        _assert_drawn(page, plot_id)
    assert not REMOTE.search(page), REMOTE.search(page)
    assert "Content-Security-Policy" in page


@needs_chromium
def test_the_page_renders_in_chromium_without_console_messages(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    from PIL import Image

    shot = tmp_path / "report.png"
    proc = _chromium(tmp_path, runs[0] / "report.html", f"--screenshot={shot}",
                     "--window-size=1280,4200")  # fmt: skip
    assert shot.is_file(), proc.stderr[-2000:]
    assert _console(proc) == []
    colors = Image.open(shot).convert("RGB").getcolors(1 << 24)  # [(count, (r, g, b))]
    non_white = sum(n for n, rgb in colors if min(rgb) < 240) / sum(n for n, _ in colors)
    assert len(colors) > 100 and non_white > 0.01, (len(colors), non_white)

    dumped = _chromium(tmp_path, runs[0] / "report.html", "--dump-dom")
    assert _console(dumped) == []
    dom = dumped.stdout
    for plot_id in PLOT_IDS:
        _assert_drawn(dom, plot_id)


@needs_chromium
def test_the_console_check_sees_a_console_message(tmp_path: Path) -> None:
    page = tmp_path / "noisy.html"
    page.write_text("<html><body><script>console.error('noise')</script></body></html>")
    assert _console(_chromium(tmp_path, page, "--dump-dom"))


def test_meshforge_report_rebuilds_the_page(runs: tuple[Path, Path]) -> None:
    page = runs[0] / "report.html"
    page.unlink()
    proc = meshforge(["report", str(runs[0])], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(page)
    for plot_id in PLOT_IDS:
        _assert_drawn(page.read_text(), plot_id)


def test_meshforge_report_compares_two_runs(runs: tuple[Path, Path]) -> None:
    a, b = runs
    proc = meshforge(["report", str(a), str(b)], timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = a / f"compare-{b.name}.html"
    assert proc.stdout.strip() == str(out)
    page = out.read_text()
    assert "alpha" in page and "beta" in page and "B/A" in page
    for plot_id in PLOT_IDS:
        _assert_drawn(page, plot_id)


def test_meshforge_report_with_out_and_cluster(runs: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "page.html"
    args = ["report", str(runs[0]), "--out", str(out), "--cluster", "examples/cluster.yaml"]
    proc = meshforge(args, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "GPU-hours" in out.read_text() and "lost to synchronisation" in out.read_text()


@pytest.mark.parametrize(
    "case, words",
    [
        ("missing", ["no such run directory"]),
        ("file", ["not a directory"]),
        ("empty", ["no metrics.jsonl nor report.json"]),
        ("cluster-missing", ["cluster file not found"]),
        ("cluster-invalid", ["invalid YAML"]),
        ("out-folder-missing", ["does not exist"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    case: str, words: list[str], runs: tuple[Path, Path], tmp_path: Path
) -> None:
    run = str(runs[0])
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "bad.yaml").write_text("gpus: [unclosed\n")
    args = {
        "missing": [str(tmp_path / "nope")],
        "file": [str(tmp_path / "file")],
        "empty": [str(tmp_path / "empty")],
        "cluster-missing": [run, "--cluster", str(tmp_path / "nope.yaml")],
        "cluster-invalid": [run, "--cluster", str(tmp_path / "bad.yaml")],
        "out-folder-missing": [run, "--out", str(tmp_path / "nope" / "x.html")],
    }[case]
    assert_one_line_error(meshforge(["report", *args], timeout=60), *words)


# ---------------------------------------------------------------- hand-made records


def _row(step: int, slow_rank: int | None = None) -> dict:
    step_s = [0.10, 0.10]
    if slow_rank is not None:
        step_s[slow_rank] = 0.18
    return {
        "step": step, "time": 1.7e9 + step, "loss": 5.0 - 0.01 * step, "tokens_per_s": 1e4,
        "mfu": 0.3, "step_time_s": max(step_s), "data_s": 0.01, "compute_s": 0.06,
        "comm_s": 0.02, "bubble_s": None, "other_s": 0.01, "peak_memory_bytes": 3 << 30,
        "net_tx_bytes": 1e6, "own_s_per_rank": [0.09, 0.09], "step_time_s_per_rank": step_s,
        "memory_bytes_per_rank": [2 << 30, (2 << 30) + step * 1000],
        "peak_memory_bytes_per_rank": [3 << 30, 3 << 30],
    }  # fmt: skip


def _sample(t: float, host: str, node: int) -> dict:
    net = {
        "lo": {"rx_bytes_per_s": 5e6, "tx_bytes_per_s": 5e6},
        "eth0": {"rx_bytes_per_s": 1e8 + t, "tx_bytes_per_s": 9e7,
                 "capacity_bytes_per_s": 1.25e9, "utilization": 0.08},
    }  # fmt: skip
    return {"time": 1.7e9 + t, "host": host, "addr": "10.0.0.1", "node": node,
            "interval_s": 1.0, "cpu_percent": 50.0, "net": net, "gpus": []}  # fmt: skip


def _write_run(
    path: Path,
    rows: list[dict] | None = None,
    report: dict | None = None,
    system: dict[str, list[dict]] | None = None,
    name: str = "hand",
) -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(f"name: {json.dumps(name)}\nparallel: {{dp: 2, zero: 1}}\n")
    if rows is not None:
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if report is not None:
        (path / "report.json").write_text(json.dumps(report))
    for node, samples in (system or {}).items():
        (path / "system").mkdir(exist_ok=True)
        (path / "system" / f"{node}.jsonl").write_text(
            "".join(json.dumps(s) + "\n" for s in samples)
        )
    return path


def _report(**extra) -> dict:
    return {"status": "completed", "name": "hand", "steps": 30, "world_size": 2,
            "layout": {"dp": 2, "zero": 1, "tp": 1, "pp": 1}, "tokens_per_s": 1e4,
            "step_time_s": 0.1, "wall_time_s": 3.0, "peak_memory_bytes": [3 << 30, 3 << 30],
            "time_breakdown": {"exposed_comm": 0.2},
            "communication": {"exposed_s": 0.02, "exposed_fraction": 0.2}, **extra}  # fmt: skip


def test_every_plot_draws_from_per_rank_keys_and_system_samples(tmp_path: Path) -> None:
    rows = [_row(s, slow_rank=1 if s % 3 == 0 else None) for s in range(1, 31)]
    rows[20]["stragglers"] = [1]
    rows[21]["memory_advice"] = ["rank 1 is at 91% of its memory: lower micro_batch"]
    report = _report(
        stragglers=[{"rank": 1, "host": "node-b", "slowdown": 1.8}],
        memory_health={"advice": ["activation checkpointing would save 1.2 GiB"]},
    )
    system = {
        "node-0": [_sample(t, "node-a", 0) for t in range(10)],
        "node-1": [_sample(t, "node-b", 1) for t in range(10)],
    }
    page = build_html([_write_run(tmp_path / "run", rows, report, system)])
    for plot_id in PLOT_IDS:
        _assert_drawn(page, plot_id)
    assert "rank 1 (straggler 1.80x)" in _figure(page, "plot-step-time")
    assert ">peak</text>" in _figure(page, "plot-memory")  # the legend of the dashed lines
    network = _figure(page, "plot-network")
    assert "node-a" in network and "node-b loopback" in network
    assert "lower micro_batch" in page and "activation checkpointing would save" in page
    assert "rank 1 on node-b: 1.80x the median step" in page
    assert "20.0 ms (20.0% of the step)" in page  # exposed communication, from report.json
    assert not REMOTE.search(page)


def test_a_failed_run_without_rows_still_has_every_figure(tmp_path: Path) -> None:
    failure = {"summary": "rank 1 crashed: <RuntimeError> & more", "verdict": "rank_crashed"}
    run = _write_run(tmp_path / "run", report={"status": "failed", "failure": failure})
    page = build_html([run])
    for plot_id in PLOT_IDS:
        assert "no data recorded: " in _figure(page, plot_id)
    assert "status-failed" in page
    assert "&lt;RuntimeError&gt; &amp; more" in page and "<RuntimeError>" not in page


def test_a_run_without_report_json_reads_its_rows(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", rows=[_row(s) for s in range(1, 6)])
    out = write_html([run])
    page = out.read_text()
    assert out == run / "report.html"
    assert "no report.json" in page  # no lock file: running or not cannot be told
    assert "10,000" in page  # tokens/s: the rows' median
    assert "<td>dp</td><td class=num>2</td>" in page  # layout: the config's


def test_a_resumed_run_keeps_the_later_rows(tmp_path: Path) -> None:
    rows = [_row(s) for s in range(1, 6)] + [{**_row(s), "loss": 9.0} for s in (4, 5)]
    page = build_html([_write_run(tmp_path / "run", rows)])
    assert "<td>final train loss</td><td class=num>9.0000</td>" in page
    train = re.search(r'<path class="data" d="([^"]+)"[^>]*><title>train loss', page)
    assert train and train.group(1).count("L") == 4  # five steps, each once


def test_long_series_are_cut_to_max_points(tmp_path: Path) -> None:
    rows = [_row(s, slow_rank=1 if s == 3333 else None) for s in range(1, 5001)]
    page = build_html([_write_run(tmp_path / "run", rows)])
    for d in re.findall(r'<path class="data" d="([^"]+)"', page):
        assert d.count("L") < MAX_POINTS
    assert len(page) < 1_500_000


def test_downsampling_keeps_a_spike() -> None:
    xs = list(range(10_000))
    ys = [1.0] * 10_000
    ys[7777] = 50.0
    kept_x, kept_y = _downsample(xs, ys)
    assert len(kept_x) <= MAX_POINTS and 50.0 in kept_y and kept_x == sorted(kept_x)


def test_text_from_the_run_is_escaped(tmp_path: Path) -> None:
    name = "<script>alert(1)</script>"
    run = _write_run(tmp_path / "run", [_row(1)], _report(name=name), name=name)
    page = build_html([run])
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_a_comparison_shows_both_runs_and_the_ratio(tmp_path: Path) -> None:
    a = _write_run(tmp_path / "a", [_row(s) for s in (1, 2)], _report(name="first"))
    b_report = _report(name="second", tokens_per_s=1.5e4)
    b = _write_run(tmp_path / "b", [_row(s) for s in (1, 2)], b_report)
    out = write_html([a, b])
    page = out.read_text()
    assert out == a / "compare-b.html"
    assert "A: first (a)" in page and "B: second (b)" in page
    assert "<td>tokens/s</td><td class=num>10,000</td><td class=num>15,000</td>" in page
    assert "1.50x" in page


def test_cost_comes_from_the_cluster_file(tmp_path: Path) -> None:
    from meshforge.cost.cluster import load_cluster
    from meshforge.cost.run import run_cost_from_report
    from meshforge.cost.tco import tco

    cluster = REPO / "examples" / "cluster.yaml"
    run = _write_run(tmp_path / "run", [_row(1)], _report())
    cost = run_cost_from_report(run, tco(load_cluster(cluster)))
    page = build_html([run], cluster=cluster)
    assert f"{cost.gpu_hours:.4g}" in page and "GPU-hours" in page


def test_a_running_run_says_so(tmp_path: Path) -> None:
    import fcntl

    run = _write_run(tmp_path / "run", [_row(1)])
    with open(run / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert 'status-running">running' in build_html([run])


def test_odd_records_do_not_break_the_page(tmp_path: Path) -> None:
    rows = [
        {"step": "x", "loss": "a", "stragglers": 3, "memory_bytes_per_rank": "no",
         "own_s_per_rank": [None, "x"], "memory_advice": "oops"},
        {"loss": 1.0, "step_time_s": 0, "data_s": 0, "tokens_per_s": True, "mfu": [1, 2]},
        {"step": 2, "loss": None, "step_time_s_per_rank": [], "peak_memory_bytes_per_rank": []},
    ]  # fmt: skip
    report = {"status": 3, "name": ["x"], "layout": "dp=2", "hosts": "vm", "stragglers": {},
              "memory_health": [], "communication": [], "peak_memory_bytes": "lots",
              "failure": "boom"}  # fmt: skip
    system = {"node-0": [{"time": "t", "net": []}, {"time": 5, "net": {"eth0": "x"}}]}
    page = build_html([_write_run(tmp_path / "run", rows, report, system)])
    assert all(f'<figure id="{plot_id}">' in page for plot_id in PLOT_IDS)
