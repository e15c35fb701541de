"""`meshforge plan --config` plans a job with context parallelism (parallel.cp, or --cp
and --cp-method over a job): a rank's activations divided by cp, the K/V exchange in
the step, cp searched at long sequences among the layouts the trainer builds, and what
the trainer refuses (cp with experts' capacity factor, compile, the method it has not built, heads
Ulysses cannot split) refused in one line. `predict_for_job` (report.json's `predicted`) on a CPU
host adds the exchange and reduces gradients over the dp x cp ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import assert_one_line_error

LLAMA = {"name": "llama", "vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4,
         "n_kv_heads": 2, "ffn_hidden": 64, "seq_len": 1024}  # fmt: skip


def _job(tmp_path: Path, parallel: Any = None, **model: Any) -> Path:
    raw = {
        "name": "cp-plan",
        "model": {**LLAMA, **model},
        "parallel": {"dp": 1, "cp": 2} if parallel is None else parallel,
        "precision": {"dtype": "fp32"},
        "train": {"steps": 10, "global_batch": 4, "micro_batch": 1},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _plan(meshforge, path: Path, *extra: str) -> dict[str, Any]:
    proc = meshforge(["plan", "--config", str(path), "--gpus", "2", *extra, "--json"])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_cp2_job_plans_and_names_cp(meshforge, tmp_path):
    path = _job(tmp_path)
    out = _plan(meshforge, path)
    assert out["layout"]["cp"] == 2 and out["layout"]["cp_method"] == "allgather"
    assert out["layout"]["dp"] == 1
    assert out["layout_fields"]["cp"] == "given"
    assert out["time_breakdown_s"]["cp_comm_s"] > 0  # the K/V exchange is in the step
    proc = meshforge(["plan", "--config", str(path), "--gpus", "2"])
    assert proc.returncode == 0, proc.stderr
    assert "cp2 allgather" in proc.stdout
    assert "context-parallel K/V (allgather)" in proc.stdout


def test_cp2_predicts_fewer_activation_bytes_than_cp1(meshforge, tmp_path):
    path = _job(tmp_path)
    cp2 = _plan(meshforge, path)
    cp1 = _plan(meshforge, path, "--set", "parallel.cp=1", "--set", "parallel.dp=2")
    assert cp1["layout"]["cp"] == 1 and cp1["layout"]["dp"] == 2
    one = cp1["memory_per_gpu_bytes"]["activations"]
    two = cp2["memory_per_gpu_bytes"]["activations"]
    # half of every activation, plus one layer's gathered K and V of the whole sequence
    gathered = 2 * 4 * LLAMA["seq_len"] * (LLAMA["d_model"] // 4) * LLAMA["n_kv_heads"]
    assert two == pytest.approx(one / 2 + gathered)
    assert two < 0.6 * one


def test_the_cp_flag_over_a_job_fixes_cp(meshforge, tmp_path):
    path = _job(tmp_path, parallel={"zero": 0})
    out = _plan(meshforge, path, "--cp", "2", "--cp-method", "allgather")
    assert out["layout"]["cp"] == 2 and out["layout"]["dp"] == 1
    assert out["layout_fields"]["cp"] == "given"


def test_ring_is_planned_for_the_gpus_it_runs_on(meshforge, tmp_path):
    """parallel.cp_method=ring is built for CUDA devices: a job that leaves
    runtime.device to the launch is planned with it (refused where it says cpu, below)."""
    out = _plan(meshforge, _job(tmp_path), "--cp-method", "ring")
    assert out["layout"]["cp"] == 2 and out["layout"]["cp_method"] == "ring"


def test_a_long_job_searches_cp_among_what_the_trainer_builds(meshforge, tmp_path):
    """At 128k tokens of Llama 3 8B on 64 GPUs the search chooses cp (nothing fits
    without it), by the method a job gets where it names none (allgather)."""
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump({
        "name": "long", "model": {"preset": "llama-8b", "seq_len": 131072},
        "parallel": {"tp": 1}, "train": {"steps": 10, "global_batch": 64, "micro_batch": 1},
    }))  # fmt: skip
    proc = meshforge(["plan", "--config", str(path), "--gpus", "64", "--top", "5", "--json"])
    assert proc.returncode == 0, proc.stderr
    candidates = json.loads(proc.stdout)["candidates"]
    assert candidates and candidates[0]["layout"]["cp"] > 1
    for c in candidates:
        if c["layout"]["cp"] > 1:
            assert c["layout"]["cp_method"] == "allgather", c


@pytest.mark.parametrize(
    "parallel, model, extra, fragments",
    [
        ({"dp": 1, "cp": 4}, {"n_heads": 2, "n_kv_heads": 1},
         ["--cp-method", "alltoall", "--gpus", "4"], ("alltoall", "2", "4")),
        ({"dp": 1, "cp": 2}, {}, ["--cp-method", "ring", "--set", "runtime.device=cpu",
         "--gpus", "2"], ("parallel.cp_method=ring needs CUDA devices",)),
        ({"dp": 1, "cp": 4, "cp_method": "alltoall"}, {"n_heads": 2, "n_kv_heads": 1},
         ["--gpus", "4"], ("alltoall", "2", "4")),
        ({"dp": 1, "cp": 2}, {"moe": {"experts": 4, "top_k": 2, "expert_ffn": 32,
                                       "capacity_factor": 1.25}},
         ["--gpus", "2"], ("parallel.cp=2", "model.moe.capacity_factor=1.25")),
        ({"dp": 1, "cp": 2}, {}, ["--set", "train.compile=true", "--gpus", "2"],
         ("train.compile=true", "parallel.cp=2")),
        ({"dp": 1, "cp": 2}, {"seq_len": 1030}, ["--gpus", "2"],
         ("parallel.cp=2", "model.seq_len=1030")),
        ("auto", {}, ["--cp", "2", "--gpus", "2"], ("parallel: auto", "context")),
        ({"dp": 1, "cp": 2}, {}, ["--cp", "4", "--gpus", "2"], ("cp=4", "--gpus 2")),
    ],
    ids=["alltoall-flag", "ring-flag", "alltoall-job", "moe-capacity", "compile", "seq",
         "auto", "cp-gpus"],
)  # fmt: skip
def test_what_the_trainer_refuses_is_refused_in_one_line(
    meshforge, tmp_path, parallel, model, extra, fragments
):
    path = _job(tmp_path, parallel, **model)
    assert_one_line_error(meshforge(["plan", "--config", str(path), *extra]), *fragments)


def test_the_job_prediction_adds_the_exchange_and_reduces_over_dp_x_cp():
    """report.json's `predicted` on a CPU host: the K/V exchange is a term of the step,
    and the gradients' all-reduce spans the dp x cp ranks (as dp 2 at cp 1 does)."""
    from meshforge.config import build_config
    from meshforge.plan.jobs.auto import ASSUMED_CPU_PROFILE
    from meshforge.plan.jobs.job import predict_for_job

    def job(parallel: dict[str, Any]) -> Any:
        return build_config({"model": LLAMA, "parallel": parallel, "precision": {"dtype": "fp32"},
                             "train": {"global_batch": 4, "micro_batch": 1}})  # fmt: skip

    cp2 = predict_for_job(job({"cp": 2}), 2, ASSUMED_CPU_PROFILE)
    dp2 = predict_for_job(job({"dp": 2}), 2, ASSUMED_CPU_PROFILE)
    one = predict_for_job(job({}), 1, ASSUMED_CPU_PROFILE)
    parts = cp2["time_breakdown_s"]
    assert cp2["layout"]["cp"] == 2 and parts["cp_comm_s"] > 0
    assert dp2["time_breakdown_s"]["cp_comm_s"] == 0
    assert parts["dp_comm_exposed_s"] > 0 and one["time_breakdown_s"]["dp_comm_exposed_s"] == 0
    total = sum(v for k, v in parts.items() if k != "step_s")
    assert parts["step_s"] == pytest.approx(total)
    assert cp2["activations_bytes"] < 0.6 * dp2["activations_bytes"]


