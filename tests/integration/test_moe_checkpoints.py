"""A mixture-of-experts checkpoint written under any layout (expert parallel or not)
resumes under any other on the uninterrupted loss curve: in-process on the shared gloo
pool (tests/layouts.py), and end to end through `meshforge train` killed under ep2 and
resumed at world 1."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_moe_layouts import MOE_TINY, moe_job

from helpers import assert_killed_run_resumes_at_world_1
from layouts import train_layout

STEPS = 20

# (name, world saving, parallel saving, world resuming, parallel resuming)
RESHARDS = [
    ("ep2->world1", 2, {"ep": 2}, 1, {}),
    ("ep2-zero3->tp2", 2, {"ep": 2, "zero": 3}, 2, {"tp": 2}),
    ("world1->ep2", 1, {}, 2, {"ep": 2}),
    ("ep4->ep2xtp2", 4, {"ep": 4}, 4, {"ep": 2, "tp": 2}),
]


@pytest.fixture(scope="module")
def reference(gloo) -> dict[int, float]:
    (out,) = gloo.run(1, train_layout, moe_job({}), STEPS)
    return out["losses"]


def _assert_continues(resumed: dict, saved: dict, reference: dict[int, float], name: str):
    # the full parameters after the load are bitwise those that were saved
    assert resumed["digest_loaded"] == saved["digest_saved"], name
    assert sorted(resumed["losses"]) == list(range(11, STEPS + 1))
    for step in range(11, STEPS + 1):  # the loss continues as if never interrupted
        assert resumed["losses"][step] == pytest.approx(reference[step], rel=1e-3), (
            f"{name} step {step}: {resumed['losses'][step]} vs {reference[step]}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("name,wa,la,wb,lb", RESHARDS, ids=[r[0] for r in RESHARDS])
def test_a_moe_checkpoint_resumes_under_another_layout(
    gloo, reference, tmp_path, name, wa, la, wb, lb
):
    root = str(tmp_path / "checkpoints")
    saved = gloo.run(wa, train_layout, moe_job(la), 10, root, 10)[0]
    resumed = gloo.run(wb, train_layout, moe_job(lb), STEPS, root, None, True)[0]
    _assert_continues(resumed, saved, reference, name)


def _bias_of(engine) -> dict[str, list[float]]:
    return {
        name: buf.tolist()
        for m in engine.parts.modules
        for name, buf in m.named_buffers()
        if name.endswith("expert_bias")
    }


def bias_roundtrip(raw: dict, root: str, save: bool) -> dict[str, list[float]]:
    """On every rank: build the engine of `raw`; with `save`, give every layer's
    expert_bias distinct values and checkpoint step 1, else resume from `root`. The
    expert_bias buffers this rank holds."""
    import torch
    import torch.distributed as dist

    from meshforge.config import build_config
    from meshforge.train.checkpoint import Checkpointer
    from meshforge.train.engine import Engine

    cfg = build_config(raw)
    torch.manual_seed(cfg.train.seed)
    engine = Engine.build(cfg, dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    checkpointer = Checkpointer(Path(root), engine.optimizers, keep=3)
    if save:
        for m in engine.parts.modules:
            for name, buf in m.named_buffers():
                if name.endswith("expert_bias"):
                    layer = int(name.split(".")[1])
                    buf.copy_(torch.arange(buf.numel()) * 0.01 + layer)
        checkpointer.save(1, {"step": 1, "world_size": dist.get_world_size()})
    else:
        assert checkpointer.resume(dist.get_rank() == 0) is not None
    return _bias_of(engine)


@pytest.mark.parametrize(
    "wa,la,wb,lb",
    [(2, {"ep": 2}, 1, {}), (1, {}, 4, {"ep": 2, "pp": 2}),
     (2, {"ep": 2, "zero": 3}, 2, {"tp": 2})],
    ids=["ep2->world1", "world1->ep2xpp2", "ep2-zero3->tp2"],
)  # fmt: skip
def test_the_expert_bias_survives_a_checkpoint_across_layouts(gloo, tmp_path, wa, la, wb, lb):
    # load_balance: bias keeps a per-expert buffer that is no parameter: it is saved
    # and loaded with the model under every layout
    root = str(tmp_path / "checkpoints")
    raw_a, raw_b = moe_job(la, load_balance="bias"), moe_job(lb, load_balance="bias")
    saved = gloo.run(wa, bias_roundtrip, raw_a, root, True)
    loaded = gloo.run(wb, bias_roundtrip, raw_b, root, False)
    expected = {f"blocks.{i}.mlp.expert_bias": [i + 0.01 * e for e in range(4)] for i in range(4)}
    for what, results in (("saved", saved), ("loaded", loaded)):
        held: dict[str, list[float]] = {}
        for per_rank in results:
            for name, values in per_rank.items():
                assert values == pytest.approx(expected[name]), (what, name, values)
                held[name] = values
        assert sorted(held) == sorted(expected), what  # every layer on some rank


# -- end to end: `meshforge train` killed under ep2, resumed at world 1 --------------------
CLI_JOB = {
    "model": MOE_TINY["model"],
    "parallel": {"ep": 2},
    "train": {"steps": 8, "global_batch": 8, "micro_batch": 2, "warmup": 2},
    "checkpoint": {"every": 4, "keep": 2},
}


@pytest.mark.slow
def test_a_run_killed_under_ep2_resumes_at_world_1_on_the_uninterrupted_curve(tmp_path):
    assert_killed_run_resumes_at_world_1(tmp_path, CLI_JOB, "ep")
