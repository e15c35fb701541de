"""The time model against independent published runs (plan/core/published.py): conversion,
fit, and leave-one-source-out error.

Each published row becomes the planner's inputs (GPTShape, Layout, Training, Cluster)
and its prediction is compared with the published figure in the source's own
convention: tokens/s per GPU as tokens/s per GPU; seconds per iteration as seconds;
TFLOP/s per GPU with the source's FLOP count (Narayanan et al. eq. 3 hardware FLOPs
with full recomputation; Megatron-Core's model FLOPs, 72·B·s·l·h²·(1 + s/6h + V/12lh)).
The error of a row is predicted throughput ÷ published throughput - 1.

Per GPU generation the fit has two constants (efficiency.ComputeCurve: f_max of the
matmul curve and the bandwidth fraction of the memory-bound kernels); t0 stays 0 and the
network at scale is comm.NETWORK_SCALING, both stated (efficiency.py, comm.py). They
minimise the sum of squared log errors by coordinate search (a few thousand
predictions: a second or two). Leave-one-source-out: for each source, fit on the other
sources and predict the held-out source's rows; a GPU generation with no rows left keeps
its shipped constants. H200 has no published training throughput we could use: it
keeps the H100's matmul constants (efficiency.py). A row whose GPU the catalogue does
not hold, as its source states (`PublishedRun.excluded`), is predicted both ways and
shown, but enters no fit and no bound.

Conversions a source needs, said once here:
* a micro-batch the source does not publish is the planner's choice: the fastest
  power of two dividing the per-rank batch whose memory fits the GPU (the planner's
  memory model, predict.evaluate; 1 where none fits), as `meshforge plan` picks one
  and as a benchmark table is tuned. Megatron-Core's 16B and 32B rows (no pipeline,
  4 sequences per rank) take 2 and 4: fewer micro-batches per step, so the gradient
  reduce-scatter overlaps more of a backward; the smaller ones tie at every size and
  keep 1; every row with a pipeline takes 1 (a larger one costs more bubble than it
  saves). Until 2026-12 this was Megatron's default, 1, for every row
  (docs/planner.md says what changed with it);
* torchtitan's selective activation checkpointing (the "op" policy: every other
  matmul and the pointwise kernels recomputed; the "layer" policy: every other block)
  recomputes about half a forward: it is predicted as the mean of `none` and `full`
  (the same device the trainer's `selective` uses, plan/jobs/job.py);
* Megatron-Core's --tp-comm-overlap (named in the row's notes) hides TP collectives
  under the GEMMs (timing.Framework.tp_comm_overlap), and its --overlap-param-gather
  the distributed optimizer's parameter gather under the next forward
  (param_gather_overlap);
* a row whose notes name DeepSpeed's pipeline engine (Megatron-DeepSpeed: BLOOM,
  MT-NLG) pays four pipeline transfers per micro-batch instead of Megatron's two
  (timing.Framework.pp_paired_transfers), and its gradient reduction after the step's
  last backward, not under it (Framework.dp_overlap);
* gradients are reduced in the dtype the row's `grad_reduce` names (fp32 unless the
  source's code reduces in 16 bits);
* Megatron-Core (the megatron-core2024 rows) reduces them in buckets of
  max(40M, 1M·dp) elements, its DistributedDataParallel default
  (megatron/core/distributed/distributed_data_parallel.py: "larger DP sizes need larger
  buckets to ensure collectives do not become latency-bound"); the other sources keep
  torch DDP's 25 MB;
* an interleaved schedule whose end chunks hold no transformer layer (Llama 3: 126
  layers over 16 x 8 chunks, the first only the embedding, the last only the head) is
  predicted with the most chunks per rank the planner's layouts take, layers // pp
  (7 for Llama 3: the same 7, 8, ..., 8, 7 layers per rank, a bubble 8/7 of the
  source's);
* a network the source does not state is InfiniBand HDR on A100 and NDR on H100 (one
  port per GPU); "roce-200g"/"roce-400g" are 200/400 Gb/s RoCE ports at 88% of line
  rate (the roce-100 preset's fraction).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from meshforge.errors import ConfigError
from meshforge.plan.core.comm import NETWORK_SCALING, NetworkScaling
from meshforge.plan.core.efficiency import CALIBRATIONS, ComputeCurve
from meshforge.plan.core.flops import GPTShape, megatron_full_recompute_flops, microbatch_flops
from meshforge.plan.core.hardware import Cluster, gpu_spec, link_spec
from meshforge.plan.core.layout import Layout, Training
from meshforge.plan.core.predict import evaluate
from meshforge.plan.core.published import PUBLISHED_RUNS, PublishedRun
from meshforge.plan.core.published_moe import PUBLISHED_MOE_RUNS
from meshforge.plan.core.timing import Framework, step_time

BOUND = 0.20  # the goal: every held-out row within ±20% of its published throughput


def generation(gpu: str) -> str:
    """The calibration a catalogue GPU belongs to ("a100", "h100", "h200")."""
    return gpu.split("-")[0]


@dataclass(frozen=True)
class Inputs:
    shape: GPTShape
    layout: Layout
    trainings: tuple[Training, ...]  # predicted as the mean step time of these
    cluster: Cluster
    framework: Framework  # how the source's trainer runs it (timing.Framework)


def planner_inputs(run: PublishedRun, curve: ComputeCurve | None = None) -> Inputs:
    """The planner's view of a published run (module docstring for the conversions)."""
    shape = GPTShape(
        run.layers, run.hidden, run.heads, run.vocab, run.seq,
        tie_embeddings=run.tied_embeddings is not False, family=run.family,
        n_kv_heads=run.kv_heads, ffn_hidden=run.ffn_hidden, head_dim=run.head_dim,
        experts=run.experts, top_k=run.top_k, expert_ffn=run.expert_ffn,
        shared_experts=run.shared_experts, dense_layers=run.dense_layers,
    )  # fmt: skip
    virtual = min(run.virtual_stages, run.layers // run.pp)  # no layer-less chunks
    layout = Layout(dp=run.dp, tp=run.tp, pp=run.pp, zero=run.zero,
                    virtual_stages=virtual, sequence_parallel=run.sequence_parallel,
                    ep=run.ep, cp=run.cp, cp_method=run.cp_method)  # fmt: skip

    def trainings(b: int) -> tuple[Training, ...]:
        def training(recompute: str) -> Training:
            return Training(run.global_batch, b, run.precision, recompute, "adamw",
                            sdpa=_sdpa(run))  # fmt: skip

        if run.source == "torchtitan" and run.recompute == "selective":
            return (training("none"), training("full"))
        return (training(run.recompute),)

    device = gpu_spec(run.gpu)
    if curve is not None:
        device = replace(device, curve=curve)
    h100_class = generation(run.gpu) in ("h100", "h200")
    intra = link_spec("nvlink4" if h100_class else "nvlink3")
    net = run.network or ("ib-ndr" if h100_class else "ib-hdr")
    inter = link_spec(net)
    cluster = Cluster(device, run.n_gpus, run.gpus_per_node, intra, inter,
                      run.nics_per_node or run.gpus_per_node)  # fmt: skip
    grad_bytes = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}[run.grad_reduce]
    deepspeed_pipeline = "DeepSpeed's pipeline engine" in run.notes
    framework = Framework(
        tp_comm_overlap="--tp-comm-overlap" in run.notes,
        param_gather_overlap="--overlap-param-gather" in run.notes,
        grad_reduce_bytes=grad_bytes,
        pp_scatter_gather="scatter/gather optimization enabled" in run.notes,
        pp_paired_transfers=not deepspeed_pipeline,
        megatron_core_buckets=run.source.startswith("megatron-"),
        dp_overlap=not deepspeed_pipeline,
    )
    x = Inputs(shape, layout, trainings(run.micro_batch or 1), cluster, framework)
    if run.micro_batch is not None:
        return x
    # not published: the fastest micro-batch that fits (module docstring)
    per_rank = run.global_batch // run.dp  # cp takes no share of the batch
    options = [replace(x, trainings=trainings(b))
               for b in (2**k for k in range(per_rank.bit_length()))
               if per_rank % b == 0 and _fits(replace(x, trainings=trainings(b)))]  # fmt: skip
    return min(options or [x], key=lambda o: (_step_s(o, NETWORK_SCALING),
                                              o.trainings[0].micro_batch))  # fmt: skip


