"""`parallel: auto` (issue 3, part 4): the planner picks the layout at launch."""

from __future__ import annotations

import pytest
import yaml

from helpers import SMALL_CPU_PROFILE as PROFILE
from helpers import SMALL_GPT as MODEL
from meshforge.config import ParallelConfig, build_config
from meshforge.errors import ConfigError
from meshforge.plan.core.cluster import build_cluster
from meshforge.plan.core.layout import Layout
from meshforge.plan.core.predict import predict_run
from meshforge.plan.jobs.auto import (
    ASSUMED_CPU_PROFILE,
    HostCosts,
    PlanningMachine,
    choose_layout,
    host_step_time,
    launch_machine,
    profile_cache_key,
    resolve_parallel_auto,
    save_cached_profile,
    shape_of,
)

HOST = HostCosts(2e9, 2e8)


def _cfg(**train):
    return build_config(
        {"model": MODEL, "parallel": "auto", "train": {"global_batch": 16, **train}}
    )


def test_auto_is_resolved_to_a_layout_the_trainer_supports():
    cfg = _cfg(micro_batch=2)
    machine = PlanningMachine(PROFILE.to_cluster(2), HOST, "test profile")
    resolved, line = resolve_parallel_auto(cfg, 2, machine=machine)
    p = resolved.parallel
    assert isinstance(p, ParallelConfig)
    assert (p.dp, p.tp, p.pp) == (2, 1, 1) and p.zero in (0, 1, 2, 3)
    b = resolved.train.micro_batch
    assert 16 % (2 * b) == 0
    resolved.check_trainable()
    assert resolved.resolve_dp(2) == 2
    assert line.startswith("meshforge: parallel: auto -> ")
    assert f"zero={p.zero}" in line and f"micro_batch={b}" in line and "test profile" in line
    assert "\n" not in line
    # everything else is kept
    assert resolved.model == cfg.model and resolved.train.global_batch == 16


def test_the_choice_is_the_fastest_of_every_supported_layout():
    cfg = _cfg()
    shape, cluster = shape_of(cfg), PROFILE.to_cluster(2)
    choice = choose_layout(cfg, 2, cluster, HOST)
    times = {}
    for zero in range(4):
        for b in (1, 2, 4, 8):  # every divisor of the per-rank batch 16 / 2
            pred = predict_run(shape, Layout(dp=2, zero=zero), 16, b, "fp32", "none", PROFILE)
            times[(zero, b)] = host_step_time(pred, shape, cluster, HOST)["step_s"]
    best = min(times, key=times.get)
    chosen = (choice.prediction.layout.zero, choice.prediction.training.micro_batch)
    assert chosen == best
    assert choice.step_time_s == pytest.approx(times[best])


def test_on_a_gpu_cluster_the_planners_own_time_model_ranks():
    cfg = build_config(
        {
            "model": {"vocab_size": 50304, "d_model": 2048, "n_layers": 24, "n_heads": 16,
                      "seq_len": 2048},
            "parallel": "auto",
            "precision": {"dtype": "bf16"},
            "train": {"global_batch": 64, "micro_batch": 1},
        }
    )  # fmt: skip
    cluster = build_cluster(8, "h100")
    choice = choose_layout(cfg, 8, cluster, host=None)
    assert choice.step_time_s == choice.prediction.step_time_s
    assert choice.fits


def test_a_mapping_is_left_alone_and_bad_input_is_named():
    cfg = build_config({"model": MODEL, "parallel": {"zero": 2}})
    assert resolve_parallel_auto(cfg, 2) == (cfg, None)
    with pytest.raises(ConfigError, match="no layout of 3 ranks"):
        resolve_parallel_auto(_cfg(), 3, machine=PlanningMachine(PROFILE.to_cluster(3), HOST, ""))
    with pytest.raises(ConfigError, match="resolved at launch"):
        _cfg().check_trainable()
    with pytest.raises(ConfigError, match="mapping of settings or 'auto'"):
        build_config({"parallel": "fastest"})


def test_a_profile_measured_earlier_is_what_auto_plans_with(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHFORGE_CACHE", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = _cfg()
    assumed = launch_machine(cfg, 2, 2)
    if assumed.host is None:
        pytest.skip("this machine has a GPU: the assumed machine is a catalogue GPU")
    assert "assumed" in assumed.source
    assert assumed.cluster.device.peak("fp32") == ASSUMED_CPU_PROFILE.matmul_flops_per_s
    key = profile_cache_key("cpu", "gloo", 2, 1)
    save_cached_profile(key, PROFILE, {"host": {"optimizer_bytes_per_s": 2e9,
                                                "sharded_optimizer_bytes_per_s": 2e8}})  # fmt: skip
    measured = launch_machine(cfg, 2, 2)
    assert measured.source.startswith("profile measured")
    assert measured.host == HOST
    assert measured.cluster.device.peak("fp32") == PROFILE.matmul_flops_per_s


def test_meshforge_train_resolves_auto_and_records_the_layout(job_factory, tmp_path):
    job = job_factory({"parallel": "auto", "train": {"steps": 4}}, name="auto")
    proc = job.train(2, env={"MESHFORGE_CACHE": str(tmp_path / "cache")})
    lines = [line for line in proc.stdout.splitlines() if "parallel: auto ->" in line]
    assert len(lines) == 1, proc.stdout
    resolved = yaml.safe_load((job.run_dir / "config.yaml").read_text())
    parallel = resolved["parallel"]
    assert isinstance(parallel, dict) and parallel["dp"] == 2
    assert (parallel["tp"], parallel["pp"]) == (1, 1)
    assert f"zero={parallel['zero']}" in lines[0]
    assert f"micro_batch={resolved['train']['micro_batch']}" in lines[0]
    layout = job.report["layout"]
    assert layout["zero"] == parallel["zero"]
    assert layout["micro_batch"] == resolved["train"]["micro_batch"]
    # the run measured this machine: the next launch plans with that profile
    assert (tmp_path / "cache" / "machine_profiles.json").exists()
