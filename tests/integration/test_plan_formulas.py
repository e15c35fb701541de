"""FLOPs, pipeline bubble and bus-bandwidth formulas against hand-computed values."""

from __future__ import annotations

import math

import pytest

from helpers import run_python
from meshforge.errors import ConfigError
from meshforge.plan.core.comm import (
    busbw,
    busbw_factor,
    collective_time,
    ring_allreduce_time,
    tp_elements_per_layer,
)
from meshforge.plan.core.efficiency import A100_CURVE, ComputeCurve
from meshforge.plan.core.flops import (
    GPTShape,
    gpt_param_count,
    korthikanti_model_flops,
    korthikanti_selective_hardware_flops,
    megatron_full_recompute_flops,
    microbatch_flops,
    params_per_rank,
)
from meshforge.plan.core.timing import pipeline_bubble_ratio


def test_planner_modules_do_not_import_torch():
    # plan/ and cost/ are pure maths (DESIGN principle 6): checked in a fresh interpreter.
    code = (
        "import sys, meshforge.plan.core.search, meshforge.plan.jobs.request, "
        "meshforge.plan.core.validation, meshforge.plan.jobs.job, "
        "meshforge.plan.jobs.machine_fit, meshforge.plan.jobs.auto, "
        "meshforge.layout, meshforge.cost.run, meshforge.cost.cluster; "
        "print('torch' in sys.modules)"
    )
    out = run_python(["-c", code])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# -- FLOPs ----------------------------------------------------------------------


def test_megatron_eq3_by_hand():
    # B=1, s=2, l=1, h=12, V=48: 96·2·144·(1 + 2/72 + 48/192) = 27648·(1.27777...)
    expected = 96 * 1 * 2 * 1 * 144 * (1 + 2 / 72 + 48 / 192)
    assert megatron_full_recompute_flops(1, 2, 1, 12, 48) == pytest.approx(expected)
    assert expected == pytest.approx(35328.0)


def test_korthikanti_model_and_selective_flops_by_hand():
    # 22B row: B=4, s=2048, l=48, h=6144, V=51200.
    base = 72 * 4 * 48 * 2048 * 6144**2
    assert korthikanti_model_flops(4, 2048, 48, 6144, 51200) == pytest.approx(
        base * (1 + 2048 / 36864 + 51200 / 3538944)
    )
    assert korthikanti_selective_hardware_flops(4, 2048, 48, 6144, 51200) == pytest.approx(
        base * (1 + 2048 / 18432 + 51200 / 3538944)
    )
    # HFU/MFU ratio that the paper's table shows for 22B (43.7 / 41.5 = 1.053)
    ratio = korthikanti_selective_hardware_flops(
        4, 2048, 48, 6144, 51200
    ) / korthikanti_model_flops(4, 2048, 48, 6144, 51200)
    assert ratio == pytest.approx(43.7 / 41.5, rel=0.002)


@pytest.mark.parametrize("layers,hidden,heads", [(48, 6144, 64), (96, 12288, 96), (2, 64, 4)])
def test_shape_flops_equal_megatron_formulas_at_mlp_ratio_4(layers, hidden, heads):
    batch, seq, vocab = 3, 2048, 51200
    shape = GPTShape(layers, hidden, heads, vocab, seq)
    f = microbatch_flops(shape, batch)
    assert f.model(layers) == pytest.approx(
        korthikanti_model_flops(batch, seq, layers, hidden, vocab)
    )
    assert f.hardware(layers, "selective") == pytest.approx(
        korthikanti_selective_hardware_flops(batch, seq, layers, hidden, vocab)
    )
    assert f.hardware(layers, "full") == pytest.approx(
        megatron_full_recompute_flops(batch, seq, layers, hidden, vocab)
    )
    assert f.hardware(layers, "none") == f.model(layers)


def test_params_per_rank_without_parallelism_is_the_model_count():
    shape = GPTShape(4, 128, 4, 256, 128)
    assert params_per_rank(shape).total == gpt_param_count(shape).total


def test_params_per_rank_divides_the_matrices_by_tp():
    shape = GPTShape(8, 1024, 16, 32000, 2048)
    full = params_per_rank(shape)
    half = params_per_rank(shape, tp=2)
    # every weight matrix and column-parallel bias halves; LayerNorms (4h per block, 2h
    # final), row-parallel biases (2h per block) and position embeddings (s·h) do not
    h = 1024
    replicated = 8 * 6 * h + 2 * h + 2048 * h
    assert half.total == (full.total - replicated) / 2 + replicated
    # pp=4: the first stage holds 2 of 8 blocks and the embeddings (V·h + s·h)
    first_stage = params_per_rank(shape, pp=4)
    assert first_stage.total == 2 * full.block + 32000 * h + 2048 * h


# -- pipeline bubble ----------------------------------------------------------------


@pytest.mark.parametrize(
    "p,m,v,expected",
    [
        (4, 8, 1, 3 / 8),
        (8, 64, 1, 7 / 64),
        (8, 64, 4, 7 / 256),
        (1, 16, 1, 0.0),
        (35, 280, 1, 34 / 280),
    ],
)
def test_bubble_over_ideal_time_is_p_minus_1_over_m_v(p, m, v, expected):
    assert pipeline_bubble_ratio(p, m, v) == pytest.approx(expected)


def test_bubble_share_of_step_is_p_minus_1_over_m_plus_p_minus_1():
    ratio = pipeline_bubble_ratio(4, 8)
    assert ratio / (1 + ratio) == pytest.approx(3 / 11)


