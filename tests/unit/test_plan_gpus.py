"""One GPU table (plan/core/gpus.py) for the planner and the trainer's MFU, and one FLOP
count for `plan` and the run reports."""

from __future__ import annotations

import re

import pytest

from meshforge.errors import ConfigError
from meshforge.observe.peak import gpu_peak_flops
from meshforge.plan.core.cluster import build_cluster
from meshforge.plan.core.efficiency import curve_for
from meshforge.plan.core.flops import GPTShape, microbatch_flops, training_flops_per_token
from meshforge.plan.core.gpus import GPU_BY_KEY, GPUS, gpu_key, match_cuda_name, normalise_cuda_name
from meshforge.plan.core.hardware import DEFAULT_INTRA_LINK, GPU_CATALOGUE, LINK_PRESETS, gpu_spec
from meshforge.plan.core.layout import Layout, Training
from meshforge.plan.core.predict import evaluate

# What torch.cuda.get_device_name reports, one per row of the table.
CUDA_NAMES = {
    "NVIDIA A100-SXM4-40GB": "a100-40gb",
    "NVIDIA A100-SXM4-80GB": "a100-80gb",
    "NVIDIA A100-PCIE-40GB": "a100-pcie-40gb",
    "NVIDIA A100 80GB PCIe": "a100-pcie-80gb",
    "NVIDIA H100 80GB HBM3": "h100",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H100 NVL": "h100-nvl",
    "NVIDIA H200": "h200",
    "NVIDIA H200 NVL": "h200-nvl",
    "NVIDIA GH200 480GB": "gh200",
    "NVIDIA GH200 144G HBM3e": "gh200-144gb",
    "NVIDIA L4": "l4",
    "NVIDIA L40": "l40",
    "NVIDIA L40S": "l40s",
    "NVIDIA A10": "a10",
    "NVIDIA A30": "a30",
    "NVIDIA A40": "a40",
    "Tesla V100-SXM2-16GB": "v100-sxm2-16gb",
    "Tesla V100-SXM2-32GB": "v100-sxm2-32gb",
    "Tesla V100-PCIE-16GB": "v100-pcie-16gb",
    "Tesla V100-PCIE-32GB": "v100-pcie-32gb",
    "Tesla V100S-PCIE-32GB": "v100s-pcie",
    "Tesla T4": "t4",
    "NVIDIA GeForce RTX 4090": "rtx-4090",
    "NVIDIA GeForce RTX 3090": "rtx-3090",
}


@pytest.mark.parametrize("name", CUDA_NAMES)
def test_every_cuda_name_matches_exactly_one_row(name: str) -> None:
    normalised = normalise_cuda_name(name)
    hits = [gpu.key for gpu in GPUS if re.fullmatch(gpu.cuda_name, normalised)]
    assert hits == [CUDA_NAMES[name]]


def test_every_row_has_a_real_name_a_link_preset_and_a_source() -> None:
    assert set(CUDA_NAMES.values()) == set(GPU_BY_KEY)
    for gpu in GPUS:
        assert gpu.intra_link in LINK_PRESETS, gpu.key
        assert gpu.architecture in {"volta", "turing", "ampere", "ada", "hopper"}, gpu.key
        assert "datasheet" in gpu.source or "whitepaper" in gpu.source, gpu.key


def test_every_gpu_of_the_table_is_plannable_by_its_key() -> None:
    assert list(GPU_CATALOGUE) == [gpu.key for gpu in GPUS]
    assert DEFAULT_INTRA_LINK == {gpu.key: gpu.intra_link for gpu in GPUS}
    for key, device in GPU_CATALOGUE.items():
        curve, calibration = curve_for(key)
        assert (device.curve, device.calibration) == (curve, calibration)


@pytest.mark.parametrize(("name", "key"), CUDA_NAMES.items())
def test_the_planner_peak_is_the_trainer_peak_for_the_same_gpu(name: str, key: str) -> None:
    device = gpu_spec(key)
    for dtype in ("bf16", "fp16", "tf32", "fp32"):
        trainer = gpu_peak_flops(name, dtype)
        if trainer is None:  # no such unit (bf16 on Volta and Turing): no plan either
            with pytest.raises(ConfigError, match=f"precision={dtype}"):
                device.peak(dtype)
        else:
            assert device.peak(dtype) == trainer


def test_a100_40gb_and_80gb_differ_in_memory_and_bandwidth_as_the_datasheet_says() -> None:
    small, large = gpu_spec("a100-40gb"), gpu_spec("a100-80gb")
    assert (small.memory_bytes, large.memory_bytes) == (40e9, 80e9)
    assert small.memory_bandwidth_bytes_per_s == pytest.approx(1.555e12)
    assert large.memory_bandwidth_bytes_per_s == pytest.approx(2.039e12)
    assert small.peak("bf16") == large.peak("bf16") == 312e12


@pytest.mark.parametrize(("alias", "key"), [("a100", "a100-80gb"), ("H100-SXM", "h100"),
                                            ("h200-sxm", "h200"), ("L40S", "l40s")])  # fmt: skip
def test_aliases_and_any_case_resolve_to_one_key(alias: str, key: str) -> None:
    assert gpu_key(alias) == key
    assert gpu_spec(alias).name == key


def test_an_unknown_gpu_is_named_with_the_keys_it_could_be() -> None:
    assert gpu_key("b200") is None and match_cuda_name("NVIDIA B200") is None
    with pytest.raises(ConfigError, match=r"--gpu 'b200' is not in the catalogue \(a100-40gb"):
        gpu_spec("b200")


# -- one FLOP convention --------------------------------------------------------------

SHAPES = {
    "gpt-tied": GPTShape(4, 128, 4, 256, 64),
    "gpt-untied": GPTShape(4, 128, 4, 256, 64, tie_embeddings=False),
    "llama-gqa": GPTShape(4, 128, 8, 320, 96, family="llama", n_kv_heads=2, tie_embeddings=False),
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES)
def test_plan_counts_the_run_reports_flops_per_token(shape: GPTShape) -> None:
    training = Training(global_batch=8, micro_batch=2, precision="bf16")
    prediction = evaluate(shape, Layout(dp=2), training, build_cluster(2, "h100"))
    tokens = training.global_batch * shape.seq_len
    assert prediction.model_flops_per_step / tokens == training_flops_per_token(shape)


def test_flops_per_token_is_6_n_matmul_plus_12_lsh_by_hand() -> None:
    # gpt: 4 layers of 4h² + 2·h·4h = 12h² matmul weights, and the head V·h (tied or not)
    h, s, V, L = 128, 64, 256, 4
    expected = 6 * (L * 12 * h * h + V * h) + 12 * L * s * h
    assert training_flops_per_token(SHAPES["gpt-tied"]) == expected
    assert training_flops_per_token(SHAPES["gpt-untied"]) == expected
    # llama GQA: q and o h x h, k and v h x (2 heads x 16), SwiGLU 3·h·f with f = 384
    llama = SHAPES["llama-gqa"]
    kv, f = 2 * (128 // 8), 384
    assert llama.mlp_width == f
    matmul = L * (2 * h * h + 2 * h * kv + 3 * h * f) + 320 * h
    assert training_flops_per_token(llama) == 6 * matmul + 12 * L * 96 * h
    # and Megatron's per-micro-batch count (plan's timing and HFU) says the same
    assert microbatch_flops(llama, 3).model(L) == 3 * 96 * training_flops_per_token(llama)