def _fits(x: Inputs) -> bool:
    """Whether every training of `x` is a valid layout (a pipeline needs at least pp
    micro-batches) that fits its GPU by the planner's memory model."""
    try:
        return all(evaluate(x.shape, x.layout, t, x.cluster).memory.fits for t in x.trainings)
    except ConfigError:
        return False


def _step_s(x: Inputs, scaling: NetworkScaling) -> float:
    """The planner's seconds per step for `x`: the mean over its trainings."""
    times = [
        step_time(x.shape, x.layout, t, x.cluster, scaling, x.framework).step_s
        for t in x.trainings
    ]  # fmt: skip
    return sum(times) / len(times)


def supported(run: PublishedRun) -> str | None:
    """Why the planner cannot represent `run`, or None."""
    if run.ep > 1 and (run.dp * run.cp) % run.ep:
        return (f"experts folded over tp x dp (ep {run.ep} does not divide dp {run.dp}): the "
                "planner's ep is a divisor of dp")  # fmt: skip
    return None


def fitted(run: PublishedRun) -> bool:
    """Whether `run` enters the fit and the ±20% bound: the planner represents it, on
    hardware of its catalogue (an excluded row is still predicted and shown)."""
    return supported(run) is None and run.excluded is None and run.cp == 1


# the long-context (cp > 1) rows enter no fit: they are checked held out, in their own
# table (plan/core/published_cp.py, `cp_validation_table`)
CP_HELD_OUT = "context parallelism: held out of the fit, in the cp table (Context parallelism)"