# -- collectives --------------------------------------------------------------------


def test_busbw_factors_match_nccl_tests():
    assert busbw_factor("all_reduce", 8) == pytest.approx(1.75)
    assert busbw_factor("reduce_scatter", 8) == pytest.approx(0.875)
    assert busbw_factor("all_gather", 4) == pytest.approx(0.75)
    assert busbw_factor("all_to_all", 2) == pytest.approx(0.5)
    assert busbw_factor("broadcast", 16) == 1.0
    assert busbw_factor("reduce", 16) == 1.0
    with pytest.raises(ConfigError, match="unknown collective"):
        busbw_factor("gossip", 4)


def test_busbw_of_a_measured_all_reduce_by_hand():
    # 1 GB all-reduced over 8 ranks in 10 ms: algbw 100 GB/s, busbw 175 GB/s
    assert busbw("all_reduce", 1e9, 0.01, 8) == pytest.approx(175e9)


def test_ring_allreduce_time_by_hand():
    # S = 1 GB, n = 4, β = 100 GB/s, α = 5 µs: 2·3/4·1e9/1e11 + 6·5e-6 = 0.015 + 3e-5
    assert ring_allreduce_time(1e9, 4, 100e9, 5e-6) == pytest.approx(0.01503)
    assert ring_allreduce_time(1e9, 1, 100e9, 5e-6) == 0.0


def test_reduce_scatter_plus_all_gather_moves_what_one_all_reduce_moves():
    rs = collective_time("reduce_scatter", 4e8, 16, 50e9)
    ag = collective_time("all_gather", 4e8, 16, 50e9)
    ar = collective_time("all_reduce", 4e8, 16, 50e9)
    assert rs + ag == pytest.approx(ar)


def test_tensor_parallel_volume_is_8bsh_t_minus_1_over_t():
    assert tp_elements_per_layer(2, 2048, 4096, 8) == pytest.approx(8 * 2 * 2048 * 4096 * 7 / 8)
    assert tp_elements_per_layer(2, 2048, 4096, 1) == 0.0


# -- the efficiency curve -----------------------------------------------------------


def test_efficiency_curve_is_the_stated_function():
    curve = ComputeCurve(f_max=0.8, t0_s=1e-4)
    peak = 100e12
    w_half = 0.8 * peak * 1e-4
    assert curve.fraction(w_half, peak) == pytest.approx(0.4)
    assert curve.fraction(1e18, peak) == pytest.approx(0.8, rel=1e-6)
    assert curve.seconds(1e12, w_half, peak) == pytest.approx(1e12 / (peak * 0.4))


def test_efficiency_rises_with_matmul_size_and_stays_below_f_max():
    peak = 312e12
    curve = ComputeCurve(f_max=0.8, t0_s=1e-4)  # the shipped fits have t0 = 0: a flat curve
    fractions = [curve.fraction(10.0**k, peak) for k in range(8, 15)]
    assert fractions == sorted(fractions)
    assert all(0 < f < curve.f_max for f in fractions)
    assert A100_CURVE.fraction(1e9, peak) <= A100_CURVE.f_max
    assert not math.isclose(fractions[0], fractions[-1])


# -- overlapped traffic and other frameworks (timing.Framework) ---------------------------


def _dp_step(framework=None, zero=1):
    from meshforge.plan.core.flops import GPTShape
    from meshforge.plan.core.hardware import Cluster, gpu_spec, link_spec
    from meshforge.plan.core.layout import Layout, Training
    from meshforge.plan.core.timing import Framework, step_time

    shape = GPTShape(24, 2048, 16, 50304, 2048)
    cluster = Cluster(gpu_spec("h100"), 64, 8, link_spec("nvlink4"), link_spec("ib-ndr"), 8)
    layout = Layout(dp=64, zero=zero)
    training = Training(256, 1, "bf16", "none", "adamw", sdpa=True)
    return step_time(shape, layout, training, cluster, framework=framework or Framework())


def test_hidden_traffic_slows_compute_by_the_stated_fraction():
    from meshforge.plan.core.timing import OVERLAP_SLOWDOWN

    t = _dp_step()
    hidden = t.dp_comm_total_s - t.dp_comm_exposed_s
    assert hidden > 0
    assert t.contention_s == pytest.approx(OVERLAP_SLOWDOWN * hidden)
    parts = ("compute_s", "tp_comm_s", "pp_comm_s", "bubble_s", "dp_comm_exposed_s",
             "contention_s", "optimizer_s")  # fmt: skip
    assert t.step_s == pytest.approx(sum(getattr(t, p) for p in parts))


def test_a_framework_that_reduces_after_the_step_exposes_all_of_it():
    from meshforge.plan.core.timing import Framework

    overlapped = _dp_step()
    after = _dp_step(Framework(dp_overlap=False))
    assert after.dp_comm_exposed_s == after.dp_comm_total_s == overlapped.dp_comm_total_s
    assert after.contention_s == 0.0
    assert after.step_s > overlapped.step_s


@pytest.mark.parametrize("zero", [0, 1])
def test_larger_gradient_buckets_pay_fewer_ring_latencies(zero):
    from meshforge.plan.core.dp_traffic import DDP_BUCKET_BYTES
    from meshforge.plan.core.timing import Framework

    small = _dp_step(zero=zero)
    large = _dp_step(Framework(grad_bucket_bytes=8 * DDP_BUCKET_BYTES), zero=zero)
    assert large.dp_comm_total_s < small.dp_comm_total_s
