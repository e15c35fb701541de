"""The tiny mixture of experts trains the same under every expert-parallel layout as
at world 1, step by step, and its routing adds up: the engine run in-process on the
shared gloo pool (tests/layouts.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from layouts import assert_same_losses

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
    ("ep2-dp4", 4, {"ep": 2}),  # two expert groups: expert gradients all-reduced over edp
    ("ep2-zero3-dp4", 4, {"ep": 2, "zero": 3}),  # ... and sharded over edp by FSDP
    ("ep2xtp2", 4, {"ep": 2, "tp": 2}),
    ("ep2xpp2", 4, {"ep": 2, "pp": 2}),
]


@pytest.fixture(scope="module")
def reference(gloo) -> dict[str, Any]:
    (out,) = gloo.run(1, train_with_load, moe_job({}), STEPS)
    losses = out["losses"]
    assert losses[STEPS] < losses[1], "the world-1 run did not learn"
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=[entry[0] for entry in LAYOUTS])
def test_every_expert_layout_matches_world_1_step_by_step(gloo, reference, layout):
    name, world, parallel = layout
    results = gloo.run(world, train_with_load, moe_job(parallel), STEPS)
    assert results[0]["layout"]["ep"] == parallel["ep"]
    for rank, out in enumerate(results):
        assert_same_losses(out["losses"], reference["losses"], f"{name} rank {rank}", RTOL)
    # each rank holds 1/ep of the experts, and ZeRO-3 shards them over edp too
    zero3 = parallel.get("zero") == 3
    share = (
        1
        / parallel["ep"]
        / (
            world // parallel["ep"] // parallel.get("tp", 1) // parallel.get("pp", 1)
            if zero3
            else 1
        )
    )
    assert results[0]["expert_share"] == pytest.approx(share), name
    # the gradient norm (AdamW would hide a wrongly scaled gradient from the losses)
    assert_same_losses(results[0]["grad_norm"], reference["grad_norm"], f"{name} grad norm", RTOL)


def train_with_load(raw: dict[str, Any], steps: int) -> dict[str, Any]:
    """train_layout's loop with the trainer's expert-load accounting: the losses, and
    the `moe` section of a row logged after every step (collective on every rank)."""
    import torch
    import torch.distributed as dist

    from layouts import step_batches
    from meshforge.config import build_config
    from meshforge.train.engine import Engine
    from meshforge.train.moe_load import ExpertLoad

    cfg = build_config(raw)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.train.seed)
    engine = Engine.build(cfg, rank, world, torch.device("cpu"))
    dims = engine.dims
    load = ExpertLoad(engine.parts, dims, engine.mesh, rank, cfg.model.n_layers)
    out: dict[str, Any] = {"losses": {}, "moe": {}, "grad_norm": {}, "layout": dims.as_dict()}
    for step in range(steps):
        micro_batches = step_batches(cfg, engine, step)
        result = engine.strategy.step(step, micro_batches, measure=False)
        out["losses"][step + 1] = engine.strategy.reduce_loss(
            result.loss_sum / dims.microbatches
        ).item()
        out["grad_norm"][step + 1] = float(result.grad_norm)  # clipped at 1.0: computed
        engine.optimizers.zero_grad()
        load.after_step()
        out["moe"][step + 1] = load.interval(torch.device("cpu"))
    experts = [p for n, p in engine.parts.named_parameters() if ".experts." in n]
    # of the whole weights of the layers this rank's stage holds (experts x ffn x d each)
    m = cfg.model
    whole = len(experts) * m.moe.experts * m.moe.expert_ffn * m.d_model
    out["expert_share"] = sum(_local(p).numel() for p in experts) / whole
    out["bias"] = {
        name: buf.tolist()
        for part in engine.parts.modules
        for name, buf in part.named_buffers()
        if name.endswith("expert_bias")
    }
    return out


def _local(p: Any) -> Any:
    return p.to_local() if hasattr(p, "to_local") else p


TOKENS_PER_STEP = 8 * 32  # global batch x seq_len


@pytest.mark.slow
@pytest.mark.parametrize("world,parallel", [(1, {}), (2, {"ep": 2}), (4, {"ep": 2, "tp": 2}),
                                            (4, {"ep": 2, "pp": 2})],
                         ids=["world1", "ep2", "ep2xtp2", "ep2xpp2"])  # fmt: skip
def test_routing_counts_add_up_to_tokens_times_top_k(gloo, world, parallel):
    results = gloo.run(world, train_with_load, moe_job(parallel), 3)
    for out in results:  # every rank sees the same reduced counts
        assert out["moe"] == results[0]["moe"]
    for step, section in results[0]["moe"].items():
        assert section["layers"] == [0, 1, 2, 3], step
        for layer, tokens in zip(section["layers"], section["tokens_per_expert"], strict=True):
            assert len(tokens) == 4
            assert sum(tokens) == TOKENS_PER_STEP * 2, (step, layer, tokens)
        assert section["dropped"] == 0
        assert section["max_load"] >= 1.0
        assert section["aux_loss"] > 0


@pytest.mark.slow
def test_a_capacity_factor_drops_tokens_and_ep2_matches_world_1(gloo):
    capped = {"capacity_factor": 0.5}  # each expert takes half its even share
    (ref,) = gloo.run(1, train_with_load, moe_job({}, **capped), 6)
    ep2 = gloo.run(2, train_with_load, moe_job({"ep": 2}, **capped), 6)[0]
    assert_same_losses(ep2["losses"], ref["losses"], "ep2 with capacity", RTOL)
    for step, section in ref["moe"].items():
        # routed counts still add up; at least half of them are dropped at c = 0.5
        assert all(sum(t) == TOKENS_PER_STEP * 2 for t in section["tokens_per_expert"])
        assert section["dropped"] >= TOKENS_PER_STEP * 2 * 4 // 2, step
        assert ep2["moe"][step]["dropped"] == section["dropped"], step
        assert ep2["moe"][step]["tokens_per_expert"] == section["tokens_per_expert"], step


@pytest.mark.slow
def test_bias_balancing_moves_the_same_bias_under_ep2_as_at_world_1(gloo):
    bias = {"load_balance": "bias", "bias_update_rate": 0.01}
    (ref,) = gloo.run(1, train_with_load, moe_job({}, **bias), 10)
    ep2 = gloo.run(2, train_with_load, moe_job({"ep": 2}, **bias), 10)[0]
    assert_same_losses(ep2["losses"], ref["losses"], "ep2 with bias balancing", RTOL)
    assert "aux_loss" not in ref["moe"][10]
    # every layer's bias moved, by the load over both ranks: as world 1's did
    assert sorted(ref["bias"]) == [f"blocks.{i}.mlp.expert_bias" for i in range(4)]
    for name, bias in ref["bias"].items():
        assert any(b != 0 for b in bias), name
        assert ep2["bias"][name] == pytest.approx(bias, abs=1e-6), name
