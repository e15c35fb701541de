"""A mixture-of-experts job that cannot train is refused before any worker starts:
exit code 2, one line naming the fields (issue 27, part 6). Every case is checked
in-process against the config's error (fast); a few also through the CLI, as a
user meets them."""

from __future__ import annotations

import pytest
import yaml

from helpers import TINY_JOB, assert_one_line_error, merge, meshforge
from meshforge.config import build_config, load_config
from meshforge.errors import ConfigError

MOE = {"model": {"name": "llama", "n_kv_heads": 2, "tie_embeddings": False,
                 "moe": {"experts": 4, "top_k": 2, "expert_ffn": 16}}}  # fmt: skip

# (id, overrides of TINY_JOB + MOE, --nproc, words the one line must contain)
CASES = [
    ("experts-not-divisible-by-ep", {"parallel": {"ep": 3}}, 3,
     ["parallel.ep=3", "model.moe.experts=4"]),
    ("top-k-above-experts", {"model": {"moe": {"top_k": 5}}}, 1,
     ["model.moe.top_k=5", "model.moe.experts=4"]),
    ("ep-not-dividing-dp", {"parallel": {"ep": 4}}, 2, ["parallel.ep=4", "dp=2"]),
    ("ep-beyond-dp-under-tp", {"parallel": {"ep": 2, "tp": 2}}, 2, ["parallel.ep=2", "dp=1"]),
    ("moe-on-gpt", {"model": {"name": "gpt", "n_kv_heads": None}}, 1,
     ["model.moe", "llama", "gpt"]),
    ("capacity-zero", {"model": {"moe": {"capacity_factor": 0}}}, 1,
     ["model.moe.capacity_factor=0"]),
    ("capacity-negative", {"model": {"moe": {"capacity_factor": -1.5}}}, 1,
     ["model.moe.capacity_factor=-1.5"]),
    ("ep-with-parameter-server", {"parallel": {"ep": 2, "mode": "parameter_server"}}, 3,
     ["parallel.ep=2", "parameter_server"]),
    ("ep-on-a-dense-model", {"model": {"moe": None}, "parallel": {"ep": 2}}, 2,
     ["parallel.ep=2", "mixture-of-experts"]),
    ("dense-layers-cover-all", {"model": {"moe": {"dense_layers": 2}}}, 1,
     ["model.moe.dense_layers=2", "n_layers=2"]),
    ("coeff-without-aux-loss", {"model": {"moe": {"load_balance": "bias",
                                                   "aux_loss_coeff": 0.1}}}, 1,
     ["model.moe.aux_loss_coeff", "load_balance=aux_loss"]),
    ("bad-router", {"model": {"moe": {"router": "relu"}}}, 1, ["model.moe.router"]),
    ("fp16", {"precision": {"dtype": "fp16"}}, 1, ["precision.dtype=fp16", "bf16"]),
    ("sequence-parallel", {"parallel": {"tp": 2, "sequence_parallel": True}}, 2,
     ["parallel.sequence_parallel=true", "mixture-of-experts"]),
    ("ep-with-zero1", {"parallel": {"ep": 2, "zero": 1}}, 2, ["parallel.ep=2", "parallel.zero=1"]),
]  # fmt: skip


THROUGH_THE_CLI = {"experts-not-divisible-by-ep", "ep-not-dividing-dp", "moe-on-gpt",
                   "capacity-zero"}  # fmt: skip


def _raw(overrides: dict) -> dict:
    raw = merge(merge(TINY_JOB, MOE), overrides)
    if raw["model"].get("moe") is None:
        raw["model"].pop("moe", None)
    if raw["model"]["name"] == "gpt":
        raw["model"].pop("n_kv_heads", None)
        raw["model"].pop("tie_embeddings", None)
    return raw


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_moe_config_names_the_fields_in_one_line(case):
    _, overrides, nproc, words = case
    with pytest.raises(ConfigError) as err:
        build_config(_raw(overrides)).dims(nproc)
    line = str(err.value)
    assert "\n" not in line
    for word in words:
        assert word.lower() in line.lower(), (word, line)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in THROUGH_THE_CLI],
                         ids=[c[0] for c in CASES if c[0] in THROUGH_THE_CLI])  # fmt: skip
def test_bad_moe_input_exits_2_with_one_line(tmp_path, case):
    _, overrides, nproc, words = case
    raw = _raw(overrides)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "run"
    proc = meshforge(
        ["train", str(path), "--run-dir", str(run_dir), "--nproc", str(nproc)], timeout=120
    )
    line = assert_one_line_error(proc, *words)
    assert line.startswith(f"meshforge: error: {path}: "), line  # the file, as every field's
    assert not run_dir.exists() or not (run_dir / "checkpoints").exists()


def test_a_layout_error_at_a_world_size_names_the_job_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_raw({"parallel": {"ep": 4}})))
    with pytest.raises(ConfigError) as err:
        load_config(path).dims(2)
    assert str(err.value).startswith(f"{path}: parallel.ep=4 does not divide")
    with pytest.raises(ConfigError) as err:  # a job not read from a file names none
        build_config(_raw({"parallel": {"ep": 4}})).dims(2)
    assert str(err.value).startswith("parallel.ep=4 does not divide")


# model.moe on a gpt is refused for its family before any other complaint: not the
# preset's other llama fields (n_kv_heads), nor the moe fields a gpt could not use
GPT_WITH_MOE = [
    ("preset-renamed-gpt", {"preset": "moe-tiny", "name": "gpt"}),
    ("moe-fields-missing", {"name": "gpt", "moe": {"experts": 4}}),
    ("beside-n-kv-heads", {"name": "gpt", "n_kv_heads": 2,
                           "moe": {"experts": 4, "top_k": 2, "expert_ffn": 16}}),
]  # fmt: skip


@pytest.mark.parametrize("model", [m for _, m in GPT_WITH_MOE], ids=[i for i, _ in GPT_WITH_MOE])
def test_moe_on_gpt_names_the_family_first(model):
    raw = merge(TINY_JOB, {"model": {}})
    raw["model"] = model
    with pytest.raises(ConfigError) as err:
        build_config(raw)
    assert str(err.value) == "model.moe applies to model.name=llama, not gpt"


def test_moe_preset_set_to_gpt_exits_2_naming_the_family(tmp_path):
    run_dir = tmp_path / "run"
    proc = meshforge(["train", "examples/moe-tiny.yaml", "--set", "model.name=gpt",
                      "--run-dir", str(run_dir)], timeout=120)  # fmt: skip
    line = assert_one_line_error(proc, "model.moe applies to model.name=llama, not gpt")
    assert "n_kv_heads" not in line
    assert not run_dir.exists()
