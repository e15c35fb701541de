"""A hand-written torch training loop: the baseline meshforge's overhead is measured against.

Same GPT module, same token data and batch shapes, plain DDP or plain FSDP2
(fully_shard per block), no gradient clipping (the benchmark sets
meshforge's grad_clip to 0 too). Run under torchrun; rank 0 prints one JSON line with the
median tokens/s over logging intervals (the first interval, with start-up, is
left out, as meshforge's report does)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from meshforge.config import ModelConfig
from meshforge.data.corpus import load_tokens
from meshforge.models.gpt import GPT


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", choices=["ddp", "fsdp"], required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = ModelConfig(
        d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, seq_len=args.seq
    )
    model = GPT(cfg)
    if args.strategy == "ddp":
        wrapped = DistributedDataParallel(model)
    else:
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = load_tokens("builtin:python-stdlib", 0.05).train
    per_rank = args.global_batch // world
    rng = np.random.default_rng(rank)
    rates, t0 = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = rng.integers(0, len(tokens) - args.seq - 1, size=per_rank)
        rows = np.stack([np.asarray(tokens[s : s + args.seq + 1]) for s in starts])
        batch = torch.from_numpy(rows.astype(np.int64))
        x, y = batch[:, :-1], batch[:, 1:]
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
    if rank == 0:
        print(json.dumps({"tokens_per_s": statistics.median(rates[1:] or rates)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
