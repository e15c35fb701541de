"""Uneven pipeline stages: any pp (x v) up to the layer count, in the planner and in the
trainer. BLOOM-176B trained 70 layers on 12 stages; meshforge splits them 5, 6 x 10, 5
(layout/stages.py) and plans the busiest rank's memory."""

from __future__ import annotations

import json

import pytest

from layouts import job, train_layout
from meshforge.cli import main as meshforge_main
from meshforge.errors import ConfigError
from meshforge.layout.stages import layer_split
from meshforge.plan.core.cluster import build_cluster
from meshforge.plan.core.flops import GPTShape, params_per_rank
from meshforge.plan.core.layout import Layout, Training, check_layout
from meshforge.plan.core.memory import activation_memory_bytes, layers_in_flight
from meshforge.plan.core.predict import evaluate

BLOOM_FORM = (
    "--layers 70 --hidden 14336 --heads 112 --vocab 250880 --seq 2048 --gpus 384 "
    "--gpu a100-80gb --tp 4 --pp 12 --global-batch 2048 --json"
).split()
BLOOM = GPTShape(70, 14336, 112, 250880, 2048)


def _plan_in_process(args: list[str], capsys) -> tuple[int, str, str]:
    """`meshforge plan ARGS` in this interpreter: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        meshforge_main(["plan", *args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


# -- the split ----------------------------------------------------------------------------


def test_layer_split_gives_the_spare_layers_to_interior_stages_first():
    assert [len(r) for r in layer_split(70, 12)] == [5] + [6] * 10 + [5]
    assert [len(r) for r in layer_split(3, 2)] == [2, 1]  # no interior stage: stage 0 first
    assert [len(r) for r in layer_split(8, 4)] == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="non-empty"):
        layer_split(3, 4)


def test_check_layout_accepts_any_pp_up_to_the_layers_and_names_the_flags_beyond():
    training = Training(global_batch=64, micro_batch=1)
    check_layout(Layout(dp=1, pp=12), training, BLOOM)
    check_layout(Layout(dp=1, pp=7, virtual_stages=5), Training(global_batch=70), BLOOM)
    shape = GPTShape(6, 256, 4, 1000, 128)
    with pytest.raises(ConfigError, match=r"--pp 4 x --virtual-stages 2 = 8 .* --layers 6"):
        check_layout(Layout(pp=4, virtual_stages=2), Training(global_batch=8), shape)


# -- parameters and memory of the busiest rank --------------------------------------------


def test_params_per_rank_is_the_rank_holding_the_most():
    # 70 layers on 12 ranks: rank 0 holds 5 blocks and the embeddings, rank 1 six blocks
    ranks = [params_per_rank(BLOOM, 4, 12, pp_rank=r) for r in range(12)]
    block = ranks[0].block
    assert ranks[1].total == pytest.approx(6 * block)
    embeddings = 250880 * 14336 / 4 + 2048 * 14336
    assert ranks[0].total == pytest.approx(5 * block + embeddings)
    assert params_per_rank(BLOOM, 4, 12).total == max(r.total for r in ranks)
    # an interior rank wins when a block outweighs the embeddings
    small_vocab = GPTShape(7, 1024, 16, 1000, 128)
    busiest = params_per_rank(small_vocab, 1, 3)
    assert busiest.total == params_per_rank(small_vocab, 1, 3, pp_rank=1).total  # 3 blocks


def test_1f1b_memory_is_the_max_over_ranks_not_the_first_stage():
    # 1F1B: rank r keeps pp-r micro-batches of its own layers. 70 on 12: rank 0 keeps
    # 12 x 5 = 60 layer-micro-batches, rank 1 keeps 11 x 6 = 66
    assert layers_in_flight(70, 12, 1, "1f1b", 64, pp_rank=0) == 60
    assert layers_in_flight(70, 12, 1, "1f1b", 64, pp_rank=1) == 66
    assert layers_in_flight(70, 12, 1, "1f1b", 64, pp_rank=11) == 5
    args = (BLOOM, 1, 4, 12, 1, False, "none", "bf16", True, 64)
    per_rank = [activation_memory_bytes(*args, pp_rank=r) for r in range(12)]
    assert activation_memory_bytes(*args) == max(per_rank)
    assert per_rank[1] > per_rank[0]


def test_interleaved_memory_on_an_even_split_is_korthikantis():
    # rank 0 of an even interleaved split: L·(1 + (p-1)/(p·v))
    assert layers_in_flight(96, 8, 4, "1f1b", 64) == pytest.approx(96 * (1 + 7 / 32))
    # 30 layers in 8 x 2 chunks of 1, 2 x 14, 1: rank 0 holds chunks 0 and 8 (1 + 2
    # layers) and runs 2·(p-1) + (v-1)·p + 1 = 23 chunk forwards before its first backward
    assert layers_in_flight(30, 8, 2, "1f1b", 64, pp_rank=0) == pytest.approx(23 * 3 / 2)


def test_the_reported_memory_is_the_busiest_ranks():
    # 7 layers on 3 ranks: 2, 3, 2. With a small vocabulary the interior rank, with one
    # block more, holds the most parameters and (1F1B: 2 x 3 > 3 x 2) activations
    shape = GPTShape(7, 1024, 16, 1000, 128)
    training = Training(global_batch=12, micro_batch=1, precision="fp32")
    prediction = evaluate(shape, Layout(pp=3), training, build_cluster(3, "h100"))
    assert prediction.pipeline_stages == (2, 3, 2)
    assert prediction.memory_pp_rank == 1
    memory = prediction.memory
    assert memory.params == 4 * params_per_rank(shape, 1, 3, pp_rank=1).total
    args = (shape, 1, 1, 3, 1, False, "none", "fp32", True, 12)
    assert memory.activations == activation_memory_bytes(*args, pp_rank=1)
    # BLOOM: the embeddings (V·h/t) outweigh a block, so rank 0 sets the memory
    training = Training(global_batch=2048, micro_batch=1, recompute="full")
    bloom = evaluate(BLOOM, Layout(dp=8, tp=4, pp=12, zero=1), training,
                     build_cluster(384, "a100-80gb"))  # fmt: skip
    assert bloom.memory_pp_rank == 0
    assert bloom.to_dict()["memory_pp_rank"] == 0


def test_a_pipeline_free_layout_has_no_stage_list():
    shape = GPTShape(4, 256, 4, 1000, 128)
    prediction = evaluate(shape, Layout(dp=2), Training(global_batch=8), build_cluster(2))
    assert prediction.to_dict()["pipeline_stages"] is None


def test_search_offers_pipelines_that_do_not_divide_the_layers():
    from meshforge.plan.core.search import LayoutChoice, search_layouts

    shape = GPTShape(7, 512, 8, 1000, 256)
    result = search_layouts(shape, Training(global_batch=48), build_cluster(6, "h100"),
                            LayoutChoice(tp=1, zero=0))  # fmt: skip
    pps = {p.layout.pp for p in result.evaluated}
    assert {2, 3, 6} <= pps  # none divides 7


# -- the CLI ------------------------------------------------------------------------------


def test_bloom_176b_plans_70_layers_on_12_stages(capsys):
    code, out, err = _plan_in_process(BLOOM_FORM, capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["pipeline_stages"] == [len(r) for r in layer_split(70, 12)]
    lay = plan["layout"]
    assert (lay["tp"], lay["pp"], lay["dp"]) == (4, 12, 8)
    # the memory printed is the busiest rank's: no pipeline rank needs more
    layout = Layout(lay["dp"], lay["tp"], lay["pp"], lay["zero"], lay["virtual_stages"],
                    lay["sequence_parallel"])  # fmt: skip
    training = Training(2048, lay["micro_batch"], recompute=lay["recompute"])
    best = evaluate(BLOOM, layout, training, build_cluster(384, "a100-80gb"))
    assert plan["memory_per_gpu_bytes"]["total"] == pytest.approx(best.memory.total)
    assert plan["memory_pp_rank"] == best.memory_pp_rank


def test_more_stages_than_layers_is_one_line_naming_the_flags(capsys):
    model = BLOOM_FORM[: BLOOM_FORM.index("--gpus")]
    args = [*model, "--gpus", "72", "--tp", "1", "--pp", "72", "--dp", "1",
            "--global-batch", "144"]  # fmt: skip
    code, _, err = _plan_in_process(args, capsys)
    assert code == 2
    line = err.strip()
    assert "\n" not in line and "--pp 72" in line and "--layers 70" in line


# -- the trainer --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "n_layers,parallel",
    [
        (3, {"pp": 2, "pp_schedule": "1f1b"}),  # stages of 2 and 1 layers
        (5, {"pp": 2, "pp_schedule": "interleaved_1f1b", "virtual_stages": 2}),  # 1, 2, 1, 1
    ],
    ids=["3-layers-pp2-1f1b", "5-layers-pp2x2-interleaved"],
)
def test_uneven_stages_train_the_same_model_as_world_1(gloo, n_layers, parallel):
    steps = 6
    reference_job = job({})
    reference_job["model"]["n_layers"] = n_layers
    (reference,) = gloo.run(1, train_layout, reference_job, steps)
    piped = job(parallel)
    piped["model"]["n_layers"] = n_layers
    results = gloo.run(2, train_layout, piped, steps)
    assert results[0]["layout"]["pp"] == 2
    for rank, out in enumerate(results):
        for step, loss in reference["losses"].items():
            assert out["losses"][step] == pytest.approx(loss, rel=1e-4), (rank, step)
