"""The machine profile times the run's own layout: the trainer's whole step with one and
two layers per stage (tp 1, or tensor-parallel stages of a pipeline), the model under
its tensor parallelism alone, and (where the step could not be timed) the data-parallel
wrapping on one and two of the job's blocks (DDP, ZeroRedundancyOptimizer, FSDP2 units),
on the live gloo group (train/calibration.py). These figures carry the CPU host model of
`predicted` (plan/core/timing.py); how close it comes is a speed figure, reported by
benchmarks/planner_accuracy.py."""

from __future__ import annotations

import math

import pytest

from meshforge.config import build_config

MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32}


def _wrapped(zero: int, micro: int) -> dict:
    import torch

    from meshforge.parallel.mesh import data_parallel_mesh as build_mesh
    from meshforge.train.calibration import measure_wrapped_blocks

    cfg = build_config({"model": MODEL, "parallel": {"zero": zero},
                        "train": {"micro_batch": micro, "global_batch": 8}})  # fmt: skip
    mesh = build_mesh(torch.device("cpu"), 2)
    m = 8 // (micro * 2)
    return vars(measure_wrapped_blocks(cfg, m, torch.device("cpu"), mesh, repeats=2))


@pytest.mark.parametrize("zero,micro", [(0, 4), (1, 4), (3, 2)])
def test_the_wrapping_is_timed_on_the_jobs_blocks(gloo, zero, micro):
    results = gloo.run(2, _wrapped, zero, micro)
    assert results[0] == results[1]  # agreed: the slowest rank's figures on both
    got = results[0]
    assert (got["zero"], got["dp"], got["microbatches"]) == (zero, 2, 8 // (micro * 2))
    assert got["block_params"] == 12 * 32**2 + 13 * 32  # a GPT block: weights, biases, norms
    assert all(math.isfinite(got[k]) for k in ("one_block_s", "two_blocks_s"))
    if zero == 3:  # every unit's gathers and reduce-scatters: well above timing noise
        assert got["two_blocks_s"] > 0
    if zero == 1:
        assert got["optimizer_one_s"] > 0 and got["optimizer_two_s"] > 0
    else:
        assert got["optimizer_one_s"] is None and got["optimizer_two_s"] is None


def _tensor_parallel() -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from meshforge.train.calibration import measure_tensor_parallel

    cfg = build_config({"model": MODEL, "parallel": {"tp": 2},
                        "train": {"micro_batch": 2, "global_batch": 2}})  # fmt: skip
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    return vars(measure_tensor_parallel(cfg, torch.device("cpu"), mesh["tp"], repeats=2))


def test_the_model_is_timed_under_its_tensor_parallelism(gloo):
    results = gloo.run(2, _tensor_parallel)
    assert results[0] == results[1]
    got = results[0]
    assert (got["tp"], got["micro_batch"], got["dp"], got["microbatches"]) == (2, 2, 1, 1)
    assert got["one_block_s"] > 0 and got["two_blocks_s"] > 0
    assert got["optimizer_one_s"] > 0 and got["optimizer_two_s"] > 0  # on DTensors


def _steps(parallel: dict, recompute: str, world: int = 2) -> tuple[dict, list[str]]:
    import torch

    from meshforge.parallel.mesh import build_mesh
    from meshforge.plan.core.timing import HostCosts, TimedSteps
    from meshforge.plan.jobs.job import host_warnings
    from meshforge.train.calibration import measure_steps

    cfg = build_config({"model": {**MODEL, "tie_embeddings": False},
                        "parallel": parallel,
                        "train": {"micro_batch": 2, "global_batch": 4,
                                  "activation_checkpointing": recompute}})  # fmt: skip
    mesh = build_mesh(cfg.dims(world), torch.device("cpu"))
    timed = measure_steps(cfg, torch.device("cpu"), mesh, repeats=2)
    # what a run records and reads back (report.json `predicted.host`)
    again = HostCosts.from_dict({"optimizer_bytes_per_s": 1e9,
                                 "sharded_optimizer_bytes_per_s": 1e9,
                                 "steps": vars(timed)})  # fmt: skip
    assert isinstance(again.steps, TimedSteps) and again.steps == timed
    return vars(timed), host_warnings(again)


@pytest.mark.parametrize("schedule,recompute", [("1f1b", "none"), ("gpipe", "full")])
def test_the_pipeline_is_timed_with_the_trainers_step(gloo, schedule, recompute):
    results = gloo.run(2, _steps, {"pp": 2, "pp_schedule": schedule}, recompute)
    assert results[0] == results[1]  # agreed figures on both stages
    got, warnings = results[0]
    assert (got["pp"], got["stages_per_rank"], got["schedule"]) == (2, 1, schedule)
    assert (got["dp"], got["zero"], got["micro_batch"], got["microbatches"]) == (1, 0, 2, 2)
    assert got["one_layer_s"] > 0 and got["two_layers_s"] > 0
    assert all("step" in w for w in warnings)  # only ever about this figure


def test_a_pipeline_of_tensor_parallel_stages_is_timed_with_the_trainers_step(gloo):
    results = gloo.run(4, _steps, {"pp": 2, "tp": 2, "pp_schedule": "1f1b"}, "none", 4)
    assert all(r == results[0] for r in results)
    got, _ = results[0]
    assert (got["tp"], got["pp"], got["schedule"], got["dp"], got["microbatches"]) == (
        2, 2, "1f1b", 1, 2
    )  # fmt: skip
    assert got["one_layer_s"] > 0 and got["two_layers_s"] > 0


@pytest.mark.parametrize("zero", [1, 3])
def test_a_data_parallel_step_is_timed_with_the_trainers_step(gloo, zero):
    """Without a pipeline the step is the trainer's accumulating step: dp 2, one
    micro-batch of 2 per rank here, under ZeroRedundancyOptimizer or FSDP2."""
    results = gloo.run(2, _steps, {"zero": zero}, "none")
    assert results[0] == results[1]
    got, _ = results[0]
    assert (got["pp"], got["stages_per_rank"], got["schedule"]) == (1, 1, "none")
    assert (got["dp"], got["zero"], got["micro_batch"], got["microbatches"]) == (2, zero, 2, 1)
    assert got["one_layer_s"] > 0 and got["two_layers_s"] > 0
