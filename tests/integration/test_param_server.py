"""parallel.mode: parameter_server. Synchronous servers train the model DDP trains;
asynchronous ones never apply a gradient staler than max_staleness; checkpoints move
between the modes; bad settings are one-line errors; `meshforge train` runs it."""

from __future__ import annotations

import math
from typing import Any

import pytest

from helpers import Job, assert_one_line_error, meshforge
from layouts import job, train_layout

STEPS = 20
RTOL = 1e-4


def ps(servers: int, sync: bool = True, max_staleness: int = 0) -> dict[str, Any]:
    settings = {"servers": servers, "sync": sync, "max_staleness": max_staleness}
    return {"mode": "parameter_server", "ps": settings}


@pytest.fixture(scope="module")
def ddp2(gloo) -> dict[int, float]:
    """DDP at world 2: global batch 8, two accumulated micro-batches of 2 per rank."""
    return gloo.run(2, train_layout, job({"zero": 0}), STEPS)[0]["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("servers", [1, 2])
def test_synchronous_servers_train_the_ddp_loss_curve(gloo, ddp2, servers):
    results = gloo.run(2 + servers, train_layout, job(ps(servers)), STEPS)
    layout = results[0]["layout"]
    assert layout["mode"] == "parameter_server"
    assert (layout["workers"], layout["servers"], layout["dp"]) == (2, servers, 2)
    assert results[0]["microbatches"] == 2  # 8 / (2 workers x 2): as DDP at world 2
    for rank, out in enumerate(results):  # servers join the loss reduction too
        assert sorted(out["losses"]) == sorted(ddp2)
        for step, loss in ddp2.items():
            assert out["losses"][step] == pytest.approx(loss, rel=RTOL), (rank, step)
    counters = [out["server_counters"] for out in results[2:]]
    assert all(c is not None for c in counters) and results[0]["server_counters"] is None
    for c in counters:  # one update per step from both workers' pushes, none stale
        assert (c["versions"], c["pushes"], c["applied"], c["dropped"]) == (20, 40, 40, 0)
        assert c["max_staleness_applied"] == 0


@pytest.mark.slow
def test_asynchronous_servers_learn_and_never_apply_a_gradient_staler_than_allowed(gloo):
    steps = 100
    raw = job(ps(1, sync=False, max_staleness=2), train={"steps": steps})
    results = gloo.run(3, train_layout, raw, steps)
    losses = results[0]["losses"]
    assert losses[steps] < 0.8 * losses[1], (losses[1], losses[steps])
    c = results[2]["server_counters"]
    assert c["pushes"] == 2 * steps  # each worker's push of each step
    assert c["applied"] + c["dropped"] == c["pushes"]
    assert c["max_staleness_applied"] <= 2
    stale = {int(k): v for k, v in c["staleness"].items()}
    assert max(stale) <= 2 and sum(stale.values()) == c["applied"]
    # the workers do not wait for each other: gradients of older parameters get applied
    assert any(v for k, v in stale.items() if k > 0), stale
    assert c["versions"] == c["applied"]  # one version per applied push


@pytest.mark.slow
def test_asynchronous_servers_drop_what_is_too_stale(gloo):
    raw = job(ps(1, sync=False, max_staleness=0), train={"steps": 10})
    c = gloo.run(3, train_layout, raw, 10)[2]["server_counters"]
    assert c["max_staleness_applied"] == 0 and set(c["staleness"]) == {"0"}
    # of two pushes of a step, the second comes from older parameters: dropped
    assert c["dropped"] > 0 and c["applied"] + c["dropped"] == 20


# (name, world A, layout A, world B, layout B): trained to step 8 under A with a
# checkpoint at step 6, then resumed from it under B to step 8
TRANSFERS = [
    ("ps->ddp", 3, ps(1), 2, {"zero": 0}),
    ("ddp->ps2", 2, {"zero": 0}, 4, ps(2)),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,wa,la,wb,lb", TRANSFERS, ids=[t[0] for t in TRANSFERS])
def test_a_checkpoint_moves_between_parameter_server_and_ddp(gloo, tmp_path, name, wa, la, wb, lb):
    root = str(tmp_path / "checkpoints")
    tied = {"tie_embeddings": True}  # the head shares the embedding: saved under both names
    saved = gloo.run(wa, train_layout, job(la, model=tied), 8, root, 6)[0]
    resumed = gloo.run(wb, train_layout, job(lb, model=tied), 8, root, None, True)[0]
    assert resumed["digest_loaded"] == saved["digest_saved"], name
    # the optimizer state came along: the next steps are those of the uninterrupted run
    for step in (7, 8):
        assert resumed["losses"][step] == pytest.approx(saved["losses"][step], rel=1e-3), step


def _config(servers: int, **model: Any):
    from meshforge.config import build_config

    return build_config(job(ps(servers), model=model))


def test_each_parameter_lives_on_one_server_balanced_by_bytes():
    from meshforge.parallel.param_server import ShardPlan

    cfg = _config(3, tie_embeddings=True)
    plan = ShardPlan.for_model(cfg, cfg.dims(5))
    owned = [name for names in plan.owned for name in names]
    assert sorted(owned) == sorted(plan.shapes) and len(set(owned)) == len(owned)
    assert "head.weight" not in plan.shapes  # the tied head is the embedding's other name
    assert plan.aliases == {"head.weight": "embed.tok.weight"}
    loads = [plan.numel(j) for j in range(3)]
    largest = max(math.prod(shape) for shape in plan.shapes.values())
    assert max(loads) - min(loads) <= largest, loads  # largest first, to the least loaded
    assert max(loads) < 0.4 * sum(loads)
    again = ShardPlan.for_model(cfg, cfg.dims(5))
    assert again.owned == plan.owned  # the same on every rank, every time


def test_a_shard_of_matrices_only_keeps_the_collective_optimizer_state_keys():
    import torch

    from meshforge.parallel.param_server import ParameterShard, ShardPlan, build_server_shard
    from meshforge.train.optim import Optimizers

    cfg = _config(2)
    plan = ShardPlan.for_model(cfg, cfg.dims(4))
    names = [n for n in plan.shapes if len(plan.shapes[n]) == 2][:2]
    plan = ShardPlan(2, 1, plan.shapes, plan.aliases, [names])
    parts = build_server_shard(cfg, plan, 0, torch.device("cpu"))
    assert isinstance(parts.modules[0], ParameterShard)
    opt = Optimizers(cfg, parts, None, torch.device("cpu"))  # type: ignore[arg-type]
    opt.ensure_state()
    model_sd, optim_sd = opt.state_dicts()
    assert sorted(model_sd) == sorted(names)
    assert f"state.{names[0]}.exp_avg" in optim_sd
    assert optim_sd[f"param_groups.{names[0]}.weight_decay"] == cfg.train.weight_decay
    opt.load_state_dicts(model_sd, optim_sd)  # no empty parameter group to trip over


BAD = [
    (2, ["parallel.ps.servers=2"], ["parallel.ps.servers=2", "no worker", "world size 2"]),
    (2, ["parallel.ps.max_staleness=-1"], ["parallel.ps.max_staleness"]),
    (3, ["parallel.ps.max_staleness=2"], ["max_staleness=2", "sync"]),
    (3, ["parallel.zero=3"], ["parameter_server", "zero=3"]),
    (4, ["parallel.ps.servers=1"], ["global_batch=8", "workers=3", "micro_batch=4"]),
]


def test_bad_parameter_server_settings_are_one_line_errors(tmp_path):
    path = tmp_path / "job.yaml"
    Job(tmp_path, {"parallel": {"mode": "parameter_server"}}, name="job")
    for nproc, sets, fragments in BAD:
        args = ["train", str(path), "--nproc", str(nproc), "--run-dir", str(tmp_path / "run")]
        for s in sets:
            args += ["--set", s]
        assert_one_line_error(meshforge(args), *fragments)
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.slow
def test_meshforge_train_runs_a_parameter_server(job_factory):
    overrides = {
        "parallel": {"mode": "parameter_server", "ps": {"servers": 1}},
        "train": {"steps": 4, "eval_every": 4},
        "checkpoint": {"every": 2},
        "observe": {"log_every": 2},
    }
    run = job_factory(overrides, name="ps")
    run.train(3)
    report = run.report
    assert report["status"] == "completed" and report["world_size"] == 3
    layout = report["layout"]
    assert layout["mode"] == "parameter_server"
    assert (layout["workers"], layout["servers"], layout["sync"]) == (2, 1, True)
    assert layout["max_staleness"] == 0
    counters = report["parameter_server"]
    assert (counters["pushes"], counters["applied"], counters["dropped"]) == (8, 8, 0)
    assert len(counters["per_server"]) == 1 and counters["per_server"][0]["versions"] == 4
    assert report["final_param_digest"] and report["val_loss"] is not None
    assert report["last_checkpoint"] == 4
    assert sorted(run.losses()) == [2, 4]
    # the server holds the optimizer state; a worker none
    states = report["model_state_bytes"]
    assert states[0]["optimizer"] == 0 and states[2]["optimizer"] > 0
    # resumed: the servers load their shards, the workers pull them
    run.train(3, "--set", "train.steps=6")
    report = run.report
    assert report["status"] == "completed" and report["resumed_from"] == 4
    assert report["parameter_server"]["pushes"] == 4  # two workers, steps 5 and 6
    assert sorted(run.losses()) == [2, 4, 6]
