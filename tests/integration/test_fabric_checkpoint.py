"""Fabric.save / Fabric.load through torch.distributed.checkpoint: a checkpoint written
under ZeRO-3 at world 2 loads at world 1 under other strategies bitwise (parameters,
momentum, scheduler, user values) and training goes on alike; a failing save leaves the
previous checkpoint as it was; a damaged or missing one is refused in one line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshforge.errors import CheckpointError
from meshforge.fabric import Fabric

BATCH = 8
USER_VALUES = {"step": 7, "extra": torch.arange(5.0), "note": {"a": [1, 2], "b": "x"}}


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def _setup(fabric: Fabric):
    return fabric.setup(
        _net(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    )


def _train(fabric: Fabric, model, opt, sched, steps: int) -> list[float]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 4, generator=g)
    y = x.sum(dim=1, keepdim=True)
    per = BATCH // fabric.world_size
    rows = slice(fabric.rank * per, (fabric.rank + 1) * per)
    losses = []
    for _ in range(steps):
        loss = (model(x[rows]) - y[rows]).square().mean()
        fabric.backward(loss)
        fabric.step()
        fabric.zero_grad()
        sched.step()
        losses.append(fabric.all_reduce_mean(loss.detach()).item())
    return losses


def _snapshot(model, opt, sched) -> dict:
    """Full parameters and momentum buffers by name (collective under FSDP)."""
    module = getattr(model, "module", model)
    local = getattr(opt, "optim", opt)
    params = {n: _full(p) for n, p in module.named_parameters()}
    names = {p: n for n, p in module.named_parameters()}
    momentum = {names[p]: _full(s["momentum_buffer"]) for p, s in local.state.items() if s}
    return {"params": params, "momentum": momentum, "scheduler": sched.state_dict()}


def _train_and_save(path: str, strategy: str) -> dict:
    with Fabric(strategy=strategy) as fabric:
        model, opt, sched = _setup(fabric)
        _train(fabric, model, opt, sched, 3)
        fabric.save(path, {"model": model, "optimizer": opt, "scheduler": sched, **USER_VALUES})
        saved = _snapshot(model, opt, sched)
        saved["after"] = _train(fabric, model, opt, sched, 2)
        return saved


def _load(path: str, strategy: str) -> dict:
    with Fabric(strategy=strategy, seed=1) as fabric:  # starts from other values
        model, opt, sched = _setup(fabric)
        state = {"model": model, "optimizer": opt, "scheduler": sched, "step": 0}
        values = fabric.load(path, state)
        loaded = _snapshot(model, opt, sched)
        loaded["values"] = values
        loaded["state_step"] = state["step"]
        loaded["after"] = _train(fabric, model, opt, sched, 2)
        return loaded


@pytest.fixture(scope="module")
def zero3_checkpoint(gloo, tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("fabric") / "ckpt"
    saved = gloo.run(2, _train_and_save, str(path), "zero3")
    return path, saved[0]


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero3"])
def test_zero3_at_world_2_loads_bitwise_at_world_1(gloo, zero3_checkpoint, strategy):
    path, saved = zero3_checkpoint
    loaded = gloo.run(1, _load, str(path), strategy)[0]
    assert saved["params"].keys() == loaded["params"].keys()
    for name, value in saved["params"].items():
        assert torch.equal(loaded["params"][name], value), name
    assert len(saved["momentum"]) == 4
    for name, value in saved["momentum"].items():
        assert torch.equal(loaded["momentum"][name], value), name
    assert loaded["scheduler"] == saved["scheduler"]
    assert saved["scheduler"]["last_epoch"] == 3
    values = loaded["values"]
    assert set(values) == set(USER_VALUES)
    assert values["step"] == 7 and loaded["state_step"] == 7
    assert torch.equal(values["extra"], USER_VALUES["extra"])
    assert values["note"] == USER_VALUES["note"]
    # training goes on as it did after the save
    for a, b in zip(saved["after"], loaded["after"], strict=True):
        assert math.isclose(a, b, rel_tol=1e-5), (saved["after"], loaded["after"])


def _save_zero1(path: str) -> dict:
    return _train_and_save(path, "zero1")


def test_zero1_at_world_2_loads_under_zero2_at_world_1(gloo, tmp_path):
    saved = gloo.run(2, _save_zero1, str(tmp_path / "ckpt"))[0]
    loaded = gloo.run(1, _load, str(tmp_path / "ckpt"), "zero2")[0]
    for name, value in saved["params"].items():
        assert torch.equal(loaded["params"][name], value), name
    assert saved["momentum"].keys() <= loaded["momentum"].keys()
    for name, value in saved["momentum"].items():  # zero1: each rank its own parameters'
        assert torch.equal(loaded["momentum"][name], value), name


def _failing_save_keeps_the_previous(path: str) -> dict:
    import errno

    import torch.distributed as dist

    import meshforge.train.checkpoint as checkpoint

    with Fabric(strategy="zero2") as fabric:
        model, opt, sched = _setup(fabric)
        fabric.save(path, {"model": model, "step": 1})
        before = _snapshot(model, opt, sched)["params"]
        _train(fabric, model, opt, sched, 2)
        real = checkpoint.hash_own_files

        def full_disk(directory, rank):
            if rank == 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(directory, rank)

        checkpoint.hash_own_files = full_disk
        try:
            fabric.save(path, {"model": model, "step": 2})
            error = None
        except CheckpointError as exc:
            error = str(exc)
        finally:
            checkpoint.hash_own_files = real
        values = fabric.load(path, {"model": model})
        after = _snapshot(model, opt, sched)["params"]
        dist.barrier()
        left = sorted(p.name for p in Path(path).parent.iterdir())
        return {"error": error, "values": values, "same": all(
            torch.equal(before[n], after[n]) for n in before
        ), "left": left}  # fmt: skip


def test_a_failing_save_leaves_the_previous_checkpoint(gloo, tmp_path):
    path = tmp_path / "ckpt"
    results = gloo.run(2, _failing_save_keeps_the_previous, str(path))
    for r in results:  # every rank raised the same one line
        assert r["error"] == results[0]["error"]
        assert r["error"].splitlines() == [r["error"]]
        assert str(path) in r["error"] and "No space left on device" in r["error"]
        assert r["values"] == {"step": 1}
        assert r["same"]
    assert results[0]["left"] == ["ckpt"]  # no temporary directory left behind


def _load_error(path: str) -> str:
    with Fabric() as fabric:
        model, _ = fabric.setup(_net())
        try:
            fabric.load(path, {"model": model})
        except CheckpointError as exc:
            return str(exc)
        return "loaded"


def _save_plain(path: str) -> None:
    with Fabric() as fabric:
        model, _ = fabric.setup(_net())
        fabric.save(path, {"model": model})


def test_a_damaged_or_missing_checkpoint_is_refused_in_one_line(gloo, tmp_path):
    missing = gloo.run(1, _load_error, str(tmp_path / "nothing"))[0]
    assert missing.splitlines() == [missing]
    assert str(tmp_path / "nothing") in missing and "no such directory" in missing

    path = tmp_path / "ckpt"
    gloo.run(1, _save_plain, str(path))
    assert gloo.run(1, _load_error, str(path))[0] == "loaded"
    shard = next(path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    damaged = gloo.run(1, _load_error, str(path))[0]
    assert damaged.splitlines() == [damaged]
    assert str(path) in damaged and f"checksum mismatch in {shard.name}" in damaged


def _fp16_scale_round_trip(path: str) -> tuple[float, float]:
    def placed(fabric: Fabric):
        return fabric.setup(nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))

    with Fabric(strategy="zero3", precision="fp16") as fabric:
        model, opt = placed(fabric)
        fabric.backward(model(torch.ones(3, 4)).float().square().mean())
        fabric.step()
        fabric._scaler.update(new_scale=128.0)  # as after a few overflows
        fabric.save(path, {"model": model, "optimizer": opt})
    with Fabric(strategy="zero1", precision="fp16") as fabric:
        model, opt = placed(fabric)
        fresh = fabric._scaler.get_scale()
        fabric.load(path, {"model": model, "optimizer": opt})
        return fresh, fabric._scaler.get_scale()


def test_the_fp16_loss_scale_comes_back(gloo, tmp_path):
    for fresh, loaded in gloo.run(2, _fp16_scale_round_trip, str(tmp_path / "ckpt")):
        assert (fresh, loaded) == (65536.0, 128.0)
