"""The Python API (meshforge.api.Fabric) trains a user's own model under every strategy."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers import run_python
from meshforge.api import Fabric
from meshforge.errors import ConfigError

EXAMPLE = "examples/fabric_mlp.py"


def _run_example(strategy: str):
    args = [EXAMPLE, "--nproc", "2", "--strategy", strategy, "--steps", "60"]
    return run_python(args, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_example_trains_an_mlp_on_two_processes(strategy):
    proc = _run_example(strategy)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    m = re.search(r"first loss (\S+)\s+final loss (\S+)", proc.stdout)
    assert m, proc.stdout
    first, final = float(m.group(1)), float(m.group(2))
    assert final < 0.5 * first
    accuracy = float(re.search(r"test accuracy (\S+)", proc.stdout).group(1))
    assert accuracy > 0.85
    # Only rank 0 prints.
    assert proc.stdout.count("test accuracy") == 1


@pytest.mark.parametrize("strategy", ["zero4", "deepspeed", ""])
def test_unknown_strategy_names_the_choices(strategy):
    with pytest.raises(ConfigError, match="ddp, zero1, zero2, zero3, fsdp"):
        Fabric(strategy=strategy)


def test_unknown_precision_names_the_choices():
    with pytest.raises(ConfigError, match="fp32, bf16, fp16"):
        Fabric(precision="fp8")


def test_fsdp_is_zero3():
    assert Fabric(strategy="fsdp").zero == Fabric(strategy="zero3").zero == 3


def test_using_fabric_outside_a_launch_says_how():
    with pytest.raises(RuntimeError, match="launch"):
        _ = Fabric().rank


@pytest.fixture
def launched_single_process(monkeypatch):
    """This process as rank 0 of 1, as torchrun would describe it."""
    from meshforge.launch.local import free_port

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for key, value in {**env, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize(("strategy", "precision"), [("zero1", "fp16"), ("zero2", "bf16")])
def test_accumulating_steps_train_under_a_launcher(launched_single_process, strategy, precision):
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    y = x.sum(dim=1, keepdim=True)
    with Fabric(strategy=strategy, precision=precision) as fabric:
        assert (fabric.rank, fabric.world_size, fabric.is_main) == (0, 1, True)
        model, optimizer = fabric.setup(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1)), lr=0.05)
        losses, norms = [], []
        for _ in range(12):
            for i, (xb, yb) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
                with fabric.no_backward_sync(enabled=i == 0), fabric.autocast():
                    out = model(fabric.to_device(xb)).float()
                    loss = (out - fabric.to_device(yb)).square().mean()
                    fabric.backward(loss / 2)
            norms.append(fabric.clip_grad_norm(1.0))
            fabric.step()
            fabric.zero_grad()
            losses.append(fabric.all_reduce_mean(loss.detach()).item())
    assert not dist.is_initialized()
    # fp16's first steps may overflow at the initial loss scale (and are skipped); later not.
    assert torch.isfinite(norms[-1])
    assert losses[-1] < losses[0]


def test_process_group_is_destroyed_when_training_raises(launched_single_process):
    with pytest.raises(ValueError, match="boom"), Fabric():
        assert dist.is_initialized()
        raise ValueError("boom")
    assert not dist.is_initialized()