def _unsupported(run: PublishedRun) -> str | None:
    """Why the dense table does not predict `run`: not representable, or a cp row."""
    return supported(run) or (CP_HELD_OUT if run.cp > 1 else None)


def _sdpa(run: PublishedRun) -> bool:
    """Megatron-LM of 2021-22 ran its fused softmax (eager attention); the later
    sources (Megatron-Core 2024, llm-foundry, torchtitan) flash attention."""
    return run.source not in ("narayanan2021", "korthikanti2022")


@functools.cache
def _inputs(run: PublishedRun) -> Inputs:
    return planner_inputs(run)


def predicted_step_s(
    run: PublishedRun, curve: ComputeCurve | None = None, scaling: NetworkScaling = NETWORK_SCALING
) -> float:
    """The planner's seconds per step for `run` (with `curve` instead of the GPU's)."""
    x = _inputs(run)
    if curve is not None:
        x = replace(x, cluster=replace(x.cluster, device=replace(x.cluster.device, curve=curve)))
    return _step_s(x, scaling)


def predicted_value(run: PublishedRun, step_s: float) -> float:
    """The prediction in the published metric's own convention."""
    tokens = run.global_batch * run.seq
    gpus = run.n_gpus
    if run.metric == "iteration_s":
        return step_s
    if run.metric == "tokens_per_s":
        return tokens / step_s
    if run.metric == "tokens_per_s_per_gpu":
        return tokens / step_s / gpus
    if run.metric == "tflops_per_gpu_hardware":  # Narayanan et al. eq. 3 (full recompute)
        flops = megatron_full_recompute_flops(run.global_batch, run.seq, run.layers,
                                              run.hidden, run.vocab)  # fmt: skip
        return flops / step_s / gpus / 1e12
    shape = planner_inputs(run).shape
    model = run.global_batch * microbatch_flops(shape, 1).model(run.layers)
    rate = model / step_s / gpus
    if run.metric == "tflops_per_gpu_model":
        return rate / 1e12
    return rate / gpu_spec(run.gpu).peak(run.precision)  # mfu


def throughput_error(run: PublishedRun, predicted: float) -> float:
    """Predicted throughput ÷ published throughput - 1 (a time is inverted)."""
    if run.metric == "iteration_s":
        return run.value / predicted - 1.0
    return predicted / run.value - 1.0


# -- the fit ------------------------------------------------------------------------------

