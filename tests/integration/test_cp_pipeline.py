"""Context parallelism under a pipeline: pp2 x cp2 (world 4) trains world 1's model
step by step, in-process on the shared gloo pool (tests/layouts.py); the stages pass
hidden states of this rank's tokens and know their positions (ContextStage)."""

from __future__ import annotations

import pytest
from test_context_parallel import STEPS, _assert_matches, _reference, cp_job, train_cp


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_pp2_x_cp2_matches_world_1_step_by_step(gloo, model):
    ref = _reference(gloo, model)
    results = gloo.run(4, train_cp, cp_job(model, {"cp": 2, "pp": 2}), STEPS)
    assert results[0]["layout"]["cp"] == 2 and results[0]["layout"]["pp"] == 2
    _assert_matches(results, ref, f"{model} pp2xcp2")
