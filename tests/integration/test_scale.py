"""`meshforge scale` (issue 3, part 6): the job at several world sizes, with speedup and
scaling efficiency by the brief's definition (REFERENCES.md), per sample of work."""

from __future__ import annotations

import json

import pytest

from helpers import assert_one_line_error, meshforge
from meshforge.bench.scaling import (
    ScaleRow,
    add_speedups,
    global_batches,
    parse_nproc_list,
)
from meshforge.errors import ConfigError


def test_scale_at_1_and_2_prints_the_table_and_writes_json_and_png(job_factory):
    job = job_factory({"train": {"steps": 8}}, name="scale")
    out = job.dir / "scale-out"
    proc = meshforge(["scale", str(job.config_path), "--nproc", "1,2", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for header in ("workers", "step time", "tokens/s", "speedup", "efficiency", "comm overhead"):
        assert header in proc.stdout
    result = json.loads((out / "scale.json").read_text())
    rows = result["rows"]
    assert [r["world_size"] for r in rows] == [1, 2]
    assert result["reference_world_size"] == 1
    for r in rows:
        assert r["status"] == "completed"
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0
        assert 0 <= r["comm_overhead_fraction"] <= 1
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["world_size"])
        assert (out / f"world-{r['world_size']}" / "report.json").exists()
    assert rows[0]["speedup"] == pytest.approx(1.0)
    # strong scaling: the same global batch at every size
    assert rows[0]["global_batch"] == rows[1]["global_batch"] == 8
    assert (out / "scale.png").stat().st_size > 0


@pytest.mark.parametrize("bad", ["0,2", "a", "1,,2", "1,1", "-1"])
def test_a_bad_nproc_list_exits_2_with_one_line(job_factory, bad):
    job = job_factory(name="bad")
    proc = meshforge(["scale", str(job.config_path), "--nproc", bad], timeout=60)
    assert_one_line_error(proc, "--nproc")


def test_a_missing_config_or_a_size_the_batch_cannot_split_exits_2(job_factory, tmp_path):
    proc = meshforge(["scale", str(tmp_path / "missing.yaml"), "--nproc", "1,2"], timeout=60)
    assert proc.returncode == 2 and "config file not found" in proc.stderr
    job = job_factory(name="odd")  # global batch 8, micro-batch 4: 3 ranks cannot split it
    proc = meshforge(["scale", str(job.config_path), "--nproc", "1,3"], timeout=60)
    assert_one_line_error(proc, "world size 3")


def test_speedup_and_efficiency_per_sample_of_work():
    # weak scaling doubles the batch: the same step time means perfect efficiency
    rows = [
        ScaleRow(1, 8, "completed", step_time_s=0.1, time_per_sample_s=0.1 / 8,
                 comm_overhead_fraction=0.0),
        ScaleRow(2, 16, "completed", step_time_s=0.1, time_per_sample_s=0.1 / 16,
                 comm_overhead_fraction=0.3),
        ScaleRow(4, 32, "completed", step_time_s=0.2, time_per_sample_s=0.2 / 32,
                 comm_overhead_fraction=0.5),
    ]  # fmt: skip
    assert add_speedups(rows) == 1
    assert [r.speedup for r in rows] == pytest.approx([1.0, 2.0, 2.0])
    assert [r.efficiency for r in rows] == pytest.approx([1.0, 1.0, 0.5])
    assert global_batches(8, [1, 2, 4], "weak") == {1: 8, 2: 16, 4: 32}
    assert global_batches(8, [2, 4], "strong") == {2: 8, 4: 8}
    assert parse_nproc_list(" 4, 1,2") == [1, 2, 4]
    with pytest.raises(ConfigError):
        global_batches(8, [3, 4], "weak")
