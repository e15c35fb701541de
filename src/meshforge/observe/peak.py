"""Peak FLOP/s of the device a run trains on, the denominator of MFU.

GPUs: the one GPU table (``meshforge.plan.core.gpus``, shared with the planner) of
dense (no sparsity) figures from NVIDIA's datasheets, matched by the full CUDA
device name. A GPU that is not in the table gets ``None`` and source
``"unknown"``: never another GPU's figure, so MFU is reported as "n/a" rather
than as a confident wrong number.

CPUs: no datasheet applies, so the peak is a measured square-matmul rate for
the run's dtype and torch thread count, cached per machine in
``$MESHFORGE_CACHE/peak_flops.json`` (default ``~/.cache/meshforge/``). The
matmuls are timed in the three operand layouts a linear layer's training runs
(forward x·Wᵀ, backward dY·W and dYᵀ·X) and the peak is the best of them: one
layout alone can fall to a slow kernel (bf16 and fp16 ``a @ b`` with both operands
row-major run ~10x below ``a @ bᵀ`` on CPUs without native bf16 units, which
made a peak timed that way alone ~10x too low and MFU meaningless).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from meshforge.fileio import atomic_writer, open_lock_file
from meshforge.plan.core.gpus import match_cuda_name


@dataclass
class PeakFlops:
    flops_per_s: float | None
    source: str  # "table:<gpu> <dtype> dense", "measured:...", "cached:...", or "unknown"
    device_name: str


_DTYPE_ALIASES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "tf32": "tf32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
}
_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _canonical_dtype(dtype: str) -> str:
    try:
        return _DTYPE_ALIASES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected fp32, tf32, bf16 or fp16") from None


def gpu_peak_flops(name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of the GPU named ``name`` for ``dtype``, or None if unknown.

    ``dtype`` is fp32 (CUDA cores), tf32, bf16 or fp16 (tensor cores). None also
    when the GPU has no such unit (bf16 on a V100)."""
    key = _canonical_dtype(dtype)
    gpu = match_cuda_name(name)
    if gpu is None:
        return None
    tflops = gpu.peak_tflops(key)
    return None if tflops is None else float(tflops) * 1e12


def cpu_model_name() -> str:
    """The CPU model from /proc/cpuinfo, or what ``platform`` knows elsewhere."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown-cpu"


def _cache_path() -> Path:
    root = os.environ.get("MESHFORGE_CACHE") or str(Path.home() / ".cache" / "meshforge")
    return Path(root) / "peak_flops.json"


# the operand layouts timed (see the module docstring): "nt" is a @ bᵀ
LAYOUTS = ("nt", "nn", "tn")
# in each cache entry: one measured otherwise (before, the "nn" layout alone) is not
# reused but measured again
METHOD = "layouts=" + ",".join(LAYOUTS)


def _cache_key(dtype: str, threads: int) -> str:
    return f"{cpu_model_name()}|torch={torch.__version__}|{dtype}|threads={threads}"


def _read_cache(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # missing or unreadable: measure again
    return data if isinstance(data, dict) else {}


def _write_cache_atomically(path: Path, data: dict[str, dict]) -> None:
    # readers see the old file or the new one, never half
    with atomic_writer(path, "w", fsync=True) as f:
        json.dump(data, f, indent=1, sort_keys=True)


@contextlib.contextmanager
def _cache_lock(path: Path) -> Iterator[None]:
    # Ranks on one machine start together: the first measures, the others wait
    # and read its figure instead of measuring on cores that are already busy.
    lock = open_lock_file(path.with_name(path.name + ".lock"))
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    finally:
        os.close(lock)


@contextlib.contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _time_matmul(a: torch.Tensor, b: torch.Tensor) -> float:
    start = time.perf_counter()
    torch.mm(a, b)
    return time.perf_counter() - start


def _operands(a: torch.Tensor, b: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`a`, `b` as the matmul of `layout` takes them: "nt" a @ bᵀ (a linear layer's
    forward, its weight stored [out, in]), "nn" a @ b (the gradient of its input),
    "tn" aᵀ @ b (the gradient of its weight). Views: no copy is timed."""
    return (a.t() if layout == "tn" else a), (b.t() if layout == "nt" else b)


