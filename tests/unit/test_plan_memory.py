"""The memory model: ZeRO model states in both conventions, Korthikanti's activations."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshforge.errors import ConfigError
from meshforge.plan.core.flops import GPTShape
from meshforge.plan.core.layout import Layout, Training
from meshforge.plan.core.memory import (
    activation_bytes_per_layer,
    activation_memory_bytes,
    comm_buffer_bytes,
    layers_in_flight,
    model_state_bytes,
    working_bytes,
)
from meshforge.plan.core.predict import evaluate
from meshforge.plan.core.profile import MachineProfile

DP_DEGREES = (1, 4, 16, 64, 256, 1024)
PARAM_COUNTS = (7.5e9, 128e9, 1e12)


def _sig3(x: float) -> float:
    return float(f"{x:.3g}")


def zero_paper_formula(stage: int, psi: float, nd: int, k: float = 12) -> float:
    """Rajbhandari et al. 1910.02054 §V, written out independently of the code."""
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return 4 * psi + k * psi / nd
    if stage == 2:
        return 2 * psi + (2 + k) * psi / nd
    return (2 + 2 + k) * psi / nd


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("nd", DP_DEGREES)
@pytest.mark.parametrize("psi", PARAM_COUNTS)
def test_zero_paper_convention_equals_the_zero_formulas(stage, nd, psi):
    got = model_state_bytes(psi, stage, nd, "bf16", "zero-paper")["total"]
    assert _sig3(got) == _sig3(zero_paper_formula(stage, psi, nd))


def test_zero_paper_figure_for_7_5b_on_64_gpus():
    # The paper's Figure 1: 120 GB, 31.4 GB, 16.6 GB, 1.88 GB per GPU
    totals = [
        model_state_bytes(7.5e9, s, 64, "fp16", "zero-paper")["total"] / 1e9 for s in range(4)
    ]
    assert [_sig3(t) for t in totals] == [120.0, 31.4, 16.6, 1.88]


def test_zero_paper_fp32_is_4_4_8():
    states = model_state_bytes(1e9, 0, 1, "fp32", "zero-paper")
    assert (states["params"], states["grads"], states["optimizer"]) == (4e9, 4e9, 8e9)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_meshforge_convention_keeps_fp32_master_params_in_every_precision(precision):
    psi, nd = 1e9, 8
    ddp = model_state_bytes(psi, 0, nd, precision)
    assert (ddp["params"], ddp["grads"], ddp["optimizer"]) == (4e9, 4e9, 8e9)
    z1 = model_state_bytes(psi, 1, nd, precision)
    assert (z1["params"], z1["grads"], z1["optimizer"]) == (4e9, 4e9, 1e9)
    for stage in (2, 3):  # FSDP2 holds everything sharded at rest
        z = model_state_bytes(psi, stage, nd, precision)
        assert (z["params"], z["grads"], z["optimizer"]) == (0.5e9, 0.5e9, 1e9)
        assert z["total"] == pytest.approx(2e9)


def test_meshforge_and_zero_paper_differ_where_the_implementations_differ():
    # ZeRO-2: the paper keeps 16-bit params replicated; FSDP2 keeps fp32 params sharded
    mesh = model_state_bytes(1e9, 2, 64, "bf16")
    paper = model_state_bytes(1e9, 2, 64, "bf16", "zero-paper")
    assert paper["params"] == 2e9 and mesh["params"] == pytest.approx(4e9 / 64)


def test_sgd_keeps_one_momentum():
    assert model_state_bytes(1e9, 0, 1, "fp32", optimizer="sgd")["optimizer"] == 4e9


def test_ddp_buckets_and_fsdp_working_memory():
    psi = 1e9
    # meshforge's DDP keeps its gradients in the buckets (gradient_as_bucket_view=True)
    assert comm_buffer_bytes(psi, 0) == 0 == comm_buffer_bytes(psi, 1)
    assert comm_buffer_bytes(psi, 1, gradient_as_bucket_view=False) == 4e9
    assert comm_buffer_bytes(psi, 2, gradient_as_bucket_view=False) == 0
    assert comm_buffer_bytes(psi, 0, "zero-paper", gradient_as_bucket_view=False) == 0
    # autocast's bf16 weight copies under DDP; none in fp32
    assert working_bytes(psi, 0, "bf16") == 2e9
    assert working_bytes(psi, 0, "fp32") == 0
    # ZeRO-2 unshards the whole model for the step; ZeRO-3 two blocks (+ the root)
    block, root = psi / 48, psi / 20
    z2 = working_bytes(psi, 2, "bf16", block, root)
    z3 = working_bytes(psi, 3, "bf16", block, root)
    assert z2 > 2 * psi and z3 < z2 / 4
    # gradient accumulation keeps the whole model's unsharded grads in fp32 until sync
    assert working_bytes(psi, 3, "bf16", block, root, microbatches=4) == pytest.approx(z3 + 4e9)


@pytest.mark.parametrize(
    "kwargs",
    [dict(params=0, zero=0, dp=1), dict(params=1e9, zero=4, dp=1), dict(params=1e9, zero=0, dp=0)],
)
def test_model_state_bytes_rejects_bad_input(kwargs):
    with pytest.raises(ConfigError):
        model_state_bytes(**kwargs)
    with pytest.raises(ConfigError, match="memory-convention"):
        model_state_bytes(1e9, 0, 1, convention="deepspeed")


# -- activations: Korthikanti et al. 2205.05198 --------------------------------------

S, B, H, A, T = 2048, 2, 12288, 96, 8
SBH = S * B * H


@pytest.mark.parametrize(
    "tp,sp,recompute,expected",
    [
        (1, False, "none", SBH * (34 + 5 * A * S / H)),  # no parallelism
        (T, False, "none", SBH * (10 + 24 / T + 5 * A * S / (H * T))),  # tensor parallel
        (T, True, "none", SBH / T * (34 + 5 * A * S / H)),  # tensor + sequence parallel
        (T, False, "selective", SBH * (10 + 24 / T)),  # TP + selective recompute
        (T, True, "selective", 34 * SBH / T),  # TP + SP + selective recompute
        (T, False, "full", 2 * SBH),  # full recompute
    ],
)
def test_activation_formulas_equal_korthikanti(tp, sp, recompute, expected):
    got = activation_bytes_per_layer(S, B, H, A, tp=tp, sequence_parallel=sp, recompute=recompute)
    assert got == pytest.approx(expected, rel=1e-12)


def test_activation_per_layer_by_hand():
    # s=2, b=1, h=4, a=2: 2·1·4·(34 + 5·2·2/4) = 8·39 = 312 bytes
    assert activation_bytes_per_layer(2, 1, 4, 2) == pytest.approx(312)


def test_sdpa_drops_the_attention_score_term():
    eager = activation_bytes_per_layer(S, B, H, A, tp=T)
    fused = activation_bytes_per_layer(S, B, H, A, tp=T, sdpa=True)
    assert eager - fused == pytest.approx(SBH * 5 * A * S / (H * T))


def test_in_flight_layers_for_pipeline_schedules():
    assert layers_in_flight(96, 1, 1, "1f1b", 64) == 96
    assert layers_in_flight(96, 8, 1, "1f1b", 64) == 96  # p micro-batches of L/p layers
    assert layers_in_flight(96, 8, 4, "1f1b", 64) == pytest.approx(96 * (1 + 7 / 32))
    assert layers_in_flight(96, 8, 1, "gpipe", 64) == 12 * 64


def test_1t_model_activations_match_korthikanti_total():
    # 1T row: first stage holds s·b·h·L/t·34 bytes with SP + selective (Korthikanti §4.2)
    shape = GPTShape(128, 25600, 160, 51200, 2048)
    got = activation_memory_bytes(shape, 1, 8, 64, 1, True, "selective", "bf16", False, 512)
    assert got == pytest.approx(2048 * 25600 * 128 / 8 * 34)


def test_fp32_doubles_activation_bytes():
    shape = GPTShape(4, 256, 4, 1000, 128)
    args = (shape, 2, 1, 1, 1, False, "none")
    bf16 = activation_memory_bytes(*args, "bf16", True, 1)
    fp32 = activation_memory_bytes(*args, "fp32", True, 1)
    assert fp32 == pytest.approx(2 * bf16, rel=0.05)


# -- properties -------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    psi=st.floats(1e6, 1e13),
    nd_small=st.integers(1, 4096),
    factor=st.integers(1, 64),
    precision=st.sampled_from(["fp32", "bf16", "fp16"]),
    convention=st.sampled_from(["meshforge", "zero-paper"]),
    stage=st.sampled_from([0, 1, 2, 3]),
)
def test_model_states_never_rise_with_dp(psi, nd_small, factor, precision, convention, stage):
    small = model_state_bytes(psi, stage, nd_small, precision, convention)["total"]
    large = model_state_bytes(psi, stage, nd_small * factor, precision, convention)["total"]
    assert large <= small * (1 + 1e-12)
    if stage == 3 and factor > 1:
        assert large < small


_PROFILE = MachineProfile(1e12, 1e10, 1e15, per_device_memory=True)


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 48),
    heads=st.sampled_from([1, 2, 4, 8, 16]),
    head_dim=st.sampled_from([16, 64, 128]),
    log_small=st.integers(0, 6),
    log_factor=st.integers(1, 4),
    precision=st.sampled_from(["fp32", "bf16"]),
)
def test_zero3_memory_per_gpu_never_rises_with_dp(
    layers, heads, head_dim, log_small, log_factor, precision
):
    shape = GPTShape(layers, heads * head_dim, heads, 5000, 256)
    training = Training(global_batch=2**12, micro_batch=1, precision=precision)
    totals = []
    for nd in (2**log_small, 2 ** (log_small + log_factor)):
        layout = Layout(dp=nd, zero=3)
        prediction = evaluate(shape, layout, training, _PROFILE.to_cluster(nd))
        totals.append(prediction.memory.total)
    assert totals[1] <= totals[0] * (1 + 1e-12)
    assert not math.isnan(totals[1])
