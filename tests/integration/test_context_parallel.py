"""Context parallelism (parallel.cp) trains the same model as world 1, step by step,
under every layout it composes with, with and without document masking (cp_method
allgather everywhere, alltoall over a few of the layouts; ring, refused on CPU, has its
point-to-point exchange run here on gloo directly, its model built by hand); it holds
fewer activations per rank; what it cannot run is refused in one line. The engine is
run in-process on the shared gloo pool (tests/layouts.py). Sequence 256 (and 1024 for
memory), as the issue asks; the whole file takes about 5 minutes on two cores."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import TINY_JOB, assert_one_line_error, merge, meshforge, short_documents_jsonl
from layouts import assert_same_losses, job

STEPS = 20
RTOL = 1e-4
SEQ = 256  # 8 chunks of 32 tokens under cp 4, 4 of 64 under cp 2

GPT_MODEL = {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": SEQ,
             "tie_embeddings": False}  # fmt: skip
LLAMA_MODEL = {"name": "llama", "vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4,
               "n_kv_heads": 2, "ffn_hidden": 64, "seq_len": SEQ}  # fmt: skip
MODELS = {"gpt": GPT_MODEL, "llama": LLAMA_MODEL}


def cp_job(model: str, parallel: dict[str, Any], **sections: dict[str, Any]) -> dict[str, Any]:
    raw = job(parallel, **sections)
    raw["model"] = copy.deepcopy(MODELS[model])
    raw["train"]["steps"] = STEPS
    return raw


def train_cp(raw: dict[str, Any], steps: int) -> dict[str, Any]:
    """train_layout's loop, recording the gradient norm (AdamW would hide a wrongly
    scaled gradient from the losses) and one micro-batch's saved activations."""
    import torch
    import torch.distributed as dist

    from layouts import step_batches
    from meshforge.config import build_config
    from meshforge.train.engine import Engine

    cfg = build_config(raw)
    torch.manual_seed(cfg.train.seed)
    engine = Engine.build(cfg, dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    dims = engine.dims
    out: dict[str, Any] = {"losses": {}, "grad_norm": {}, "layout": dims.as_dict()}
    for step in range(steps):
        micro_batches = step_batches(cfg, engine, step)
        result = engine.strategy.step(step, micro_batches, measure=step == 0)
        out["losses"][step + 1] = engine.strategy.reduce_loss(
            result.loss_sum / dims.microbatches
        ).item()
        out["grad_norm"][step + 1] = float(result.grad_norm)
        if step == 0:
            out["activation_bytes"] = result.activation_bytes
        engine.optimizers.zero_grad()
    out["digest"] = engine.param_digest()
    return out


_REFERENCES: dict[tuple[str, bool], dict[str, Any]] = {}


def _reference(gloo, model: str, masked_source: str | None = None) -> dict[str, Any]:
    key = (model, masked_source is not None)
    if key not in _REFERENCES:
        (out,) = gloo.run(1, train_cp, _job(model, {}, masked_source), STEPS)
        assert out["losses"][STEPS] < out["losses"][1], "the world-1 run did not learn"
        _REFERENCES[key] = out
    return _REFERENCES[key]


def _job(model: str, parallel: dict[str, Any], masked_source: str | None) -> dict[str, Any]:
    if masked_source is None:
        return cp_job(model, parallel)
    return cp_job(model, parallel, data={"source": masked_source, "document_masking": True})


def _assert_matches(results: list[dict[str, Any]], ref: dict[str, Any], what: str) -> None:
    for rank, out in enumerate(results):
        assert_same_losses(out["losses"], ref["losses"], f"{what} rank {rank}", RTOL)
    assert_same_losses(results[0]["grad_norm"], ref["grad_norm"], f"{what} grad norm", RTOL)


# (model, layout): both models under the layouts the issue names (cp2, dp2 x cp2,
# tp2 x cp2), one model each under the rest (the suite's time)
LAYOUTS = [
    (model, layout)
    for model, layouts in {
        "gpt": [("cp2", 2, {"cp": 2}), ("dp2xcp2", 4, {"cp": 2}),
                ("tp2xcp2", 4, {"cp": 2, "tp": 2}), ("cp4", 4, {"cp": 4}),
                ("tp2-sp-xcp2", 4, {"cp": 2, "tp": 2, "sequence_parallel": True})],
        "llama": [("cp2", 2, {"cp": 2}), ("dp2xcp2", 4, {"cp": 2}),
                  ("tp2xcp2", 4, {"cp": 2, "tp": 2}), ("cp2-zero3", 2, {"cp": 2, "zero": 3}),
                  ("dp2xcp2-zero2", 4, {"cp": 2, "zero": 2})],
    }.items()
    for layout in layouts
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("model", "layout"), LAYOUTS, ids=[f"{lay[0]}-{m}" for m, lay in LAYOUTS])
def test_every_cp_layout_matches_world_1_step_by_step(gloo, model, layout):
    name, world, parallel = layout
    ref = _reference(gloo, model)
    results = gloo.run(world, train_cp, cp_job(model, parallel), STEPS)
    assert results[0]["layout"]["cp"] == parallel["cp"]
    assert results[0]["layout"]["dp"] == world // parallel["cp"] // parallel.get("tp", 1)
    _assert_matches(results, ref, f"{model} {name}")


# -- document masking ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory) -> str:
    """Byte-token shards of many short documents, separated by the byte tokenizer's 0x1e."""
    from meshforge.data.shards import prepare

    root = tmp_path_factory.mktemp("cpdocs")
    prepare(short_documents_jsonl(root, 4000, max_words=12, max_chars=60), root / "shards")
    return str(root / "shards")


MASKED_LAYOUTS = [
    ("gpt", ("cp2", 2, {"cp": 2})),
    ("llama", ("cp2", 2, {"cp": 2})),
    ("llama", ("dp2xcp2", 4, {"cp": 2})),
    ("gpt", ("tp2xcp2", 4, {"cp": 2, "tp": 2})),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "layout"), MASKED_LAYOUTS, ids=[f"{lay[0]}-{m}" for m, lay in MASKED_LAYOUTS]
)
def test_document_masking_under_cp_matches_world_1(gloo, short_docs, model, layout):
    name, world, parallel = layout
    ref = _reference(gloo, model, short_docs)
    results = gloo.run(world, train_cp, _job(model, parallel, short_docs), STEPS)
    _assert_matches(results, ref, f"{model} masked {name}")


