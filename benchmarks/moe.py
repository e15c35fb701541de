"""meshforge's mixture-of-experts training step against a plain torch loop, and the
MoE's tokens/s against a dense llama with the same active parameters.

1. The same small MoE llama (models/llama.py with models/moe.py's `MoE`), fp32, gloo
   on 127.0.0.1, meshforge (`Engine.build` and its AccumulatingStep, driven as
   tests/layouts.py's train_layout does: the step, not the trainer's logging around
   it) against a plain loop, for

     ep1   world 1, every expert on the one rank
     ep2   world 2, parallel.ep=2: half of each layer's experts per rank

   The plain loop (`PlainSide`) builds the same module and takes its own slice of
   each layer's stacked expert weights (plain tensors), routes with the module's own
   router math, dispatches and combines the tokens with the same
   `all_to_all_single_autograd` (variable splits), runs the same expert loop
   (`torch._grouped_mm` where it applies: CUDA bf16 only, so a loop here), reduces
   the other gradients with torch DDP (the expert weights ignored, their gradient
   divided by the data-parallel degree, as ExpertGradSync does with ep = world) and
   steps torch's AdamW (weight decay on matrices only, as meshforge). Both sides see
   the global batch split over the ranks, one micro-batch per rank, no clipping.
   Goal: meshforge/plain >= 0.97.

2. Beside it, world 1, both through meshforge: the MoE against a dense llama whose
   SwiGLU is top_k x expert_ffn (+ shared_experts x expert_ffn) wide, every other
   dimension the same, so both have the same active parameters per token: what the
   routing, the gather/scatter and the per-expert loop cost on top of the same
   arithmetic.

How it is timed. This machine's speed drifts by tens of percent from one minute to
the next (a shared host), more than the difference measured. So every side lives in
the same torchrun processes (one launch per layout and repetition): each is warmed
up, then the sides take turns, `--block` steps each, the order rotating every round,
and each round gives a ratio of two blocks run seconds apart.

    python benchmarks/moe.py [--reps 2] [--rounds 8] [--block 5] [--layouts ep1,ep2]
        [--experts 8] [--top-k 2] [--expert-ffn 128] [--d-model 128] [--layers 4]
        [--seq 128]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

from paired_run import launch
from paired_run import worker as run_worker

HERE = Path(__file__).resolve().parent
GLOBAL_BATCH = 16
SEED = 0
WARMUP = 5  # steps of each side before the timed rounds
LAYOUTS = {"ep1": 1, "ep2": 2}  # layout -> world size (= ep)


# -- the job ------------------------------------------------------------------------------
def model_section(args: argparse.Namespace, moe: bool) -> dict:
    m = {
        "name": "llama",
        "vocab_size": 256,
        "d_model": args.d_model,
        "n_layers": args.layers,
        "n_heads": 4,
        "n_kv_heads": 2,
        "seq_len": args.seq,
        "tie_embeddings": False,
    }
    if moe:
        m["ffn_hidden"] = args.top_k * args.expert_ffn  # unused: every layer is a MoE
        m["moe"] = {
            "experts": args.experts,
            "top_k": args.top_k,
            "expert_ffn": args.expert_ffn,
            "shared_experts": args.shared,
        }
    else:
        m["ffn_hidden"] = (args.top_k + args.shared) * args.expert_ffn  # the active width
    return m


def job(args: argparse.Namespace, ep: int, moe: bool) -> dict:
    return {
        "name": "moe-bench",
        "model": model_section(args, moe),
        "parallel": {"ep": ep} if ep > 1 else {},
        "train": {
            "steps": args.steps,
            "global_batch": GLOBAL_BATCH,
            "micro_batch": GLOBAL_BATCH // ep,
            "grad_clip": 0.0,
            "warmup": 5,
            "eval_every": 0,
            "seed": SEED,
        },
        "checkpoint": {"every": 0},
        "observe": {"log_every": 10},
    }


# -- one torchrun of this file's --worker per layout and repetition ----------------------------
def run_paired(args: argparse.Namespace, ep: int) -> dict:
    """One torchrun over `ep` ranks whose processes build every side and time them in
    alternating blocks of steps (the worker's `paired`)."""
    forwarded = [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("rounds", "block", "experts", "top_k", "expert_ffn", "shared", "d_model",
                  "layers", "seq")
    ]  # fmt: skip
    dense = ["--with-dense"] if ep == 1 and not args.no_dense else []
    return launch(__file__, ep, [*forwarded, *dense], f"ep{ep}", timeout=1800)


# -- the worker (one rank of torchrun): every side in this process ---------------------------
def worker(args: argparse.Namespace) -> None:
    run_worker(paired, args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def paired(args: argparse.Namespace) -> dict:
    """Build meshforge's engine and the plain loop (and, with --with-dense, meshforge's
    dense model) in this process, warm each up, then time `rounds` rounds of `block`
    steps of each, the order rotating every round. Per round: each side's tokens/s
    (its block's time, the slowest rank's, between barriers), and the ratios of the
    round; a round's sides run seconds apart, so a change in the machine's speed
    (other jobs, another VM on the host) touches both nearly alike."""
    import torch.distributed as dist

    sides = {"meshforge": MeshforgeSide(args, moe=True), "plain": PlainSide(args)}
    if args.with_dense:
        sides["dense"] = MeshforgeSide(args, moe=False)
    names = list(sides)
    for side in sides.values():  # warm-up: allocator, first-touch, gloo's buffers
        for _ in range(WARMUP):
            side.step()
    tokens = args.block * GLOBAL_BATCH * args.seq
    rates: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.block):
                sides[name].step()
            sides[name].sync()
            dist.barrier()
            rates[name].append(tokens / (time.perf_counter() - t0))
    out: dict = {"rates": rates}
    out["ratio"] = [m / p for m, p in zip(rates["meshforge"], rates["plain"], strict=True)]
    if "dense" in rates:
        out["moe_dense"] = [m / d for m, d in zip(rates["meshforge"], rates["dense"], strict=True)]
    return out


class PlainDispatch:
    """GroupedExperts.forward (the model's expert loop) behind a dispatch and a
    combine all-to-all; written directly on torch."""

    def __init__(self, compute, ep: int) -> None:
        self.compute, self.ep = compute, ep

    def __call__(self, x, counts):
        import torch
        import torch.distributed as dist
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        ep, local = self.ep, counts.numel() // self.ep
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts)
        send = counts.view(ep, local).sum(1).tolist()
        recv_sizes = received.view(ep, local)
        recv = recv_sizes.sum(1).tolist()
        got = all_to_all_single_autograd(x.contiguous(), recv, send, dist.group.WORLD)
        got = got.wait() if hasattr(got, "wait") else got
        # (source rank, expert) chunks -> (expert, source rank): sort rows by local expert
        expert_of_row = torch.arange(local).repeat(ep).repeat_interleave(recv_sizes.flatten())
        order = torch.argsort(expert_of_row, stable=True)
        y = self.compute(got[order], recv_sizes.sum(0))
        back = y[torch.argsort(order)]  # back to (source rank, expert)
        out = all_to_all_single_autograd(back, send, recv, dist.group.WORLD)
        return out.wait() if hasattr(out, "wait") else out


