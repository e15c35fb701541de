"""Train your own model with meshforge's Python API: an MLP classifying 2-D spirals.

    python examples/fabric_mlp.py --nproc 2 --strategy zero2 --steps 200
    python examples/fabric_mlp.py --optimizer sgd --schedule cosine --meta-init \
        --checkpoint runs/spirals --steps 100       # again with --steps 200 resumes

The data set is generated here, deterministically from --seed (three interleaved
spiral arms with noise), so the example needs no download. The training loop is
an ordinary PyTorch loop; meshforge.fabric.Fabric places the model under the chosen
strategy (ddp | zero1 | zero2 | zero3) and starts the worker processes (or, under
torchrun, srun or mpirun, runs as one of their ranks).

--optimizer sgd gives Fabric your own optimizer (SGD with momentum) instead of its
default AdamW, --schedule cosine an LR scheduler; --meta-init builds the model on the
meta device (sharded before it is allocated); --checkpoint DIR saves model, optimizer,
scheduler and step there at the end and resumes from it when it exists.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from meshforge.fabric import PRECISIONS, STRATEGIES, Fabric

CLASSES = 3


def spirals(n_per_class: int, seed: int, noise: float = 0.2) -> TensorDataset:
    """Points (x, y) on CLASSES spiral arms, labelled by arm."""
    g = torch.Generator().manual_seed(seed)
    r = torch.linspace(0.1, 1.0, n_per_class).repeat(CLASSES)
    arm = torch.arange(CLASSES).repeat_interleave(n_per_class)
    theta = 3.0 * math.pi * r + arm * (2.0 * math.pi / CLASSES)
    theta = theta + noise * torch.randn(theta.shape, generator=g)
    points = torch.stack([r * torch.cos(theta), r * torch.sin(theta)], dim=1)
    return TensorDataset(points, arm)


class MLP(nn.Module):
    def __init__(self, width: int = 128, depth: int = 3) -> None:
        super().__init__()
        dims = [2] + [width] * depth
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.GELU()) for a, b in zip(dims, dims[1:], strict=False)
        )
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def train(fabric: Fabric, args: argparse.Namespace) -> float:
    """The training function every rank runs; returns the test accuracy."""
    with fabric.init_module(empty_init=True) if args.meta_init else contextlib.nullcontext():
        model = MLP()
    if args.optimizer == "sgd":  # your own optimizer: a callable params -> Optimizer
        optimizer = functools.partial(torch.optim.SGD, lr=args.lr, momentum=0.9)
        options = {"optimizer": optimizer}
    else:  # meshforge's default AdamW
        options = {"lr": args.lr}
    if args.schedule == "cosine":  # a callable optimizer -> LRScheduler
        options["scheduler"] = functools.partial(
            torch.optim.lr_scheduler.CosineAnnealingLR, T_max=args.steps
        )
    # Under zero2/zero3 each hidden layer becomes its own FSDP unit.
    model, optimizer, *scheduler = fabric.setup(model, shard_units=list(model.layers), **options)
    loader = fabric.setup_dataloader(spirals(1000, args.seed), batch_size=args.batch_size)
    fabric.print(
        f"{fabric.world_size} processes, strategy={args.strategy}, precision={args.precision}"
    )

    step, epoch, first_loss, loss_value = 0, 0, None, float("nan")
    state = {"model": model, "optimizer": optimizer, "step": 0, "epoch": 0}
    if scheduler:
        state["scheduler"] = scheduler[0]
    if args.checkpoint and Path(args.checkpoint).exists():
        fabric.load(args.checkpoint, state)  # every rank, whatever layout wrote it
        step, epoch = state["step"], state["epoch"]
        fabric.print(f"resumed from step {step}")
    while step < args.steps:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = fabric.to_device((x, y))
            with fabric.autocast():
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y)
            fabric.backward(loss)
            fabric.clip_grad_norm(1.0)
            fabric.step()
            fabric.zero_grad()
            if scheduler:
                scheduler[0].step()
            step += 1
            if step == 1 or step % args.log_every == 0 or step == args.steps:
                loss_value = fabric.all_reduce_mean(loss.detach()).item()
                first_loss = loss_value if first_loss is None else first_loss
                fabric.print(f"step {step:4d}  loss {loss_value:.4f}")
            if step == args.steps:
                break
        epoch += 1
    if args.checkpoint:
        fabric.save(args.checkpoint, {**state, "step": step, "epoch": epoch})
        fabric.print(f"saved step {step} to {args.checkpoint}")

    # Held-out points from another seed; every rank runs the forward (FSDP gathers).
    test_x, test_y = spirals(500, args.seed + 1).tensors
    with torch.no_grad(), fabric.autocast():
        predicted = model(fabric.to_device(test_x)).argmax(dim=-1).cpu()
    accuracy = (predicted == test_y).float().mean().item()
    if first_loss is None:  # resumed at or past --steps: nothing left to train
        fabric.print(f"nothing to train: the checkpoint is at step {step} of {args.steps}")
    else:
        fabric.print(f"first loss {first_loss:.4f}  final loss {loss_value:.4f}")
    fabric.print(f"test accuracy {accuracy:.3f}")
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--strategy", default="zero2", choices=list(STRATEGIES))
    parser.add_argument("--precision", default="fp32", choices=list(PRECISIONS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=128, help="per process")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    parser.add_argument("--schedule", default="constant", choices=["constant", "cosine"])
    parser.add_argument("--meta-init", action="store_true", help="build on the meta device")
    parser.add_argument("--checkpoint", help="save here at the end; resume from it if it exists")
    args = parser.parse_args()
    fabric = Fabric(strategy=args.strategy, precision=args.precision, seed=args.seed)
    # partial() pickles by reference to train(), so the spawned workers can run it.
    fabric.launch(functools.partial(train, args=args), nproc=args.nproc)


if __name__ == "__main__":
    main()
