"""meshforge's mixture-of-experts training step against a plain torch loop, and the
MoE's tokens/s against a dense llama with the same active parameters.

1. The same small MoE llama (models/llama.py with models/moe.py's `MoE`), fp32, gloo
   on 127.0.0.1, meshforge (`Engine.build` and its AccumulatingStep, driven as
   tests/layouts.py's train_layout does: the step, not the trainer's logging around
   it) and a plain loop alternating in one run, for

     ep1   world 1, every expert on the one rank
     ep2   world 2, parallel.ep=2: half of each layer's experts per rank

   The plain loop (this file, `--worker`) builds the same module and takes its own
   slice of each layer's stacked expert weights (plain tensors, no DTensor), routes
   with the module's own router math, dispatches and combines the tokens with the
   same `all_to_all_single_autograd` (variable splits), runs the same expert loop
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

    python benchmarks/moe.py [--reps 4] [--steps 60] [--layouts ep1,ep2] [--experts 8]
        [--top-k 2] [--expert-ffn 128] [--d-model 128] [--layers 4] [--seq 128]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
GLOBAL_BATCH = 16
SEED = 0
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


# -- the two sides, each a torchrun of this file's --worker ----------------------------------
def run_side(args: argparse.Namespace, side: str, ep: int, moe: bool = True):
    """(median, best) tokens/s of one run: `side` meshforge or plain, over `ep` ranks."""
    from meshforge.launch.local import free_port

    forwarded = [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("steps", "experts", "top_k", "expert_ffn", "shared", "d_model", "layers", "seq")
    ]
    name = f"{side} ep{ep}" + ("" if moe else " dense")
    for attempt in range(2):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            # a fresh rendezvous port each run, on loopback
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            f"--nproc_per_node={ep}",
            str(Path(__file__).resolve()),
            "--worker",
            side,
            *forwarded,
            *([] if moe else ["--dense"]),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        lines = out.stdout.strip().splitlines()
        if lines and lines[-1].startswith("{"):
            res = json.loads(lines[-1])
            return res["tokens_per_s"], res["best"]
        errors = [ln for ln in out.stderr.splitlines() if "Error" in ln] or out.stderr.splitlines()
        print(
            f"{name} failed (attempt {attempt + 1}, rc {out.returncode}): "
            + " | ".join(errors[-3:]),
            file=sys.stderr,
            flush=True,
        )
    raise RuntimeError(f"{name} failed twice")


# -- the plain loop (one rank of torchrun) --------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo")
    result = plain_train(args) if args.worker == "plain" else meshforge_train(args)
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    gc.collect()  # leave as plain_loop.leave does (gloo's pending drops, then no teardown)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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


def plain_train(args: argparse.Namespace) -> dict[str, float]:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from meshforge.data.corpus import load_tokens
    from meshforge.models.llama import Llama, LlamaArgs
    from meshforge.models.moe import GroupedExperts, MoEArgs

    rank, world = dist.get_rank(), dist.get_world_size()
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
    expert_params: list[nn.Parameter] = []
    local = args.experts // world
    for g in (m for m in model.modules() if isinstance(m, GroupedExperts)):
        if world > 1:
            for holder in (g.gate, g.up, g.proj):
                shard = holder.weight.detach()[rank * local : (rank + 1) * local].clone()
                holder.weight = nn.Parameter(shard)
            g.forward = PlainDispatch(g.forward, world)
        expert_params += [g.gate.weight, g.up.weight, g.proj.weight]
    wrapped: nn.Module = model
    if world > 1:
        ids = {id(p) for p in expert_params}
        names = [n for n, p in model.named_parameters() if id(p) in ids]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
        wrapped = DistributedDataParallel(model)
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=3e-3,
        betas=(0.9, 0.95),
    )
    tokens = load_tokens("builtin:python-stdlib", 0.05).train
    per_rank = GLOBAL_BATCH // world
    rng = np.random.default_rng(rank)
    rates, t0, log_every = [], time.perf_counter(), 10
    loss = torch.zeros(())
    prof = Profile(args, rank)
    for step in range(1, args.steps + 1):
        prof.at(step - 1)
        starts = rng.integers(0, len(tokens) - args.seq - 1, size=per_rank)
        rows = np.stack([np.asarray(tokens[s : s + args.seq + 1]) for s in starts])
        batch = torch.from_numpy(rows.astype(np.int64))
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        for g in opt.param_groups:  # a warm-up, as meshforge's schedule sets the lr
            g["lr"] = 3e-3 * min(1.0, step / 5)
        logits = wrapped(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        if world > 1:
            for p in expert_params:  # already summed over the ranks by the all-to-all
                if p.grad is not None:
                    p.grad.div_(world)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % log_every == 0:
            dist.all_reduce(loss.detach())
            now = time.perf_counter()
            rates.append(log_every * GLOBAL_BATCH * args.seq / (now - t0))
            t0 = now
    prof.at(args.steps)
    dist.all_reduce(loss.detach())
    steady = rates[1:] or rates
    return {"tokens_per_s": statistics.median(steady), "best": max(steady)}


def meshforge_train(args: argparse.Namespace) -> dict[str, float]:
    """meshforge's side: the Engine built from the job config, its step strategy
    (AccumulatingStep under DDP + expert parallelism) driven as the trainer drives it
    (set_lr, forward/backward, the expert gradient reduction, AdamW, zero_grad), with
    meshforge's own batch sampler; timed exactly as the plain loop is."""
    import torch
    import torch.distributed as dist

    from meshforge.config import build_config
    from meshforge.data.corpus import load_tokens
    from meshforge.data.loader import rank_micro_batches
    from meshforge.train.engine import Engine

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = build_config(job(args, world, not args.dense))
    torch.manual_seed(cfg.train.seed)
    engine = Engine.build(cfg, rank, world, torch.device("cpu"))
    dims, t = engine.dims, cfg.train
    tokens = load_tokens("builtin:python-stdlib", 0.05).train
    rates, t0, log_every = [], time.perf_counter(), 10
    loss = torch.zeros(())
    prof = Profile(args, rank)
    for step in range(args.steps):
        prof.at(step)
        micro_batches = rank_micro_batches(
            tokens,
            seq_len=cfg.model.seq_len,
            global_batch=t.global_batch,
            micro_batch=t.micro_batch,
            dp_rank=engine.dp_rank,
            dp_size=dims.dp,
            seed=t.seed,
            step=step,
        )
        result = engine.strategy.step(step, micro_batches, measure=False)
        engine.optimizers.zero_grad()
        if (step + 1) % log_every == 0:
            loss = engine.strategy.reduce_loss(result.loss_sum / dims.microbatches)
            now = time.perf_counter()
            rates.append(log_every * GLOBAL_BATCH * args.seq / (now - t0))
            t0 = now
    prof.at(args.steps)
    dist.all_reduce(loss.detach())
    steady = rates[1:] or rates
    return {"tokens_per_s": statistics.median(steady), "best": max(steady)}


