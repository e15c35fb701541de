"""Every layout trains the same model, and a checkpoint of any layout loads under any
other: the engine run in-process on the shared gloo pool (tests/layouts.py)."""

from __future__ import annotations

import pytest

from layouts import (
    activation_bytes,
    assert_same_losses,
    build_peak_bytes,
    digest_at_build,
    job,
    train_layout,
)

STEPS = 20
RTOL = 1e-4

# (name, world size, parallel settings[, train settings]) trained against the world-1
# run of TINY4 (global batch 8 in micro-batches of 2: 4 accumulated at world 1)
LAYOUTS = [
    ("ddp-accum", 2, {"zero": 0}),
    ("ddp", 2, {"zero": 0}, {"micro_batch": 4}),
    ("zero1-accum", 2, {"zero": 1}),
    ("zero1", 2, {"zero": 1}, {"micro_batch": 4}),
    ("zero2-accum", 2, {"zero": 2}),
    ("zero2", 2, {"zero": 2}, {"micro_batch": 4}),
    ("zero3-accum", 2, {"zero": 3}),
    ("zero3", 2, {"zero": 3}, {"micro_batch": 4}),
    ("tp2", 2, {"tp": 2}),
    ("tp2-sp", 2, {"tp": 2, "sequence_parallel": True}),
    ("pp2-gpipe", 2, {"pp": 2, "pp_schedule": "gpipe"}),
    ("pp2-1f1b", 2, {"pp": 2, "pp_schedule": "1f1b"}),
    ("pp2-interleaved", 2, {"pp": 2, "pp_schedule": "interleaved_1f1b", "virtual_stages": 2}),
    ("pp2-zbv", 2, {"pp": 2, "pp_schedule": "zbv"}),
    ("dp2xtp2", 4, {"tp": 2}),
    ("pp2xdp2-zero3", 4, {"pp": 2, "zero": 3}),
    ("pp2xtp2", 4, {"pp": 2, "tp": 2}),
]


@pytest.fixture(scope="module")
def reference(gloo) -> dict[int, float]:
    (out,) = gloo.run(1, train_layout, job({}), STEPS)
    losses = out["losses"]
    assert losses[STEPS] < losses[1], "the world-1 run did not learn"
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=[entry[0] for entry in LAYOUTS])
def test_every_layout_matches_world_1_step_by_step(gloo, reference, layout):
    name, world, parallel, *train = layout
    results = gloo.run(world, train_layout, job(parallel, train=train[0] if train else {}), STEPS)
    layout = results[0]["layout"]
    assert layout["tp"] * layout["pp"] * layout["dp"] == world
    micro_batch = train[0]["micro_batch"] if train else 2
    assert results[0]["microbatches"] == 8 // (layout["dp"] * micro_batch)
    for rank, out in enumerate(results):  # every rank reports the same reduced loss
        assert_same_losses(out["losses"], reference, f"{name} rank {rank}", RTOL)


@pytest.mark.slow
def test_tensor_parallel_keeps_a_tied_output_head_tied(gloo):
    tied = job({}, model={"tie_embeddings": True})
    (ref,) = gloo.run(1, train_layout, tied, 10)
    tp2 = job({"tp": 2, "sequence_parallel": True}, model={"tie_embeddings": True})
    out = gloo.run(2, train_layout, tp2, 10)[0]
    assert_same_losses(out["losses"], ref["losses"], "tied tp2", RTOL)
    # one Parameter serves both the embedding and the head, under TP as at world 1
    for result in (ref, out):
        assert "embed.tok.weight" in result["param_names"]
        assert "head.weight" not in result["param_names"]


