"""A job file can name a user's own model factory (`model.name: package.module:fn`):
data parallel and ZeRO place it unchanged, TP and PP when it brings a plan or the
stage layout; a factory that cannot be built is refused before any worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from helpers import assert_one_line_error
from layouts import job, train_layout

TESTS = str(Path(__file__).parents[1])
STEPS = 12
FACTORY = {"name": "user_models:tiny_lm", "kwargs": {"width": 32, "layers": 4}, "seq_len": 32}


def _factory_job(parallel: dict, **model) -> dict:
    raw = job(parallel, train={"steps": STEPS})
    raw["model"] = {**FACTORY, **model}
    return raw


def _with_model(job, model: dict):
    """The tiny CLI job with its model section replaced (its GPT shape fields would not
    apply to a factory)."""
    job.cfg["model"] = model
    job.config_path.write_text(yaml.safe_dump(job.cfg))
    return job


@pytest.fixture(scope="module")
def reference(gloo) -> dict[int, float]:
    (out,) = gloo.run(1, train_layout, _factory_job({}), STEPS)
    assert out["losses"][STEPS] < out["losses"][1], "the world-1 run did not learn"
    return out["losses"]


@pytest.mark.parametrize(
    ("parallel", "model"),
    [
        ({"zero": 2}, {}),
        ({"zero": 3}, {}),
        ({"tp": 2, "loss_parallel": False}, {"tp_plan": "user_models:tp_plan"}),
        ({"pp": 2}, {}),
    ],
    ids=["zero2", "zero3", "tp2-user-plan", "pp2-stage-layout"],
)
def test_a_factory_model_trains_like_world_1(gloo, reference, parallel, model):
    results = gloo.run(2, train_layout, _factory_job(parallel, **model), STEPS)
    for out in results:
        for step, loss in reference.items():
            assert out["losses"][step] == pytest.approx(loss, rel=1e-4), step


def test_a_factory_job_trains_through_the_cli_under_zero2(job_factory):
    job = _with_model(job_factory({"parallel": {"zero": 2}, "train": {"steps": 6}}), FACTORY)
    job.train(2, env={"PYTHONPATH": TESTS})
    report = job.report
    assert report["status"] == "completed"
    params = report["model_params"]
    assert params == 4 * (32 * 2 + 2 * 32 * 64 + 64 + 32) + 256 * 32 * 2 + 2 * 32
    assert report["flops_per_token"] == 6 * params
    losses = job.losses()
    assert losses[6] < losses[1]


BAD_FACTORIES = [
    ({"name": "no_such_module:make"}, {}, ["model.name=no_such_module:make", "cannot import"]),
    ({"name": "user_models:nothing"}, {}, ["user_models has no nothing"]),
    ({"name": "user_models:not_a_module"}, {}, ["returned dict", "nn.Module"]),
    ({"name": "user_models:broken"}, {}, ["raised RuntimeError", "no GPU here"]),
    ({"name": "user_models:tiny_lm", "d_model": 64}, {}, ["model.d_model", "model.kwargs"]),
    ({"name": "user_models:tiny_lm", "n_layers": 4}, {}, ["model.n_layers", "model.kwargs"]),
    ({"name": "user_models:tiny_lm"}, {"tp": 2}, ["model.tp_plan"]),
    ({"name": "user_models:returns_a_tuple"}, {}, ["(1, 32, 256)", "returned tuple"]),
    ({"name": "user_models:tiny_lm", "kwargs": {"vocab": 100}}, {}, ["returned (1, 32, 100)"]),
    ({"name": "user_models:flat_lm"}, {"pp": 2}, ["parallel.pp=2", "stage layout"]),
]
BAD_IDS = ["no-module", "no-attribute", "not-a-module", "raises", "shape-field",
           "shape-field-at-its-default", "tp-no-plan", "returns-a-tuple", "wrong-vocab",
           "pp-without-stage-layout"]  # fmt: skip


@pytest.mark.parametrize(("model", "parallel", "fragments"), BAD_FACTORIES, ids=BAD_IDS)
def test_a_factory_that_cannot_be_built_is_refused_at_launch(model, parallel, fragments):
    from meshforge.config import build_config
    from meshforge.errors import ConfigError
    from meshforge.launch.train import validate_job

    raw = {**job(parallel), "model": {**model, "seq_len": 32}}
    with pytest.raises(ConfigError) as info:
        validate_job(build_config(raw), 2)  # what every launcher runs before any worker
    assert len(str(info.value).splitlines()) == 1
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize("case", [0, 8], ids=[BAD_IDS[0], BAD_IDS[8]])
def test_the_cli_refuses_a_bad_factory_in_one_line_before_any_worker(job_factory, case):
    model, parallel, fragments = BAD_FACTORIES[case]
    job = _with_model(job_factory({"parallel": parallel}), {**model, "seq_len": 32})
    proc = job.train(2, env={"PYTHONPATH": TESTS}, check=False)
    assert_one_line_error(proc, *fragments)
    assert not job.run_dir.exists()
