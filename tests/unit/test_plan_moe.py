"""The planner knows a mixture of experts: total parameters for memory, active ones for
FLOPs, the expert-parallel all-to-alls against the link, ep in the layout search, the
`meshforge plan` flags, and the published MoE runs it was not fitted on."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import assert_one_line_error
from meshforge.config import ModelConfig
from meshforge.errors import ConfigError
from meshforge.plan.core.comm import busbw_factor, ep_alltoall_bytes
from meshforge.plan.core.flops import (
    GPTShape,
    gpt_param_count,
    microbatch_flops,
    shape_of,
    training_flops_per_token,
)
from meshforge.plan.core.hardware import Cluster, gpu_spec, link_spec
from meshforge.plan.core.layout import Layout, Training
from meshforge.plan.core.predict import evaluate
from meshforge.plan.core.published_moe import PUBLISHED_MOE_RUNS
from meshforge.plan.core.search import LayoutChoice, search_layouts
from meshforge.plan.core.timing import step_time
from meshforge.plan.core.validation import moe_markdown, moe_validation_table, supported
from meshforge.plan.jobs.request import build_model

MIXTRAL = shape_of(ModelConfig(preset="mixtral-8x7b", seq_len=4096))
QWEN3 = shape_of(ModelConfig(preset="qwen3-30b-a3b", seq_len=4096))
# a small MoE that the search runs through quickly: 8 experts, top-2, 4 layers
SMALL = GPTShape(4, 512, 8, 1000, 256, family="llama", n_kv_heads=4, ffn_hidden=1024,
                 experts=8, top_k=2, expert_ffn=512)  # fmt: skip


def _cluster(n: int, gpus_per_node: int = 8, network: str = "ib-ndr") -> Cluster:
    return Cluster(gpu_spec("h100"), n, min(n, gpus_per_node), link_spec("nvlink4"),
                   link_spec(network), nics_per_node=min(n, gpus_per_node))  # fmt: skip


# -- parameters and FLOPs -------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, total, active",
    [
        # Mistral AI, "Mixtral of Experts", arXiv 2401.04088: 47B total (46.7B on the Hub's
        # model card), 13B active (12.9B)
        (MIXTRAL, 46.7e9, 12.9e9),
        # Qwen, Qwen3-30B-A3B model card: 30.5B total, 3.3B activated
        (QWEN3, 30.5e9, 3.3e9),
    ],
    ids=["mixtral-8x7b", "qwen3-30b-a3b"],
)
def test_param_counts_match_the_published_total_and_active(shape, total, active):
    count = gpt_param_count(shape)
    assert count.total == pytest.approx(total, rel=0.02)
    assert count.active == pytest.approx(active, rel=0.03)
    assert count.embedding + count.non_embedding == count.total  # the fields still add up


def test_a_dense_model_has_every_parameter_active():
    dense = shape_of(ModelConfig(preset="llama-8b"))
    count = gpt_param_count(dense)
    assert count.active == count.total == 8_030_261_248


def test_flops_count_the_active_parameters_not_the_held_ones():
    count = gpt_param_count(MIXTRAL)
    head = MIXTRAL.vocab_size * MIXTRAL.d_model  # embedding lookups are not matmuls
    attention = 12.0 * MIXTRAL.n_layers * MIXTRAL.seq_len * MIXTRAL.q_width
    # 6 x (active parameters less the untied embedding table) + the attention scores
    expected = 6.0 * (count.active - head - MIXTRAL.n_layers * 2 * MIXTRAL.d_model
                      - MIXTRAL.d_model) + attention  # fmt: skip
    assert training_flops_per_token(MIXTRAL) == pytest.approx(expected, rel=1e-9)
    assert training_flops_per_token(MIXTRAL) < 0.35 * 6.0 * count.total
    # the planner's per-micro-batch count is the trainer's per-token one
    flops = microbatch_flops(MIXTRAL, 1).model(MIXTRAL.n_layers)
    assert flops == pytest.approx(MIXTRAL.seq_len * training_flops_per_token(MIXTRAL))


def test_more_experts_at_the_same_top_k_add_memory_not_flops():
    wider = replace(SMALL, experts=16)
    assert gpt_param_count(wider).total > gpt_param_count(SMALL).total
    # only the router grows with the experts: h x E more per layer
    delta = training_flops_per_token(wider) - training_flops_per_token(SMALL)
    assert delta == pytest.approx(6.0 * SMALL.n_layers * SMALL.d_model * 8)


def test_head_dim_sets_the_attention_width():
    assert QWEN3.q_width == 32 * 128 and QWEN3.kv_width == 4 * 128
    assert QWEN3.q_width != QWEN3.d_model  # Qwen3's heads are wider than d_model / n_heads


def test_dense_layers_are_dense():
    mixed = replace(SMALL, dense_layers=2)
    assert gpt_param_count(SMALL).total > gpt_param_count(mixed).total
    assert mixed.moe_layers == 2


# -- memory ---------------------------------------------------------------------------


def test_expert_parallel_ranks_hold_their_share_of_the_experts():
    cluster, training = _cluster(16), Training(global_batch=64, micro_batch=1)
    states = {}
    for ep in (1, 2, 8):
        layout = Layout(dp=16, zero=0, ep=ep)
        states[ep] = evaluate(MIXTRAL, layout, training, cluster).memory.params
    experts = MIXTRAL.n_layers * MIXTRAL.expert_block_params()
    # fp32 master params: 4 bytes each; ep = 8 holds one expert of eight per layer
    assert states[1] - states[8] == pytest.approx(4 * experts * (1 - 1 / 8), rel=1e-9)
    assert states[1] > states[2] > states[8]


def test_zero_shards_the_experts_over_the_ranks_that_hold_the_same_ones():
    cluster, training = _cluster(16), Training(global_batch=64, micro_batch=1)
    for ep in (1, 4, 8):
        memory = evaluate(MIXTRAL, Layout(dp=16, zero=3, ep=ep), training, cluster).memory
        # under ZeRO-3 every parameter ends on 1/16 of the ranks, whatever ep is
        assert memory.params == pytest.approx(4 * gpt_param_count(MIXTRAL).total / 16, rel=1e-6)


# -- the all-to-all -------------------------------------------------------------------


def test_alltoall_moves_the_routed_tokens_that_live_elsewhere():
    size = ep_alltoall_bytes(micro_batch=2, seq=4096, hidden=4096, top_k=2, tp=1, act_bytes=2)
    assert size == 2 * 4096 * 2 * 4096 * 2
    assert busbw_factor("all_to_all", 8) == pytest.approx(7 / 8)  # the share sent elsewhere


def _ep_seconds(shape, micro_batch, network="ib-ndr", ep=8, gpus=16):
    layout = Layout(dp=gpus, zero=2, ep=ep)
    training = Training(global_batch=gpus * micro_batch, micro_batch=micro_batch)
    return step_time(shape, layout, training, _cluster(gpus, 4, network)).ep_comm_s


def test_alltoall_time_grows_with_tokens_and_falls_with_link_bandwidth():
    assert _ep_seconds(SMALL, 2) > _ep_seconds(SMALL, 1) > 0
    assert _ep_seconds(SMALL, 1, "eth-25") > _ep_seconds(SMALL, 1, "ib-ndr")
    assert _ep_seconds(replace(SMALL, top_k=4), 1) > _ep_seconds(SMALL, 1)


def test_no_alltoall_without_expert_parallelism():
    assert _ep_seconds(SMALL, 1, ep=1) == 0.0
    layout, training = Layout(dp=8, zero=2), Training(global_batch=8, micro_batch=1)
    assert step_time(SMALL, layout, training, _cluster(8)).ep_comm_s == 0.0


def test_the_alltoall_is_in_the_step_time():
    training = Training(global_batch=16, micro_batch=1)
    t = step_time(SMALL, Layout(dp=16, zero=2, ep=8), training, _cluster(16, 4))
    parts = (t.compute_s + t.tp_comm_s + t.ep_comm_s + t.pp_comm_s + t.bubble_s
             + t.dp_comm_exposed_s + t.contention_s + t.optimizer_s)  # fmt: skip
    assert t.step_s == pytest.approx(parts) and t.ep_comm_s > 0
    assert t.to_dict()["ep_comm_s"] == t.ep_comm_s


# -- the search -----------------------------------------------------------------------


def test_the_search_tries_ep_dividing_dp_and_the_experts():
    training = Training(global_batch=32)
    result = search_layouts(SMALL, training, _cluster(8), LayoutChoice(tp=1, pp=1, zero=2))
    seen = {p.layout.ep for p in result.evaluated}
    assert seen == {1, 2, 4, 8}
    for p in result.evaluated:
        assert p.layout.dp % p.layout.ep == 0 and SMALL.experts % p.layout.ep == 0


def test_the_search_keeps_ep_1_for_a_dense_model_and_a_given_ep():
    dense = replace(SMALL, experts=0, top_k=0, expert_ffn=0)
    training = Training(global_batch=32)
    result = search_layouts(dense, training, _cluster(8), LayoutChoice(tp=1, pp=1, zero=2))
    assert {p.layout.ep for p in result.evaluated} == {1}
    fixed = search_layouts(SMALL, training, _cluster(8), LayoutChoice(ep=4, zero=2))
    assert {p.layout.ep for p in fixed.evaluated} == {4}


def test_experts_that_do_not_split_evenly_are_refused():
    small6 = replace(SMALL, experts=6)
    with pytest.raises(ConfigError, match="--ep 4 does not divide --experts 6"):
        evaluate(small6, Layout(dp=8, ep=4), Training(global_batch=8), _cluster(8))
    with pytest.raises(ConfigError, match="does not divide the data-parallel ranks"):
        evaluate(SMALL, Layout(dp=2, tp=4, ep=4), Training(global_batch=8), _cluster(8))


def test_flags_build_the_preset_and_a_shape_alike():
    preset = build_model(preset="mixtral-8x7b", seq=4096)
    flags = build_model(32, 4096, 32, 32000, 4096, 14336 / 4096, tied=False, kv_heads=8,
                        moe={"experts": 8, "top_k": 2, "expert_ffn": 14336})  # fmt: skip
    assert gpt_param_count(flags).total == gpt_param_count(preset).total
    overridden = build_model(preset="qwen3-30b-a3b", seq=4096, moe={"top_k": 4})
    assert overridden.top_k == 4 and overridden.experts == 128


# -- meshforge plan -------------------------------------------------------------------


_SHAPE = ["plan", "--layers", "4", "--hidden", "512", "--heads", "8", "--vocab", "1000",
          "--seq", "256", "--global-batch", "48"]  # fmt: skip


@pytest.mark.parametrize(
    "extra, fragments",
    [
        (["--gpus", "8", "--experts", "8", "--expert-ffn", "128", "--top-k", "9"],
         ("--top-k 9", "--experts 8")),
        (["--gpus", "12", "--gpus-per-node", "4", "--experts", "8", "--expert-ffn", "128",
          "--ep", "3"], ("--ep 3 does not divide --experts 8",)),
        (["--gpus", "8", "--experts", "8"], ("--expert-ffn",)),
        (["--gpus", "8", "--top-k", "2"], ("--top-k", "--experts")),
        (["--gpus", "8", "--ep", "2"], ("--ep 2", "mixture-of-experts")),
        (["--gpus", "8", "--experts", "8", "--expert-ffn", "64", "--dense-layers", "4"],
         ("--dense-layers 4",)),
    ],
    ids=["top-k", "ep-experts", "no-expert-ffn", "top-k-alone", "ep-dense", "dense-layers"],
)  # fmt: skip
def test_bad_moe_flags_exit_2_with_one_line(meshforge, extra, fragments):
    assert_one_line_error(meshforge(_SHAPE + extra), *fragments)


@pytest.mark.parametrize(
    "preset, total, active",
    [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("mixtral-8x7b", 46.7e9, 12.9e9)],
)
def test_plan_plans_the_moe_presets(meshforge, preset, total, active):
    layout = ["--tp", "1", "--pp", "1", "--zero", "3", "--micro-batch", "1", "--recompute",
              "full", "--ep", "8"]  # fmt: skip
    proc = meshforge(["plan", "--model", preset, "--seq", "4096", "--gpus", "16",
                      "--global-batch", "64", *layout, "--json"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["layout"]["ep"] == 8
    assert out["model_params"] == pytest.approx(total, rel=0.02)
    assert out["model_active_params"] == pytest.approx(active, rel=0.03)
    assert out["time_breakdown_s"]["ep_comm_s"] > 0


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_the_plan_says_a_preset_plans_at_its_published_context(meshforge, preset):
    job = ["--gpus", "16", "--global-batch", "64", "--tp", "1", "--pp", "1", "--zero", "3",
           "--micro-batch", "1", "--recompute", "full"]  # fmt: skip
    layout = [*job, "--ep", "8"]
    proc = meshforge(["plan", "--model", preset, *layout])
    assert proc.returncode == 0, proc.stderr
    assert f"seq 32,768: {preset}'s published context; --seq to change" in proc.stdout
    searched = meshforge(["plan", "--model", preset, *job, "--top", "2"])  # ep searched
    assert searched.returncode == 0, searched.stderr
    assert f"seq 32,768: {preset}'s published context" in searched.stdout
    given = meshforge(["plan", "--model", preset, "--seq", "4096", *layout])
    assert "seq 4,096 (--seq)" in given.stdout and "32,768" not in given.stdout


# -- the published MoE runs -----------------------------------------------------------


def test_published_moe_runs_are_predicted_and_not_fitted_on():
    from meshforge.plan.core.published import PUBLISHED_RUNS

    assert not set(PUBLISHED_MOE_RUNS) & set(PUBLISHED_RUNS)  # outside the fit
    rows = moe_validation_table()
    predicted = [r for r in rows if r.unsupported is None]
    assert len(predicted) >= 3 and len({r.run.source for r in predicted}) >= 2
    for row in predicted:
        assert row.predicted is not None and row.predicted > 0
        assert row.error == row.held_out_error  # every row is held out
    assert all(supported(r.run) for r in rows if r.unsupported)


def test_the_docs_show_the_moe_table_as_the_planner_predicts_it():
    docs = Path(__file__).resolve().parents[2] / "docs" / "planner.md"
    assert moe_markdown(moe_validation_table()) in docs.read_text()
