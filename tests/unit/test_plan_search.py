"""Layout search and single-layout evaluation: validity, memory, ordering, time model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshforge.errors import ConfigError
from meshforge.plan.core.flops import GPTShape
from meshforge.plan.core.hardware import Cluster, gpu_spec, link_spec
from meshforge.plan.core.layout import Layout, Training
from meshforge.plan.core.predict import evaluate, predict_run
from meshforge.plan.core.profile import MachineProfile
from meshforge.plan.core.search import LayoutChoice, best_layout, search_layouts

GIB = 2**30


def _gpu_cluster(n: int, gpus_per_node: int = 8, gpu: str = "a100-80gb") -> Cluster:
    return Cluster(gpu_spec(gpu), n, min(n, gpus_per_node), link_spec("nvlink3"),
                   link_spec("ib-hdr"), nics_per_node=min(n, gpus_per_node))  # fmt: skip


def _assert_valid(prediction, shape: GPTShape, n_gpus: int, global_batch: int) -> None:
    """Divisibility rules, restated independently of layout.check_layout."""
    lay, train = prediction.layout, prediction.training
    assert lay.dp * lay.tp * lay.pp == n_gpus
    assert shape.n_heads % lay.tp == 0
    assert lay.pp * lay.virtual_stages <= shape.n_layers  # uneven stages allowed
    assert global_batch % (lay.dp * train.micro_batch) == 0
    m = global_batch // (lay.dp * train.micro_batch)
    if lay.pp > 1 and lay.virtual_stages == 1:
        assert m >= lay.pp  # 1F1B: a micro-batch per stage
    if lay.virtual_stages > 1:  # torch's interleaved 1F1B: m a multiple of its rounds
        assert lay.pp > 1 and m % max(1, m // lay.pp) == 0
    if lay.sequence_parallel:
        assert lay.tp > 1 and shape.seq_len % lay.tp == 0


shapes = st.builds(
    lambda layers, heads, head_dim, vocab, seq: GPTShape(
        layers, heads * head_dim, heads, vocab, seq
    ),
    layers=st.sampled_from([1, 2, 3, 4, 6, 8, 12]),
    heads=st.sampled_from([1, 2, 3, 4, 6, 8]),
    head_dim=st.sampled_from([16, 32, 64]),
    vocab=st.integers(50, 5000),
    seq=st.sampled_from([32, 64, 128, 256]),
)


@settings(max_examples=40, deadline=None)
@given(
    shape=shapes,
    n_gpus=st.sampled_from([1, 2, 3, 4, 6, 8]),
    global_batch=st.sampled_from([1, 2, 4, 8, 12, 16, 24, 48]),
    memory_mb=st.integers(1, 200),
    precision=st.sampled_from(["fp32", "bf16"]),
)
def test_search_returns_only_valid_layouts_that_fit_best_first(
    shape, n_gpus, global_batch, memory_mb, precision
):
    profile = MachineProfile(5e10, 2e9, memory_mb * 1e6, allreduce_latency_s=2e-5,
                             per_device_memory=True)  # fmt: skip
    cluster = profile.to_cluster(n_gpus)
    training = Training(global_batch=global_batch, precision=precision)
    try:
        result = search_layouts(shape, training, cluster)
    except ConfigError:
        return  # no valid layout at all (e.g. a batch no dp divides): nothing to check
    for prediction in result.candidates:
        _assert_valid(prediction, shape, n_gpus, global_batch)
        assert prediction.fits and prediction.memory.total <= cluster.device.memory_bytes
    fitting = [p.step_time_s for p in result.evaluated if p.fits]
    steps = [p.step_time_s for p in result.candidates]
    assert steps == sorted(steps)
    assert len(result.candidates) == len(fitting)
    if result.best is not None:
        assert result.best.step_time_s <= min(fitting)
    for prediction in result.evaluated:  # everything evaluated was valid too
        _assert_valid(prediction, shape, n_gpus, global_batch)


@settings(max_examples=15, deadline=None)
@given(
    log_gpus=st.integers(3, 7),
    heads=st.sampled_from([8, 16, 32]),
    layers=st.sampled_from([8, 16, 32]),
)
def test_search_on_a_gpu_cluster_never_beats_its_own_best(log_gpus, heads, layers):
    shape = GPTShape(layers, heads * 128, heads, 32000, 2048)
    cluster = _gpu_cluster(2**log_gpus)
    result = search_layouts(shape, Training(global_batch=256), cluster)
    assert result.best is not None
    assert all(result.best.step_time_s <= p.step_time_s for p in result.evaluated if p.fits)


def test_search_respects_the_fields_the_user_fixed():
    shape = GPTShape(24, 2048, 16, 32000, 2048)
    choice = LayoutChoice(tp=2, zero=1, recompute="selective")
    result = search_layouts(shape, Training(global_batch=64), _gpu_cluster(16), choice)
    assert result.candidates
    for p in result.evaluated:
        assert (p.layout.tp, p.layout.zero, p.training.recompute) == (2, 1, "selective")


def test_a_model_that_fits_nowhere_has_no_candidates_and_best_layout_says_so():
    shape = GPTShape(96, 12288, 96, 51200, 2048)  # 175B on 8 x 40 GB
    cluster = _gpu_cluster(8, gpu="a100-40gb")
    assert search_layouts(shape, Training(global_batch=8), cluster).candidates == []
    assert best_layout(shape, Training(global_batch=8), cluster).fits is False


def test_fixed_fields_that_break_a_rule_name_it():
    shape = GPTShape(24, 2048, 16, 32000, 2048)
    with pytest.raises(ConfigError, match="--tp 3 does not divide --heads 16"):
        search_layouts(shape, Training(global_batch=64), _gpu_cluster(6), LayoutChoice(tp=3))
    with pytest.raises(ConfigError, match="global-batch 10 is not divisible"):
        evaluate(shape, Layout(dp=4), Training(global_batch=10), _gpu_cluster(4))
    with pytest.raises(ConfigError, match="does not equal --gpus 8"):
        evaluate(shape, Layout(dp=4), Training(global_batch=16), _gpu_cluster(8))


# -- time model behaviour -------------------------------------------------------------


def test_tensor_parallel_across_nodes_is_slower_than_inside_one():
    shape = GPTShape(32, 8192, 64, 51200, 2048)
    training = Training(global_batch=32, precision="bf16", recompute="selective")
    layout = Layout(dp=1, tp=16, sequence_parallel=True)
    one_node = Cluster(gpu_spec("h100"), 16, 16, link_spec("nvlink4"), link_spec("ib-ndr"), 16)
    two_nodes = Cluster(gpu_spec("h100"), 16, 8, link_spec("nvlink4"), link_spec("ib-ndr"), 8)
    fast = evaluate(shape, layout, training, one_node).time
    slow = evaluate(shape, layout, training, two_nodes).time
    assert slow.tp_comm_s > fast.tp_comm_s
    assert slow.compute_s == pytest.approx(fast.compute_s)


def test_zero3_moves_more_data_than_ddp_and_recompute_costs_time():
    shape = GPTShape(24, 2048, 16, 32000, 2048)
    cluster = Cluster(gpu_spec("a100-80gb"), 64, 8, link_spec("nvlink3"), link_spec("eth-10"), 1)
    training = Training(global_batch=64)
    # in fp32 ZeRO-3 moves 1.5x DDP's bytes (in bf16 its gathers are half as large, and
    # 2 + 2 + 4 bytes per parameter equal DDP's fp32 all-reduce)
    fp32 = Training(global_batch=64, precision="fp32")
    ddp = evaluate(shape, Layout(dp=64, zero=0), fp32, cluster).time
    z3 = evaluate(shape, Layout(dp=64, zero=3), fp32, cluster).time
    assert z3.dp_comm_total_s > ddp.dp_comm_total_s
    full = evaluate(shape, Layout(dp=64), Training(global_batch=64, recompute="full"), cluster)
    none = evaluate(shape, Layout(dp=64), training, cluster)
    # on this slow network the step is bound by the all-reduce the backward hides under
    assert full.time.compute_s > none.time.compute_s
    assert full.step_time_s >= none.step_time_s
    assert full.hfu > full.mfu and none.hfu == none.mfu


def test_interleaving_shrinks_the_bubble():
    shape = GPTShape(32, 4096, 32, 51200, 2048)
    training = Training(global_batch=64)
    cluster = _gpu_cluster(8)
    plain = evaluate(shape, Layout(dp=1, tp=1, pp=8), training, cluster)
    interleaved = evaluate(shape, Layout(dp=1, tp=1, pp=8, virtual_stages=4), training, cluster)
    assert interleaved.bubble_fraction < plain.bubble_fraction
    # bubble / (steady compute + p2p) is (p-1)/(m·v): here 7/64 and 7/256
    t = plain.time
    assert t.bubble_s / (t.compute_s + t.pp_comm_s) == pytest.approx(7 / 64)


def test_predict_run_on_a_measured_cpu_profile():
    # the trainer's entry: gpt-tiny on 2 CPU ranks, DDP, fp32
    shape = GPTShape(4, 128, 4, 256, 128)
    profile = MachineProfile(matmul_flops_per_s=5e10, allreduce_busbw_bytes_per_s=1e9,
                             memory_bytes=16e9, allreduce_latency_s=1e-4)  # fmt: skip
    p = predict_run(shape, Layout(dp=2), 16, 4, "fp32", "none", profile)
    params = 4 * 198272 + 256 * 128 + 128 * 128 + 2 * 128  # gpt_param_count by hand
    assert p.model_params == params
    assert p.memory.model_states == pytest.approx(16 * params)
    assert p.memory.device == pytest.approx(8e9)  # host memory shared by the 2 ranks
    # compute: 2 micro-batches of 4 sequences per rank at the measured rate
    flops = 2 * (
        3 * (4 * (2 * 4 * 128 * 12 * 128**2 + 4 * 4 * 128**2 * 128) + 2 * 4 * 128 * 256 * 128)
    )
    assert p.time.compute_s == pytest.approx(flops / 5e10)
    assert p.time.dp_comm_total_s > 0 and p.step_time_s > p.time.compute_s
    assert p.tokens_per_s == pytest.approx(16 * 128 / p.step_time_s)


def test_profile_rejects_bad_fields(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text('{"matmul_flops_per_s": 1e10, "allreduce_busbw_bytes_per_s": 1e9}')
    with pytest.raises(ConfigError, match="missing key 'memory_bytes'"):
        MachineProfile.from_json_file(path)
    path.write_text(
        '{"matmul_flops_per_s": -1, "allreduce_busbw_bytes_per_s": 1e9, "memory_bytes": 1}'
    )
    with pytest.raises(ConfigError, match="profile.matmul_flops_per_s"):
        MachineProfile.from_json_file(path)
    path.write_text('{"matmul_flops": 1}')
    with pytest.raises(ConfigError, match="unknown key 'matmul_flops'"):
        MachineProfile.from_json_file(path)
    profile = MachineProfile(1e10, 1e9, 1e9)
    assert MachineProfile.from_dict(profile.to_dict()) == profile