class PlainSide:
    """The plain loop: the same module, its own slice of each layer's stacked expert
    weights (plain tensors), dispatch and combine by `PlainDispatch`, torch DDP over the
    rest (the expert weights ignored, their gradient divided by the data-parallel
    degree, as ExpertGradSync does with ep = world), torch's AdamW (weight decay on
    matrices only, as meshforge)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import numpy as np
        import torch
        import torch.distributed as dist
        from torch import nn
        from torch.nn.parallel import DistributedDataParallel

        from meshforge.data.corpus import load_tokens
        from meshforge.models.llama import Llama, LlamaArgs
        from meshforge.models.moe import GroupedExperts, MoEArgs

        self.args = args
        rank, world = dist.get_rank(), dist.get_world_size()
        self.world = world
        torch.manual_seed(SEED)
        cfg = LlamaArgs(
            vocab_size=256,
            d_model=args.d_model,
            n_layers=args.layers,
            n_heads=4,
            n_kv_heads=2,
            seq_len=args.seq,
            ffn_hidden=args.top_k * args.expert_ffn,
            moe=MoEArgs(
                experts=args.experts,
                top_k=args.top_k,
                expert_ffn=args.expert_ffn,
                shared_experts=args.shared,
            ),
        )
        model = Llama(cfg)
        model.init_weights(SEED)
        self.expert_params: list[nn.Parameter] = []
        local = args.experts // world
        for g in (m for m in model.modules() if isinstance(m, GroupedExperts)):
            if world > 1:
                for holder in (g.gate, g.up, g.proj):
                    shard = holder.weight.detach()[rank * local : (rank + 1) * local].clone()
                    holder.weight = nn.Parameter(shard)
                g.forward = PlainDispatch(g.forward, world)
            self.expert_params += [g.gate.weight, g.up.weight, g.proj.weight]
        self.model: nn.Module = model
        if world > 1:
            ids = {id(p) for p in self.expert_params}
            names = [n for n, p in model.named_parameters() if id(p) in ids]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
            self.model = DistributedDataParallel(model)
        params = list(model.parameters())
        self.opt = torch.optim.AdamW(
            [
                {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=3e-3,
            betas=(0.9, 0.95),
        )
        self.tokens = load_tokens("builtin:python-stdlib", 0.05).train
        self.rng = np.random.default_rng(rank)
        self.n = 0
        self.loss = torch.zeros(())

    def step(self) -> None:
        import numpy as np
        import torch
        import torch.nn.functional as F

        a = self.args
        self.n += 1
        starts = self.rng.integers(0, len(self.tokens) - a.seq - 1, size=GLOBAL_BATCH // self.world)
        rows = np.stack([np.asarray(self.tokens[s : s + a.seq + 1]) for s in starts])
        batch = torch.from_numpy(rows.astype(np.int64))
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        for g in self.opt.param_groups:  # a warm-up, as meshforge's schedule sets the lr
            g["lr"] = 3e-3 * min(1.0, self.n / 5)
        logits = self.model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        if self.world > 1:
            for p in self.expert_params:  # already summed over the ranks by the all-to-all
                if p.grad is not None:
                    p.grad.div_(self.world)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.loss = loss.detach()

    def sync(self) -> None:
        import torch.distributed as dist

        dist.all_reduce(self.loss)  # the block's end, as a logged step would read it


class MeshforgeSide:
    """meshforge's side: the Engine built from the job config, its step strategy
    (AccumulatingStep under DDP + expert parallelism; no wrapper over one rank) driven
    as the trainer drives it (set_lr, forward/backward, the expert gradient reduction,
    AdamW, zero_grad), with meshforge's own batch sampler."""

    def __init__(self, args: argparse.Namespace, moe: bool) -> None:
        import torch
        import torch.distributed as dist

        from meshforge.config import build_config
        from meshforge.data.corpus import load_tokens
        from meshforge.train.engine import Engine

        rank, world = dist.get_rank(), dist.get_world_size()
        self.cfg = build_config(job(args, world, moe))
        torch.manual_seed(self.cfg.train.seed)
        self.engine = Engine.build(self.cfg, rank, world, torch.device("cpu"))
        self.tokens = load_tokens("builtin:python-stdlib", 0.05).train
        self.n = 0
        self.result = None

    def step(self) -> None:
        from meshforge.data.loader import rank_micro_batches

        engine, t = self.engine, self.cfg.train
        micro_batches = rank_micro_batches(
            self.tokens,
            seq_len=self.cfg.model.seq_len,
            global_batch=t.global_batch,
            micro_batch=t.micro_batch,
            dp_rank=engine.dp_rank,
            dp_size=engine.dims.dp,
            seed=t.seed,
            step=self.n,
        )
        self.result = engine.strategy.step(self.n, micro_batches, measure=False)
        engine.optimizers.zero_grad()
        self.n += 1

    def sync(self) -> None:
        assert self.result is not None
        self.engine.strategy.reduce_loss(self.result.loss_sum / self.engine.dims.microbatches)


