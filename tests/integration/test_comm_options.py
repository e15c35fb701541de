"""parallel.comm does what it says: DDP's compression hooks, reduction after backward
(overlap: false), FSDP's prefetch and reduce dtype, each trained on the shared gloo
pool (tests/layouts.py); a setting on a layout it does not apply to is refused by the
CLI in one line."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers import assert_one_line_error
from layouts import job, train_layout

STEPS = 30
POWERSGD = {"compression": "powersgd", "powersgd_rank": 1, "powersgd_warmup": 2}


@pytest.fixture(scope="module")
def ddp_losses(gloo) -> dict[int, float]:
    """Plain DDP at world 2 (2 micro-batches accumulated per step): the curve every
    DDP option is held against."""
    return gloo.run(2, train_layout, job({"zero": 0}), STEPS)[0]["losses"]


def _losses(gloo, parallel: dict, steps: int = STEPS) -> dict[int, float]:
    results = gloo.run(2, train_layout, job(parallel), steps)
    assert results[0]["losses"] == results[1]["losses"]  # both ranks reduce the same loss
    return results[0]["losses"]


def _same(got: dict[int, float], ref: dict[int, float], rel: float, what: str) -> None:
    for step in sorted(got):
        assert got[step] == pytest.approx(ref[step], rel=rel), f"{what} step {step}"


@pytest.mark.parametrize(
    "comm",
    [{"compression": "bf16"}, {"compression": "fp16"}, POWERSGD],
    ids=["bf16", "fp16", "powersgd"],
)
def test_every_compression_trains_at_world_2(gloo, ddp_losses, comm):
    losses = _losses(gloo, {"zero": 0, "comm": comm})
    assert losses[STEPS] < 0.85 * losses[1], losses
    assert losses[STEPS] == pytest.approx(ddp_losses[STEPS], rel=0.05)
    # the hook runs: compressed gradients move the curve off plain DDP's
    assert any(losses[s] != ddp_losses[s] for s in losses)


def test_powersgd_compresses_after_its_warmup_counted_in_optimizer_steps(gloo, ddp_losses):
    """The hook runs on the synchronising micro-batch only (2 per step here), so its
    warm-up of 2 is 2 optimizer steps of plain all-reduce: the losses of steps 1-3
    (before the first compressed update) are DDP's, step 4's is not."""
    losses = _losses(gloo, {"zero": 0, "comm": POWERSGD}, steps=4)
    _same({s: losses[s] for s in (1, 2, 3)}, ddp_losses, 1e-6, "powersgd warm-up")
    assert losses[4] != pytest.approx(ddp_losses[4], rel=1e-6)


def test_powersgd_with_many_buckets_keeps_every_rank_in_step(gloo, ddp_losses):
    """PowerSGD all-reduces Q from P's completion callback; with many buckets in flight
    torch's hook as is lets two ranks start them in different orders, and gloo aborts
    on the mismatch (`op.preamble.length <= op.nbytes`). meshforge runs it bucket by
    bucket on gloo: 30 steps with ~40 buckets finish and learn."""
    losses = _losses(gloo, {"zero": 0, "comm": {**POWERSGD, "bucket_mb": 0.002}})
    assert losses[STEPS] < 0.85 * losses[1], losses


def test_zero1_takes_compression_as_ddp_does(gloo, ddp_losses):
    """ZeRO-1 shards only the optimizer: with the same hook it follows DDP's curve."""
    zero0 = _losses(gloo, {"zero": 0, "comm": POWERSGD}, steps=8)
    zero1 = _losses(gloo, {"zero": 1, "comm": POWERSGD}, steps=8)
    _same(zero1, zero0, 1e-4, "zero1 + powersgd vs zero0 + powersgd")
    assert zero1[8] != pytest.approx(ddp_losses[8], rel=1e-6)  # compressed, not plain
    bf16 = _losses(gloo, {"zero": 1, "comm": {"compression": "bf16"}}, steps=8)
    assert bf16[8] < bf16[1]
    assert any(bf16[s] != ddp_losses[s] for s in bf16)


