"""The planner checks itself against real runs (issue 3, part 5).

Every `meshforge train` report carries `predicted`: the planner's memory and step
time for that run, on the profile the run measured of its own machine (matmul rate
at the model's sizes, the optimizer step, gloo all-reduce on the live group). Here,
for DDP and ZeRO-3 at world 2: model-state memory within 10% per rank, and a step-time
prediction whose parts add up (its accuracy is a speed figure, reported by
benchmarks/planner_accuracy.py).

The model is the tiny GPT widened to d_model=128, as in benchmarks/planner_accuracy.py,
whose small GPT it is.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace

import pytest

from helpers import SMALL_CPU_PROFILE as PROFILE
from helpers import SMALL_GPT as MODEL
from meshforge.config import build_config
from meshforge.plan.core.comm import collective_time
from meshforge.plan.core.dp_traffic import CLIP_BYTES_PER_PARAM, rank_models
from meshforge.plan.core.efficiency import matmul_unit_flops
from meshforge.plan.core.flops import GPTShape, microbatch_flops
from meshforge.plan.core.layout import Layout
from meshforge.plan.core.predict import predict_run
from meshforge.plan.core.profile import MachineProfile
from meshforge.plan.core.timing import TensorParallelModels, TimedSteps, WrappedBlocks
from meshforge.plan.jobs.auto import HostCosts, host_step_time
from meshforge.plan.jobs.job import predict_for_job
from meshforge.plan.jobs.machine_fit import fit_allreduce, fit_matmul_curve

TRAIN = {"steps": 30, "global_batch": 16, "micro_batch": 8}


def _selfcheck(job, label: str) -> None:
    """Model states per rank within 10% of the prediction, and a step-time prediction
    of the right kind. How close the predicted step time comes to the measured one is
    a speed figure: it depends on what else the machine runs, so it is reported by
    benchmarks/planner_accuracy.py, not asserted here (no timing thresholds in tests)."""
    report = job.report
    predicted = report["predicted"]
    assert predicted and "error" not in predicted, predicted
    want = predicted["model_state_bytes"]["total"]
    for rank, measured in enumerate(report["model_state_bytes"]):
        ratio = measured["total"] / want
        assert 0.9 <= ratio <= 1.1, f"{label} rank {rank}: model states {measured} vs {want}"
    step = predicted["step_time_s"]
    assert math.isfinite(step) and step > 0, f"{label}: predicted step {step}"
    parts = predicted["time_breakdown_s"]
    assert parts["compute_s"] > 0, parts
    if predicted["host"]["steps"] is not None:  # the whole step timed: optimizer included
        assert parts["optimizer_s"] == parts["dp_comm_exposed_s"] == 0, parts
    else:
        assert parts["optimizer_s"] > 0, parts
    assert sum(v for k, v in parts.items() if k != "step_s") == pytest.approx(step), parts


@pytest.mark.parametrize("zero", [0, 3], ids=["ddp", "zero3"])
def test_prediction_matches_the_run_at_world_2(job_factory, zero):
    job = job_factory(
        {"model": MODEL, "parallel": {"zero": zero}, "train": TRAIN}, name=f"zero{zero}"
    )
    proc = job.train(2)
    _selfcheck(job, f"zero={zero}")
    predicted = job.report["predicted"]
    # the console says where the machine figures come from
    cached = predicted["measurement"]["cached"]
    said = "machine profile from the cache" if cached else "machine profile measured"
    assert said in proc.stdout + proc.stderr
    assert predicted["layout"]["dp"] == 2 and predicted["layout"]["zero"] == zero
    assert predicted["profile"]["allreduce_busbw_bytes_per_s"] > 0
    assert predicted["measurement"]["allreduce"]["points"]  # measured on the live group
    assert predicted["host"]["recompute_layer_s"] >= 0  # a layer timed recomputed too
    # the run's own step timed whole (its wrapping, optimizer and all) with one and two
    # layers; the wrapping alone on its blocks only if that failed
    timed = predicted["host"]["steps"]
    assert (timed["dp"], timed["zero"], timed["pp"], timed["schedule"]) == (2, zero, 1, "none")
    assert timed["microbatches"] == TRAIN["global_batch"] // (2 * TRAIN["micro_batch"])
    assert predicted["host"]["wrapped"] is None


def test_tp2_and_pp2_runs_carry_a_prediction_of_their_own_layout(job_factory):
    """The self-check covers tp/pp layouts: model states per rank within 10%; under tp the
    step's compute is the model timed under its own tensor parallelism at the run's
    start (its collectives and DTensor's dispatch included), under pp the whole step
    of its own pipeline timed likewise (sends, bubble and optimizer included)."""
    for name, parallel in (("tp2", {"tp": 2}), ("pp2", {"pp": 2, "pp_schedule": "1f1b"})):
        model = {**MODEL, "tie_embeddings": False}
        job = job_factory({"model": model, "parallel": parallel, "train": TRAIN}, name=name)
        job.train(2)
        predicted = job.report["predicted"]
        assert predicted and "error" not in predicted, predicted
        assert predicted["layout"]["tp"] * predicted["layout"]["pp"] == 2
        parts = predicted["time_breakdown_s"]
        if name == "tp2":
            timed = predicted["host"]["tensor_parallel"]
            assert timed["tp"] == 2 and timed["micro_batch"] == TRAIN["micro_batch"]
            assert parts["compute_s"] > 0 and parts["tp_pp_comm_s"] == 0, timed
        else:
            assert predicted["host"]["tensor_parallel"] is None
            timed = predicted["host"]["steps"]
            assert (timed["pp"], timed["schedule"], timed["microbatches"]) == (2, "1f1b", 2)
            assert parts["compute_s"] > 0, parts
            assert parts["bubble_s"] == parts["tp_pp_comm_s"] == parts["optimizer_s"] == 0
        want = predicted["model_state_bytes"]["total"]
        for rank, measured in enumerate(job.report["model_state_bytes"]):
            ratio = measured["total"] / want
            assert 0.9 <= ratio <= 1.1, f"{name} rank {rank}: {measured} vs {want}"


# -- the pieces, without a run -------------------------------------------------------


def test_the_fitted_matmul_curve_reproduces_the_time_measured_at_size():
    shape, b = GPTShape(2, 128, 4, 256, 64), 8
    flops = microbatch_flops(shape, b).model(shape.n_layers)
    unit = matmul_unit_flops(b, shape.seq_len, shape.d_model, shape.mlp_ratio, 1)
    peak, t0 = fit_matmul_curve(6e10, 0.05, flops, unit)
    assert peak == 6e10 and t0 > 0
    profile = MachineProfile(
        matmul_flops_per_s=peak,
        allreduce_busbw_bytes_per_s=1e9,
        memory_bytes=8e9,
        matmul_overhead_s=t0,
    )
    pred = predict_run(shape, Layout(), 8, b, "fp32", "none", profile)
    assert math.isclose(pred.time.compute_s, 0.05, rel_tol=1e-9)
    # a cached peak below the rate measured at size is not believed
    assert fit_matmul_curve(1e9, 0.05, flops, unit) == (flops / 0.05, 0.0)


def test_the_allreduce_fit_recovers_bandwidth_and_latency():
    n, busbw, alpha = 4, 2e9, 1e-4
    points = [(s, collective_time("all_reduce", s, n, busbw, alpha)) for s in (4e3, 2.6e5, 4.2e6)]
    got_bw, got_alpha = fit_allreduce(points, n)
    assert math.isclose(got_bw, busbw, rel_tol=1e-6)
    assert math.isclose(got_alpha, alpha, rel_tol=1e-6)


def test_zero3_on_a_cpu_host_pays_every_units_collectives_twice():
    shape = GPTShape(2, 128, 4, 256, 64)
    host = HostCosts(2e9, 2e8)
    cluster = PROFILE.to_cluster(2)
    zero2 = predict_run(shape, Layout(dp=2, zero=2), 16, 8, "fp32", "none", PROFILE)
    zero3 = predict_run(shape, Layout(dp=2, zero=3), 16, 8, "fp32", "none", PROFILE)
    t2 = host_step_time(zero2, shape, cluster, host)
    t3 = host_step_time(zero3, shape, cluster, host)
    units = shape.n_layers + 1
    gather = collective_time("all_gather", 4 * 198_272, 2, 1e9, 3e-4)  # one block
    assert t3["dp_comm_exposed_s"] - t2["dp_comm_exposed_s"] > (units - 1) * gather
    assert t3["optimizer_s"] == t2["optimizer_s"]  # both on DTensor shards


def test_predict_for_job_reports_memory_and_time_per_rank():
    cfg = build_config({"model": MODEL, "parallel": {"zero": 3}, "train": TRAIN})
    out = predict_for_job(cfg, 2, PROFILE, runtime_bytes=1e8)
    states = out["model_state_bytes"]
    assert states["total"] == states["params"] + states["grads"] + states["optimizer"]
    assert states["params"] == pytest.approx(4 * 437_760 / 2)
    assert out["memory_total_bytes"] == pytest.approx(out["planner_memory_total_bytes"] + 1e8)
    assert out["tokens_per_s"] == pytest.approx(16 * 64 / out["step_time_s"])
    # the trainer's `selective` (every other block recomputed) lies between none and full
    times = {}
    for mode in ("none", "selective", "full"):
        sel = build_config({"model": MODEL, "train": {**TRAIN, "activation_checkpointing": mode}})
        times[mode] = predict_for_job(sel, 2, PROFILE)["step_time_s"]
    assert times["none"] < times["selective"] < times["full"]


@pytest.mark.parametrize(
    "parallel,batch",
    [({"pp_schedule": "interleaved_1f1b", "virtual_stages": 2}, 12),  # 3 micro-batches
     ({"pp_schedule": "gpipe"}, 4), ({"pp_schedule": "zbv"}, 4)],  # one micro-batch
)  # fmt: skip
def test_every_pipeline_the_trainer_accepts_gets_a_prediction(parallel, batch):
    """The trainer runs these micro-batch counts (torch's rules, parallel/dims.py); the
    planner predicts them, where Megatron-LM's rules would refuse them."""
    model = {**MODEL, "n_layers": 4, "tie_embeddings": False}
    cfg = build_config({"model": model, "parallel": {"pp": 2, **parallel},
                        "train": {**TRAIN, "global_batch": batch, "micro_batch": 4}})  # fmt: skip
    cfg.dims(2)  # `meshforge train` accepts it
    out = predict_for_job(cfg, 2, PROFILE)
    assert out["step_time_s"] > 0 and out["layout"]["pp"] == 2


def _rank_params(raw: dict) -> int:
    """Parameters the trainer's engine puts on this rank."""
    import torch
    import torch.distributed as dist

    from meshforge.train.engine import Engine

    engine = Engine.build(build_config(raw), dist.get_rank(), 2, torch.device("cpu"))
    return sum(p.numel() for p in engine.parts.parameters())


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved_1f1b", "zbv"])
def test_the_busiest_pipeline_rank_holds_what_the_trainer_puts_there(gloo, schedule):
    """Six untied layers on two ranks: 1F1B and GPipe three per rank (and the
    embedding or the head); interleaved
    stages 0, 2 and 1, 3 of [1, 2, 2, 1] layers; ZB-V stages 0, 3 (both ends of the
    model, two layers) and 1, 2 (four layers)."""
    parallel = {"pp": 2, "pp_schedule": schedule}
    if schedule == "interleaved_1f1b":
        parallel["virtual_stages"] = 2
    raw = {"model": {**MODEL, "n_layers": 6, "tie_embeddings": False}, "parallel": parallel,
           "train": {**TRAIN, "global_batch": 8, "micro_batch": 4}}  # fmt: skip
    held = gloo.run(2, _rank_params, raw)
    out = predict_for_job(build_config(raw), 2, PROFILE)
    # the rank of most memory (activations included: GPipe's last rank, with the
    # logits) holds what the trainer's rank holds, in fp32
    assert out["model_state_bytes"]["params"] in [4 * n for n in held], held


def _host_times(layout: Layout, host: HostCosts, micro: int = 8) -> dict[str, float]:
    shape = GPTShape(2, 128, 4, 256, 64)
    pred = predict_run(shape, layout, 16, micro, "fp32", "none", PROFILE)
    return host_step_time(pred, shape, PROFILE.to_cluster(layout.world_size), host)


def test_the_wrapping_timed_on_the_runs_blocks_is_used_for_its_own_layout_only():
    """A run times the trainer's data-parallel wrapping on one and two of its blocks
    (train.calibration.measure_wrapped_blocks); the host model takes those figures for
    that layout (ZeRO stage, dp, micro-batches) and the traffic model for any other."""
    blocks = 198_272.0
    fsdp = WrappedBlocks(3, 2, 1, blocks, one_block_s=0.010, two_blocks_s=0.030)
    plain = HostCosts(2e9, 2e8)
    timed = HostCosts(2e9, 2e8, wrapped=fsdp)
    zero3 = _host_times(Layout(dp=2, zero=3), timed)["dp_comm_exposed_s"]
    # two blocks at half the two-block figure each, and the root unit on top
    assert zero3 >= 0.030
    slower = HostCosts(2e9, 2e8, wrapped=replace(fsdp, two_blocks_s=0.060))
    assert _host_times(Layout(dp=2, zero=3), slower)["dp_comm_exposed_s"] > zero3
    for other in (Layout(dp=2, zero=2), Layout(dp=4, zero=3)):
        micro = 4 if other.dp == 4 else 8
        assert _host_times(other, timed, micro) == _host_times(other, plain, micro)
    assert _host_times(Layout(dp=2, zero=3), timed, micro=4) == _host_times(
        Layout(dp=2, zero=3), plain, micro=4
    )  # two micro-batches per step: not the step that was timed
    # DDP: linear in the parameters through the two figures (the model holds 2.2 blocks)
    ddp = WrappedBlocks(0, 2, 1, blocks, one_block_s=0.004, two_blocks_s=0.006)
    comm = _host_times(Layout(dp=2), HostCosts(2e9, 2e8, wrapped=ddp))["dp_comm_exposed_s"]
    held = rank_models(GPTShape(2, 128, 4, 256, 64))[0].params
    assert comm == pytest.approx(0.004 + 0.002 * (held - blocks) / blocks)
    # ZeRO-1: the ZeroRedundancyOptimizer's step as timed, plus clipping at the plain rate
    zero1 = WrappedBlocks(1, 2, 1, blocks, 0.004, 0.006, optimizer_one_s=0.002,
                          optimizer_two_s=0.003)  # fmt: skip
    out = _host_times(Layout(dp=2, zero=1), HostCosts(2e9, 2e8, wrapped=zero1))
    want = 0.002 + 0.001 * (held - blocks) / blocks + held * CLIP_BYTES_PER_PARAM / 2e9
    assert out["optimizer_s"] == pytest.approx(want)
    # what a cache holds comes back as it was
    again = HostCosts.from_dict(
        asdict(HostCosts(2e9, 2e8, zero1, TensorParallelModels(2, 8, 1, 2)))
    )
    assert again == HostCosts(2e9, 2e8, zero1, TensorParallelModels(2, 8, 1, 2))


def test_a_model_timed_under_tensor_parallelism_sets_the_compute_of_that_tp():
    """Blocks and ends timed through a step under the job's tp and its data-parallel
    wrapping (train.calibration.measure_tensor_parallel): L blocks and the ends, their
    collectives included; only for that layout and micro-batching."""
    tp = TensorParallelModels(2, 8, one_block_s=0.012, two_blocks_s=0.020, microbatches=2)
    out = _host_times(Layout(dp=1, tp=2), HostCosts(2e9, 2e8, tensor_parallel=tp))
    assert out["compute_s"] == pytest.approx(2 * 0.008 + 0.004)
    assert out["tp_pp_comm_s"] == 0.0
    untimed = _host_times(Layout(dp=1, tp=2), HostCosts(2e9, 2e8))
    assert untimed["tp_pp_comm_s"] > 0.0
    other = _host_times(Layout(dp=1, tp=2), HostCosts(2e9, 2e8, tensor_parallel=tp), micro=4)
    assert other == _host_times(Layout(dp=1, tp=2), HostCosts(2e9, 2e8), micro=4)
    # beside dp 2: the data-parallel traffic is in the timed figures
    both = TensorParallelModels(2, 4, 0.012, 0.020, dp=2, microbatches=2)
    beside = _host_times(Layout(dp=2, tp=2), HostCosts(2e9, 2e8, tensor_parallel=both), micro=4)
    assert beside["dp_comm_exposed_s"] == 0.0
    assert beside["compute_s"] == pytest.approx(2 * 0.008 + 0.004)
    # the optimizer step as timed on the DTensor parameters, linear in the blocks
    timed = replace(both, optimizer_one_s=0.003, optimizer_two_s=0.005)
    out = _host_times(Layout(dp=2, tp=2), HostCosts(2e9, 2e8, tensor_parallel=timed), micro=4)
    assert out["optimizer_s"] == pytest.approx(0.003 + 0.002 * (2 - 1))
    assert _host_times(Layout(dp=2, tp=2), HostCosts(2e9, 2e8), micro=4)["dp_comm_exposed_s"] > 0


def test_a_timed_pipeline_is_the_step_of_its_own_layout_only():
    """A run with pp > 1 (tp 1) times a whole optimizer step of its own pipeline with one
    and two layers per stage (train.calibration.measure_steps); the host model's step
    for that layout is those figures at the layers its slowest stage holds, in place of
    the planner's compute, sends, bubble and optimizer; any other layout keeps them."""
    pipe = TimedSteps(2, 1, "1f1b", 1, 0, 4, 4, one_layer_s=0.020, two_layers_s=0.035)
    plain, timed = HostCosts(2e9, 2e8), HostCosts(2e9, 2e8, steps=pipe)
    got = _host_times(Layout(pp=2), timed, micro=4)
    assert got["compute_s"] == pytest.approx(0.020)  # two layers, one per stage
    # the timed step is a logged one: the exchanges of a logged step are in it
    assert got["bubble_s"] == got["tp_pp_comm_s"] == got["optimizer_s"] == 0
    assert got["logging_allreduce_s"] == 0
    assert got["step_s"] == pytest.approx(0.020)
    untimed = _host_times(Layout(pp=2), plain, micro=4)
    assert untimed["bubble_s"] > 0 and untimed["optimizer_s"] > 0
    # a deeper model: 0.015 s per further layer on the slowest stage (3 of 5 layers)
    deeper = GPTShape(5, 128, 4, 256, 64)
    pred = predict_run(deeper, Layout(pp=2), 16, 4, "fp32", "none", PROFILE)
    cluster = PROFILE.to_cluster(2)
    assert host_step_time(pred, deeper, cluster, timed)["compute_s"] == pytest.approx(0.050)
    # timed for another schedule, micro-batch count or layout: not used
    assert host_step_time(pred, deeper, cluster, timed, schedule="gpipe") == host_step_time(
        pred, deeper, cluster, plain, schedule="gpipe"
    )
    for other, micro in ((Layout(pp=2), 8), (Layout(pp=2, dp=2), 4)):
        assert _host_times(other, timed, micro) == _host_times(other, plain, micro)
    # ZB-V, two stages per rank in a V: six layers in stages of [1, 2, 2, 1], so the
    # second rank holds four (two per stage), where a loop placement would give three
    vee = HostCosts(2e9, 2e8, steps=replace(pipe, stages_per_rank=2, schedule="zbv"))
    six = GPTShape(6, 128, 4, 256, 64)
    pred = predict_run(six, Layout(pp=2), 16, 4, "fp32", "none", PROFILE, schedule="zbv")
    got = host_step_time(pred, six, cluster, vee, schedule="zbv")
    assert got["compute_s"] == pytest.approx(0.035)  # the two-layer figure


def test_full_recomputation_costs_what_was_timed_on_a_layer():
    """A run times one layer recomputed as the trainer recomputes it; on a CPU host a
    `full` step is the `none` step plus that, for every layer and micro-batch, and
    `selective` half of it."""
    host = HostCosts(2e9, 2e8, recompute_layer_s=0.004)
    steps = {}
    for mode in ("none", "selective", "full"):
        cfg = build_config({"model": MODEL, "train": {**TRAIN, "activation_checkpointing": mode}})
        steps[mode] = predict_for_job(cfg, 1, PROFILE, host=host)["time_breakdown_s"]
    m, layers = TRAIN["global_batch"] // TRAIN["micro_batch"], MODEL["n_layers"]
    extra = m * layers * 0.004
    assert steps["full"]["compute_s"] == pytest.approx(steps["none"]["compute_s"] + extra)
    assert steps["selective"]["compute_s"] == pytest.approx(steps["none"]["compute_s"] + extra / 2)
    assert steps["full"]["step_s"] == pytest.approx(sum(
        v for k, v in steps["full"].items() if k != "step_s"
    ))  # fmt: skip
