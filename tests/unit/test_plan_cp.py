"""The planner knows context parallelism: activations and tokens per rank divided by cp,
each method's K/V exchange against the link (ring's hidden under attention), cp in the
layout search at long sequences, the `meshforge plan --cp/--cp-method` flags, and the
published long-context run it was not fitted on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import assert_one_line_error
from meshforge.plan.core.comm import (
    busbw_factor,
    cp_allgather_bytes,
    cp_alltoall_bytes,
    cp_ring_block_bytes,
    group_link,
)
from meshforge.plan.core.flops import GPTShape
from meshforge.plan.core.hardware import Cluster, gpu_spec, link_spec
from meshforge.plan.core.layout import Layout, Training
from meshforge.plan.core.memory import activation_memory_bytes
from meshforge.plan.core.predict import evaluate
from meshforge.plan.core.search import LayoutChoice, search_layouts
from meshforge.plan.core.timing import cp_exchange_s, step_time
from meshforge.plan.core.validation import cp_markdown, cp_validation_table
from meshforge.plan.core.work import microbatch_work

# Llama 3 8B's shape at 128k tokens
LLAMA8B = GPTShape(32, 4096, 32, 128256, 131072, family="llama", n_kv_heads=8,
                   ffn_hidden=14336, tie_embeddings=False)  # fmt: skip


def _cluster(n: int) -> Cluster:
    return Cluster(gpu_spec("h100"), n, min(n, 8), link_spec("nvlink4"), link_spec("ib-ndr"),
                   nics_per_node=min(n, 8))  # fmt: skip


def _activations(shape: GPTShape, cp: int, method: str = "ring", recompute="none") -> float:
    return activation_memory_bytes(shape, 1, 1, 1, 1, False, recompute, "bf16", True, 1,
                                   cp=cp, cp_method=method)  # fmt: skip


@pytest.mark.parametrize("cp", [2, 4, 8, 16])
def test_activations_per_rank_scale_as_one_over_cp(cp):
    one = _activations(LLAMA8B, 1)
    assert _activations(LLAMA8B, cp, "ring") == pytest.approx(one / cp, rel=1e-9)
    assert _activations(LLAMA8B, cp, "alltoall") == pytest.approx(one / cp, rel=1e-9)
    # allgather also holds one layer's gathered K and V of the whole sequence
    gathered = 2 * 2 * LLAMA8B.seq_len * LLAMA8B.kv_width
    assert _activations(LLAMA8B, cp, "allgather") == pytest.approx(one / cp + gathered)


def test_allgather_exchange_is_the_hand_formula():
    b, s, kv, t, e, cp = 2, 65536, 1024, 2, 2, 8
    size = cp_allgather_bytes(b, s, kv, t, e)
    assert size == 2 * b * s * kv * e / t  # K and V of the whole sequence, 1/t of the heads
    cluster = _cluster(64)
    layout = Layout(dp=4, tp=t, pp=1, cp=cp, cp_method="allgather")
    shape = GPTShape(4, 4096, 32, 1000, s, family="llama", n_kv_heads=8, ffn_hidden=8192)
    assert shape.kv_width == kv
    work = microbatch_work(shape, t, False, b, "bf16", "none", True, cluster.device, cp)
    out = cp_exchange_s(shape, layout, b, e, "none", work, cluster)
    bw, lat = group_link(cluster, cp, layout.cp_stride)
    # forward all-gather + backward reduce-scatter, each (cp-1)/cp of S over the link
    hand = 2 * ((cp - 1) / cp * size / bw + (cp - 1) * lat)
    assert out["total_s"] == pytest.approx(hand)
    assert out["exposed_s"] == out["total_s"]  # attention waits for all of K and V
    full = cp_exchange_s(shape, layout, b, e, "full", work, cluster)
    assert full["total_s"] == pytest.approx(1.5 * hand)  # the recomputed forward gathers again


def test_alltoall_exchange_is_the_hand_formula():
    b, s, q, kv, t, cp, e = 1, 32768, 4096, 1024, 1, 8, 2
    sizes = cp_alltoall_bytes(b, s, q, kv, t, cp, e)
    assert sizes == (b * s / cp * q * e, 2 * b * s / cp * kv * e, b * s / cp * q * e)
    assert sum(sizes) == b * s / cp * (2 * q + 2 * kv) * e / t
    cluster = _cluster(8)
    shape = GPTShape(4, 4096, 32, 1000, s, family="llama", n_kv_heads=8, ffn_hidden=8192)
    layout = Layout(dp=1, tp=1, pp=1, cp=cp, cp_method="alltoall")
    work = microbatch_work(shape, t, False, b, "bf16", "none", True, cluster.device, cp)
    out = cp_exchange_s(shape, layout, b, e, "none", work, cluster)
    bw, lat = group_link(cluster, cp, layout.cp_stride)
    one_pass = busbw_factor("all_to_all", cp) * sum(sizes) / bw + 3 * (cp - 1) * lat
    assert out["total_s"] == pytest.approx(2 * one_pass)  # forward and backward
    assert out["exposed_s"] == out["total_s"]


def test_ring_is_hidden_when_attention_dominates():
    cluster = _cluster(8)  # cp 8 on NVLink, 128k tokens: each block's attention is long
    layout = Layout(dp=1, tp=1, pp=1, cp=8, cp_method="ring")
    work = microbatch_work(LLAMA8B, 1, False, 1, "bf16", "none", True, cluster.device, 8)
    out = cp_exchange_s(LLAMA8B, layout, 1, 2, "none", work, cluster)
    block = cp_ring_block_bytes(1, LLAMA8B.seq_len, LLAMA8B.kv_width, 1, 8, 2)
    assert out["total_s"] > 0 and block == 2 * LLAMA8B.seq_len / 8 * LLAMA8B.kv_width * 2
    assert work.attention.forward_s / 8 > block / group_link(cluster, 8, 1)[0]
    assert out["exposed_s"] == 0.0
    training = Training(global_batch=8, micro_batch=1, recompute="full")
    assert step_time(LLAMA8B, layout, training, cluster).cp_comm_s == 0.0


def test_ring_is_exposed_when_the_transfer_outweighs_the_block():
    # a short sequence over many nodes: the blocks' attention is tiny
    shape = GPTShape(4, 4096, 32, 1000, 4096, family="llama", ffn_hidden=8192)
    cluster = _cluster(256)
    layout = Layout(dp=1, tp=8, pp=1, cp=32, cp_method="ring")
    work = microbatch_work(shape, 8, False, 1, "bf16", "none", True, cluster.device, 32)
    out = cp_exchange_s(shape, layout, 1, 2, "none", work, cluster)
    assert 0.0 < out["exposed_s"] < out["total_s"]


def test_cp_divides_the_tokens_and_shards_states_over_dp_x_cp():
    cluster = _cluster(64)
    training = Training(global_batch=8, micro_batch=1, recompute="full")
    base = evaluate(LLAMA8B, Layout(dp=8, tp=8, pp=1, zero=1), training, cluster)
    cp = evaluate(LLAMA8B, Layout(dp=1, tp=8, pp=1, zero=1, cp=8), training, cluster)
    assert cp.layout.world_size == 64
    # ZeRO-1 shards the optimizer states over the 8 ranks either way (dp x cp)
    assert cp.memory.optimizer == pytest.approx(base.memory.optimizer)
    assert cp.memory.activations < base.memory.activations / 7
    assert cp.time.cp_comm_s > 0  # allgather: exposed
    assert base.time.cp_comm_s == 0


def test_a_short_sequence_search_keeps_cp_1():
    shape = GPTShape(4, 1024, 16, 1000, 4096, family="llama", ffn_hidden=2048)
    result = search_layouts(shape, Training(global_batch=16), _cluster(8),
                            LayoutChoice(tp=1, zero=1, recompute="none"))  # fmt: skip
    assert {p.layout.cp for p in result.evaluated} == {1}


def test_the_search_finds_cp_where_cp_1_does_not_fit():
    training = Training(global_batch=64)
    choice = LayoutChoice(tp=1, pp=1)
    none = search_layouts(LLAMA8B, training, _cluster(64), LayoutChoice(tp=1, pp=1, cp=1))
    assert none.best is None  # 128k tokens of an 8B model on one rank: no fit
    found = search_layouts(LLAMA8B, training, _cluster(64), choice)
    assert found.best is not None and found.best.layout.cp > 1


_PLAN = ["plan", "--model", "llama-8b", "--seq", "131072", "--gpus", "64", "--global-batch",
         "64", "--tp", "1", "--pp", "1"]  # fmt: skip


def test_plan_cli_finds_a_cp_layout_for_128k_tokens(meshforge):
    proc = meshforge([*_PLAN, "--top", "3", "--json"])
    assert proc.returncode == 0, proc.stderr
    best = json.loads(proc.stdout)["candidates"][0]
    assert best["layout"]["cp"] > 1 and best["fits"]
    assert "cp_comm_s" in best["time_breakdown_s"]
    proc = meshforge([*_PLAN, "--cp", "1", "--top", "3", "--json"])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["candidates"] == []  # nothing fits without cp


def test_plan_cli_ring_method_shows_the_exchange(meshforge):
    proc = meshforge([*_PLAN, "--cp", "8", "--cp-method", "ring", "--zero", "3",
                      "--micro-batch", "1", "--recompute", "full", "--json"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["layout"]["cp"] == 8 and out["layout"]["cp_method"] == "ring"
    assert out["layout_fields"]["cp"] == "given"
    assert out["time_breakdown_s"]["cp_comm_s"] == 0.0


@pytest.mark.parametrize(
    "extra, fragments",
    [
        (["--seq", "131072", "--gpus", "64", "--cp", "3"], ("cp=3", "--gpus 64")),
        (["--seq", "1000", "--gpus", "64", "--cp", "16"], ("--seq 1000", "2 x --cp 16")),
        (["--seq", "8192", "--gpus", "64", "--cp", "64", "--cp-method", "alltoall"],
         ("alltoall", "--heads 32", "--cp 64")),
        (["--seq", "8192", "--gpus", "8", "--cp", "2", "--cp-method", "zigzag"],
         ("--cp-method", "zigzag")),
    ],
    ids=["cp-gpus", "seq-cp", "alltoall-heads", "method"],
)  # fmt: skip
def test_bad_cp_input_exits_2_with_one_line(meshforge, extra, fragments):
    args = ["plan", "--layers", "4", "--hidden", "1024", "--heads", "32", "--vocab", "1000",
            "--family", "llama", "--global-batch", "64", *extra]  # fmt: skip
    assert_one_line_error(meshforge(args), *fragments)


def test_the_long_context_run_is_predicted_held_out():
    (row,) = cp_validation_table()
    assert row.run.cp == 16 and row.unsupported is None
    assert row.error is not None and row.held_out_error is not None


def test_the_docs_show_the_cp_table_as_the_planner_predicts_it():
    docs = Path(__file__).resolve().parents[2] / "docs" / "planner.md"
    assert cp_markdown(cp_validation_table()) in docs.read_text()


def test_a_mixture_of_experts_shards_its_expert_states_over_dp_x_cp_too():
    """cp replicates the experts as it does every weight: ZeRO shards their states over
    the dp x cp ranks holding them, as over dp alone at the same world size."""
    moe = GPTShape(4, 512, 8, 1000, 4096, family="llama", n_kv_heads=4, ffn_hidden=1024,
                   experts=8, top_k=2, expert_ffn=512)  # fmt: skip
    cluster = _cluster(8)
    training = Training(global_batch=8, micro_batch=1, recompute="full")
    base = evaluate(moe, Layout(dp=8, zero=3), training, cluster)
    cp = evaluate(moe, Layout(dp=1, zero=3, cp=8), training, cluster)
    for states in ("params", "grads", "optimizer"):
        assert getattr(cp.memory, states) == pytest.approx(getattr(base.memory, states)), states
