"""Peak FLOP/s: the GPU table never guesses, the CPU figure is measured once per machine.

The table itself (one row per CUDA name, shared with the planner): test_plan_gpus.py."""

from __future__ import annotations

import json
import math
import multiprocessing

import pytest
import torch

from meshforge.observe import peak
from meshforge.observe.peak import (
    PeakFlops,
    detect_peak_flops,
    gpu_peak_flops,
    measure_cpu_matmul_flops,
    mfu,
)

TFLOPS = 1e12


@pytest.mark.parametrize(
    "name",
    ["NVIDIA H100 80GB HBM3", "NVIDIA H100", "NVIDIA H100 SXM5 80GB", "H100-SXM5-80GB"],
)
def test_h100_sxm_name_variants_map_to_the_h100_sxm_figure(name: str) -> None:
    assert gpu_peak_flops(name, "bf16") == 989 * TFLOPS
    assert gpu_peak_flops(name, "fp16") == 989 * TFLOPS
    assert gpu_peak_flops(name, "fp32") == 67 * TFLOPS


def test_h100_pcie_and_nvl_are_not_taken_for_the_sxm_part() -> None:
    assert gpu_peak_flops("NVIDIA H100 PCIe", "bf16") == 756 * TFLOPS
    assert gpu_peak_flops("NVIDIA H100 80GB HBM2e", "bf16") == 756 * TFLOPS
    assert gpu_peak_flops("NVIDIA H100 NVL", "bf16") == 835.5 * TFLOPS


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA A100-SXM4-40GB",
        "NVIDIA A100-SXM4-80GB",
        "NVIDIA A100-PCIE-40GB",
        "NVIDIA A100 80GB PCIe",
    ],
)
def test_a100_40gb_and_80gb_both_peak_at_312_bf16(name: str) -> None:
    assert gpu_peak_flops(name, "bf16") == 312 * TFLOPS
    assert gpu_peak_flops(name, "tf32") == 156 * TFLOPS
    assert gpu_peak_flops(name, "fp32") == 19.5 * TFLOPS


def test_h200_matches_its_datasheet() -> None:
    assert gpu_peak_flops("NVIDIA H200", "bf16") == 989 * TFLOPS
    assert gpu_peak_flops("NVIDIA H200 NVL", "bf16") == 835.5 * TFLOPS


def test_similar_names_map_to_their_own_gpu() -> None:
    assert gpu_peak_flops("NVIDIA A10", "bf16") == 125 * TFLOPS
    assert gpu_peak_flops("NVIDIA L40", "bf16") == 181.05 * TFLOPS
    assert gpu_peak_flops("NVIDIA L40S", "bf16") == 362.05 * TFLOPS
    assert gpu_peak_flops("NVIDIA L4", "bf16") == 121 * TFLOPS
    assert gpu_peak_flops("NVIDIA GeForce RTX 4090", "bf16") == 165.2 * TFLOPS
    assert gpu_peak_flops("Tesla V100-SXM2-32GB", "fp16") == 125 * TFLOPS
    assert gpu_peak_flops("Tesla V100S-PCIE-32GB", "fp16") == 130 * TFLOPS


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA A10G",  # not the A10, and not the A100
        "NVIDIA GeForce RTX 4090 D",
        "NVIDIA GeForce RTX 4090 Laptop GPU",
        "NVIDIA B200",
        "NVIDIA H800",
        "NVIDIA A100X",
        "AMD Instinct MI300X",
        "",
    ],
)
def test_an_unknown_gpu_has_no_figure(name: str) -> None:
    assert gpu_peak_flops(name, "bf16") is None


def test_a_gpu_without_the_dtype_has_no_figure() -> None:
    assert gpu_peak_flops("Tesla V100-SXM2-16GB", "bf16") is None


def test_an_unknown_dtype_is_an_error() -> None:
    with pytest.raises(ValueError, match="int8"):
        gpu_peak_flops("NVIDIA H100", "int8")


def test_detect_on_an_unknown_cuda_device_says_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Mystery 9000")
    assert detect_peak_flops(torch.device("cuda", 0), "bf16") == PeakFlops(
        None, "unknown", "NVIDIA Mystery 9000"
    )