# -- the driver -----------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2, help="torchrun launches per layout")
    ap.add_argument("--rounds", type=int, default=8, help="alternating rounds per launch")
    ap.add_argument("--block", type=int, default=5, help="steps per side per round")
    ap.add_argument("--layouts", default="ep1,ep2", help="of ep1, ep2")
    ap.add_argument("--no-dense", action="store_true", help="skip the MoE vs dense part")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-ffn", type=int, default=128)
    ap.add_argument("--shared", type=int, default=0, help="shared experts")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "moe.txt")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--with-dense", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.steps = WARMUP + args.rounds * args.block  # meshforge's train.steps (its lr horizon)
    if args.worker:
        worker(args)
        return

    from meshforge.plan.jobs.auto import cpu_model_name

    chosen = args.layouts.split(",")
    command = "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0]))] + sys.argv[1:])
    load = os.getloadavg()
    started = time.perf_counter()
    lines: list[str] = []

    def emit(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    ratios: dict[str, list[float]] = {lay: [] for lay in chosen}  # per round, all launches
    rates: dict[str, dict[str, list[float]]] = {lay: {} for lay in chosen}
    moe_dense: list[float] = []
    for rep in range(args.reps):
        for lay in chosen:
            ep = LAYOUTS[lay]
            res = run_paired(args, ep)
            ratios[lay] += res["ratio"]
            for side, values in res["rates"].items():
                rates[lay].setdefault(side, []).extend(values)
            moe_dense += res.get("moe_dense", [])
            med = {side: statistics.median(v) for side, v in res["rates"].items()}
            emit(
                f"launch {rep} {lay}: "
                + "  ".join(f"{side} {v:8.0f} tok/s" for side, v in med.items())
                + "  meshforge/plain per round: "
                + " ".join(f"{r:.3f}" for r in res["ratio"])
            )
    emit("")
    emit(
        f"{'layout':24s} {'meshforge tok/s':>16s} {'plain tok/s':>12s} {'ratio':>7s} "
        f"{'rounds':>7s} {'IQR of ratio':>14s}"
    )
    for lay in chosen:
        r = sorted(ratios[lay])
        q1, q3 = r[len(r) // 4], r[(3 * len(r)) // 4]
        name = f"{lay} (world {LAYOUTS[lay]}) vs plain"
        emit(
            f"{name:24s} {statistics.median(rates[lay]['meshforge']):16.0f} "
            f"{statistics.median(rates[lay]['plain']):12.0f} {statistics.median(r):7.3f} "
            f"{len(r):7d} {q1:6.3f}-{q3:.3f}"
        )
    if moe_dense:
        r = sorted(moe_dense)
        q1, q3 = r[len(r) // 4], r[(3 * len(r)) // 4]
        dense_rates = rates["ep1"].get("dense", []) if "ep1" in rates else []
        emit(
            f"{'MoE vs dense (world 1)':24s} {statistics.median(rates['ep1']['meshforge']):16.0f} "
            f"{statistics.median(dense_rates):12.0f} {statistics.median(r):7.3f} "
            f"{len(r):7d} {q1:6.3f}-{q3:.3f}"
        )
    emit(
        f"\n{args.reps} launches per layout x {args.rounds} rounds x {args.block} steps per side, "
        f"after {WARMUP} warm-up steps each, {time.perf_counter() - started:.0f} s. Every "
        "side is built in the same processes and timed in alternating blocks (the order "
        "rotating each round); ratio = median over all rounds of meshforge's tokens/s over "
        "plain's in the same round; goal meshforge/plain >= 0.97. MoE vs dense: meshforge "
        "both, same active parameters (the dense column is the dense model's tokens/s)"
    )
    header = [
        f"machine: {cpu_model_name()}, {os.cpu_count()} cores, torch {version('torch')}; "
        f"load average before/after: {load[0]:.2f}/{os.getloadavg()[0]:.2f} "
        "(the machine is shared: other jobs' load shows in the measured times)",
        f"command: {command}",
        f"llama d_model={args.d_model} n_layers={args.layers} heads=4 kv_heads=2 "
        f"seq={args.seq} vocab=256; MoE: {args.experts} experts, top-{args.top_k}, "
        f"expert_ffn={args.expert_ffn}, {args.shared} shared, aux loss, dropless; dense: "
        f"ffn_hidden={(args.top_k + args.shared) * args.expert_ffn}; fp32, gloo on "
        f"127.0.0.1, global batch {GLOBAL_BATCH} split over the ranks, no clipping",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(header + lines) + "\n")
    print(f"written to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
