"""A hand-written torch training loop: the baseline meshforge's overhead is measured against.

Same GPT module, same token data and batch shapes, no gradient clipping (the
benchmark sets meshforge's grad_clip to 0 too), AdamW. Strategies, each written
directly on torch's own APIs:

  ddp   torch DDP, each rank its share of the global batch
  fsdp  FSDP2 (fully_shard per block, then the root), torch's defaults: the root
        is not resharded after forward (meshforge zero=3 reshards it too)
  tp    tensor parallel over all ranks: DTensor parallelize_module with
        ColwiseParallel/RowwiseParallel (meshforge.models.tensor_parallel's plan,
        the same torch calls), vocabulary-sharded logits into the cross-entropy
        under loss_parallel(); every rank reads the whole global batch
  pp    one pipeline stage per rank (meshforge.parallel.pipeline.split_stage for the
        module surgery only), driven here by torch.distributed.pipelining's
        PipelineStage + Schedule1F1B over global_batch / micro_batch micro-batches;
        untied head, as pipeline parallelism needs

Run under torchrun; rank 0 prints one JSON line with the median tokens/s over
logging intervals (the first interval, with start-up, is left out, as meshforge's
report does) and the best such interval."""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from meshforge.data.corpus import load_tokens
from meshforge.models.gpt import GPT, GPTArgs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", choices=["ddp", "fsdp", "tp", "pp"], required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=4, help="pp: rows per micro-batch")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument(
        "--timeline",
        default=None,
        help="rank 0 writes JSON {first_step_start, last_step_end} (time.time()) here",
    )
    args = ap.parse_args()

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    dist.init_process_group("gloo")
    result = train(args)
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    leave()


def train(args: argparse.Namespace) -> dict[str, float]:
    """The run; every model, mesh, optimizer and tensor of it is released on return."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    pp = args.strategy == "pp"
    cfg = GPTArgs(
        vocab_size=256,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        seq_len=args.seq,
        tie_embeddings=not pp,
    )
    model = GPT(cfg)
    loss_ctx = None
    schedule = None
    if args.strategy == "ddp":
        wrapped = DistributedDataParallel(model)
    elif args.strategy == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    elif args.strategy == "tp":
        from torch.distributed.tensor.parallel import loss_parallel

        from meshforge.models.tensor_parallel import apply_tensor_parallel

        mesh = init_device_mesh("cpu", (world,))
        apply_tensor_parallel(model, mesh, sequence_parallel=False, loss_parallel=True)
        wrapped, loss_ctx = model, loss_parallel
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        from meshforge.parallel.pipeline import split_stage

        model = split_stage(model, rank, world)  # this rank's blocks (+ embed / head)
        stage = PipelineStage(model, rank, world, torch.device("cpu"))

        def stage_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

        schedule = Schedule1F1B(stage, args.global_batch // args.micro_batch, loss_fn=stage_loss)
        wrapped = model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = load_tokens("builtin:python-stdlib", 0.05).train
    # tp and pp ranks all take the whole global batch (dp = 1); ddp/fsdp split it
    per_rank = args.global_batch if args.strategy in ("tp", "pp") else args.global_batch // world
    rng = np.random.default_rng(0 if args.strategy in ("tp", "pp") else rank)
    rates, t0 = [], time.perf_counter()
    first_step_start = time.time()
    for step in range(1, args.steps + 1):
        starts = rng.integers(0, len(tokens) - args.seq - 1, size=per_rank)
        rows = np.stack([np.asarray(tokens[s : s + args.seq + 1]) for s in starts])
        batch = torch.from_numpy(rows.astype(np.int64))
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        if schedule is not None:
            losses: list[torch.Tensor] = []
            if rank == 0:
                schedule.step(x, return_outputs=False)
            elif rank == world - 1:
                schedule.step(target=y, losses=losses, return_outputs=False)
            else:
                schedule.step(return_outputs=False)
            loss = torch.stack(losses).mean() if losses else torch.zeros(())
        elif loss_ctx is not None:
            with loss_ctx():
                logits = wrapped(x)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                loss.backward()
            loss = loss.full_tensor()
        else:
            logits = wrapped(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.log_every == 0:
            dist.all_reduce(loss.detach())
            now = time.perf_counter()
            rates.append(args.log_every * args.global_batch * args.seq / (now - t0))
            t0 = now
    dist.all_reduce(loss.detach())  # the last step ends on every rank
    last_step_end = time.time()
    if args.timeline and rank == 0:
        with open(args.timeline, "w") as f:
            json.dump({"first_step_start": first_step_start, "last_step_end": last_step_end}, f)
    steady = rates[1:] or rates
    return {"tokens_per_s": statistics.median(steady), "best": max(steady)}


def leave() -> None:
    """End a finished rank with exit code 0 (as meshforge.runtime.dist does, see there).

    gloo's worker threads drop a finished collective after the caller has moved on, and
    the drop takes the GIL when it frees a tensor's Python object; one still pending at
    interpreter teardown aborts the process ("terminate called without an active
    exception"). So: collect the run's reference cycles, leave together (the barrier
    lets pending drops finish), destroy the groups, then end without the teardown, since
    FSDP2's groups outlive destroy_process_group (DTensor's caches hold their mesh)."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
