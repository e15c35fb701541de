"""The launcher names the failing rank and its error, and keeps per-rank logs."""

from __future__ import annotations

import json

import pytest

from helpers import meshforge
from meshforge.config import load_config
from meshforge.plan.core.flops import FLOPS_CONVENTION, shape_of, training_flops_per_token


@pytest.mark.slow
def test_worker_failure_names_rank_and_error(job_factory):
    job = job_factory({"train": {"steps": 10}})
    proc = job.train(2, env={"MESHFORGE_FAULT": "crash:3:1"}, check=False)
    assert proc.returncode == 1
    assert "rank 1 failed" in proc.stderr
    assert "injected crash at step 3 on rank 1" in proc.stderr
    log = (job.run_dir / "logs" / "rank-1.log").read_text()
    assert "injected crash at step 3 on rank 1" in log and "Traceback" in log
    assert (job.run_dir / "logs" / "rank-0.log").exists()
    diagnosis = json.loads((job.run_dir / "health" / "diagnosis.json").read_text())
    assert diagnosis["first_failure"]["rank"] == 1
    report = job.report
    assert report["status"] == "failed"
    assert report["failure"]["first_failure"]["rank"] == 1


@pytest.mark.slow
def test_run_directory_has_the_designed_layout(job_factory):
    job = job_factory({"train": {"steps": 4, "eval_every": 2}, "checkpoint": {"every": 2}})
    proc = job.train(2)
    assert "meshforge sample" in proc.stdout
    for name in ("config.yaml", "metrics.jsonl", "report.json", "report.html"):
        assert (job.run_dir / name).is_file(), name
    assert not (job.run_dir / "report.png").exists()  # drawn on demand, off the exit
    # start-up and shutdown, consistent with the metrics' timestamps
    timing = job.report["timing"]
    rows = [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert timing["launched_at"] < timing["first_step_at"] < rows[0]["time"]
    assert timing["startup_s"] == pytest.approx(timing["first_step_at"] - timing["launched_at"])
    assert sum(timing["startup_phases_s"].values()) == pytest.approx(timing["startup_s"])
    assert rows[-1]["time"] <= timing["last_step_at"] < timing["report_at"] <= timing["exited_at"]
    assert timing["shutdown_s"] == pytest.approx(timing["exited_at"] - timing["last_step_at"])
    assert 0 < timing["final_checkpoint_s"] < timing["shutdown_s"]
    assert timing["restart_gaps_s"] == []
    report = meshforge(["report", str(job.run_dir), "--png"])
    assert report.returncode == 0, report.stderr
    assert (job.run_dir / "report.png").stat().st_size > 10_000
    assert (job.run_dir / "checkpoints" / "step-00000004" / "manifest.json").is_file()
    assert {p.name for p in (job.run_dir / "logs").glob("rank-*.log")} == {
        "rank-0.log",
        "rank-1.log",
    }
    report = job.report
    required = {
        "status",
        "steps",
        "world_size",
        "layout",
        "model_params",
        "first_loss",
        "final_loss",
        "tokens_per_s",
        "mfu",
        "step_time_s",
        "time_breakdown",
        "model_state_bytes",
        "peak_memory_bytes",
        "predicted",
        "resumed_from",
        "final_param_digest",
    }
    assert required <= set(report)
    assert report["status"] == "completed" and report["world_size"] == 2
    assert len(report["peak_memory_bytes"]) == 2 and min(report["peak_memory_bytes"]) > 0
    assert len(report["final_param_digest"]) == 64
    fractions = report["time_breakdown"]
    assert sum(fractions.values()) == pytest.approx(1.0, abs=1e-6)
    assert report["mfu"] is not None and 0 < report["mfu"] < 1
    # one FLOP convention, said out loud, the planner's (plan/core/flops.py); MFU from it
    shape = shape_of(load_config(job.run_dir / "config.yaml"))
    assert report["flops_convention"] == FLOPS_CONVENTION
    assert report["flops_per_token"] == training_flops_per_token(shape)
    per_rank = report["tokens_per_s"] * report["flops_per_token"] / report["world_size"]
    assert report["mfu"] == pytest.approx(per_rank / report["peak_flops"]["flops_per_s"])
    rows = [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert any("val_loss" in r for r in rows)


@pytest.mark.slow
def test_training_on_prepared_token_shards(job_factory, tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(3):
        (texts / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox. " * 400)
    shards = tmp_path / "shards"
    prep = meshforge(["data", "prepare", str(texts), str(shards), "--shard-tokens", "8K"])
    assert prep.returncode == 0, prep.stderr
    assert len(list(shards.glob("shard-*.bin"))) >= 2
    job = job_factory({"data": {"source": str(shards)}, "train": {"steps": 12}})
    job.train(2)
    losses = job.losses()
    assert losses[12] < losses[1]  # a repetitive text is quickly learnt