def _measure_matmul_rates(
    dtype: str, threads: int, budget_s: float = 0.3
) -> tuple[dict[str, float], int]:
    """The best rate of n x n matmuls in `dtype` (2·n³ FLOPs each) in each operand
    layout of LAYOUTS; n grows until the forward's layout takes ~30 ms."""
    torch_dtype = _TORCH_DTYPES["fp32" if dtype == "tf32" else dtype]
    with _torch_threads(threads), torch.no_grad():
        n, elapsed = 128, 0.0
        while True:
            a = torch.randn(n, n).to(torch_dtype)
            b = torch.randn(n, n).to(torch_dtype)
            x, y = _operands(a, b, LAYOUTS[0])
            torch.mm(x, y)  # warm-up: thread pool start, kernel selection
            # the best of three: one matmul stalled by another process (a shared
            # machine) must not stop the growth at a size too small to reach the peak
            elapsed = min(_time_matmul(x, y) for _ in range(3))
            if elapsed >= 0.01 or n >= 4096:
                break
            # Aim at ~30 ms per matmul (time grows as n³), at most 4x per step.
            grow = min(4.0, (0.03 / max(elapsed, 1e-6)) ** (1 / 3))
            n = min(4096, max(n + 64, int(n * grow) // 64 * 64))
        rates = {}
        for layout in LAYOUTS:
            x, y = _operands(a, b, layout)
            first = _time_matmul(x, y)  # warm-up, and how long one takes
            share = budget_s / len(LAYOUTS)
            repeats = max(3, min(50, int(share / max(first, elapsed, 1e-6))))
            rates[layout] = 2.0 * n**3 / min(_time_matmul(x, y) for _ in range(repeats))
    return rates, n


def _measure_matmul_rate(dtype: str, threads: int, budget_s: float = 0.3) -> tuple[float, int]:
    """The peak: the best rate over the operand layouts, and the size measured."""
    rates, n = _measure_matmul_rates(dtype, threads, budget_s)
    return max(rates.values()), n


def measure_cpu_matmul_flops(
    dtype: str, threads: int | None = None, use_cache: bool = True
) -> float:
    """Measured peak matmul FLOP/s of this CPU for ``dtype`` with ``threads`` torch threads.

    Cached per (cpu model, torch version, dtype, threads); a second call on the
    same machine reads the cache instead of measuring."""
    flops, _ = _cpu_peak(_canonical_dtype(dtype), threads or torch.get_num_threads(), use_cache)
    return flops


def _cpu_peak(dtype: str, threads: int, use_cache: bool) -> tuple[float, bool]:
    """(FLOP/s, whether it came from the cache).

    Never below one thread's peak: more threads are not slower at a matmul, and a
    figure below it was measured while other processes held the cores (a thread pool
    oversubscribed on a shared machine stalls at every barrier: 100x slower rates
    were seen), which would make every MFU of this machine absurd."""
    flops, cached = _cpu_peak_one(dtype, threads, use_cache)
    if threads > 1:
        one, _ = _cpu_peak_one(dtype, 1, use_cache)
        flops = max(flops, one)
    return flops, cached


def _cpu_peak_one(dtype: str, threads: int, use_cache: bool) -> tuple[float, bool]:
    if use_cache:
        try:
            return _cpu_peak_cached(dtype, threads)
        except OSError:
            pass  # no writable cache directory: a figure uncached beats none
    return _measure_matmul_rate(dtype, threads)[0], False


def _cpu_peak_cached(dtype: str, threads: int) -> tuple[float, bool]:
    path = _cache_path()
    key = _cache_key(dtype, threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _cache_lock(path):
        entry = _read_cache(path).get(key)
        if isinstance(entry, dict) and entry.get("method") == METHOD:
            cached = entry.get("flops_per_s")
            if isinstance(cached, int | float) and math.isfinite(cached) and cached > 0:
                return float(cached), True
        rates, n = _measure_matmul_rates(dtype, threads)
        flops = max(rates.values())
        data = _read_cache(path)
        data[key] = {
            "flops_per_s": flops,
            "flops_per_s_by_layout": rates,  # the slowest says what training may meet
            "method": METHOD,
            "matrix_size": n,
            "measured_unix_s": time.time(),
        }
        _write_cache_atomically(path, data)
    return flops, False


def _cuda_matmul_dtype(dtype: str) -> str:
    # fp32 matmuls run on tensor cores as tf32 only when PyTorch is told to.
    if dtype == "fp32" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return dtype


def detect_peak_flops(device: torch.device, dtype: str, threads: int | None = None) -> PeakFlops:
    """Peak FLOP/s for MFU on ``device`` at ``dtype`` (one process, ``threads`` threads on CPU)."""
    key = _canonical_dtype(dtype)
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        matmul_dtype = _cuda_matmul_dtype(key)
        gpu = match_cuda_name(name)
        flops = gpu_peak_flops(name, matmul_dtype)
        if gpu is None or flops is None:
            return PeakFlops(None, "unknown", name)
        return PeakFlops(flops, f"table:{gpu.label} {matmul_dtype} dense", name)
    if device.type == "cpu":
        n_threads = threads or torch.get_num_threads()
        flops, cached = _cpu_peak(key, n_threads, use_cache=True)
        origin = "cached" if cached else "measured"
        return PeakFlops(flops, f"{origin}:cpu matmul {key} threads={n_threads}", cpu_model_name())
    return PeakFlops(None, "unknown", str(device))


def mfu(achieved_flops_per_s: float | None, peak: PeakFlops) -> float | None:
    """Model FLOPs utilisation = achieved model FLOP/s ÷ peak FLOP/s (REFERENCES.md).

    None when either side is unknown; not clamped, so a value above 1 shows a
    wrong peak or FLOP count instead of hiding it."""
    if achieved_flops_per_s is None or peak.flops_per_s is None or peak.flops_per_s <= 0:
        return None
    if not math.isfinite(achieved_flops_per_s):
        return None
    return achieved_flops_per_s / peak.flops_per_s
