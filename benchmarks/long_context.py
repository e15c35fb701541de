"""Context parallelism at long sequences: meshforge's cp 2 against cp 1 at world 2, per
sequence length and K/V method, beside the planner's prediction of each step.

For each sequence length (--seqs, default 512,1024,2048,4096) one torchrun of two ranks
(gloo on 127.0.0.1, fp32, the tests' tiny Llama: d_model 32, 2 layers, 4 heads, 2
key/value heads, SwiGLU 64, vocabulary 256; --model gpt for the tiny GPT) builds in
the same processes, through `Engine.build` and its step (driven as
tests/integration/test_context_parallel.py's train_cp drives it):

    cp1              parallel.dp 2: each rank trains whole sequences (global batch 2,
                     one micro-batch of one sequence per rank)
    cp2 M            parallel.cp 2, cp_method M (each of --methods): each rank trains
                     half of every sequence (the same global batch: two micro-batches
                     of one sequence, each split over the two ranks)
    cp2 M local      the same cp2 engine with its attention's collective replaced by a
                     communication-free stand-in of the same shapes (allgather:
                     `gather` concatenates cp local copies of K/V instead of
                     all-gathering them; its backward then sums the copies' gradients
                     locally instead of reduce-scattering them; alltoall: `exchange`
                     keeps this rank's blocks where the all-to-all would trade them).
                     Same compute, no K/V exchange: the difference of the two is the
                     exposed exchange.

A method the layout rules refuse is reported as `refused: <the rule's message>`; a
method without a stand-in has no exposed-exchange figure (n/a).

Measured per side: tokens/s (global batch x seq / step time), the activation bytes
one micro-batch saves for backward (the step's `activation_bytes`, the largest rank's),
and for the cp2 sides the exposed K/V exchange (ms per step). Predicted: what
report.json's `predicted` says for the same job (`train.calibration.calibrate` on this
machine under the job's layout, then `train.report.predicted_for`, which is
`plan.jobs.job.predict_for_job` with the CPU host model; the calibration times the
job's own step, its K/V exchange included): the step time and the activations; and,
without that timed step, the planner's own model of the step and of its K/V exchange
(`cp_comm_s`) on the measured profile.

How it is timed: the sides of a sequence length live in the same two processes; each
is warmed up, then the sides take turns, --block steps each, the order rotating every
round, so the machine's drift (a shared host) touches all sides of a round alike. Each
figure is the median over rounds of the round's own figure (a ratio, or the difference
of two blocks run seconds apart).

    python benchmarks/long_context.py [--seqs 512,1024,2048,4096]
        [--methods allgather,alltoall] [--rounds 6] [--block 2] [--model llama]
        [--smoke]

About 10 minutes at the defaults on a quiet 2-core machine (seq 4096 takes most of it);
--smoke runs seq 512 to 2048, 2 rounds of 1 step (about a minute), marked as such.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

from emit import emit
from paired_run import launch
from paired_run import worker as run_worker

HERE = Path(__file__).resolve().parent
GLOBAL_BATCH = 2
WORLD = 2
SEED = 0
WARMUP = 2  # steps of each side before the timed rounds (the first one measured)

MODELS = {
    "llama": {"name": "llama", "vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4,
              "n_kv_heads": 2, "ffn_hidden": 64, "tie_embeddings": False},
    "gpt": {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4,
            "tie_embeddings": False},
}  # fmt: skip


def job(args: argparse.Namespace, seq: int, cp: int, method: str = "allgather") -> dict:
    parallel = {"dp": 1, "cp": cp, "cp_method": method} if cp > 1 else {"dp": WORLD}
    return {
        "name": "long-context-bench",
        "model": {**MODELS[args.model], "seq_len": seq},
        "data": {"source": "builtin:python-stdlib"},
        "parallel": parallel,
        "precision": {"dtype": "fp32"},
        "train": {
            "steps": 1000,
            "global_batch": GLOBAL_BATCH,
            "micro_batch": 1,
            "grad_clip": 1.0,
            "warmup": 2,
            "eval_every": 0,
            "seed": SEED,
        },
        "checkpoint": {"every": 0},
        "observe": {"log_every": 10},
    }


# -- one torchrun of this file's --worker per sequence length --------------------------------
def run_seq(args: argparse.Namespace, seq: int) -> dict:
    forwarded = [f"--seq={seq}", f"--methods={args.methods}", f"--rounds={args.rounds}",
                 f"--block={args.block}", f"--model={args.model}"]  # fmt: skip
    env = dict(os.environ)
    if args.recalibrate:
        env["MESHFORGE_RECALIBRATE"] = "1"
    return launch(__file__, WORLD, forwarded, f"seq {seq}", timeout=3600, env=env)


# -- the worker (one rank of torchrun): every side in this process ---------------------------
def worker(args: argparse.Namespace) -> None:
    run_worker(paired, args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _local_stand_in(attend):
    """A communication-free attend of the same shapes as `attend` (module docstring),
    or None where this benchmark knows no stand-in for its method."""
    import torch

    from meshforge.parallel.context_parallel import AllGatherAttend, AllToAllAttend

    if isinstance(attend, AllToAllAttend):

        class LocalExchange(AllToAllAttend):
            def exchange(self, t: torch.Tensor) -> torch.Tensor:
                return t.clone()  # (cp, ...) blocks kept: the same shapes, no traffic

        return LocalExchange(attend.group)
    if isinstance(attend, AllGatherAttend):
        size = attend.group.size()

        class LocalGather(type(attend)):  # type: ignore[misc]
            def gather(self, t: torch.Tensor) -> torch.Tensor:
                return torch.cat([t] * size, dim=0)

        return LocalGather(attend.group)
    return None


class Side:
    """meshforge's engine for one job, driven as the trainer drives its step (the
    step strategy, the optimizers' zero_grad; the loss reduced at a block's end)."""

    def __init__(self, cfg, tokens, local: bool = False) -> None:
        import torch
        import torch.distributed as dist

        from meshforge.train.engine import Engine

        self.cfg, self.tokens = cfg, tokens
        torch.manual_seed(cfg.train.seed)
        self.engine = Engine.build(cfg, dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
        self.n, self.result, self.activation_bytes = 0, None, None
        self.stand_in = "none"
        if local:
            replaced = 0
            for module in self.engine.parts.modules:
                for m in module.modules():
                    attend = getattr(m, "attend", None)
                    standin = _local_stand_in(attend) if attend is not None else None
                    if standin is not None:
                        m.attend, replaced = standin, replaced + 1
            self.stand_in = "replaced" if replaced else "missing"

    def step(self) -> None:
        from meshforge.data.loader import rank_micro_batches

        engine, t = self.engine, self.cfg.train
        micro_batches = rank_micro_batches(
            self.tokens, seq_len=self.cfg.model.seq_len, global_batch=t.global_batch,
            micro_batch=t.micro_batch, dp_rank=engine.dp_rank, dp_size=engine.dims.dp,
            seed=t.seed, step=self.n,
        )  # fmt: skip
        measure = self.n == 0
        self.result = engine.strategy.step(self.n, micro_batches, measure=measure)
        if measure:
            self.activation_bytes = self.result.activation_bytes
        engine.optimizers.zero_grad()
        self.n += 1

    def sync(self) -> None:
        assert self.result is not None
        self.engine.strategy.reduce_loss(self.result.loss_sum / self.engine.dims.microbatches)


def paired(args: argparse.Namespace) -> dict:
    """Build every side of this sequence length, predict the real ones as report.json
    would, warm each up, then time `rounds` rounds of `block` steps of each, the order
    rotating every round (the module docstring)."""
    import torch
    import torch.distributed as dist

    from meshforge.config import build_config
    from meshforge.data.corpus import load_tokens
    from meshforge.errors import ConfigError
    from meshforge.plan.jobs.job import predict_for_job
    from meshforge.train.calibration import calibrate
    from meshforge.train.report import predicted_for

    seq = args.seq
    tokens = load_tokens("builtin:python-stdlib", 0.05).train
    configs = {"cp1": build_config(job(args, seq, 1))}
    refused: dict[str, str] = {}
    for method in args.methods.split(","):
        try:
            cfg = build_config(job(args, seq, 2, method))
            cfg.dims(WORLD)
        except (ConfigError, ValueError) as exc:
            refused[f"cp2 {method}"] = " ".join(str(exc).split())
            continue
        configs[f"cp2 {method}"] = cfg
    sides: dict[str, Side] = {}
    predicted: dict[str, dict] = {}
    modelled: dict[str, dict] = {}
    profiles: dict[str, dict] = {}
    for name, cfg in configs.items():
        sides[name] = Side(cfg, tokens)
        measured = calibrate(cfg, sides[name].engine, torch.device("cpu"))
        predicted[name] = predicted_for(cfg, WORLD, measured) or {}
        if measured is not None and measured.host is not None:
            # the planner's own model on this machine: the host model without the
            # run's timed step (its compute of s/cp tokens, its K/V exchange)
            host = dataclasses.replace(measured.host, steps=None, wrapped=None,
                                       tensor_parallel=None)  # fmt: skip
            modelled[name] = predict_for_job(cfg, WORLD, measured.profile, host=host)
        details = measured.details if measured is not None else {}
        profiles[name] = {k: details.get(k) for k in ("cached", "load_average")}
        if name != "cp1":
            local = Side(cfg, tokens, local=True)
            if local.stand_in == "replaced":
                sides[f"{name} local"] = local
            else:
                del local
    names = list(sides)
    for side in sides.values():
        for _ in range(WARMUP):
            side.step()
        side.sync()
    seconds: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.block):
                sides[name].step()
            sides[name].sync()
            dist.barrier()
            seconds[name].append((time.perf_counter() - t0) / args.block)
    # the slowest rank's figures: a step ends with its slowest rank
    flat = [s for n in names for s in seconds[n]]
    flat += [float(sides[n].activation_bytes or 0) for n in names]
    buf = torch.tensor(flat, dtype=torch.float64)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    values = buf.tolist()
    k = 0
    for n in names:
        seconds[n] = values[k : k + args.rounds]
        k += args.rounds
    activation = {n: values[k + i] for i, n in enumerate(names)}
    keep = ("step_time_s", "activations_bytes", "time_breakdown_s", "warnings", "error")
    return {
        "seq": seq,
        "seconds": seconds,
        "activation_bytes": activation,
        "predicted": {n: {k: p.get(k) for k in keep if k in p} for n, p in predicted.items()},
        "modelled": {n: {k: p.get(k) for k in keep if k in p} for n, p in modelled.items()},
        "profiles": profiles,
        "refused": refused,
        "no_stand_in": [n for n in configs if n != "cp1" and f"{n} local" not in sides],
    }


# -- the driver -----------------------------------------------------------------------------
def _median_iqr(values: list[float]) -> tuple[float, float, float]:
    v = sorted(values)
    return statistics.median(v), v[len(v) // 4], v[(3 * len(v)) // 4]


def table(results: list[dict], tokens_per_step: dict[int, int]) -> list[str]:
    head = (f"{'seq':>5s} {'side':16s} {'tok/s':>8s} {'vs cp1':>7s} {'step ms':>8s} "
            f"{'pred ms':>8s} {'meas/pred':>9s} {'model ms':>8s} {'act MiB':>8s} {'vs cp1':>7s} "
            f"{'pred MiB':>8s} {'K/V exposed ms':>17s} {'model K/V':>9s}")  # fmt: skip
    out = [head, "-" * len(head)]
    mib = 2.0**20
    for res in results:
        seq, secs = res["seq"], res["seconds"]
        base = secs["cp1"]
        base_act = res["activation_bytes"]["cp1"]
        for name in [n for n in secs if not n.endswith(" local")]:
            step, *_ = _median_iqr(secs[name])
            vs = statistics.median(b / s for b, s in zip(base, secs[name], strict=True))
            pred = res["predicted"].get(name, {})
            pred_s = pred.get("step_time_s")
            pred_act = pred.get("activations_bytes")
            model = res["modelled"].get(name, {})
            model_s = model.get("step_time_s")
            cp_pred = (model.get("time_breakdown_s") or {}).get("cp_comm_s")
            act = res["activation_bytes"][name]
            if f"{name} local" in secs:
                diffs = [(s - lo) * 1e3 for s, lo in zip(secs[name], secs[f"{name} local"],
                                                          strict=True)]  # fmt: skip
                mid, q1, q3 = _median_iqr(diffs)
                exposed = f"{mid:5.1f} ({q1:.0f}..{q3:.0f})"
            elif name == "cp1":
                exposed = "-"
            else:
                exposed = "n/a"
            out.append(
                f"{seq:5d} {name:16s} {tokens_per_step[seq] / step:8.0f} {vs:7.3f} "
                f"{step * 1e3:8.1f} {_fmt(pred_s, 1e3, '8.1f')} "
                f"{_fmt(None if not pred_s else step / pred_s, 1, '9.2f')} "
                f"{_fmt(model_s, 1e3, '8.1f')} {act / mib:8.2f} "
                f"{act / base_act if base_act else float('nan'):7.3f} "
                f"{_fmt(pred_act, 1 / mib, '8.2f')} {exposed:>17s} "
                f"{_fmt(cp_pred if name != 'cp1' else None, 1e3, '9.1f')}"
            )
        for name, message in res["refused"].items():
            out.append(f"{seq:5d} {name:16s} refused: {message}")
    return out


def _fmt(value: float | None, scale: float, spec: str) -> str:
    width = int(spec.split(".")[0])
    return "-".rjust(width) if value is None else format(value * scale, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default=None, help="sequence lengths (default 512,1024,2048,4096)")
    ap.add_argument("--methods", default="allgather,alltoall", help="cp methods to try")
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds per seq")
    ap.add_argument("--block", type=int, default=2, help="steps per side per round")
    ap.add_argument("--model", choices=sorted(MODELS), default="llama")
    ap.add_argument(
        "--recalibrate",
        action="store_true",
        help="measure the machine again (not the cached profile)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a short check: 2 rounds of 1 step (seq 512-2048 unless --seqs); marked as such",
    )
    ap.add_argument("--out", type=Path, default=HERE / "results" / "long_context.txt")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.smoke:
        args.rounds, args.block = 2, 1
    args.seqs = args.seqs or ("512,1024,2048" if args.smoke else "512,1024,2048,4096")

    from meshforge.plan.jobs.auto import cpu_model_name

    seqs = [int(s) for s in args.seqs.split(",")]
    command = "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0]))] + sys.argv[1:])
    load = os.getloadavg()
    started = time.perf_counter()
    results = []
    for seq in seqs:
        t0 = time.perf_counter()
        results.append(run_seq(args, seq))
        print(f"seq {seq}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    lines = table(results, {s: GLOBAL_BATCH * s for s in seqs})
    profiles = [p for r in results for p in r["profiles"].values()]
    loads = [p["load_average"] for p in profiles if p.get("load_average") is not None]
    cached = sum(1 for p in profiles if p.get("cached"))
    no_stand_in = sorted({n for r in results for n in r["no_stand_in"]})
    m = MODELS[args.model]
    header = []
    if args.smoke:
        header.append("SMOKE RUN (--smoke: 2 rounds of 1 step per side, on a loaded machine): "
                      "a check that the benchmark runs, not a measurement")  # fmt: skip
    header += [
        f"machine: {cpu_model_name()}, {os.cpu_count()} cores, torch {version('torch')}; "
        f"load average before/after: {load[0]:.2f}/{os.getloadavg()[0]:.2f} "
        "(the machine is shared: other jobs' load shows in the measured times)",
        f"command: {command}",
        f"{args.model} "
        + " ".join(f"{k}={v}" for k, v in m.items() if k != "name")
        + f"; fp32, gloo on 127.0.0.1, world {WORLD}, global batch {GLOBAL_BATCH}, "
        "micro-batch 1; cp1 = dp 2 (whole sequences per rank), cp2 = dp 1 x cp 2",
        "",
    ]
    notes = [
        "",
        f"{args.rounds} rounds x {args.block} steps per side per seq, after {WARMUP} warm-up "
        f"steps each, sides alternating (order rotating each round); "
        f"{time.perf_counter() - started:.0f} s in all.",
        "tok/s: global batch x seq / median step time. vs cp1: the median over rounds of "
        "cp1's step time over the side's, in the same round (> 1: faster than cp1).",
        "act MiB: the activations one micro-batch saves for backward (the step's "
        "activation_bytes, the larger rank's); vs cp1: over cp1's.",
        "K/V exposed ms: per step, the median over rounds (IQR) of the cp2 step's time "
        "less the same cp2 step with its attention's collective replaced by a "
        "communication-free stand-in of the same shapes (allgather: concatenating local "
        "copies of K/V; the backward then sums them locally instead of reduce-scattering; "
        "alltoall: each all-to-all keeps this rank's blocks in place).",
        "pred ms: report.json's `predicted` step for the same job on this machine "
        "(train.calibration.calibrate under the job's layout, which times the job's own "
        "step with one and two layers, then train.report.predicted_for: "
        "plan.jobs.job.predict_for_job with the CPU host model); meas/pred: step ms over it; "
        "pred MiB: its activations.",
        "model ms: the same prediction without the run's timed step (the host model on the "
        "measured profile: the planner's compute of s/cp tokens, its traffic and its K/V "
        "exchange); model K/V: that exchange (cp_comm_s), against K/V exposed.",
        f"machine profiles: {len(profiles) - cached} measured, {cached} from meshforge's "
        f"calibration cache (--recalibrate measures again); load "
        f"average when measured {min(loads, default=0):.1f}-{max(loads, default=0):.1f}.",
    ]
    if no_stand_in:
        notes.append("no stand-in (K/V exposed n/a): " + ", ".join(no_stand_in))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    emit(header + lines + notes, args.out)
    print(f"written to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
