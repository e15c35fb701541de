"""The published runs the time model is calibrated against, and the comparison.

Korthikanti et al. 2022 (arXiv 2205.05198, table in REFERENCES.md): Megatron-LM
GPT models on DGX A100 80GB nodes (Selene: NVLink 3 inside a node, eight
InfiniBand HDR ports per node), tensor parallel 8, sequence length 2048,
vocabulary 51200, bf16, selective recomputation with sequence parallelism, data
parallel 1. The paper does not list the micro-batch size; we take Megatron's
usual 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from meshforge.plan.efficiency import ComputeCurve
from meshforge.plan.flops import GPTShape
from meshforge.plan.hardware import Cluster, gpu_spec, link_spec
from meshforge.plan.layout import Layout, Training
from meshforge.plan.predict import Prediction, evaluate


@dataclass(frozen=True)
class PublishedRun:
    name: str
    heads: int
    hidden: int
    layers: int
    pp: int
    gpus: int
    global_batch: int
    iteration_s: float
    mfu: float
    hfu: float


KORTHIKANTI_2022 = (
    PublishedRun("22B", 64, 6144, 48, 1, 8, 4, 1.10, 0.415, 0.437),
    PublishedRun("175B", 96, 12288, 96, 8, 64, 64, 13.75, 0.514, 0.528),
    PublishedRun("530B", 128, 20480, 105, 35, 280, 280, 37.83, 0.560, 0.570),
    PublishedRun("1T", 160, 25600, 128, 64, 512, 512, 71.49, 0.563, 0.570),
)
TP, SEQ, VOCAB, MICRO_BATCH = 8, 2048, 51200, 1


def predict_published(run: PublishedRun, curve: ComputeCurve | None = None) -> Prediction:
    """The planner's prediction for one published run (optionally with another curve)."""
    shape = GPTShape(run.layers, run.hidden, run.heads, VOCAB, SEQ)
    device = gpu_spec("a100-80gb")
    if curve is not None:
        device = replace(device, curve=curve)
    cluster = Cluster(
        device=device,
        n_gpus=run.gpus,
        gpus_per_node=8,
        intra=link_spec("nvlink3"),
        inter=link_spec("ib-hdr"),
        nics_per_node=8,
    )
    layout = Layout(dp=run.gpus // (TP * run.pp), tp=TP, pp=run.pp, sequence_parallel=True)
    training = Training(run.global_batch, MICRO_BATCH, "bf16", "selective", sdpa=False)
    return evaluate(shape, layout, training, cluster)


def calibration_table() -> list[dict[str, float | str]]:
    """Predicted versus published MFU, HFU and iteration time for each run."""
    rows: list[dict[str, float | str]] = []
    for run in KORTHIKANTI_2022:
        pred = predict_published(run)
        assert pred.mfu is not None and pred.hfu is not None and pred.step_time_s is not None
        rows.append(
            {
                "model": run.name,
                "published_mfu": run.mfu,
                "predicted_mfu": pred.mfu,
                "mfu_ratio": pred.mfu / run.mfu,
                "published_hfu": run.hfu,
                "predicted_hfu": pred.hfu,
                "published_iteration_s": run.iteration_s,
                "predicted_iteration_s": pred.step_time_s,
                "fits": pred.fits,
            }
        )
    return rows


def _log_error(curve: ComputeCurve, runs: tuple[PublishedRun, ...] = KORTHIKANTI_2022) -> float:
    """Sum of squared log(predicted MFU / published MFU) over the runs."""
    total = 0.0
    for run in runs:
        mfu = predict_published(run, curve).mfu
        assert mfu is not None
        total += math.log(mfu / run.mfu) ** 2
    return total


def fit_compute_curve(runs: tuple[PublishedRun, ...] = KORTHIKANTI_2022) -> ComputeCurve:
    """Least squares in log MFU over a grid (f_max step 0.01, t0 step 10 µs).

    This is how efficiency.A100_CURVE was obtained from all four runs; a test
    re-runs it, and fitting on three runs to predict the fourth (leave-one-out) shows
    how far the curve carries beyond its own data."""
    grid = (
        ComputeCurve(f_max / 100, t0_us / 1e6)
        for f_max in range(50, 96)
        for t0_us in range(0, 401, 10)
    )
    return min(grid, key=lambda curve: _log_error(curve, runs))