class Profile:
    """--profile FILE: rank 0 profiles steps 10-19 (torch.profiler) and writes the
    operator table, heaviest self time first, to FILE (side and layout appended)."""

    FIRST, LAST = 10, 20

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.path = args.profile if rank == 0 else None
        self.name = f"{args.worker}{'-dense' if args.dense else ''}"
        self.prof = None

    def at(self, steps_done: int) -> None:
        if self.path is None:
            return
        import torch
        from torch.profiler import profile

        if steps_done == self.FIRST:
            self.prof = profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.start()
        elif steps_done == self.LAST and self.prof is not None:
            self.prof.stop()
            world = os.environ.get("WORLD_SIZE", "1")
            table = self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
            with open(f"{self.path}.{self.name}-world{world}.txt", "w") as f:
                f.write(table)
            self.prof = None


# -- the driver -----------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
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
    ap.add_argument("--worker", choices=["plain", "meshforge"], help=argparse.SUPPRESS)
    ap.add_argument("--dense", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
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

    # per layout: [((meshforge median, best), (plain median, best)) per rep]
    results: dict[str, list] = {lay: [] for lay in chosen}
    dense: list[tuple[tuple[float, float], tuple[float, float]]] = []  # (moe, dense) per rep
    for rep in range(args.reps):
        mf_ep1 = den = None
        for lay in chosen:
            ep = LAYOUTS[lay]
            # MoE vs dense rides on the ep1 meshforge run, next to it and alternating too:
            # even reps dense, meshforge, plain; odd reps plain, meshforge, dense
            with_dense = ep == 1 and not args.no_dense
            if rep % 2 == 0:  # alternate which goes first
                den = run_side(args, "meshforge", 1, moe=False) if with_dense else den
                mf = run_side(args, "meshforge", ep)
                plain = run_side(args, "plain", ep)
            else:
                plain = run_side(args, "plain", ep)
                mf = run_side(args, "meshforge", ep)
                den = run_side(args, "meshforge", 1, moe=False) if with_dense else den
            if ep == 1:
                mf_ep1 = mf
            results[lay].append((mf, plain))
            emit(
                f"rep {rep} {lay}: meshforge {mf[0]:8.0f} tok/s  plain {plain[0]:8.0f} "
                f"tok/s  ratio {mf[0] / plain[0]:.3f}  (best intervals {mf[1]:.0f} / "
                f"{plain[1]:.0f} = {mf[1] / plain[1]:.3f})"
            )
        if not args.no_dense:
            if mf_ep1 is None:  # no ep1 layout chosen: a MoE run of its own beside the dense
                mf_ep1 = run_side(args, "meshforge", 1)
                den = run_side(args, "meshforge", 1, moe=False)
            assert den is not None
            dense.append((mf_ep1, den))
            emit(
                f"rep {rep} MoE/dense (world 1, meshforge both): MoE {mf_ep1[0]:8.0f} tok/s  "
                f"dense {den[0]:8.0f} tok/s  ratio {mf_ep1[0] / den[0]:.3f}  (best "
                f"{mf_ep1[1]:.0f} / {den[1]:.0f} = {mf_ep1[1] / den[1]:.3f})"
            )
    emit("")
    emit(
        f"{'layout':24s} {'meshforge tok/s':>16s} {'plain tok/s':>12s} {'ratio':>7s} "
        f"{'best-interval ratio':>20s}"
    )
    for lay in chosen:
        pairs = results[lay]
        mf = statistics.median(p[0][0] for p in pairs)
        plain = statistics.median(p[1][0] for p in pairs)
        ratio = statistics.median(p[0][0] / p[1][0] for p in pairs)
        best = statistics.median(p[0][1] / p[1][1] for p in pairs)
        name = f"{lay} (world {LAYOUTS[lay]}) vs plain"
        emit(f"{name:24s} {mf:16.0f} {plain:12.0f} {ratio:7.3f} {best:20.3f}")
    if dense:
        moe_t = statistics.median(p[0][0] for p in dense)
        den_t = statistics.median(p[1][0] for p in dense)
        ratio = statistics.median(p[0][0] / p[1][0] for p in dense)
        best = statistics.median(p[0][1] / p[1][1] for p in dense)
        emit(
            f"{'MoE vs dense (world 1)':24s} {moe_t:16.0f} {den_t:12.0f} {ratio:7.3f} {best:20.3f}"
        )
    emit(
        f"\n{args.steps} steps, {args.reps} alternating repetitions, "
        f"{time.perf_counter() - started:.0f} s; ratio = median of per-repetition throughput "
        "ratios (each run: median of its steady logging intervals of 10 steps); best-interval "
        "ratio: the same with each run's fastest steady interval, the least disturbed by other "
        "load; goal meshforge/plain >= 0.97; MoE vs dense: meshforge both, same active "
        "parameters (MoE tokens/s over dense tokens/s)"
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
