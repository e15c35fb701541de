"""The layout rules (layout/rules.py): each written once, named in the caller's fields."""

from __future__ import annotations

import pytest

from meshforge.config import build_config
from meshforge.errors import ConfigError
from meshforge.layout import JOB_NAMES, LayoutRequest, ModelShape, check, derive
from meshforge.plan.core.layout import FLAG_NAMES

SHAPE = ModelShape(n_layers=4, d_model=64, n_heads=4, kv_heads=4, mlp_hidden=256,
                   vocab_size=256, seq_len=32)  # fmt: skip


def test_one_rule_speaks_the_job_files_names_and_the_command_lines():
    req = LayoutRequest(tp=3)
    assert check(req, SHAPE, JOB_NAMES, trainer=False)[0] == (
        "parallel.tp=3 does not divide model.n_heads=4"
    )
    assert check(req, SHAPE, FLAG_NAMES, trainer=False)[0] == "--tp 3 does not divide --heads 4"


def test_every_violation_is_returned_not_only_the_first():
    req = LayoutRequest(tp=3, pp=2, zero=1, dtype="fp16")
    problems = check(req, SHAPE, JOB_NAMES)
    assert any("model.n_heads=4" in p for p in problems)
    assert any(p.startswith("parallel.zero=1 with parallel.tp=3") for p in problems)
    assert any(p.startswith("precision.dtype=fp16") for p in problems)


def test_the_trainers_own_rules_apply_to_the_trainer_only():
    # tp=2 splits 4 heads, but not a vocabulary of 255: the trainer refuses, a bare
    # planner shape (another framework pads the vocabulary) does not
    shape = ModelShape(**{**SHAPE.__dict__, "vocab_size": 255})
    assert check(LayoutRequest(tp=2), shape, FLAG_NAMES, trainer=False) == []
    assert "vocab_size=255" in check(LayoutRequest(tp=2), shape, JOB_NAMES)[0]


def test_derive_fills_dp_and_microbatches_from_the_world():
    req = LayoutRequest(tp=2, pp=2, global_batch=16, micro_batch=2)
    dims = derive(req, SHAPE, world_size=8)
    assert (dims.dp, dims.tp, dims.pp, dims.microbatches) == (2, 2, 2, 4)
    assert dims.coords(5) == {"tp": 1, "cp": 0, "dp": 0, "pp": 1}
    with pytest.raises(ConfigError, match="world size 6 is not divisible by parallel.tp=2"):
        derive(req, SHAPE, world_size=6)


def test_a_parameter_server_layout_counts_its_workers():
    req = LayoutRequest(servers=1, global_batch=8, micro_batch=2)
    dims = derive(req, SHAPE, world_size=3)
    assert (dims.dp, dims.servers, dims.world_size, dims.is_server(2)) == (2, 1, 3, True)
    with pytest.raises(ConfigError, match="leaves no worker in world size 1"):
        derive(req, SHAPE, world_size=1)


def test_virtual_stages_without_a_pipeline_are_refused_in_both_vocabularies():
    req = LayoutRequest(pp=1, pp_schedule="interleaved_1f1b", virtual_stages=2)
    assert "parallel.virtual_stages > 1 needs parallel.pp > 1" in check(req, SHAPE)
    assert "--virtual-stages > 1 needs --pp > 1" in check(req, SHAPE, FLAG_NAMES, trainer=False)


def test_a_job_config_and_its_layout_request_agree():
    cfg = build_config({"model": {"n_layers": 4, "tie_embeddings": False},
                        "parallel": {"pp": 2, "pp_schedule": "gpipe"},
                        "train": {"global_batch": 8, "micro_batch": 2}})  # fmt: skip
    dims = cfg.dims(4)
    assert (dims.dp, dims.pp, dims.pp_schedule, dims.microbatches) == (2, 2, "gpipe", 2)
    assert dims.as_dict()["pp_schedule"] == "gpipe"