def test_detect_on_a_known_cuda_device_names_the_table_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    found = detect_peak_flops(torch.device("cuda", 0), "bf16")
    assert found.flops_per_s == 989 * TFLOPS
    assert found.source == "table:H100 SXM bf16 dense"


def test_fp32_on_cuda_counts_tf32_only_when_pytorch_allows_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert detect_peak_flops(torch.device("cuda"), "fp32").flops_per_s == 19.5 * TFLOPS
        torch.set_float32_matmul_precision("high")
        assert detect_peak_flops(torch.device("cuda"), "fp32").flops_per_s == 156 * TFLOPS
    finally:
        torch.set_float32_matmul_precision(previous)


def test_cpu_measurement_is_positive_and_cached_per_machine(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHFORGE_CACHE", str(tmp_path))
    threads_before = torch.get_num_threads()
    first = measure_cpu_matmul_flops("fp32", threads=1)
    assert math.isfinite(first) and first > 0
    assert torch.get_num_threads() == threads_before

    cache_file = tmp_path / "peak_flops.json"
    entries = json.loads(cache_file.read_text())
    (key,) = entries
    assert key == f"{peak.cpu_model_name()}|torch={torch.__version__}|fp32|threads=1"
    assert entries[key]["flops_per_s"] == first

    # A second call must read the file, not measure: plant a value and get it back.
    entries[key]["flops_per_s"] = 1234.5
    cache_file.write_text(json.dumps(entries))
    assert measure_cpu_matmul_flops("fp32", threads=1) == 1234.5
    found = detect_peak_flops(torch.device("cpu"), "fp32", threads=1)
    assert found.flops_per_s == 1234.5
    assert found.source == "cached:cpu matmul fp32 threads=1"


def test_cpu_cache_is_keyed_by_dtype(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHFORGE_CACHE", str(tmp_path))
    found = detect_peak_flops(torch.device("cpu"), "bf16", threads=1)
    assert found.source == "measured:cpu matmul bf16 threads=1"
    assert found.flops_per_s is not None and found.flops_per_s > 0
    assert found.device_name == peak.cpu_model_name()
    keys = json.loads((tmp_path / "peak_flops.json").read_text())
    assert [k.split("|")[2] for k in keys] == ["bf16"]


def test_a_corrupt_cache_file_is_measured_again(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHFORGE_CACHE", str(tmp_path))
    (tmp_path / "peak_flops.json").write_text('{"half written')
    assert measure_cpu_matmul_flops("fp32", threads=1) > 0
    assert len(json.loads((tmp_path / "peak_flops.json").read_text())) == 1


def _measure_in_child(cache_dir: str, threads: int) -> float:
    import os

    os.environ["MESHFORGE_CACHE"] = cache_dir
    from meshforge.observe.peak import measure_cpu_matmul_flops as measure

    return measure("fp32", threads=threads)


def test_racing_processes_leave_a_valid_cache_with_every_entry(tmp_path) -> None:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        rates = pool.starmap(_measure_in_child, [(str(tmp_path), t) for t in (1, 2, 3)])
    assert all(r > 0 for r in rates)
    entries = json.loads((tmp_path / "peak_flops.json").read_text())
    assert sorted(k.rsplit("=", 1)[1] for k in entries) == ["1", "2", "3"]
    assert not list(tmp_path.glob("*.tmp"))


def test_mfu_is_achieved_over_peak() -> None:
    h100 = PeakFlops(989e12, "table:H100 SXM bf16 dense", "NVIDIA H100 80GB HBM3")
    assert mfu(395.6e12, h100) == pytest.approx(0.4)
    assert mfu(0.0, h100) == 0.0


def test_mfu_is_none_when_either_side_is_unknown() -> None:
    assert mfu(1e12, PeakFlops(None, "unknown", "NVIDIA B200")) is None
    assert mfu(None, PeakFlops(1e12, "measured:cpu", "cpu")) is None
    assert mfu(float("nan"), PeakFlops(1e12, "measured:cpu", "cpu")) is None


def test_an_unwritable_cache_still_gives_a_measured_figure(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("MESHFORGE_CACHE", str(blocker / "cache"))
    found = detect_peak_flops(torch.device("cpu"), "fp32", threads=1)
    assert found.flops_per_s is not None and found.flops_per_s > 0
    assert found.source == "measured:cpu matmul fp32 threads=1"