# -- alltoall (Ulysses) ----------------------------------------------------------------------

ALLTOALL_LAYOUTS = [  # (name, model, world, parallel, document masking)
    ("cp2-gpt", "gpt", 2, {"cp": 2}, False),
    ("cp2-llama", "llama", 2, {"cp": 2}, False),  # its 2 kv heads travel unrepeated
    ("dp2xcp2-llama", "llama", 4, {"cp": 2}, False),
    ("tp2xcp2-gpt", "gpt", 4, {"cp": 2, "tp": 2}, False),  # one head per cp rank
    ("cp2-documents-llama", "llama", 2, {"cp": 2}, True),
]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ALLTOALL_LAYOUTS, ids=[entry[0] for entry in ALLTOALL_LAYOUTS])
def test_alltoall_matches_world_1_step_by_step(gloo, request, layout):
    """parallel.cp_method=alltoall over a few of the layouts above (the allgather tests
    cover the rest: the split, the loss and the gradient reduction are the same)."""
    name, model, world, parallel, masking = layout
    source = request.getfixturevalue("short_docs") if masking else None
    ref = _reference(gloo, model, source)
    results = gloo.run(world, train_cp, _job(model, {**parallel, "cp_method": "alltoall"}, source),
                       STEPS)  # fmt: skip
    assert results[0]["layout"]["cp_method"] == "alltoall"
    _assert_matches(results, ref, f"{model} alltoall {name}")


# -- ring (CUDA only for users; its exchange run here on gloo) --------------------------------


