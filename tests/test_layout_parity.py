"""Every layout trains the same model: world 1 vs world 2 under ZeRO 0-3, step by step."""

from __future__ import annotations

import pytest

STEPS = 20
RTOL = 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("micro_batch", [4, 2], ids=["no-accum", "accum"])
def test_losses_match_world1_for_every_zero_stage(job_factory, micro_batch):
    # global_batch 8: at world 2 micro_batch 4 means 1 micro-batch per step, 2 means 2.
    base = {"train": {"micro_batch": micro_batch, "steps": STEPS}}
    reference = job_factory(base, name="world1")
    reference.train(1)
    ref = reference.losses()
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert ref[STEPS] < ref[1], "the reference run did not learn"
    for zero in (0, 1, 2, 3):
        job = job_factory({**base, "parallel": {"zero": zero}}, name=f"zero{zero}")
        job.train(2)
        got = job.losses()
        accum = job.report["layout"]["grad_accum"]
        assert accum == (1 if micro_batch == 4 else 2)
        for step in range(1, STEPS + 1):
            assert got[step] == pytest.approx(ref[step], rel=RTOL), (
                f"zero={zero} step {step}: {got[step]} vs world-1 {ref[step]}"
            )