# (name, world A, layout A, world B, layout B): saved under A at step 10, resumed under B
RESHARDS = [
    ("tp2->dp2", 2, {"tp": 2}, 2, {"zero": 0}),
    ("pp2->world1", 2, {"pp": 2}, 1, {}),
    ("dp2xtp2->pp2xdp2", 4, {"tp": 2}, 4, {"pp": 2, "zero": 3}),
    ("zero3->tp2", 2, {"zero": 3}, 2, {"tp": 2, "sequence_parallel": True}),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,wa,la,wb,lb", RESHARDS, ids=[r[0] for r in RESHARDS])
def test_a_checkpoint_resumes_under_another_layout(gloo, reference, tmp_path, name, wa, la, wb, lb):
    root = str(tmp_path / "checkpoints")
    saved = gloo.run(wa, train_layout, job(la), 10, root, 10)[0]
    resumed = gloo.run(wb, train_layout, job(lb), STEPS, root, None, True)[0]
    # the full parameters after the load are bitwise those that were saved
    assert resumed["digest_loaded"] == saved["digest_saved"], name
    assert sorted(resumed["losses"]) == list(range(11, STEPS + 1))
    for step in range(11, STEPS + 1):  # the loss continues as if never interrupted
        assert resumed["losses"][step] == pytest.approx(reference[step], rel=1e-3), (
            f"{name} step {step}: {resumed['losses'][step]} vs {reference[step]}"
        )


@pytest.mark.parametrize(
    "world,parallel",
    [(2, {"pp": 2}), (2, {"pp": 2, "pp_schedule": "interleaved_1f1b", "virtual_stages": 2}),
     (4, {"pp": 2, "zero": 3}), (4, {"pp": 2, "tp": 2}), (2, {"zero": 3})],
    ids=["pp2", "pp2-interleaved", "pp2xdp2-zero3", "pp2xtp2", "zero3"],
)  # fmt: skip
def test_every_layout_digests_the_parameters_as_world_1_does(gloo, world, parallel):
    # the same seed initialises the same parameters under any layout: rank 0's digest
    # of the stages, shards and slices the ranks hold is the world-1 model's
    ((reference, _),) = gloo.run(1, digest_at_build, job({}))
    results = gloo.run(world, digest_at_build, job(parallel))
    assert results[0][0] == reference
    assert all(digest == "" for digest, _ in results[1:])


@pytest.mark.slow
def test_the_digest_of_a_sharded_model_never_holds_it_whole_on_rank_0(gloo):
    # 16 layers of d_model 512: about 50M parameters, 200 MB in fp32; the largest
    # single parameter is 4 MB
    big = job(
        {"zero": 3},
        model={"d_model": 512, "n_layers": 16, "n_heads": 8, "vocab_size": 256, "seq_len": 32},
    )
    (digest, grown), *_ = gloo.run(2, digest_at_build, big, True)
    assert len(digest) == 64
    assert grown < 50e6, f"rank 0 grew by {grown / 1e6:.0f} MB to digest a 200 MB model"


@pytest.mark.slow
def test_zero3_builds_only_its_shard_of_a_model_too_big_to_build_whole(gloo):
    # 16 layers of d_model 512: about 50M parameters, 200 MB in fp32
    big = job(
        {"zero": 3},
        model={"d_model": 512, "n_layers": 16, "n_heads": 8, "vocab_size": 256, "seq_len": 32},
    )
    sharded = gloo.run(2, build_peak_bytes, big, False)  # first: nothing cached to reuse
    whole = gloo.run(2, build_peak_bytes, big, True)
    for rank in range(2):
        assert whole[rank] > 150e6, f"the whole model should take ~200 MB, saw {whole[rank]}"
        assert sharded[rank] <= 0.6 * whole[rank], (
            f"rank {rank}: building under ZeRO-3 peaked at {sharded[rank] / 1e6:.0f} MB, "
            f"the whole model at {whole[rank] / 1e6:.0f} MB"
        )


@pytest.mark.slow
@pytest.mark.parametrize("world,parallel", [(1, {}), (2, {"tp": 2})], ids=["dp", "tp2"])
def test_full_activation_checkpointing_saves_less_for_backward(gloo, world, parallel):
    none = gloo.run(
        world, activation_bytes, job(parallel, train={"activation_checkpointing": "none"})
    )
    full = gloo.run(
        world, activation_bytes, job(parallel, train={"activation_checkpointing": "full"})
    )
    for rank in range(world):
        assert 0 < full[rank] < 0.5 * none[rank], (rank, full[rank], none[rank])