Constants = tuple[dict[str, ComputeCurve], NetworkScaling]


def _loss(runs, curves: dict[str, ComputeCurve], scaling: NetworkScaling) -> float:
    total = 0.0
    for run in runs:
        pred = predicted_value(run, predicted_step_s(run, curves[generation(run.gpu)], scaling))
        total += math.log(1.0 + throughput_error(run, pred)) ** 2
    return total


def _refine(loss, point: list[float], steps: list[float], bounds, rounds: int = 5):
    """Coordinate search: each constant tried at ±step within its bounds; the steps
    halve each round."""
    best = loss(point)
    for _ in range(rounds):
        improved = True
        while improved:
            improved = False
            for i, step in enumerate(steps):
                for sign in (-1.0, 1.0):
                    trial = list(point)
                    trial[i] = min(bounds[i][1], max(bounds[i][0], trial[i] + sign * step))
                    value = loss(trial)
                    if value < best - 1e-12:
                        best, point, improved = value, trial, True
        steps = [s / 2 for s in steps]
    return point, best


# where every fit starts (no data in it): the curve of an unknown GPU, no degradation.
# t0 is not fitted: every published run's matmuls are large (the MLP unit W of the
# smallest, MPT-1B on A100 40GB, is 7e11 FLOPs, ~3 ms), where a fixed cost of tens of µs
# is below what the published figures resolve; the calibrations keep t0 = 0 (a measured
# profile fits its own, plan/core/profile.py).
START_CURVE = ComputeCurve(0.7, 0.0, 0.7, scope="matmul")
# f_max, bandwidth fraction: physical ranges (a fraction of a peak is <= 1)
BOUNDS = ((0.3, 1.0), (0.2, 1.0))
STEPS = (0.08, 0.16)


def fit(runs: tuple[PublishedRun, ...]) -> Constants:
    """Least squares in log throughput error (module docstring): per generation
    (f_max, bandwidth fraction) from START_CURVE. The network at scale is the stated
    comm.NETWORK_SCALING, not fitted. A generation without rows keeps its shipped curve."""
    curves = dict(CALIBRATIONS)
    scaling = NETWORK_SCALING
    for gen in ("a100", "h100"):
        rows = [r for r in runs if generation(r.gpu) == gen]
        if not rows:
            continue
        base = replace(START_CURVE, attention_fraction=CALIBRATIONS[gen].attention_fraction)

        def loss(p, rows=rows, base=base, gen=gen):
            curve = replace(base, f_max=p[0], bandwidth_fraction=p[1])
            return _loss(rows, {gen: curve}, scaling)

        p, _ = _refine(loss, [base.f_max, base.bandwidth_fraction], list(STEPS), BOUNDS)
        curves[gen] = replace(base, f_max=round(p[0], 3), bandwidth_fraction=round(p[1], 3))
    curves["h200"] = curves["h100"]
    return curves, scaling


# -- the table ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    run: PublishedRun
    predicted: float | None  # in the published metric (constants fitted on every source)
    error: float | None  # predicted / published throughput - 1
    held_out_predicted: float | None  # constants fitted without this row's source
    held_out_error: float | None
    unsupported: str | None  # why the planner cannot represent the run

    @property
    def excluded(self) -> str | None:
        """Why the row is outside the fit and the bound (hardware not in the catalogue)."""
        return self.run.excluded


def _predict(run: PublishedRun, constants: Constants) -> tuple[float, float]:
    curves, scaling = constants
    value = predicted_value(run, predicted_step_s(run, curves[generation(run.gpu)], scaling))
    return value, throughput_error(run, value)


def validation_table(runs: tuple[PublishedRun, ...] = PUBLISHED_RUNS) -> list[Row]:
    """Every published row: predicted with the constants fitted on all sources, and
    held out (fitted on the other sources only). Excluded rows (`PublishedRun.excluded`)
    are predicted both ways but enter no fit."""
    usable = tuple(r for r in runs if fitted(r))
    everything = fit(usable)
    held = {}
    for source in dict.fromkeys(r.source for r in runs if _unsupported(r) is None):
        constants = fit(tuple(r for r in usable if r.source != source))
        for run in runs:
            if run.source == source and _unsupported(run) is None:
                held[run] = _predict(run, constants)
    rows = []
    for run in runs:
        why = _unsupported(run)
        if why is not None:
            rows.append(Row(run, None, None, None, None, why))
            continue
        value, error = _predict(run, everything)
        rows.append(Row(run, value, error, *held[run], None))
    return rows


