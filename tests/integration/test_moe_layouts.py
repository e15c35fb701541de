"""The tiny mixture of experts trains the same under every expert-parallel layout as
at world 1, step by step, and its routing adds up: the engine run in-process on the
shared gloo pool (tests/layouts.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from layouts import train_layout

STEPS = 20
RTOL = 1e-4

# 4 experts, top-2, dropless, fp32; 4 layers so pp=2 splits it
MOE_TINY: dict[str, Any] = {
    "model": {"name": "llama", "vocab_size": 256, "d_model": 32, "n_layers": 4, "n_heads": 4,
              "n_kv_heads": 2, "seq_len": 32, "ffn_hidden": 64, "tie_embeddings": False,
              "moe": {"experts": 4, "top_k": 2, "expert_ffn": 32}},
    "data": {"source": "builtin:python-stdlib"},
    "precision": {"dtype": "fp32"},
    "train": {"global_batch": 8, "micro_batch": 2, "lr": 3.0e-3, "warmup": 5, "seed": 7,
              "steps": 20, "eval_every": 0},
}  # fmt: skip


def moe_job(parallel: dict[str, Any], **moe: Any) -> dict[str, Any]:
    raw = copy.deepcopy(MOE_TINY)
    raw["parallel"] = dict(parallel)
    raw["model"]["moe"].update(moe)
    return raw


LAYOUTS = [
    ("ep2", 2, {"ep": 2}),
    ("ep2-zero3", 2, {"ep": 2, "zero": 3}),
    ("ep4", 4, {"ep": 4}),
    ("ep2xtp2", 4, {"ep": 2, "tp": 2}),
    ("ep2xpp2", 4, {"ep": 2, "pp": 2}),
]


@pytest.fixture(scope="module")
def reference(gloo) -> dict[int, float]:
    (out,) = gloo.run(1, train_layout, moe_job({}), STEPS)
    losses = out["losses"]
    assert losses[STEPS] < losses[1], "the world-1 run did not learn"
    return losses


def _assert_same_losses(got: dict[int, float], ref: dict[int, float], what: str, rel: float):
    assert sorted(got) == sorted(ref), what
    for step in sorted(ref):
        assert got[step] == pytest.approx(ref[step], rel=rel), (
            f"{what} step {step}: {got[step]} vs world-1 {ref[step]}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=[entry[0] for entry in LAYOUTS])
def test_every_expert_layout_matches_world_1_step_by_step(gloo, reference, layout):
    name, world, parallel = layout
    results = gloo.run(world, train_layout, moe_job(parallel), STEPS)
    assert results[0]["layout"]["ep"] == parallel["ep"]
    for rank, out in enumerate(results):
        _assert_same_losses(out["losses"], reference, f"{name} rank {rank}", RTOL)
