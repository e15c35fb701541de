"""A mixture of experts trained by `meshforge train` (expert parallel) leaves through
`meshforge export --format hf` as a MixtralForCausalLM that transformers loads with no
custom code and that computes meshforge's logits and greedy continuation; a mixture
Mixtral cannot express is refused in one line."""

from __future__ import annotations

import copy

import pytest
import torch
from test_moe_layouts import MOE_TINY

from helpers import Job, assert_one_line_error, meshforge
from meshforge.config import build_config, save_config
from meshforge.data.tokenizer import ByteTokenizer
from meshforge.models import export as formats
from meshforge.train.saved_run import load_model

transformers = pytest.importorskip("transformers")

STEPS = 4
ATOL = 1e-4
PROMPT = "def "


def _moe_model(**moe) -> dict:
    model = copy.deepcopy(MOE_TINY["model"])
    model["moe"].update(moe)
    return model


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """A tiny Mixtral-like MoE (with a head_dim of its own) trained under ep2."""
    model = {**_moe_model(), "head_dim": 16}
    job = Job(
        tmp_path_factory.mktemp("moe-export"),
        {"model": model, "parallel": {"ep": 2}, "train": {"steps": STEPS, "warmup": 1}},
        name="moe",
    )
    job.train(2)
    return job


@pytest.mark.slow
def test_a_moe_run_exports_as_mixtral_with_meshforge_logits_and_greedy_tokens(moe_run, tmp_path):
    out = tmp_path / "hf"
    proc = meshforge(["export", str(moe_run.run_dir), "--format", "hf", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert "MixtralForCausalLM" in proc.stdout and len(proc.stdout.strip().splitlines()) == 1

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(hf).__name__ == "MixtralForCausalLM"
    assert not any(info.values()), info  # no weight missing, unexpected or reshaped
    assert hf.config.num_local_experts == 4 and hf.config.num_experts_per_tok == 2
    model, step = load_model(moe_run.run_dir)
    assert step == STEPS
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = model(idx), hf.eval()(idx).logits
    assert ours.shape == theirs.shape == (2, 32, 256)
    assert torch.allclose(ours, theirs, rtol=0, atol=ATOL), (ours - theirs).abs().max()

    # greedy decoding: transformers' generate continues the prompt as meshforge sample
    sampled = meshforge(["sample", str(moe_run.run_dir), "--prompt", PROMPT, "--tokens", "16",
                         "--temperature", "0"])  # fmt: skip
    assert sampled.returncode == 0, sampled.stderr
    ids = torch.tensor([ByteTokenizer().encode(PROMPT).tolist()])
    with torch.no_grad():
        gen = hf.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert gen.shape == (1, len(PROMPT) + 16)
    assert sampled.stdout == ByteTokenizer().decode(gen[0].tolist()) + "\n"


@pytest.mark.parametrize(
    "moe,why",
    [({"shared_experts": 1}, "shared_experts=1"), ({"dense_layers": 1}, "dense_layers=1"),
     ({"router": "sigmoid"}, "router=sigmoid"), ({"load_balance": "bias"}, "load_balance=bias")],
    ids=["shared", "dense", "sigmoid", "bias"],
)  # fmt: skip
def test_a_moe_that_mixtral_cannot_express_is_refused_in_one_line(tmp_path, moe, why):
    # refused from config.yaml alone, before any checkpoint is looked for
    run = tmp_path / "run"
    run.mkdir()
    save_config(build_config({"model": _moe_model(**moe)}), run / "config.yaml")
    proc = meshforge(["export", str(run), "--format", "hf"])
    assert_one_line_error(proc, why, "MixtralForCausalLM", "--format torch")
    assert not (run / "export").exists()


def test_the_mixtral_mapping_names_every_expert_once():
    cfg = build_config({"model": _moe_model()}).model
    shapes = {
        f"blocks.{i}.mlp.{name}": shape
        for i in range(cfg.n_layers)
        for name, shape in (("router.weight", (4, 32)), ("experts.gate.weight", (4, 32, 32)),
                            ("experts.up.weight", (4, 32, 32)),
                            ("experts.proj.weight", (4, 32, 32)))
    }  # fmt: skip
    state = {k: torch.randn(s) for k, s in shapes.items()}
    out = formats.hf_weights(cfg, state)
    assert len(out) == cfg.n_layers * (1 + 3 * 4)
    layer = "model.layers.1.block_sparse_moe."
    assert torch.equal(out[f"{layer}gate.weight"], state["blocks.1.mlp.router.weight"])
    for ours, theirs in (("gate", "w1"), ("proj", "w2"), ("up", "w3")):
        for e in range(4):
            got = out[f"{layer}experts.{e}.{theirs}.weight"]
            assert torch.equal(got, state[f"blocks.1.mlp.experts.{ours}.weight"][e])


def test_the_mixtral_config_carries_the_routing_and_notes_a_capacity():
    cfg = build_config({"model": {**_moe_model(load_balance="none"), "head_dim": 16}}).model
    config = formats.hf_config(cfg, eod_id=None)
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)
    assert (config["intermediate_size"], config["head_dim"]) == (32, 16)
    assert config["router_aux_loss_coef"] == 0.0  # load_balance: none
    assert formats.hf_notes(cfg) == []
    capped = build_config({"model": _moe_model(capacity_factor=1.25)}).model
    (note,) = formats.hf_notes(capped)
    assert "capacity_factor=1.25" in note and "every token" in note
