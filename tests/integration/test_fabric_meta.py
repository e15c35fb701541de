"""Fabric.init_module(empty_init=True): a model built on the meta device is sharded
before it is materialised, so at world 2 under ZeRO-3 a rank's memory peak while
building and placing it stays well below that of building the whole model first;
its values come from init_weights(seed) (equal to a normal build's) or from each
submodule's reset_parameters()."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from helpers import peak_rss_growth
from meshforge.errors import ConfigError
from meshforge.fabric import Fabric


class Wide(nn.Module):
    """LAYERS square layers: at WIDTH 2048 and 12 layers about 200 MB of fp32."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.norm(x)


class Seeded(nn.Module):
    """A model whose init_weights(seed) gives every parameter the same values however it
    is sharded (each from a generator of its own, the rank's slice copied in)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.head = nn.Linear(6, 2)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights(seed=torch.initial_seed())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        for i, (_, p) in enumerate(sorted(self.named_parameters())):
            g = torch.Generator().manual_seed(seed * 1000 + i)
            full = torch.randn(tuple(p.shape), generator=g)
            if isinstance(p, DTensor):
                part = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(part.to_local())
            else:
                p.copy_(full)


class Unresettable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.proj = nn.Linear(4, 4)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _build_peak(empty_init: bool, layers: int, width: int) -> dict:
    with Fabric(strategy="zero3") as fabric:
        # the first setup imports modules and makes groups: not the model's memory
        warm = Wide(2, 16)
        fabric.setup(warm, shard_units=list(warm.layers))
        del warm
        growth: list[int] = []
        with peak_rss_growth(growth):
            with fabric.init_module(empty_init=True) if empty_init else contextlib.nullcontext():
                model = Wide(layers, width)
            model, _ = fabric.setup(model, shard_units=list(model.layers))
        weights = [layer.weight for layer in model.layers]
        bound = 1 / math.sqrt(width)  # nn.Linear's reset_parameters: U(-bound, bound)
        local = [w.to_local() for w in weights]
        first = weights[0].full_tensor()  # collective
        return {
            "growth": growth[0],
            "halves_differ": not torch.equal(first[: width // 2], first[width // 2 :]),
            "full_bytes": sum(p.numel() * 4 for p in model.parameters()),
            "in_bound": all(bool((t.abs() <= bound).all()) for t in local),
            "spread": min(float(t.std()) for t in local) / (bound / math.sqrt(3)),
            "norm_ones": bool((model.norm.weight.to_local() == 1).all()),
        }


def test_meta_init_peak_memory_per_rank_is_at_most_0_6x_the_full_builds(gloo):
    full = gloo.run(2, _build_peak, False, 12, 2048)
    meta = gloo.run(2, _build_peak, True, 12, 2048)
    model_bytes = full[0]["full_bytes"]
    assert model_bytes > 190e6
    for rank in range(2):
        # the normal build holds the whole model at least once
        assert full[rank]["growth"] >= 0.9 * model_bytes, full
        assert meta[rank]["growth"] <= 0.6 * full[rank]["growth"], (meta, full)
        # reset_parameters gave the shards nn.Linear's distribution, not garbage
        assert meta[rank]["in_bound"] and meta[rank]["norm_ones"]
        assert meta[rank]["halves_differ"]  # each rank's shard drawn, not a copy of another's
        assert 0.9 < meta[rank]["spread"] < 1.1, meta


def _seeded_params(strategy: str, empty_init: bool) -> dict:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(5))
    with Fabric(strategy=strategy, seed=11) as fabric:
        with fabric.init_module(empty_init=True) if empty_init else contextlib.nullcontext():
            model = Seeded()
        model, opt = fabric.setup(model)
        params = {n: _full(p) for n, p in getattr(model, "module", model).named_parameters()}
        loss = model(x).square().mean()
        fabric.backward(loss)
        fabric.step()
        return {"params": params, "loss": fabric.all_reduce_mean(loss.detach()).item()}


@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
def test_meta_init_with_init_weights_equals_a_normal_build(gloo, strategy):
    normal = gloo.run(1, _seeded_params, "ddp", False)[0]
    meta = gloo.run(2, _seeded_params, strategy, True)
    for rank in range(2):
        assert meta[rank]["params"].keys() == normal["params"].keys()
        for name, value in normal["params"].items():
            assert torch.equal(meta[rank]["params"][name], value), name
        assert math.isclose(meta[rank]["loss"], normal["loss"], rel_tol=1e-6)


def _unresettable() -> str:
    with Fabric(strategy="zero2") as fabric:
        with fabric.init_module(empty_init=True):
            model = Unresettable()
        try:
            fabric.setup(model)
        except ConfigError as exc:
            return str(exc)
        return "set up"


def test_meta_init_refuses_a_module_it_cannot_initialise(gloo):
    message = gloo.run(1, _unresettable)[0]
    assert message.splitlines() == [message]
    assert "(the model) (Unresettable)" in message and "init_weights(seed)" in message
