"""`meshforge preflight --data PATH [--data-run RUN_DIR]`: each node reads the training data
as the loader does, and with a previous run's tokens/s per device the check says whether
the storage keeps up (PASS at 2x the need or more, WARN at 1-2x, FAIL under it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import assert_one_line_error, meshforge
from meshforge.health.preflight import FAIL, PASS, WARN, data_check


def _reports(rates: list[float | None], ranks_per_node: int = 2) -> list[dict]:
    reports = []
    for node, rate in enumerate(rates):
        for local in range(ranks_per_node):
            rank = node * ranks_per_node + local
            r = {"rank": rank, "host": f"n{node}", "addr": f"10.0.0.{node + 1}"}
            if local == 0:
                probe = {"path": "/data/shards", "bytes_per_token": 2, "cached": False}
                probe.update(
                    {"bytes_per_s": None, "error": "no index.json"}
                    if rate is None
                    else {"bytes_per_s": rate, "error": None}
                )
                r["node"] = {"data_read": probe}
            reports.append(r)
    return reports


def _hosts(reports: list[dict]) -> dict[int, str]:
    return {r["rank"]: r["host"] for r in reports}


@pytest.mark.parametrize(
    "rate,status", [(9e6, PASS), (6e6, WARN), (3e6, FAIL)], ids=["3x", "1.5x", "0.75x"]
)
def test_the_need_of_a_node_is_its_ranks_tokens_times_bytes(rate, status):
    # 1M tokens/s per device x 2 ranks x 2 bytes = 4 MB/s per node
    reports = _reports([20e6, rate])
    check = data_check(reports, _hosts(reports), 1e6)
    assert check.status == status, check.detail
    if status != PASS:
        assert check.hosts == ["n1"] and check.ranks == [2]
    assert "/data/shards" in check.detail and "n0 20.0 MB/s" in check.detail


def test_a_node_that_cannot_read_the_data_fails_by_name():
    reports = _reports([20e6, None])
    check = data_check(reports, _hosts(reports), None)
    assert check.status == FAIL and check.hosts == ["n1"] and "no index.json" in check.detail


@pytest.mark.slow
def test_preflight_reads_the_data_on_every_node(tmp_path: Path):
    shards = tmp_path / "shards"
    src = tmp_path / "text.txt"
    src.write_text("def f(x):\n    return x + 1\n" * 4000)
    assert meshforge(["data", "prepare", str(src), str(shards)]).returncode == 0
    run = tmp_path / "earlier"
    run.mkdir()
    for tokens_per_s, status, code in ((1e3, PASS, 0), (1e13, FAIL, 1)):
        (run / "report.json").write_text(
            json.dumps({"tokens_per_s": tokens_per_s, "world_size": 2, "nodes": 1})
        )
        proc = meshforge(
            ["preflight", "--nproc", "2", "--run-dir", str(tmp_path / "pf"), "--bandwidth-mb",
             "0", "--data", str(shards), "--data-run", str(run), "--json"],
            timeout=180,
        )  # fmt: skip
        assert proc.returncode == code, proc.stderr[-2000:]
        checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
        assert checks["data read"]["status"] == status, checks["data read"]
        assert str(shards) in checks["data read"]["detail"]


def test_bad_data_flags_are_one_line(tmp_path: Path):
    proc = meshforge(["preflight", "--data", str(tmp_path / "missing")])
    assert_one_line_error(proc, "--data", "no such file")
    proc = meshforge(["preflight", "--data-run", str(tmp_path)])
    assert_one_line_error(proc, "--data-run", "--data")
