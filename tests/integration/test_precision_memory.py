"""Mixed precision and activation checkpointing train the same model."""

from __future__ import annotations

import pytest

from layouts import job, train_layout


@pytest.mark.slow
@pytest.mark.parametrize("dtype, zero", [("bf16", 3), ("fp16", 2)])
def test_mixed_precision_trains_under_zero(job_factory, dtype, zero):
    job = job_factory({"precision": {"dtype": dtype}, "parallel": {"zero": zero}})
    job.train(2)
    losses = job.losses()
    assert losses[20] < losses[1] - 0.5, losses
    assert job.report["layout"]["dtype"] == dtype
    if dtype == "fp16":
        rows = (job.run_dir / "metrics.jsonl").read_text()
        assert '"loss_scale"' in rows  # the dynamic loss scale is tracked


@pytest.mark.slow
def test_activation_checkpointing_does_not_change_the_losses(gloo):
    curves = {}
    for mode in ("none", "full", "selective"):
        raw = job({}, train={"activation_checkpointing": mode, "steps": 8})
        raw["model"] = {**raw["model"], "n_layers": 3}
        (out,) = gloo.run(1, train_layout, raw, 8)  # the engine the trainer runs
        curves[mode] = out["losses"]
    for mode in ("full", "selective"):
        for step, loss in curves["none"].items():
            assert curves[mode][step] == pytest.approx(loss, rel=1e-5)
