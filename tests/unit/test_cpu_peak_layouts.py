"""The CPU peak MFU divides by: timed in the run's dtype in each operand layout a
linear layer's training runs, the best of them (bf16 `a @ b` alone falls to a slow
kernel on CPUs without bf16 units), and a cached figure measured otherwise is measured
again. Logic only: the timer is faked, no rate is asserted of this machine."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from meshforge.observe import peak
from meshforge.train.calibration import _stale_cpu_peak, peak_matmul_flops

# seconds per matmul in each layout: "nn" slow, as bf16 a @ b is on an AVX2 CPU
SECONDS = {"nn": 0.2, "nt": 0.02, "tn": 0.01}


def _layout(x: torch.Tensor, y: torch.Tensor) -> str:
    return ("t" if not x.is_contiguous() else "n") + ("t" if not y.is_contiguous() else "n")


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.dtype, str]]:
    calls: list[tuple[torch.dtype, str]] = []

    def fake(x: torch.Tensor, y: torch.Tensor) -> float:
        calls.append((x.dtype, _layout(x, y)))
        assert x.dtype == y.dtype
        return SECONDS[_layout(x, y)]

    monkeypatch.setattr(peak, "_time_matmul", fake)
    return calls


def test_operands_take_each_layout() -> None:
    a, b = torch.zeros(4, 4), torch.zeros(4, 4)
    assert {layout: _layout(*peak._operands(a, b, layout)) for layout in peak.LAYOUTS} == {
        "nt": "nt", "nn": "nn", "tn": "tn"
    }  # fmt: skip


def test_the_peak_is_the_best_layout_in_the_runs_dtype(timed) -> None:
    rates, n = peak._measure_matmul_rates("bf16", threads=1)
    assert set(rates) == set(peak.LAYOUTS)
    assert {dtype for dtype, _ in timed} == {torch.bfloat16}  # every matmul in bf16
    assert {layout for _, layout in timed} == set(peak.LAYOUTS)
    flops = 2.0 * n**3
    assert rates == {k: pytest.approx(flops / s) for k, s in SECONDS.items()}
    best, _ = peak._measure_matmul_rate("bf16", threads=1)
    assert best == pytest.approx(flops / SECONDS["tn"])  # not the slow "nn" alone


def test_fp16_and_fp32_are_timed_in_their_own_dtype(timed) -> None:
    peak._measure_matmul_rates("fp16", threads=1)
    peak._measure_matmul_rates("tf32", threads=1)
    assert {dtype for dtype, _ in timed} == {torch.float16, torch.float32}


def test_a_cached_peak_measured_otherwise_is_measured_again(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHFORGE_CACHE", str(tmp_path))
    measured: list[str] = []

    def rates(dtype: str, threads: int) -> tuple[dict[str, float], int]:
        measured.append(dtype)
        return {"nt": 5.0e9, "nn": 1.0e9, "tn": 9.0e9}, 512

    monkeypatch.setattr(peak, "_measure_matmul_rates", rates)
    old = peak._cache_key("bf16", 1)
    (tmp_path / "peak_flops.json").write_text(json.dumps({old: {"flops_per_s": 7.4e8}}))
    assert peak.measure_cpu_matmul_flops("bf16", threads=1) == 9.0e9  # not 7.4e8
    assert peak.measure_cpu_matmul_flops("bf16", threads=1) == 9.0e9  # cached now
    assert peak.measure_cpu_matmul_flops("fp32", threads=1) == 9.0e9
    assert measured == ["bf16", "fp32"]  # one measurement per dtype
    entries = json.loads((tmp_path / "peak_flops.json").read_text())
    entry = entries[old]
    assert entry["method"] == peak.METHOD and entry["flops_per_s_by_layout"]["nn"] == 1.0e9
    assert sorted(k.split("|")[2] for k in entries) == ["bf16", "fp32"]
    _, source = peak_matmul_flops(torch.device("cpu"), "bf16", 1)
    assert source.endswith(peak.METHOD)


def test_a_cached_machine_profile_with_an_old_cpu_peak_is_stale() -> None:
    def m(device: str, source: str) -> SimpleNamespace:
        return SimpleNamespace(device_type=device, peak_source=source)

    assert _stale_cpu_peak(m("cpu", "cpu matmul bf16 threads=1"))
    assert not _stale_cpu_peak(m("cpu", f"cpu matmul bf16 threads=1 {peak.METHOD}"))
    assert not _stale_cpu_peak(m("cuda", "table:H100 bf16"))


def test_a_peak_measured_below_one_threads_is_raised_to_it(tmp_path, monkeypatch) -> None:
    """Two threads timed while other processes held the cores (the rate 100x low):
    the peak is one thread's, never the absurd figure, cached or measured."""
    monkeypatch.setenv("MESHFORGE_CACHE", str(tmp_path))
    rates = {1: 9.0e10, 2: 2.0e8}  # FLOP/s of one and of two threads

    def fake(dtype: str, threads: int, budget_s: float = 0.3):
        return {layout: rates[threads] for layout in peak.LAYOUTS}, 128

    monkeypatch.setattr(peak, "_measure_matmul_rates", fake)
    assert peak.measure_cpu_matmul_flops("fp32", threads=2) == 9.0e10
    # the bad figure as measured stays in the cache; read back, it is raised again
    cached = json.loads((tmp_path / "peak_flops.json").read_text())
    assert cached[peak._cache_key("fp32", 2)]["flops_per_s"] == 2.0e8
    assert peak.measure_cpu_matmul_flops("fp32", threads=2) == 9.0e10
    rates[2] = 1.6e11  # a real speed-up with two threads is kept
    assert peak.measure_cpu_matmul_flops("fp32", threads=2, use_cache=False) == 1.6e11