def moe_validation_table(runs: tuple[PublishedRun, ...] = PUBLISHED_MOE_RUNS) -> list[Row]:
    """The mixture-of-experts rows (plan/core/published_moe.py), predicted with the
    shipped constants, which are the fit on the dense sources only: every row is held
    out, so `predicted` and `held_out_predicted` are the same prediction."""
    return _unfitted_rows(runs, lambda run, value, error: (value, error))


def cp_validation_table(runs: tuple[PublishedRun, ...] | None = None) -> list[Row]:
    """The long-context rows (plan/core/published_cp.py), none of them fitted on:
    `predicted` with the shipped constants (the fit on the dense cp-1 runs), and
    `held_out_predicted` with the constants fitted without the row's source at all."""
    from meshforge.plan.core.published_cp import PUBLISHED_CP_RUNS

    runs = PUBLISHED_CP_RUNS if runs is None else runs
    usable = tuple(r for r in PUBLISHED_RUNS if fitted(r))
    return _unfitted_rows(
        runs,
        lambda run, value, error: _predict(
            run, fit(tuple(r for r in usable if r.source != run.source))
        ),
    )


def _unfitted_rows(
    runs: tuple[PublishedRun, ...],
    held_out: Callable[[PublishedRun, float, float], tuple[float | None, float | None]],
) -> list[Row]:
    """Rows of runs none of the fits used: predicted with the shipped constants;
    `held_out(run, value, error)` gives the held-out prediction and its error."""
    rows = []
    for run in runs:
        why = supported(run)
        if why is not None:
            rows.append(Row(run, None, None, None, None, why))
            continue
        value = predicted_value(run, predicted_step_s(run))
        error = throughput_error(run, value)
        rows.append(Row(run, value, error, *held_out(run, value, error), None))
    return rows


def cp_markdown(rows: list[Row]) -> str:
    """The docs' context-parallel table (docs/planner.md, "Context parallelism")."""
    out = _markdown_rows(rows)
    kept = [r for r in rows if r.error is not None]
    errors = ", ".join(
        f"{r.run.name} {100 * r.error:+.1f}% (source held out: {100 * r.held_out_error:+.1f}%)"
        for r in kept
    )
    return out + f"\n\nNot fitted on (the fit is the dense cp-1 runs): {errors}."


def moe_markdown(rows: list[Row]) -> str:
    """The docs' MoE table (docs/planner.md, "Mixture of experts")."""
    out = _markdown_rows(rows)
    kept = [r for r in rows if r.excluded is None and r.error is not None]
    errors = ", ".join(f"{r.run.name} {100 * r.error:+.1f}%" for r in kept)
    return out + f"\n\nHeld out (constants fitted on the dense runs only): {errors}."


def _layout(run: PublishedRun) -> str:
    parts = [f"tp{run.tp}", f"pp{run.pp}", f"dp{run.dp}"]
    if run.virtual_stages > 1:
        parts[1] += f"x{run.virtual_stages}"
    if run.cp > 1:
        parts.append(f"cp{run.cp}")
    if run.ep > 1:
        parts.append(f"ep{run.ep}")
    return " ".join(parts) + f" zero{run.zero} {run.recompute}"


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def markdown(rows: list[Row]) -> str:
    """The docs' tables (docs/planner.md): the fitted rows, then the excluded ones."""
    kept = [r for r in rows if r.excluded is None]
    out = _markdown_rows(kept)
    excluded = [r for r in rows if r.excluded is not None]
    if excluded:
        reasons = {r.excluded: r.run.source for r in reversed(excluded)}  # one per reason
        notes = "\n".join(f"* {source}: {why}." for why, source in reasons.items())
        out += ("\n\nExcluded from the fit and the bound (hardware the catalogue does not "
                "hold, as the source states it), predicted for the record:\n\n"
                + _markdown_rows(excluded) + "\n\n" + notes)  # fmt: skip
    return out + "\n\n" + summary(rows)


