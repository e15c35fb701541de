"""Measure once, reuse: the machine figures behind `predicted` and the CPU MFU are
taken once per machine and configuration, cached, and reused by later runs;
--recalibrate (MESHFORGE_RECALIBRATE) measures again."""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from meshforge.train import calibration_cache


def _profile_twice(cache: str, recalibrate_second: bool) -> list[dict]:
    """On every rank: measure_profile for a tiny job twice, the second time with or
    without MESHFORGE_RECALIBRATE; the details of both."""
    from meshforge.config import build_config
    from meshforge.train.calibration import measure_profile

    os.environ["MESHFORGE_CACHE"] = cache
    cfg = build_config({"model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32},
                        "train": {"micro_batch": 2, "global_batch": 4}})  # fmt: skip
    first_profile = measure_profile("cpu", "fp32", None, cfg)
    first = first_profile.details
    if recalibrate_second:
        os.environ[calibration_cache.RECALIBRATE_ENV] = "1"
    second_profile = measure_profile("cpu", "fp32", None, cfg)
    second = second_profile.details
    other = build_config({**cfg.model_dump(), "train": {"micro_batch": 4, "global_batch": 8}})
    third = measure_profile("cpu", "fp32", None, other).details
    runtimes = {"first": first_profile.runtime_bytes, "second": second_profile.runtime_bytes}
    return [first, second, third, {"rank": dist.get_rank(), **runtimes}]


def test_a_second_measurement_comes_from_the_cache(gloo, tmp_path):
    results = gloo.run(2, _profile_twice, str(tmp_path), False)
    for first, second, third, rank in results:
        assert first["cached"] is False and second["cached"] is True
        if rank["rank"] == 0:  # the measuring rank's baseline is kept with the figures
            assert rank["second"] >= rank["first"]
        assert second["measured_at"] == first["measured_at"]
        # the same figures, refitted: what the planner predicts with is unchanged
        assert second["compute_at_size"] == first["compute_at_size"]
        assert second["allreduce"] == first["allreduce"]
        # how busy the machine was when they were taken, kept with them
        assert first["load_average"] >= 0 and first["cpus"] >= 1
        assert (second["load_average"], second["cpus"]) == (first["load_average"], first["cpus"])
        assert third["cached"] is False  # another micro-batch: the job's timings differ
    entries = json.loads((tmp_path / calibration_cache.CACHE_FILE).read_text())
    assert len(entries) == 2  # one per configuration; the second run added nothing
    assert all(e["runtime_bytes"] > 0 for e in entries.values())
    assert all("world=2" in key and "threads=" in key and "torch=" in key for key in entries)


def test_recalibrate_measures_again_and_replaces_the_entry(gloo, tmp_path):
    results = gloo.run(2, _profile_twice, str(tmp_path), True)
    for first, second, _, _ in results:
        assert first["cached"] is False and second["cached"] is False
        assert second["measured_at"] > first["measured_at"]
    entries = json.loads((tmp_path / calibration_cache.CACHE_FILE).read_text())
    newest = max(e["measured_at"] for e in entries.values())
    assert newest >= results[0][1]["measured_at"]
    assert len(entries) == 2


def test_an_unreadable_cache_is_measured_over(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHFORGE_CACHE", str(tmp_path))
    (tmp_path / calibration_cache.CACHE_FILE).write_text("{not json")
    assert calibration_cache.load("any") is None