def test_reduction_after_backward_gives_the_same_losses_as_overlap(gloo, ddp_losses):
    # small buckets: the flat all-reduces are many, not one
    comm = {"overlap": False, "bucket_mb": 0.01}
    losses = _losses(gloo, {"zero": 0, "comm": comm}, steps=20)
    _same(losses, ddp_losses, 1e-5, "overlap: false")


def test_flat_reduction_packs_gradients_into_buckets_of_bucket_mb():
    from meshforge.parallel.comm import FlatGradReduction

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1000, 1000, 3000, 10)]
    for p in params:
        p.grad = torch.ones_like(p)
    kib16 = 16 * 1024 / 2**20  # 16 KiB: 4096 fp32 values
    sizes = [[g.numel() for g in b] for b in FlatGradReduction(None, kib16).buckets(params)]
    assert sizes == [[1000, 1000], [3000, 10]]


def _fsdp_settings(raw: dict) -> dict:
    """This rank's FSDP units: parameter dtypes and how many blocks each prefetches."""
    from meshforge.config import build_config
    from meshforge.train.engine import Engine

    engine = Engine.build(build_config(raw), dist.get_rank(), 2, torch.device("cpu"))
    (model,) = engine.parts.modules
    blocks = list(model.blocks.values())

    def ahead(unit) -> tuple[int, int]:  # torch keeps the explicit lists on the unit's state
        state = unit._get_fsdp_state()
        return len(state._states_to_forward_prefetch), len(state._states_to_backward_prefetch)

    return {
        "dtypes": {str(p.dtype) for p in engine.parts.parameters()},
        "prefetch": [ahead(u) for u in [model, *blocks]],
    }


def test_zero3_prefetch_and_reduce_dtype_are_applied(gloo):
    comm = {"prefetch": 2, "reduce_dtype": "bf16"}
    settings = gloo.run(2, _fsdp_settings, job({"zero": 3, "comm": comm}))[0]
    assert settings["dtypes"] == {"torch.float32"}  # fp32 training keeps fp32 parameters
    # the root and 4 blocks: 2 ahead in forward, 2 behind in backward where there are
    assert settings["prefetch"] == [(2, 2), (2, 0), (2, 1), (1, 2), (0, 2)]


def test_zero3_with_prefetch_and_bf16_reduction_trains(gloo):
    default = _losses(gloo, {"zero": 3}, steps=10)
    prefetch = _losses(gloo, {"zero": 3, "comm": {"prefetch": 2}}, steps=10)
    _same(prefetch, default, 1e-6, "prefetch 2")  # prefetching moves only the gathers
    bf16 = _losses(gloo, {"zero": 3, "comm": {"prefetch": 2, "reduce_dtype": "bf16"}}, steps=10)
    assert bf16[10] < 0.9 * bf16[1]
    assert any(bf16[s] != default[s] for s in bf16)  # gradients reduced in bf16


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (["parallel.comm.compression=powersgd", "parallel.comm.powersgd_rank=0"],
         "parallel.comm.powersgd_rank"),
        (["parallel.zero=3", "parallel.comm.compression=bf16"], "parallel.comm.compression"),
        (["parallel.comm.overlap=false", "parallel.comm.compression=fp16"],
         "parallel.comm.overlap"),
        (["parallel.comm.prefetch=2"], "parallel.comm.prefetch"),
    ],
    ids=["powersgd-rank-0", "compression-under-zero3", "no-overlap-with-compression",
         "prefetch-under-zero0"],
)  # fmt: skip
def test_the_cli_refuses_a_setting_its_layout_cannot_take(job_factory, settings, named):
    job = job_factory()
    overrides = [arg for s in settings for arg in ("--set", s)]
    proc = job.train(2, *overrides, check=False)
    assert_one_line_error(proc, named)
    assert not job.run_dir.exists()
