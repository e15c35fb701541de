"""`meshforge bench io` (issue 11, parts 5-7): storage read throughput and latency per
reader count and order, the page cache dropped or said plainly not to be, the read
bandwidth a job needs against what was measured, and a slow reader that the trainer
reports as waiting for data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from helpers import assert_one_line_error, meshforge
from meshforge.bench import io as bench
from meshforge.bench.io import IoBenchOptions, IoRow, JobNeed
from meshforge.data.shards import prepare
from meshforge.errors import ConfigError

QUICK = ["--seconds", "0.2", "--block", "64K", "--page-cache", "fadvise"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain directory of files (4 MiB), flushed to disk so the page cache can drop it."""
    root = tmp_path_factory.mktemp("io")
    rng = np.random.default_rng(0)
    for i in range(4):
        path = root / f"part-{i}.dat"
        path.write_bytes(rng.integers(0, 256, size=1 << 20, dtype=np.uint8).tobytes())
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    return root


def test_a_row_for_each_reader_count_and_order_and_the_scaling(data_dir: Path) -> None:
    proc = meshforge(["bench", "io", str(data_dir), "--readers", "1,2,4", *QUICK])
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if not line.startswith("#")]
    assert [(r[0], r[1]) for r in rows] == [
        (order, n) for order in ("sequential", "random") for n in ("1", "2", "4")
    ]
    assert all(float(r[2]) > 0 for r in rows)  # MB/s
    assert "# scaling (sequential, MB/s at N readers / at 1): 1: 1.00x, 2: " in proc.stdout
    assert "# page cache before each pass: posix_fadvise(POSIX_FADV_DONTNEED)" in proc.stdout
    # the cache was dropped, or the output says plainly that it was not
    assert ("page cache dropped:" in proc.stdout) != ("page cache NOT dropped" in proc.stdout)


def test_json_has_every_row_its_percentiles_and_the_scaling(data_dir: Path) -> None:
    proc = meshforge(["bench", "io", str(data_dir), "--readers", "1,2,4", *QUICK, "--json"])
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["kind"] == "files" and result["files"] == 4
    assert result["total_bytes"] == 4 << 20 and result["token_bytes"] == 2
    rows = result["rows"]
    assert [(r["order"], r["readers"]) for r in rows] == [
        (o, n) for o in ("sequential", "random") for n in (1, 2, 4)
    ]
    for r in rows:
        assert r["bytes"] > 0 and r["reads"] > 0 and r["mb_per_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["mb_per_s"] * 1e6 / 2)
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]
        assert r["scaling"] == pytest.approx(
            r["mb_per_s"] / next(x["mb_per_s"] for x in rows if x["order"] == r["order"])
        )
    assert set(result["scaling"]) == {"sequential", "random"}
    assert result["page_cache"]["requested"] == "fadvise"


