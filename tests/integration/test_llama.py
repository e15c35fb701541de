"""The Llama-style decoder (models/llama.py) trains under every kind of layout with
the losses of world 1, and its parts behave as Llama's do: grouped-query attention
shares key/value heads, rotary embeddings make attention depend on relative
positions only, and the planner counts its parameters as the model holds them."""

from __future__ import annotations

import pytest
import torch

from layouts import job, train_layout
from meshforge.config import ModelConfig
from meshforge.errors import ConfigError
from meshforge.models.llama import Llama, apply_rotary, rotary
from meshforge.models.registry import model_args
from meshforge.plan.core.flops import gpt_param_count, shape_of

STEPS = 20
RTOL = 1e-4
LLAMA = {"name": "llama", "vocab_size": 256, "d_model": 32, "n_layers": 4, "n_heads": 4,
         "n_kv_heads": 2, "ffn_hidden": 64, "seq_len": 32}  # fmt: skip


def _llama_job(parallel: dict, **train) -> dict:
    raw = job(parallel, train=train)
    raw["model"] = dict(LLAMA)
    return raw


@pytest.fixture(scope="module")
def reference(gloo) -> dict[int, float]:
    (out,) = gloo.run(1, train_layout, _llama_job({}), STEPS)
    assert out["losses"][STEPS] < out["losses"][1], "the world-1 run did not learn"
    return out["losses"]


@pytest.mark.parametrize(
    "parallel",
    [{"zero": 0}, {"zero": 3}, {"tp": 2, "sequence_parallel": True}, {"pp": 2}],
    ids=["ddp", "zero3", "tp2-sp", "pp2"],
)
def test_llama_trains_like_world_1_under_every_layout(gloo, reference, parallel):
    results = gloo.run(2, train_layout, _llama_job(parallel), STEPS)
    for rank, out in enumerate(results):
        assert sorted(out["losses"]) == sorted(reference)
        for step, loss in reference.items():
            assert out["losses"][step] == pytest.approx(loss, rel=RTOL), (rank, step)


def test_parameter_count_matches_the_planners():
    for fields in (LLAMA, {**LLAMA, "n_kv_heads": None, "tie_embeddings": True}):
        cfg = ModelConfig(**fields)
        built = sum(p.numel() for p in Llama(model_args(cfg)).parameters())
        assert built == gpt_param_count(shape_of(cfg)).total
    # the published size of a preset (Llama 3.1 8B: 8.03e9 parameters)
    assert gpt_param_count(shape_of(ModelConfig(preset="llama-8b"))).total == 8_030_261_248


def test_rotary_scores_depend_on_relative_position_only():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    cos, sin = rotary(q, 10000.0, 16, 12)

    def score(i: int, j: int) -> float:
        qi = apply_rotary(q, cos[i : i + 1], sin[i : i + 1])
        kj = apply_rotary(k, cos[j : j + 1], sin[j : j + 1])
        return float((qi * kj).sum())

    assert score(5, 2) == pytest.approx(score(9, 6), rel=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 4), rel=1e-3)


def test_grouped_query_attention_holds_fewer_key_value_weights():
    full = Llama(model_args(ModelConfig(**{**LLAMA, "n_kv_heads": None})))
    grouped = Llama(model_args(ModelConfig(**LLAMA)))
    assert full.blocks["0"].attn.k.weight.shape == (32, 32)
    assert grouped.blocks["0"].attn.k.weight.shape == (16, 32)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n_kv_heads": 3}, "n_kv_heads=3 does not divide model.n_heads=4"),
        ({"mlp_ratio": 2}, "model.mlp_ratio applies to model.name=gpt"),
        ({"dropout": 0.1}, "model.dropout applies to model.name=gpt"),
    ],
)
def test_bad_llama_fields_are_named(fields, message):
    from meshforge.config import build_config

    with pytest.raises(ConfigError, match=message):
        build_config({"model": {**LLAMA, **fields}})


def test_tensor_parallel_must_divide_the_key_value_heads():
    from meshforge.config import build_config

    with pytest.raises(ConfigError, match="does not divide model.n_kv_heads=2"):
        build_config({**_llama_job({"tp": 4}), "model": {**LLAMA, "n_kv_heads": 2}})
