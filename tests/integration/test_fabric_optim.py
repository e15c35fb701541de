"""Fabric with the user's own optimizer and LR scheduler: SGD with momentum and StepLR
trained under ZeRO-2 (and ZeRO-1) give the losses of world 1 at world 2, and those of
the same loop in plain PyTorch."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from meshforge.fabric import Fabric

GLOBAL_BATCH = 16
STEPS = 6


def _net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    return x, x.sum(dim=-1, keepdim=True).sin()


def _groups(params) -> list[dict]:
    """Two groups with options of their own: matrices, and biases at twice the lr."""
    params = list(params)
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 1e-3},
        {"params": [p for p in params if p.dim() < 2], "lr": 0.2},
    ]


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _steplr(opt: torch.optim.Optimizer):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _train(strategy: str, how: str) -> dict:
    """Every rank: STEPS steps on its slice of the global batch."""
    x, y = _data()
    with Fabric(strategy=strategy) as fabric:
        net = _net()
        optimizer = (
            _sgd(_groups(net.parameters())) if how == "instance" else (lambda p: _sgd(_groups(p)))
        )
        model, opt, sched = fabric.setup(net, optimizer=optimizer, scheduler=_steplr)
        per_rank = GLOBAL_BATCH // fabric.world_size
        rows = slice(fabric.rank * per_rank, (fabric.rank + 1) * per_rank)
        losses, lrs = [], []
        for _ in range(STEPS):
            loss = (model(x[rows]) - y[rows]).square().mean()
            fabric.backward(loss)
            fabric.step()
            fabric.zero_grad()
            lrs.append([g["lr"] for g in opt.param_groups])
            sched.step()
            losses.append(fabric.all_reduce_mean(loss.detach()).item())
        local = getattr(opt, "optim", opt)  # ZeRO-1's local optimizer
        return {
            "losses": losses,
            "lrs": lrs,
            "kind": type(local).__name__,
            "momentum_buffers": sum("momentum_buffer" in s for s in local.state.values()),
            "options": [(g["momentum"], g["weight_decay"]) for g in opt.param_groups],
        }


def _plain_torch_losses() -> list[float]:
    """The same loop without meshforge: one process, the whole batch."""
    x, y = _data()
    model = _net()
    opt = _sgd(_groups(model.parameters()))
    sched = _steplr(opt)
    losses = []
    for _ in range(STEPS):
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    ("strategy", "how"), [("zero2", "callable"), ("zero2", "instance"), ("zero1", "instance")]
)
def test_sgd_momentum_and_steplr_train_alike_at_world_1_and_2(gloo, strategy, how):
    one = gloo.run(1, _train, strategy, how)[0]
    two = gloo.run(2, _train, strategy, how)
    reference = _plain_torch_losses()
    assert two[0]["losses"] == two[1]["losses"]  # every rank reports the same mean
    for a, b, ref in zip(one["losses"], two[0]["losses"], reference, strict=True):
        assert math.isclose(a, b, rel_tol=1e-5), (one["losses"], two[0]["losses"])
        assert math.isclose(a, ref, rel_tol=1e-5), (one["losses"], reference)
    assert reference[-1] < reference[0]
    # StepLR halves each group's own lr every 2 steps; the groups keep their options.
    expected = [lr * 0.5 ** (s // 2) for s in range(STEPS) for lr in (0.1, 0.2)]
    for run in (one, *two):
        assert run["kind"] == "SGD"
        assert [lr for lrs in run["lrs"] for lr in lrs] == pytest.approx(expected)
        assert run["options"] == [(0.9, 1e-3), (0.9, 0.0)]
    # momentum state exists, and under ZeRO it is split between the ranks
    assert one["momentum_buffers"] == 6
    if strategy == "zero1":
        assert two[0]["momentum_buffers"] + two[1]["momentum_buffers"] == 6
        assert 0 < two[0]["momentum_buffers"] < 6
    else:
        assert two[0]["momentum_buffers"] == two[1]["momentum_buffers"] == 6  # one shard each
