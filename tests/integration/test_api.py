"""The Python API (meshforge.fabric.Fabric) trains a user's own model under every strategy."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers import run_python
from meshforge.errors import ConfigError
from meshforge.fabric import Fabric

EXAMPLE = "examples/fabric_mlp.py"


def _run_example(strategy: str):
    args = [EXAMPLE, "--nproc", "2", "--strategy", strategy, "--steps", "60"]
    return run_python(args, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero3"])  # every strategy in-process: test_fabric_*
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


@pytest.mark.slow
def test_example_with_its_own_optimizer_meta_init_and_a_checkpoint_resumes(tmp_path):
    ckpt = tmp_path / "spirals"
    args = [EXAMPLE, "--nproc", "2", "--strategy", "zero2", "--optimizer", "sgd"]
    args += ["--schedule", "cosine", "--meta-init", "--checkpoint", str(ckpt), "--lr", "0.5"]
    first = run_python([*args, "--steps", "20"], timeout=120)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "saved step 20" in first.stdout and (ckpt / "manifest.json").is_file()
    again = run_python([*args, "--steps", "40"], timeout=120)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "resumed from step 20" in again.stdout and "saved step 40" in again.stdout
    assert "step   20 " not in again.stdout  # went on from the checkpoint, not from 0


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


@pytest.mark.parametrize(
    ("strategy", "precision", "optimizer"),
    [("zero1", "fp16", "adamw"), ("zero2", "bf16", "adamw"), ("zero3", "fp16", "sgd")],
)
def test_accumulating_steps_train_under_a_launcher(
    launched_single_process, strategy, precision, optimizer
):
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    y = x.sum(dim=1, keepdim=True)
    with Fabric(strategy=strategy, precision=precision) as fabric:
        assert (fabric.rank, fabric.world_size, fabric.is_main) == (0, 1, True)
        net = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1))
        if optimizer == "sgd":  # the loss scaler and clipping with the user's optimizer
            model, _ = fabric.setup(net, lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9))
        else:
            model, _ = fabric.setup(net, lr=0.05)
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


# -- bad input to setup and load: one line each, naming what to do ------------------------


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _refusal(case: str, where: str) -> str:
    """What Fabric says to CASE (run on every rank of the pool)."""
    from meshforge.errors import CheckpointError

    with Fabric(strategy="zero2") as fabric:
        model = nn.Linear(4, 2)
        try:
            if case == "scheduler-instance":
                opt = _sgd(model.parameters())
                fabric.setup(model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2))
            elif case == "scheduler-not-callable":
                fabric.setup(model, _sgd, scheduler=0.5)
            elif case == "foreign-parameters":
                fabric.setup(model, optimizer=_sgd(nn.Linear(3, 3).parameters()))
            elif case == "foreign-parameters-callable":
                fabric.setup(model, optimizer=lambda params: _sgd(nn.Linear(3, 3).parameters()))
            elif case == "optimizer-and-adamw-keywords":
                fabric.setup(model, optimizer=_sgd, lr=0.1, betas=(0.8, 0.9))
            elif case == "not-an-optimizer":
                fabric.setup(model, optimizer="sgd")
            elif case == "stepped-optimizer":
                opt = _sgd(model.parameters())
                model(torch.ones(1, 4)).sum().backward()
                opt.step()
                fabric.setup(model, optimizer=opt)
            elif case == "load-missing":
                placed, _ = fabric.setup(model)
                fabric.load(where, {"model": placed})
        except (ConfigError, CheckpointError) as exc:
            return str(exc)
        return "accepted"


@pytest.mark.parametrize(
    ("case", "fragments"),
    [
        ("scheduler-instance", ["callable optimizer -> LRScheduler", "not a StepLR instance"]),
        ("scheduler-not-callable", ["callable optimizer -> LRScheduler", "float"]),
        ("foreign-parameters", ["2 parameter(s) that are not the model's", "(3, 3), (3,)"]),
        ("foreign-parameters-callable", ["2 parameter(s) that are not the model's"]),
        ("optimizer-and-adamw-keywords", ["lr, betas configure the default AdamW"]),
        ("not-an-optimizer", ["torch.optim.Optimizer or a callable", "not str"]),
        ("stepped-optimizer", ["SGD already has state"]),
        ("load-missing", ["cannot load checkpoint", "no such directory"]),
    ],
)
def test_bad_optimizer_scheduler_and_checkpoint_input_is_one_line(gloo, tmp_path, case, fragments):
    where = str(tmp_path / "no-checkpoint-here")
    message = gloo.run(1, _refusal, case, where)[0]
    assert message != "accepted"
    assert message.splitlines() == [message]
    for fragment in fragments:
        assert fragment in message, message
    if case == "load-missing":
        assert where in message
