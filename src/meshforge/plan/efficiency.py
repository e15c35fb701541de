"""The achievable fraction of peak FLOP/s: one stated curve, not a per-row constant.

A GPU reaches its datasheet peak only on large matrix multiplies. We model the
time of a unit of work W (FLOPs) as

    t(W) = W / (f_max · peak) + t0            (a fixed cost t0 per unit of work)

so the achieved fraction of peak is

    f(W) = W / (peak · t(W)) = f_max · W / (W + W_half),   W_half = f_max · peak · t0.

f_max is what the largest matmuls reach once the memory-bound kernels around them
(LayerNorm, GELU, dropout, softmax, bias adds) are paid for; t0 stands for launch
latency, wave quantisation and the per-kernel fixed costs that weigh more on small
matrices. W is the per-GPU matmul size: the FLOPs of one micro-batch through the
MLP's first projection on one tensor-parallel rank, 2·b·s·h·(r·h/t).

The two constants were fitted once by least squares (in log MFU) to the four
Korthikanti et al. (2205.05198) A100 runs in REFERENCES.md, through the whole time
model (tensor-parallel all-reduces, pipeline bubble and point-to-point included):
see `meshforge.plan.calibration` and docs/planner.md for the resulting table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ComputeCurve:
    f_max: float  # fraction of peak that the largest matmuls reach
    t0_s: float  # fixed cost per unit of work (seconds)

    def fraction(self, work_flops: float, peak_flops_per_s: float) -> float:
        """f(W) = f_max·W / (W + f_max·peak·t0)."""
        if work_flops <= 0:
            return self.f_max
        w_half = self.f_max * peak_flops_per_s * self.t0_s
        return self.f_max * work_flops / (work_flops + w_half)

    def seconds(self, flops: float, work_flops: float, peak_flops_per_s: float) -> float:
        """Time of `flops` of work made of units of size `work_flops`."""
        return flops / (peak_flops_per_s * self.fraction(work_flops, peak_flops_per_s))


# Fitted to Korthikanti's table (A100 80GB, bf16, Megatron-LM); see module docstring.
A100_CURVE = ComputeCurve(f_max=0.75, t0_s=130e-6)


def curve_for(gpu: str) -> tuple[ComputeCurve, str]:
    """The achievable-fraction curve for a catalogue GPU (its key, e.g. "h100"), and
    which calibration it is (the GPU whose published runs it was fitted on)."""
    return A100_CURVE, "a100"


def matmul_unit_flops(micro_batch: int, seq: int, hidden: int, mlp_ratio: float, tp: int) -> float:
    """W = 2·b·s·h·(r·h/t): the per-GPU MLP up-projection of one micro-batch."""
    return 2.0 * micro_batch * seq * hidden * (mlp_ratio * hidden / tp)
