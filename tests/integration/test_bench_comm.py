"""`meshforge bench comm` (issue 8, part 2): collective bus bandwidth as nccl-tests reports
it, busbw = algbw x the collective's factor (REFERENCES.md), every result checked."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import assert_one_line_error, meshforge
from meshforge.bench import comm
from meshforge.bench.comm import (
    OPS,
    CommBenchOptions,
    bus_bandwidth_gbps,
    count_wrong,
    element_count,
    fill_known,
    make_buffers,
    parse_size,
    size_steps,
)
from meshforge.errors import ConfigError

# nccl-tests doc/PERFORMANCE.md: busbw = algbw x factor, n ranks
FORMULAS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 64])
def test_busbw_is_algbw_times_the_nccl_tests_factor_of_each_collective(op, n):
    size_bytes, time_s = 64 << 20, 0.0125
    algbw_gbps = size_bytes / time_s / 1e9
    assert bus_bandwidth_gbps(op, size_bytes, time_s, n) == pytest.approx(
        algbw_gbps * FORMULAS[op](n)
    )


def test_every_collective_the_bench_runs_has_a_formula():
    assert set(OPS) == set(FORMULAS)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1024", 1024),
        ("1K", 1024),
        ("1k", 1024),
        ("64K", 64 << 10),
        ("256M", 256 << 20),
        ("256MiB", 256 << 20),
        ("8KB", 8 << 10),
        ("1G", 1 << 30),
        ("1.5K", 1536),
    ],
)
def test_sizes_read_as_nccl_tests_reads_them(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "K", "12X", "1KK", "-1K", "abc", "1 M B"])
def test_unreadable_sizes_are_config_errors(text):
    with pytest.raises(ConfigError, match="expected a size"):
        parse_size(text, "--min-bytes")


def test_sizes_step_geometrically_from_min_to_max():
    assert size_steps(1024, 65536, 2) == [1 << k for k in range(10, 17)]
    assert size_steps(1024, 10_000, 3) == [1024, 3072, 9216]
    assert size_steps(1, 4, 1.5) == [1, 2, 3, 4]  # always grows by at least a byte


def test_sharded_collectives_round_the_size_to_whole_shares():
    assert element_count("all_reduce", 1000, 4, 3) == 250
    assert element_count("all_gather", 1000, 4, 3) == 249  # 3 shares of 83 floats
    assert element_count("all_to_all", 8, 4, 4) == 0  # too small: the row is left out


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"min_bytes": 2 << 20, "max_bytes": 1 << 20}, "above --max-bytes"),
        ({"ops": ("all_reduce", "all_gatherr")}, "all_gatherr"),
        ({"ops": ()}, "--ops"),
        ({"factor": 1.0}, "--factor"),
        ({"factor": float("nan")}, "--factor"),
        ({"iters": 0}, "--iters"),
        ({"dtype": "int8"}, "--dtype"),
    ],
)
def test_options_that_cannot_run_are_refused(options, fragment):
    with pytest.raises(ConfigError, match=fragment):
        CommBenchOptions(**options)


def test_options_survive_the_trip_to_the_launched_ranks():
    from meshforge.cli.bench import parse_comm_args

    options = CommBenchOptions(
        ops=("broadcast", "all_to_all"), min_bytes=96, max_bytes=3 << 20, factor=3.5,
        warmup=0, iters=7, dtype="bfloat16", device="cpu", as_json=True,
    )  # fmt: skip
    assert parse_comm_args(options.to_argv()) == (options, [])


def _simulate(op: str, sends: list[torch.Tensor], n: int, rank: int) -> torch.Tensor:
    """What the collective delivers to `rank`, written out by hand."""
    if op == "all_reduce":
        return torch.stack(sends).sum(0)
    if op == "broadcast":
        return sends[comm.ROOT].clone()
    if op == "all_gather":
        return torch.cat(sends)
    if op == "reduce_scatter":
        return torch.stack(sends).sum(0).view(n, -1)[rank].clone()
    return torch.cat([s.view(n, -1)[rank] for s in sends])  # all_to_all


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_correct_results_count_no_wrong_values_and_each_bad_element_counts_once(op, dtype):
    n, count = 4, 4 * 6
    bufs = [make_buffers(op, count, dtype, torch.device("cpu"), n) for _ in range(n)]
    for rank, b in enumerate(bufs):
        fill_known(op, b, rank, n)
    sends = [b.send.clone() for b in bufs]
    for rank, b in enumerate(bufs):
        b.recv.copy_(_simulate(op, sends, n, rank))
        assert count_wrong(op, b, rank, n) == 0
    bufs[1].recv[3] += 100
    bufs[1].recv[-1] = 0
    assert count_wrong(op, bufs[1], 1, n) == 2


def _bench_at_world(ops: tuple[str, ...]) -> dict:
    options = CommBenchOptions(ops=ops, min_bytes=256, max_bytes=4096, factor=4, warmup=1,
                               iters=2, device="cpu")  # fmt: skip
    return comm.measure(options, torch.device("cpu"), "gloo").to_dict()


def test_four_ranks_run_every_collective_with_no_wrong_values(gloo):
    result = gloo.run(4, _bench_at_world, OPS)[0]
    assert result["world_size"] == 4 and result["wrong"] == 0
    assert {r["op"] for r in result["rows"]} == set(OPS)
    for row in result["rows"]:
        assert row["busbw_factor"] == pytest.approx(FORMULAS[row["op"]](4))
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * row["busbw_factor"])
        assert 0 < row["min_time_us"] <= row["time_us"]
        assert row["count"] * 4 == row["size_bytes"]  # float32, whole shares


def test_two_ranks_through_the_cli_print_the_nccl_tests_table_for_every_collective():
    proc = meshforge(["bench", "comm", "--nproc", "2", "--min-bytes", "1K", "--max-bytes",
                      "64K", "--warmup", "1", "--iters", "3"], timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "2 rank(s), backend gloo" in out
    for header in ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"):
        assert header in out
    rows = [line.split() for line in out.splitlines() if line and not line.startswith("#")]
    assert len(rows) == len(OPS) * 7  # 1K, 2K, ..., 64K for each collective
    for op in OPS:
        assert f"# {op}  (busbw = algbw x" in out
    assert [int(r[0]) for r in rows[:7]] == [1024 << k for k in range(7)]
    assert all(r[-1] == "0" for r in rows)  # #wrong
    assert "# Out of bounds values : 0 OK" in out


def test_json_output_is_one_object_with_a_row_per_collective_and_size():
    proc = meshforge(["bench", "comm", "--nproc", "2", "--max-bytes", "4K", "--iters", "2",
                      "--ops", "all_reduce,broadcast", "--json"], timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["world_size"] == 2 and result["wrong"] == 0
    assert [(r["op"], r["size_bytes"]) for r in result["rows"]] == [
        (op, size) for op in ("all_reduce", "broadcast") for size in (1024, 2048, 4096)
    ]
    assert set(result["avg_busbw_gbps"]) == {"all_reduce", "broadcast"}


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--min-bytes", "2M", "--max-bytes", "1M"], ["--min-bytes", "--max-bytes"]),
        (["--ops", "all_reduce,allgather"], ["allgather", "all_gather"]),
        (["--factor", "1"], ["--factor"]),
        (["--nproc", "0"], ["0"]),
        (["--min-bytes", "12X"], ["--min-bytes", "12X"]),
        (["--iters", "0"], ["--iters"]),
        (["--run-dir", "x"], ["--run-dir"]),
        (["--bogus"], ["--bogus"]),
    ],
)
def test_bad_input_is_refused_in_one_line(args, fragments):
    assert_one_line_error(meshforge(["bench", "comm", *args], timeout=120), *fragments)