def test_a_step_timed_under_cp_predicts_only_the_same_cp_layout():
    """A calibration times a cp job's own step (its K/V exchange in it): that figure
    is the prediction of the same layout only; a step timed at cp 1 is not a cp 2 one."""
    from meshforge.config import build_config
    from meshforge.plan.core.timing import HostCosts, TimedSteps
    from meshforge.plan.jobs.auto import ASSUMED_CPU_PROFILE
    from meshforge.plan.jobs.job import predict_for_job

    cfg = build_config({"model": LLAMA, "parallel": {"cp": 2}, "precision": {"dtype": "fp32"},
                        "train": {"global_batch": 4, "micro_batch": 1}})  # fmt: skip

    def host(cp: int) -> HostCosts:
        steps = TimedSteps(1, 1, "none", 1, 0, 1, 4, 0.5, 0.75, cp=cp)
        return HostCosts(3e9, 3e9, steps=steps)

    timed = predict_for_job(cfg, 2, ASSUMED_CPU_PROFILE, host=host(2))
    assert timed["step_time_s"] == pytest.approx(0.5 + 0.25 * (LLAMA["n_layers"] - 1))
    assert timed["time_breakdown_s"]["cp_comm_s"] == 0  # in the timed step
    other = predict_for_job(cfg, 2, ASSUMED_CPU_PROFILE, host=host(1))
    assert other["time_breakdown_s"]["cp_comm_s"] > 0
    assert other["step_time_s"] != pytest.approx(timed["step_time_s"])
