"""Context parallelism with what else a job may turn on, each trained step by step
against world 1 in-process on the shared gloo pool (tests/layouts.py): a pipeline
(pp2 x cp2, world 4: the stages pass hidden states of this rank's tokens and know
their positions, ContextStage) and activation checkpointing (the recomputed forward
gathers the keys and values again)."""

from __future__ import annotations

import pytest
from test_context_parallel import STEPS, _assert_matches, _reference, cp_job, train_cp


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "method"), [("gpt", "allgather"), ("llama", "allgather"), ("llama", "alltoall")]
)
def test_pp2_x_cp2_matches_world_1_step_by_step(gloo, model, method):
    ref = _reference(gloo, model)
    results = gloo.run(4, train_cp, cp_job(model, {"cp": 2, "pp": 2, "cp_method": method}), STEPS)
    assert results[0]["layout"]["cp"] == 2 and results[0]["layout"]["pp"] == 2
    _assert_matches(results, ref, f"{model} pp2xcp2 {method}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_cp2_with_activation_checkpointing_matches_world_1(gloo, mode):
    ref = _reference(gloo, "llama")
    raw = cp_job("llama", {"cp": 2}, train={"activation_checkpointing": mode})
    results = gloo.run(2, train_cp, raw, STEPS)
    _assert_matches(results, ref, f"llama cp2 {mode} checkpointing")
    plain = gloo.run(2, train_cp, cp_job("llama", {"cp": 2}), 1)
    if mode == "full":  # only the blocks' inputs are kept
        assert results[0]["activation_bytes"] < plain[0]["activation_bytes"]