def test_reader_processes_read_a_shard_directory_with_a_byte_budget(tmp_path: Path) -> None:
    text = np.random.default_rng(1).integers(32, 127, 600_000, dtype=np.uint8).tobytes()
    (tmp_path / "t.txt").write_bytes(text)
    prepare(tmp_path / "t.txt", tmp_path / "shards", shard_tokens=100_000)
    proc = meshforge(
        ["bench", "io", str(tmp_path / "shards"), "--readers", "1,2", "--mode", "processes",
         "--order", "random", "--bytes", "256K", "--block", "32K", "--page-cache", "fadvise",
         "--json"]
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["kind"] == "shards" and result["files"] == 6 and result["mode"] == "processes"
    assert [r["bytes"] for r in result["rows"]] == [256 << 10, 256 << 10]


def test_a_warm_page_cache_is_said_plainly(data_dir: Path) -> None:
    for f in data_dir.iterdir():
        f.read_bytes()  # now cached (and --page-cache keep leaves it so)
    proc = meshforge(
        ["bench", "io", str(data_dir), "--readers", "1", "--order", "sequential",
         "--seconds", "0.2", "--block", "64K", "--page-cache", "keep"]
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "# page cache before each pass: not dropped (--page-cache keep)" in proc.stdout
    assert "# page cache NOT dropped: 1 of 1 pass(es) began with up to" in proc.stdout
    assert "include page-cache reads, not only storage reads" in proc.stdout


def test_every_block_is_read_by_exactly_one_reader_in_either_order(data_dir: Path) -> None:
    data = bench.find_files(data_dir)
    blocks = bench.plan_blocks(data, 300_000)  # blocks that do not divide a file
    assert int(blocks[:, 2].sum()) == data.total_bytes
    for order in ("sequential", "random"):
        parts = bench.reader_blocks(blocks, order, 3, seed=0)
        together = np.concatenate(parts)
        assert sorted(map(tuple, together.tolist())) == sorted(map(tuple, blocks.tolist()))
    first = bench.reader_blocks(blocks, "sequential", 3, 0)[0]
    assert (np.diff(first[:, 0] * 2**40 + first[:, 1]) > 0).all()  # in file order


def _row(order: str, readers: int, mb_per_s: float) -> IoRow:
    return IoRow(order, readers, 1, 1, 1.0, mb_per_s, mb_per_s * 5e5, 1, 1, 1, None, 0.0, False)


def test_the_job_needs_tokens_per_s_times_bytes_per_token_and_the_headroom_is_the_ratio(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_text(
        json.dumps({"tokens_per_s": 40_000.0, "world_size": 4, "nodes": 2})
    )
    need = bench.need_from_run(run, bytes_per_token=2)
    assert (need.tokens_per_s_per_device, need.devices, need.nodes) == (10_000, 4, 2)
    assert need.bytes_per_s == 80_000 and need.bytes_per_s_per_node == 40_000
    bigger = bench.need_from_run(run, 4, nodes=8, gpus_per_node=8)  # 64 devices, 4 B/token
    assert bigger.bytes_per_s == 10_000 * 64 * 4 and bigger.bytes_per_s_per_node == 320_000

    rows = [_row("sequential", 1, 9.0), _row("random", 1, 0.1), _row("random", 4, 0.3)]
    v = bench.verdict(need, rows)  # the best random row: 0.3 MB/s vs 40 kB/s per node
    assert v.row == "random, 4 reader(s)" and v.headroom == pytest.approx(7.5)
    assert v.word == "OK" and "storage must serve 80.0 kB/s to 2 nodes" in v.line
    assert bench.verdict(need, [_row("random", 1, 0.05)]).word == "TIGHT"
    assert bench.verdict(need, [_row("random", 1, 0.02)]).word == "TOO SLOW"


def test_the_planner_gives_the_tokens_per_s_of_a_job_config_on_a_cluster(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(
        "model: {vocab_size: 50304, d_model: 768, n_layers: 12, n_heads: 12, seq_len: 1024}\n"
        "precision: {dtype: bf16}\ntrain: {global_batch: 64, micro_batch: 4}\n"
    )
    need = bench.need_from_plan(config, nodes=2, gpus_per_node=8, bytes_per_token=2)
    assert need.devices == 16 and need.nodes == 2 and need.tokens_per_s_per_device > 1_000
    assert need.source.startswith("planner: job.yaml on 2 x 8 h100")
    more = bench.need_from_plan(config, nodes=4, gpus_per_node=8, bytes_per_token=2)
    assert more.bytes_per_s > need.bytes_per_s


def test_a_verdict_line_against_a_finished_runs_report(data_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "report.json").write_text(
        json.dumps({"tokens_per_s": 18_000.0, "world_size": 2, "nodes": 1})
    )
    proc = meshforge(
        ["bench", "io", str(data_dir), "--readers", "1", "--order", "random", *QUICK,
         "--run", str(tmp_path), "--nodes", "16", "--gpus-per-node", "8"]
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "#   9,000 tokens/s per device x 128 device(s) on 16 node(s)" in proc.stdout
    assert "needs 2.3 MB/s in aggregate (2 B/token), 144.0 kB/s per node" in proc.stdout
    verdict = [line for line in proc.stdout.splitlines() if line.startswith("verdict: ")]
    assert len(verdict) == 1 and "x what each node" in verdict[0]


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["/no/such/dir"], ["/no/such/dir", "no such file"]),
        (["{data}", "--readers", "0"], ["--readers", ">= 1"]),
        (["{data}", "--readers", "one"], ["--readers", "1,2,4"]),
        (["{data}", "--mode", "fibers"], ["--mode fibers"]),
        (["{data}", "--order", "backwards"], ["--order backwards"]),
        (["{data}", "--seconds", "1", "--bytes", "1M"], ["--seconds or --bytes"]),
        (["{data}", "--block", "big"], ["--block"]),
        (["{data}", "--config", "{data}/x.yaml"], ["--config needs --nodes"]),
        (["{data}", "--nodes", "2"], ["--run or --config"]),
        (["{data}", "--run", "{data}"], ["no report.json"]),
    ],
)
def test_bad_input_is_one_line(data_dir: Path, args: list[str], fragments: list[str]) -> None:
    argv = [a.replace("{data}", str(data_dir)) for a in args]
    assert_one_line_error(meshforge(["bench", "io", *argv]), *fragments)


def test_options_refuse_both_budgets() -> None:
    with pytest.raises(ConfigError, match="--seconds or --bytes"):
        IoBenchOptions(path=".", seconds=1.0, max_bytes=10)
    assert IoBenchOptions(path=".").budget_s == bench.DEFAULT_SECONDS
    assert IoBenchOptions(path=".", max_bytes=10).budget_s is None
    assert JobNeed("x", 1.0, 2, 1, 2).bytes_per_s == 4.0


def test_a_slow_reader_raises_the_data_wait_fraction_and_the_trainer_warns(
    tmp_path: Path, job_factory
) -> None:
    text = np.random.default_rng(2).integers(32, 127, 50_000, dtype=np.uint8).tobytes()
    (tmp_path / "t.txt").write_bytes(text)
    shards = tmp_path / "slow-shards"
    prepare(tmp_path / "t.txt", shards)
    job = job_factory(
        {
            "data": {"source": str(shards), "prefetch": 1, "wait_warning": 0.25},
            "train": {"steps": 12},
            "observe": {"log_every": 3},
        }
    )
    # 4 sequences per rank and step, 50 ms each: 0.2 s of reading per step, far above
    # what the tiny model computes in one
    proc = job.train(2, env={"MESHFORGE_DATA_DELAY_S": "0.05"})
    rows = [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows if r["step"] > 3]
    assert steady and all(r["data_wait_fraction"] > 0.25 for r in steady)
    console = proc.stdout + proc.stderr
    warned = [line for line in console.splitlines() if "waiting for data" in line]
    assert warned and str(shards) in warned[0]
    assert job.report["data_wait_fraction"] > 0.25