def ring_parity(model: str, seq: int) -> dict[str, Any]:
    """On each of 2 ranks, one cp group: world 1's loss and gradients of a model, and
    those of the same model with `apply_context_parallel(..., "ring")` on this rank's
    tokens, its keys and values rotated by RingAttend.rotate's batch_isend_irecv over
    gloo (the layout rules, which refuse ring on CPU, are not asked); and the seconds
    the trainer's exposed-communication profile (observe/comm_time.py) finds in it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshforge.config import build_config
    from meshforge.models.registry import build_model
    from meshforge.observe.comm_time import measure_tp_comm
    from meshforge.parallel.context_parallel import ContextSplit, apply_context_parallel
    from meshforge.train.step import cross_entropy

    cfg = build_config({"model": {**MODELS[model], "seq_len": seq}})
    g = torch.Generator().manual_seed(5)
    x, y = (torch.randint(0, 256, (2, seq), generator=g) for _ in range(2))
    torch.manual_seed(0)
    ref = build_model(cfg.model)
    ref_loss = cross_entropy(ref(x), y)
    ref_loss.backward()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    m = build_model(cfg.model)
    apply_context_parallel(m, mesh, "ring")
    xs, ys, docs = ContextSplit.of(mesh).shard(x, y)

    def step() -> torch.Tensor:
        loss = cross_entropy(m(xs, docs=docs), ys)
        loss.backward()
        return loss

    loss, comm_s = measure_tp_comm(step, torch.device("cpu"))
    # the mean over the cp ranks is world 1's (module docstring of context_parallel.py)
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    for t in grads.values():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return {
        "loss": mean.item() / dist.get_world_size(),
        "ref_loss": ref_loss.item(),
        "comm_s": comm_s,
        # (key biases' gradients are zero but for rounding: softmax ignores them)
        "grads_differ": [
            n
            for n, p in ref.named_parameters()
            if not torch.allclose(grads[n], p.grad, rtol=1e-4, atol=1e-6)
        ],  # fmt: skip
    }


@pytest.mark.parametrize("model", ["gpt", "llama"])  # llama: 2 kv heads travel unrepeated
def test_ring_on_gloo_gives_world_1s_loss_and_gradients(gloo, model):
    for rank, out in enumerate(gloo.run(2, ring_parity, model, 64)):
        assert out["loss"] == pytest.approx(out["ref_loss"], rel=1e-5), (rank, out)
        assert out["grads_differ"] == [], (rank, out)
        assert out["comm_s"] > 0, out  # the exchange is seen as communication


# -- memory ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cp2_saves_at_most_six_tenths_of_world_1s_activations_at_seq_1024(gloo):
    """One micro-batch's saved activations per rank (report.json's activation_bytes),
    at a sequence long enough for attention to matter."""
    long = {**GPT_MODEL, "seq_len": 1024}
    raw = cp_job("gpt", {}, train={"global_batch": 2, "micro_batch": 1})
    raw["model"] = long
    (one,) = gloo.run(1, train_cp, raw, 1)
    two = gloo.run(2, train_cp, {**raw, "parallel": {"cp": 2}}, 1)
    for rank, out in enumerate(two):
        ratio = out["activation_bytes"] / one["activation_bytes"]
        assert ratio <= 0.6, f"rank {rank}: {out['activation_bytes']} vs {one['activation_bytes']}"


@pytest.mark.slow
def test_cp2_trains_through_the_cli_and_records_fewer_activations(job_factory):
    """`meshforge train --nproc 2` with parallel.cp=2 at seq 1024: the run completes, its
    report names the layout and predicts the cp step, and its activation_bytes (logged
    and in report.json) are at most 0.6x those of the same job on one rank."""
    long = {"model": {"seq_len": 1024, "n_heads": 4},
            "train": {"steps": 2, "global_batch": 2, "micro_batch": 1},
            "observe": {"log_every": 1}}  # fmt: skip
    one = job_factory(long, name="cp1")
    one.train(1)
    two = job_factory(merge(long, {"parallel": {"cp": 2}}), name="cp2")
    proc = two.train(2)
    assert "cp=2 (allgather)" in proc.stdout + proc.stderr
    report = two.report
    assert report["status"] == "completed"
    assert report["layout"]["cp"] == 2 and report["layout"]["dp"] == 1
    # the K/V exchange profiled in one step: exposed communication, and said so
    assert "context-parallel" in report["communication"]["method"]
    assert report["time_breakdown"]["exposed_comm"] > 0, report["time_breakdown"]
    # calibrated under cp: the prediction is of the cp layout, from its own step timed
    # at the run's start (the K/V exchange in it)
    predicted = report["predicted"]
    assert predicted["layout"]["cp"] == 2, predicted
    assert predicted["host"]["steps"]["cp"] == 2, predicted["host"]

    def saved(job) -> int:
        rows = [
            json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()
        ]
        return next(r["activation_bytes"] for r in rows if r.get("activation_bytes"))

    assert saved(two) <= 0.6 * saved(one), (saved(two), saved(one))
    # report.json carries the figure the step logged (the issue's `activation_bytes`)
    assert report["activation_bytes"] == saved(two)
    assert one.report["activation_bytes"] == saved(one)


# -- bad input -------------------------------------------------------------------------------


def _refused(tmp_path: Path, parallel: dict[str, Any], nproc: int, **model: Any) -> Any:
    raw = merge(TINY_JOB, {"parallel": parallel, "model": model})
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(raw))
    args = ["train", str(config), "--nproc", str(nproc), "--run-dir", str(tmp_path / "run")]
    proc = meshforge(args, timeout=120)
    assert not (tmp_path / "run" / "checkpoints").exists()
    return proc


@pytest.mark.parametrize(
    ("parallel", "nproc", "model", "words"),
    [
        pytest.param(  # runtime.device: auto, and no GPU: the launcher finds the workers' cpu
            {"cp": 2, "cp_method": "ring"},
            2,
            {},
            [
                "parallel.cp_method=ring needs CUDA devices",
                "run on cpu",
                "use parallel.cp_method=allgather or alltoall",
            ],
            marks=pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="a GPU host"),
        ),  # fmt: skip
        (
            {"cp": 4, "cp_method": "alltoall"},
            4,
            {},
            ["parallel.cp_method=alltoall", "model.n_heads=2", "parallel.cp=4"],
        ),
        ({"cp": 3}, 3, {}, ["parallel.cp=3", "model.seq_len=32", "2 x cp = 6"]),
        ({"cp": 2}, 3, {}, ["world size 3", "parallel.cp=2"]),
        ({"cp": 0}, 1, {}, ["parallel.cp"]),
        (
            {"cp": 2, "mode": "parameter_server", "ps": {"servers": 1}},
            3,
            {},
            ["parallel.cp=2", "parallel.mode=parameter_server"],
        ),
    ],
    ids=["ring-on-cpu", "alltoall-heads", "seq-len", "world", "zero-degree", "param-server"],
)
def test_what_cp_cannot_run_is_refused_in_one_line(tmp_path, parallel, nproc, model, words):
    assert_one_line_error(_refused(tmp_path, parallel, nproc, **model), *words)