def summary(rows: list[Row]) -> str:
    """One line: how many fitted rows are within the ±20% goal held out, and which not."""
    kept = [r for r in rows if r.excluded is None and r.held_out_error is not None]
    errors = sorted(abs(r.held_out_error) for r in kept)
    median = errors[len(errors) // 2] if errors else 0.0
    within = sum(e <= 0.20 for e in errors)
    misses = ", ".join(
        f"{r.run.name} ({r.run.source}, {r.run.n_gpus} {r.run.gpu}) {100 * r.held_out_error:+.1f}%"
        for r in kept
        if abs(r.held_out_error) > 0.20
    )
    line = (
        f"Held out: {within} of {len(kept)} predicted rows within ±20% of the published "
        f"figure (median |error| {100 * median:.1f}%, {len({r.run.source for r in kept})} "
        "sources)"
    )
    return line + (f"; beyond ±20%: {misses}." if misses else ".")


def _micro_batch(run: PublishedRun) -> str:
    """The micro-batch a row is predicted with; "(chosen)" where the source does not
    publish one and the planner chose it (module docstring)."""
    if run.micro_batch is not None:
        return str(run.micro_batch)
    if _unsupported(run) is not None and not (run.cp > 1 and supported(run) is None):
        return "–"
    return f"{_inputs(run).trainings[0].micro_batch} (chosen)"


def _markdown_rows(rows: list[Row]) -> str:
    lines = [
        "| row | source | GPU | GPUs | layout | micro-batch | metric | published | predicted "
        "| error | held-out predicted | held-out error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        run = r.run
        if r.unsupported:
            rest = f"– | – | – | – ({r.unsupported}) |"
        else:
            rest = (f"{_number(r.predicted)} | {r.error:+.1%} | {_number(r.held_out_predicted)}"
                    f" | {r.held_out_error:+.1%} |")  # fmt: skip
        lines.append(
            f"| {run.name} | {run.source} | {run.gpu} | {run.n_gpus} | {_layout(run)} | "
            f"{_micro_batch(run)} | {run.metric} | {_number(run.value)} | {rest}"
        )
    return "\n".join(lines)


def constants_markdown(constants: Constants) -> str:
    curves, scaling = constants
    lines = ["| calibration | f_max | t0 | bandwidth fraction | attention fraction |",
             "|---|---|---|---|---|"]  # fmt: skip
    for gen in ("a100", "h100", "h200"):
        c = curves[gen]
        lines.append(f"| {gen} | {c.f_max:.3f} | {c.t0_s * 1e6:.1f} µs | "
                     f"{c.bandwidth_fraction:.3f} | {c.attention_fraction:.2f} |")  # fmt: skip
    lines.append(f"\nNetwork at scale: κ = {scaling.kappa:.4f}.")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m meshforge.plan.core.validation [--markdown]
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m meshforge.plan.core.validation",
        description="The planner against published training runs (plan/core/published.py): "
        "the fitted constants, each row's error, and its error when its source is held "
        "out of the fit (docs/planner.md has the same tables).",
    )
    ap.add_argument("--markdown", action="store_true", help="the constants too, as in the docs")
    ap.add_argument("--moe", action="store_true", help="the mixture-of-experts rows only")
    ap.add_argument("--cp", action="store_true", help="the context-parallel rows only")
    args = ap.parse_args()
    try:
        if args.cp:
            print(cp_markdown(cp_validation_table()))
            raise SystemExit(0)
        if args.moe:
            print(moe_markdown(moe_validation_table()))
            raise SystemExit(0)
        table = validation_table()
        if args.markdown:
            usable = tuple(r for r in PUBLISHED_RUNS if fitted(r))
            print(constants_markdown(fit(usable)) + "\n\n" + markdown(table))
        else:
            print(markdown(table))
    except KeyboardInterrupt:
        import sys

        print("meshforge: interrupted (Ctrl-C)", file=sys.stderr)
        raise SystemExit(130) from None
