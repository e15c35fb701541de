"""How fast a device runs a transformer's work: one calibrated curve per GPU generation.

Two kinds of kernel make up a training step, and they are limited by different things:

* **matmuls** (the projections, the MLP, the logits) are compute-bound. A unit of work
  W (FLOPs) takes

      t(W) = W / (f_max · peak) + t0        (a fixed cost t0 per unit of work)

  so the achieved fraction of peak is f(W) = f_max · W / (W + W_half), with
  W_half = f_max · peak · t0. f_max is what the largest matmuls reach; t0 stands for
  launch latency, wave quantisation and the per-kernel fixed costs that weigh more on
  small matrices. W is the per-GPU matmul size: the FLOPs of one micro-batch through
  the MLP's first projection on one tensor-parallel rank, 2·b·s·h·(f/t).
* **memory-bound kernels** (norms, activations, softmax and dropout of eager attention,
  residual adds, rotary embeddings, the cross-entropy, the optimizer) take the bytes
  they move ÷ (bandwidth_fraction × the device's memory bandwidth); plan/core/work.py
  counts the bytes.

A *measured* machine (plan/core/profile.py) times a whole transformer layer and fits t0 so
that the curve gives that time for the layer's Megatron-convention FLOPs: its curve has
scope "all" (it already holds the memory-bound kernels, and no bytes are added). The
GPU calibrations have scope "matmul". Their f_max and bandwidth fraction are fitted by
least squares in log throughput to published runs on that GPU (plan/core/validation.py;
docs/planner.md has the table, with each source held out in turn).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ComputeCurve:
    f_max: float  # fraction of peak that the largest matmuls reach
    t0_s: float  # fixed cost per unit of work (seconds)
    # fraction of the datasheet memory bandwidth that memory-bound kernels reach
    bandwidth_fraction: float = 1.0
    # fused (flash) attention's forward+backward rate as a fraction of peak
    attention_fraction: float = 0.5
    # "all": the curve times every kernel (a measured machine); "matmul": only the
    # matmuls, the memory-bound kernels are timed from their bytes
    scope: str = "all"

    def fraction(self, work_flops: float, peak_flops_per_s: float) -> float:
        """f(W) = f_max·W / (W + f_max·peak·t0)."""
        if work_flops <= 0:
            return self.f_max
        w_half = self.f_max * peak_flops_per_s * self.t0_s
        return self.f_max * work_flops / (work_flops + w_half)

    def seconds(self, flops: float, work_flops: float, peak_flops_per_s: float) -> float:
        """Time of `flops` of work made of units of size `work_flops`."""
        return flops / (peak_flops_per_s * self.fraction(work_flops, peak_flops_per_s))


# FlashAttention-2's forward+backward rate, causal, head dim 128, s = 2k-8k, as a
# fraction of the dense bf16 peak (stated, not fitted): ~190 of 312 TFLOP/s on A100
# (Dao 2023, arXiv 2307.08691, Fig. 6) and ~335 of 989 on H100 (Dao 2023, Fig. 7;
# Shah et al. 2024, arXiv 2407.08608, Fig. 3: FlashAttention-2 on H100).
A100_ATTENTION_FRACTION = 0.6
H100_ATTENTION_FRACTION = 0.34

# -- the calibrations (fitted by plan/core/validation.py; a test re-runs each fit) -----------
#
# A100: Megatron-LM (Narayanan et al. 2021; Korthikanti et al. 2022), FSDP and LLM Foundry
# runs on A100 80GB. H100: runs on H100 SXM. H200 has the H100's SMs and tensor cores
# (the same GH100 die, the same 989 TFLOP/s dense bf16) and more, faster HBM (4.8 vs
# 3.35 TB/s): its matmul constants are the H100's, and its memory-bound kernels run
# faster through the datasheet bandwidth, at the H100's bandwidth fraction.
# t0 is not fitted (plan/core/validation.py): every published run's matmuls are large enough
# (W >= 1e11 FLOPs) that a fixed cost of tens of µs is below what the figures resolve,
# so the GPU calibrations keep t0 = 0; a measured profile fits its own. The H100's
# bandwidth fraction sits at its lower bound, 0.2: not a physical bandwidth, but what the
# fit needs for its small-h runs (MPT-1B/3B/7B on 512 GPUs, Megatron-Core 1.7B), which
# lose more per token than the counted memory-bound bytes explain at a physical
# fraction (docs/planner.md, "Limits").
A100_CURVE = ComputeCurve(0.66, 0.0, 0.85, A100_ATTENTION_FRACTION, "matmul")
H100_CURVE = ComputeCurve(0.645, 0.0, 0.2, H100_ATTENTION_FRACTION, "matmul")
H200_CURVE = H100_CURVE
# GPUs of no calibrated architecture: the A100 matmul constants with a lower f_max, a
# stated guess rather than a fit (nothing published to fit it to).
GENERIC_CURVE = ComputeCurve(0.6, 20e-6, 0.6, 0.3, "matmul")

CALIBRATIONS: dict[str, ComputeCurve] = {
    "a100": A100_CURVE,
    "h100": H100_CURVE,
    "h200": H200_CURVE,
}
# catalogue-key prefixes of each calibrated architecture (Ampere GA100, Hopper GH100)
ARCHITECTURES = {"a100": "a100", "a800": "a100", "h100": "h100", "h800": "h100",
                 "h200": "h200", "gh200": "h200"}  # fmt: skip


def curve_for(gpu: str) -> tuple[ComputeCurve, str]:
    """The curve for a catalogue GPU (its key, e.g. "h100-pcie"), and the name of its
    calibration: the GPU whose published runs it was fitted on, "h200 (from h100)" for
    H200, or "generic" for an architecture without published runs."""
    key = gpu.lower()
    for prefix in sorted(ARCHITECTURES, key=len, reverse=True):
        if key.startswith(prefix):
            name = ARCHITECTURES[prefix]
            label = "h200 (h100 matmuls, its own memory bandwidth)" if name == "h200" else name
            return CALIBRATIONS[name], label
    return GENERIC_CURVE, "generic (no published runs on this GPU model)"


# The smallest matmul unit (W, below) of the published runs behind the calibrations:
# below it a plan extrapolates (t0 is 0 for the fitted GPUs, so kernel launch and
# per-kernel costs that dominate tiny matmuls are not in the step time).
VALIDATED_MIN_UNIT_FLOPS = 1e11


def matmul_unit_flops(micro_batch: int, seq: int, hidden: int, mlp_ratio: float, tp: int) -> float:
    """W = 2·b·s·h·(r·h/t): the per-GPU MLP up-projection of one micro-batch."""
    return 2.0 * micro_batch * seq * hidden * (mlp_ratio * hidden / tp)
