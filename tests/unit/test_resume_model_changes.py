"""A run directory resumed as another model is refused in one line that names the
fields that differ, down to the fields of model.moe (never a whole section)."""

from __future__ import annotations

import pytest

from helpers import TINY_JOB, merge
from meshforge.config import build_config, save_config
from meshforge.errors import ConfigError
from meshforge.launch.rundir import check_earlier_run, model_changes

MOE = {"model": {"name": "llama", "n_kv_heads": 2, "tie_embeddings": False,
                 "moe": {"experts": 4, "top_k": 2, "expert_ffn": 16}}}  # fmt: skip


def _cfg(*overrides: dict):
    raw = TINY_JOB
    for extra in overrides:
        raw = merge(raw, extra)
    return build_config(raw)


def _run_dir(tmp_path, cfg):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_config(cfg, run_dir / "config.yaml")
    return run_dir


def test_other_experts_name_only_that_moe_field(tmp_path):
    run_dir = _run_dir(tmp_path, _cfg(MOE))
    now = _cfg(MOE, {"model": {"moe": {"experts": 8}}})
    with pytest.raises(ConfigError) as err:
        check_earlier_run(now, run_dir, fresh=False)
    line = str(err.value)
    assert "\n" not in line
    assert "model.moe.experts 4 -> 8" in line
    assert "expert_ffn" not in line and "top_k" not in line and "{" not in line


def test_each_differing_moe_field_and_model_field_is_named():
    before = _cfg(MOE).model_dump(mode="json")
    now = _cfg(MOE, {"model": {"d_model": 64, "moe": {"top_k": 1, "expert_ffn": 32}}})
    assert model_changes(before, now) == [
        "model.d_model 32 -> 64", "model.moe.top_k 2 -> 1", "model.moe.expert_ffn 16 -> 32"
    ]  # fmt: skip


def test_a_mixture_of_experts_added_or_removed_is_named_as_the_section():
    dense = _cfg(merge(MOE, {"model": {"moe": None}}))
    moe = _cfg(MOE)
    assert model_changes(dense.model_dump(mode="json"), moe) == ["model.moe None -> set"]
    assert model_changes(moe.model_dump(mode="json"), dense) == ["model.moe set -> None"]


def test_the_same_model_is_no_change(tmp_path):
    cfg = _cfg(MOE)
    assert model_changes(cfg.model_dump(mode="json"), cfg) == []
    check_earlier_run(cfg, _run_dir(tmp_path, cfg), fresh=False)
