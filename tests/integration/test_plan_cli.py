"""`meshforge plan` as scripts call it: the issue's exact form, --params, search, errors;
a job file (--config), planned as `meshforge train` would run it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from helpers import REPO, assert_one_line_error, meshforge
from meshforge.plan.core.efficiency import curve_for

ISSUE_FORM = (
    "--layers 96 --hidden 12288 --heads 96 --vocab 51200 --seq 2048 --gpus 1024 "
    "--gpus-per-node 8 --gpu a100-80gb --network ib-hdr --global-batch 1536 --tp 8 --pp 8 "
    "--recompute full --json"
).split()
PLAN_KEYS = {"layout", "fits", "step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "hfu",
             "bubble_fraction", "memory_per_gpu_bytes"}  # fmt: skip


def _plan(*args: str):
    return meshforge(["plan", *args], timeout=120)


def test_the_issue_form_prints_one_json_object_with_the_listed_keys():
    proc = _plan(*ISSUE_FORM)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert PLAN_KEYS <= out.keys()
    assert {"model_states", "activations", "total"} <= out["memory_per_gpu_bytes"].keys()
    lay = out["layout"]
    assert (lay["tp"], lay["pp"], lay["dp"], lay["recompute"]) == (8, 8, 16, "full")
    # hardware TFLOP/s counts the recomputed forward: HFU > MFU
    assert out["hfu"] > out["mfu"] > 0.2
    assert out["calibration"] == curve_for("a100-80gb")[1]  # which fit the curve is
    assert out["tflops_per_gpu"] == pytest.approx(out["hfu"] * 312, rel=1e-6)
    assert out["tokens_per_s"] == pytest.approx(1536 * 2048 / out["step_time_s"])
    assert 0 < out["bubble_fraction"] < 0.3
    mem = out["memory_per_gpu_bytes"]
    assert mem["total"] > mem["model_states"] + mem["activations"]
    assert out["fits"] == (mem["total"] <= mem["device"])


def test_params_form_gives_model_state_maths():
    args = "--params 7.5e9 --gpus 64 --zero 3 --memory-convention zero-paper --precision fp16"
    proc = _plan(*args.split(), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["memory_per_gpu_bytes"]["model_states"] == pytest.approx(16 * 7.5e9 / 64)
    assert out["step_time_s"] is None and out["memory_per_gpu_bytes"]["activations"] is None


def test_search_prints_candidates_best_first():
    proc = _plan("--layers", "24", "--hidden", "2048", "--heads", "16", "--vocab", "50304",
                 "--seq", "2048", "--gpus", "16", "--gpu", "h100", "--global-batch", "256",
                 "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    candidates = json.loads(proc.stdout)["candidates"]
    assert 1 <= len(candidates) <= 5
    steps = [c["step_time_s"] for c in candidates]
    assert steps == sorted(steps)
    assert all(PLAN_KEYS <= c.keys() and c["fits"] for c in candidates)


def test_table_output_for_humans():
    proc = _plan(*ISSUE_FORM[:-1])
    assert proc.returncode == 0, proc.stderr
    # dp was left out: the search chose it (marked *); tp and pp were given
    assert "MFU / HFU" in proc.stdout and "dp16* tp8 pp8" in proc.stdout
    assert "* chosen by the search: dp," in proc.stdout


def test_cpu_profile_file(tmp_path):
    profile = tmp_path / "cpu.json"
    profile.write_text(json.dumps({"matmul_flops_per_s": 5e10, "allreduce_busbw_bytes_per_s": 1e9,
                                   "memory_bytes": 1.6e10}))  # fmt: skip
    proc = _plan("--layers", "4", "--hidden", "128", "--heads", "4", "--vocab", "256",
                 "--seq", "128", "--global-batch", "16", "--dp", "2", "--tp", "1", "--pp", "1",
                 "--zero", "3", "--micro-batch", "4", "--recompute", "none",
                 "--precision", "fp32", "--cpu-profile", str(profile), "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["n_gpus"] == 2 and out["memory_per_gpu_bytes"]["device"] == pytest.approx(8e9)


@pytest.mark.parametrize(
    "args,words",
    [
        (["--layers", "96", "--gpus", "8", "--global-batch", "8"], ["--hidden", "missing"]),
        (ISSUE_FORM[:-7] + ["--tp", "7"], ["tp=7", "--gpus 1024"]),
        (ISSUE_FORM[:-7] + ["--tp", "64", "--pp", "1"], ["--tp 64 does not divide --heads 96"]),
        (["--params", "1e9", "--gpus", "8", "--gpu", "b300"], ["--gpu", "b300"]),
        (["--params", "1e9", "--gpus", "8", "--gpu", "h1000"], ["did you mean h100?"]),
        (["--params", "1e9", "--gpus", "8", "--network", "carrier-pigeon"], ["--network"]),
        (["--params", "1e9", "--gpus", "8", "--memory-convention", "ds"], ["--memory-convention"]),
        (["--params", "1e9", "--gpus", "8", "--precision", "fp8"], ["--precision"]),
        (["--params", "1e9", "--gpus", "8", "--dp", "4", "--tp", "1", "--pp", "1"], ["--gpus 8"]),
        (["--params", "1e9"], ["--gpus"]),
        (["--params", "1e9", "--gpus", "8", "--cpu-profile", "/nonexistent.json"], ["profile"]),
        (["--params", "abc", "--gpus", "8"], ["--params"]),
        (["--params", "1e9", "--gpus", "8", "--mlp-ratio", "3"], ["--mlp-ratio", "--params"]),
        ([a if a != "1536" else "0" for a in ISSUE_FORM], ["--global-batch must be >= 1, got 0"]),
        (["--params", "1e9", "--gpus", "8", "--global-batch", "8"], ["--global-batch", "--params"]),
        (ISSUE_FORM[:-1] + ["--framework", "horovod"], ["--framework", "deepspeed-pipeline"]),
        (
            [
                "--config",
                str(REPO / "examples/gpt-tiny.yaml"),
                "--gpus",
                "2",
                "--framework",
                "megatron-core",
            ],
            ["--framework megatron-core with --config"],
        ),
        (
            ["--config", str(REPO / "examples/cluster.yaml"), "--gpus", "8"],
            ["examples/cluster.yaml", "unknown key 'gpus'"],
        ),
    ],
)
def test_bad_input_exits_2_with_one_line_naming_it(args, words):
    assert_one_line_error(_plan(*args), *words)


# -- a job file: --config ---------------------------------------------------------------------

LAYOUT_FIELDS = ("dp", "tp", "pp", "ep", "zero", "micro_batch", "virtual_stages", "recompute",
                 "sequence_parallel")  # fmt: skip
RESULT_KEYS = ("layout", "step_time_s", "memory_per_gpu_bytes", "model_params", "training",
               "fits", "mfu")  # fmt: skip


def _plan_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """`meshforge plan ARGS` in this process (the CLI's own entry point, exit code and all)."""
    from meshforge.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["plan", *args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, stop.value.code, out.out, out.err)


def _json_here(capsys, *args: str) -> dict:
    proc = _plan_here(capsys, *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _job(tmp_path: Path, cfg: dict, name: str = "job.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_config_plans_the_same_as_the_equivalent_flags(capsys):
    # examples/gpt-tiny.yaml: gpt 4 x 128, 4 heads, vocab 256, seq 128; zero 2, tp 1, pp 1,
    # dp auto; global batch 16, micro-batch 8, fp32, no activation checkpointing
    job = _json_here(capsys, "--config", str(REPO / "examples/gpt-tiny.yaml"), "--gpus", "2")
    flags = _json_here(
        capsys, "--layers", "4", "--hidden", "128", "--heads", "4", "--vocab", "256",
        "--seq", "128", "--global-batch", "16", "--precision", "fp32", "--zero", "2",
        "--tp", "1", "--pp", "1", "--micro-batch", "8", "--recompute", "none", "--gpus", "2",
    )  # fmt: skip
    assert job == flags
    assert job["layout"]["dp"] == 2 and job["layout"]["zero"] == 2
    assert job["layout_fields"]["dp"] == "searched"
    assert all(job["layout_fields"][k] == "given" for k in ("tp", "pp", "zero", "micro_batch"))


def test_a_job_giving_only_tp_has_the_rest_searched(tmp_path, capsys):
    cfg = {"model": {"preset": "llama-8b"}, "parallel": {"tp": 2},
           "precision": {"dtype": "bf16"}, "train": {"global_batch": 256}}  # fmt: skip
    out = _json_here(capsys, "--config", _job(tmp_path, cfg), "--gpus", "32")
    assert out["layout"]["tp"] == 2
    assert out["layout_fields"] == {k: "given" if k == "tp" else "searched" for k in LAYOUT_FIELDS}
    table = _plan_here(capsys, "--config", _job(tmp_path, cfg), "--gpus", "32").stdout
    assert " tp2 " in table and "dp" in table and "* chosen by the search: dp, pp" in table


def test_a_layout_flag_overrides_the_jobs_field_and_counts_as_given(capsys):
    out = _json_here(
        capsys, "--config", str(REPO / "examples/gpt-tiny.yaml"), "--gpus", "2", "--zero", "3",
        "--dp", "2",
    )  # fmt: skip
    assert (out["layout"]["zero"], out["layout"]["dp"]) == (3, 2)
    assert out["layout_fields"]["dp"] == out["layout_fields"]["zero"] == "given"


def test_gpus_defaults_to_the_jobs_world_size(tmp_path, capsys):
    cfg = {"model": {"tie_embeddings": False}, "parallel": {"dp": 2, "tp": 2, "pp": 2}}
    out = _json_here(capsys, "--config", _job(tmp_path, cfg))
    assert out["n_gpus"] == 8
    assert (out["layout"]["dp"], out["layout"]["tp"], out["layout"]["pp"]) == (2, 2, 2)


def test_a_preset_job_plans_the_presets_shape(tmp_path, capsys):
    cfg = {
        "model": {"preset": "llama-8b"},
        "precision": {"dtype": "bf16"},
        "parallel": {"tp": 8, "pp": 2, "zero": 2},
        "train": {"global_batch": 512, "micro_batch": 1, "activation_checkpointing": "full"},
    }
    job = _json_here(capsys, "--config", _job(tmp_path, cfg), "--gpus", "64")
    flags = _json_here(
        capsys, "--model", "llama-8b", "--tp", "8", "--pp", "2", "--zero", "2", "--gpus", "64",
        "--global-batch", "512", "--micro-batch", "1", "--recompute", "full",
    )  # fmt: skip
    for key in RESULT_KEYS:
        assert job[key] == flags[key], key
    assert 7.9e9 < job["model_params"] < 8.2e9
    assert (job["layout"]["tp"], job["layout"]["pp"], job["layout"]["dp"]) == (8, 2, 4)


def test_the_search_offers_only_layouts_the_trainer_runs(tmp_path, capsys):
    # gpt2-1.5b ties its head to the embedding: the trainer refuses pp > 1; its
    # activation checkpointing is none, full or every other block (not Korthikanti's).
    # Its bare shape, given by flags, is any model of that shape: every layout is offered
    shape = ["--layers", "48", "--hidden", "1600", "--heads", "25", "--vocab", "50257",
             "--seq", "1024"]  # fmt: skip
    bare = _json_here(capsys, *shape, "--gpus", "64", "--global-batch", "64", "--top", "20")
    assert any(c["layout"]["pp"] > 1 or c["layout"]["recompute"] == "selective"
               for c in bare["candidates"])  # fmt: skip
    preset = _json_here(capsys, "--model", "gpt2-1.5b", "--gpus", "64", "--global-batch", "64",
                        "--top", "20")  # fmt: skip
    cfg = {"model": {"preset": "gpt2-1.5b"}, "parallel": "auto",
           "precision": {"dtype": "bf16"}, "train": {"global_batch": 64}}  # fmt: skip
    job = _json_here(capsys, "--config", _job(tmp_path, cfg), "--gpus", "64", "--top", "20")
    for out in (preset, job):  # the preset is meshforge's model: the trainer's layouts only
        assert out["candidates"]
        for c in out["candidates"]:
            assert c["layout"]["pp"] == 1 and c["layout"]["recompute"] != "selective"
            assert c["layout"]["tp"] == 1  # tp 2, 4, 8 do not divide the vocabulary, 50257
            assert c["layout_fields"] == {k: "searched" for k in LAYOUT_FIELDS}


def test_a_preset_layout_the_trainer_refuses_is_refused_with_its_reason(capsys):
    for flags, reason in [
        (["--model", "gpt2-124m", "--tp", "2", "--gpus", "2"], "does not divide model.vocab_size"),
        (["--model", "gpt2-124m", "--pp", "2", "--gpus", "2"], "tie_embeddings"),
        (["--model", "llama-8b", "--tp", "16", "--gpus", "64"], "n_kv_heads=8"),
    ]:
        refused = _plan_here(capsys, *flags, "--global-batch", "512")
        assert_one_line_error(refused, reason)
    # the same shapes by flags are any model's: planned
    bare = _json_here(capsys, "--layers", "12", "--hidden", "768", "--heads", "12", "--vocab",
                      "50257", "--seq", "1024", "--tp", "2", "--gpus", "2", "--global-batch",
                      "512")  # fmt: skip
    assert bare["layout"]["tp"] == 2


def test_set_overrides_the_job_as_for_train(capsys):
    out = _json_here(capsys, "--config", str(REPO / "examples/gpt-tiny.yaml"), "--gpus", "2",
                     "--set", "train.global_batch=32", "--set", "model.n_layers=8")  # fmt: skip
    assert out["training"]["global_batch"] == 32
    small = _json_here(capsys, "--config", str(REPO / "examples/gpt-tiny.yaml"), "--gpus", "2")
    assert out["model_params"] > small["model_params"]


def test_flag_form_marks_given_and_searched_fields(capsys):
    out = _json_here(capsys, *ISSUE_FORM[:-1])
    fields = out["layout_fields"]
    assert (fields["tp"], fields["pp"], fields["recompute"]) == ("given", "given", "given")
    assert fields["dp"] == fields["zero"] == fields["micro_batch"] == "searched"


@pytest.mark.parametrize(
    "job,args,words",
    [
        (None, ["--config", "/nonexistent/job.yaml"], ["not found", "/nonexistent/job.yaml"]),
        ("model: {name: gpt\n", [], ["invalid YAML"]),
        ("train: {stepz: 5}\n", [], ["unknown key", "train.stepz"]),
        ("model: {name: 'user_models:tiny_mlp'}\n", ["--gpus", "2"],
         ["model.name=user_models:tiny_mlp", "factory"]),
        ("parallel: {mode: parameter_server}\n", ["--gpus", "2"], ["parameter_server"]),
        ("model: {n_layers: 4}\n", ["--gpus", "2", "--layers", "8"],
         ["--layers", "--config", "--set model.n_layers"]),
        ("model: {n_layers: 4}\n", ["--gpus", "2", "--model", "llama-8b"],
         ["--model", "--set model.preset"]),
        ("model: {n_layers: 4}\n", ["--gpus", "2", "--global-batch", "8"],
         ["--global-batch", "train.global_batch"]),
        ("model: {n_layers: 4}\n", ["--gpus", "2", "--params", "1e9"], ["--params", "--config"]),
        ("model: {n_layers: 4}\n", ["--gpus", "2", "--optimizer", "sgd"], ["--optimizer"]),
        ("parallel: {tp: 2}\n", [], ["--gpus", "parallel.dp", "parallel.pp"]),
        ("parallel: {tp: 2}\n", ["--gpus", "2", "--set", "parallel.tp=3"], ["parallel.tp=3"]),
        # the trainer's own checks of the given layout name the job's fields
        ("parallel: {tp: 1, pp: 1}\ntrain: {global_batch: 16, micro_batch: 8}\n",
         ["--gpus", "4"], ["train.global_batch=16", "dp=4"]),
        ("model: {tie_embeddings: true}\nparallel: {dp: 1, tp: 1, pp: 2}\n", [],
         ["model.tie_embeddings", "parallel.pp=2"]),
        ("parallel: {pp: 2, pp_schedule: zbv}\nmodel: {tie_embeddings: false}\n", ["--gpus", "2"],
         ["pp_schedule=zbv"]),
        (None, ["--gpus", "2", "--params", "1e9", "--set", "train.steps=5"], ["--set", "--config"]),
        # a flag is checked as the same --set would be
        ("parallel: {pp: 2, pp_schedule: 1f1b}\nmodel: {tie_embeddings: false}\n",
         ["--gpus", "2", "--virtual-stages", "2"], ["--virtual-stages 2", "interleaved_1f1b"]),
    ],
)  # fmt: skip
def test_bad_job_input_exits_2_with_one_line(tmp_path, capsys, job, args, words):
    if job is not None:
        path = tmp_path / "job.yaml"
        path.write_text(job)
        args = ["--config", str(path), *args]
    assert_one_line_error(_plan_here(capsys, *args), *words)


def test_a_gpipe_job_without_a_pipeline_plans(tmp_path, capsys):
    """The schedule the planner cannot model is refused only where a pipeline runs:
    --pp 1 beside a gpipe job plans, as --set parallel.pp=1 does."""
    job = _job(tmp_path, {"parallel": {"pp": 2, "pp_schedule": "gpipe"},
                          "model": {"tie_embeddings": False}})  # fmt: skip
    out = _json_here(capsys, "--config", job, "--gpus", "2", "--pp", "1")
    assert out["layout"]["pp"] == 1 and out["layout_fields"]["pp"] == "given"


def test_a_model_smaller_than_the_validated_runs_is_flagged(capsys):
    """A tiny model on a calibrated GPU: the step time is a lower bound, and says so."""
    small = _json_here(capsys, "--config", str(REPO / "examples" / "gpt-3d.yaml"), "--gpus",
                       "8", "--gpu", "h100")  # fmt: skip
    assert any("lower bound" in w for w in small["warnings"]), small.get("warnings")
    big = _json_here(capsys, "--model", "llama-8b", "--gpus", "64", "--gpu", "h100",
                     "--global-batch", "512")  # fmt: skip
    assert "warnings" not in big


def test_a_profile_and_a_gpu_together_are_refused(tmp_path):
    """A measured profile is the machine: a --gpu beside it would be silently ignored."""
    proc = meshforge(["plan", "--params", "1e9", "--gpus", "8", "--gpu", "a100",
                      "--cpu-profile", str(tmp_path / "p.json")])  # fmt: skip
    assert_one_line_error(proc, "--profile", "--gpu a100")


def test_when_nothing_fits_the_search_shows_the_layout_closest_to_fitting():
    args = ["plan", "--layers", "80", "--hidden", "8192", "--heads", "64", "--vocab",
            "32000", "--seq", "4096", "--global-batch", "1024", "--gpus", "8", "--gpu",
            "a100-40gb"]  # fmt: skip
    proc = meshforge([*args, "--json"])
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    closest = doc["closest"]
    assert doc["candidates"] == [] and closest["fits"] is False
    # the least memory of every layout the search tried: ZeRO-3 over all 8 GPUs needs more
    zero3 = meshforge([*args, "--dp", "8", "--tp", "1", "--pp", "1", "--zero", "3",
                       "--micro-batch", "1", "--recompute", "full", "--json"])  # fmt: skip
    least = closest["memory_per_gpu_bytes"]["total"]
    assert least <= json.loads(zero3.stdout)["memory_per_gpu_bytes"]["total"]
    text = meshforge(args).stdout
    assert "no layout of 8 x a100-40gb fits in memory; the one needing least" in text


def test_a_bare_parameter_count_leaves_the_batch_fields_empty():
    """Model states do not depend on the batch: no placeholder batch in the answer."""
    proc = meshforge(["plan", "--params", "7e9", "--gpus", "8", "--json"])
    assert proc.returncode == 0, proc.stderr
    best = json.loads(proc.stdout)["candidates"][0]
    assert best["training"]["global_batch"] is None and best["layout"]["microbatches"] is None
    assert best["step_time_s"] is None and best["memory_per_gpu_bytes"]["total"] > 0


def test_a_non_integer_mlp_ratio_sizes_the_mlp():
    """--mlp-ratio 2.6875 (a SwiGLU-sized MLP of width 2.6875 h) plans that width; a
    preset keeps the trainer's integer model.mlp_ratio."""
    shape = ["--layers", "4", "--hidden", "512", "--heads", "8", "--vocab", "1000", "--seq",
             "128", "--global-batch", "8", "--gpus", "1", "--json"]  # fmt: skip
    params = {}
    for ratio in ("2", "2.6875", "3"):
        proc = meshforge(["plan", *shape, "--mlp-ratio", ratio])
        assert proc.returncode == 0, proc.stderr
        params[ratio] = json.loads(proc.stdout)["candidates"][0]["model_params"]
    # two MLP matrices of h x width per layer, and the width's bias
    per_width = 4 * (2 * 512 + 1)
    assert params["2.6875"] - params["2"] == pytest.approx(per_width * 0.6875 * 512)
    assert params["2"] < params["2.6875"] < params["3"]
    refused = meshforge(["plan", "--model", "gpt2-124m", "--mlp-ratio", "2.5", "--gpus", "1",
                         "--global-batch", "8"])  # fmt: skip
    assert_one_line_error(refused, "--mlp-ratio 2.5", "integer")


def test_the_profile_cache_a_run_writes_is_a_profile_plan_reads(tmp_path):
    """machine_profiles.json (written by every training run) holds one entry per
    measured machine: with one entry `--cpu-profile` reads its profile; with more, it
    names them. Planned with the planner's own time model, it says so."""
    profile = {"matmul_flops_per_s": 5e10, "allreduce_busbw_bytes_per_s": 1e9,
               "memory_bytes": 1.6e10, "name": "cpu:gloo:1thr"}  # fmt: skip
    cache = tmp_path / "machine_profiles.json"
    cache.write_text(json.dumps({"this|cpu|gloo|world=2": {"profile": profile, "host": {}}}))
    shape = ["--layers", "2", "--hidden", "128", "--heads", "4", "--vocab", "256", "--seq",
             "64", "--global-batch", "16", "--precision", "fp32", "--gpus", "2"]  # fmt: skip
    proc = _plan(*shape, "--cpu-profile", str(cache), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["candidates"][0]["n_gpus"] == 2
    assert any("CPU host model" in w for w in doc["candidates"][0]["warnings"])
    two = {"a|cpu": {"profile": profile}, "b|cpu": {"profile": profile}}
    cache.write_text(json.dumps(two))
    assert_one_line_error(
        _plan(*shape, "--cpu-profile", str(cache)), "2 measured machines", "a|cpu"
    )


def test_ctrl_c_during_a_search_is_one_line_and_exit_130(capsys, monkeypatch):
    import os
    import signal
    import time

    import meshforge.plan.jobs.request as request

    def interrupted(*args, **kwargs):  # the search, as a Ctrl-C reaches it
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)  # the handler raises inside this call
        raise AssertionError("SIGINT did not interrupt the search")

    monkeypatch.setattr(request, "plan", interrupted)
    # a fresh `meshforge` process starts with Python's own SIGINT handler; an earlier
    # in-process test of the suite may have left another one installed
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    before = signal.getsignal(signal.SIGINT)
    try:
        stopped = _plan_here(capsys, "--model", "llama-8b", "--gpus", "64", "--global-batch", "512")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert stopped.returncode == 130, stopped.stderr
    assert stopped.stderr.strip().splitlines() == ["meshforge: interrupted (Ctrl-C)"]
    assert signal.getsignal(signal.SIGINT) is before  # the CLI left it as it found it


def test_a_published_run_is_planned_from_flags_as_the_validation_plans_it(capsys):
    """BLOOM-176B (DeepSpeed's pipeline engine, 100 Gb/s Omni-Path ports) and Megatron-Core's
    GPT 7.1B (its buckets and overlaps) from the command line: the step time of their rows
    in the validation table (plan/core/validation.py), to the digit."""
    from meshforge.plan.core.published import PUBLISHED_RUNS
    from meshforge.plan.core.validation import planner_inputs, predicted_step_s

    bloom = next(r for r in PUBLISHED_RUNS if r.source == "bloom2022")
    core = next(r for r in PUBLISHED_RUNS if r.name == "GPT 7.1B")
    for run, framework in ((bloom, "deepspeed-pipeline"), (core, "megatron-core")):
        x = planner_inputs(run)
        flags = ["--layers", run.layers, "--hidden", run.hidden, "--heads", run.heads,
                 "--vocab", run.vocab, "--seq", run.seq, "--gpus", run.n_gpus,
                 "--gpu", run.gpu, "--network", run.network or "ib-ndr",
                 "--tp", run.tp, "--pp", run.pp, "--dp", run.dp, "--zero", run.zero,
                 "--micro-batch", x.trainings[0].micro_batch, "--virtual-stages",
                 x.layout.virtual_stages, "--global-batch", run.global_batch,
                 "--recompute", run.recompute, "--precision", run.precision,
                 "--no-sequence-parallel"]  # fmt: skip
        if run.sequence_parallel:
            flags[-1] = "--sequence-parallel"
        if run.nics_per_node:
            flags += ["--nics-per-node", run.nics_per_node]
        if run.tied_embeddings is False:
            flags += ["--no-tie-embeddings"]
        out = _json_here(capsys, *map(str, flags), "--framework", framework)
        assert out["framework"] == framework
        assert out["step_time_s"] == pytest.approx(predicted_step_s(run), rel=1e-9)
        ours = _json_here(capsys, *map(str, flags))  # meshforge's own trainer
        assert ours["step_time_s"] != pytest.approx(out["step_time_s"], rel=1e-3)


def test_uneven_pipeline_stages_are_shown_with_the_ranks_that_set_pace_and_memory(capsys):
    args = ["--layers", "70", "--hidden", "14336", "--heads", "112", "--vocab", "250880",
            "--seq", "2048", "--gpus", "384", "--gpu", "a100-80gb", "--tp", "4", "--pp", "12",
            "--global-batch", "2048", "--recompute", "full"]  # fmt: skip
    out = _json_here(capsys, *args)
    assert out["pipeline_stages"] == [5] + [6] * 10 + [5]
    # the last rank holds the 250880-word head and the loss: it sets the pace
    assert out["slowest_pp_rank"] == 11
    table = _plan_here(capsys, *args)
    assert "pipeline stages" in table.stdout
    assert f"5, 6 x10, 5 layers; slowest rank 11; most memory rank {out['memory_pp_rank']}" in (
        table.stdout
    )


def test_a_port_rate_names_a_link_without_a_preset(capsys):
    base = ISSUE_FORM[:-1]
    i = base.index("--network")
    slow = _json_here(capsys, *base[:i], "--network", "roce-100g", *base[i + 2 :])
    fast = _json_here(capsys, *base[:i], "--network", "roce-400g", *base[i + 2 :])
    assert fast["step_time_s"] < slow["step_time_s"]


def test_a_runs_config_is_planned_at_the_world_size_it_ran(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text((REPO / "examples/gpt-tiny.yaml").read_text())  # dp: auto
    (run / "report.json").write_text(json.dumps({"world_size": 2}))
    proc = _plan_here(capsys, "--config", str(run / "config.yaml"), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["n_gpus"] == 2
    assert "--gpus 2" in proc.stderr and "report.json" in proc.stderr
    (run / "report.json").unlink()  # a job file elsewhere: --gpus is needed
    assert_one_line_error(_plan_here(capsys, "--config", str(run / "config.yaml")), "--gpus")


def test_a_llama_shape_by_flags_plans_as_the_validation_plans_llama_3_405b(capsys):
    from meshforge.plan.core.published import PUBLISHED_RUNS
    from meshforge.plan.core.validation import planner_inputs, predicted_step_s

    run = next(r for r in PUBLISHED_RUNS if r.name.startswith("Llama 3 405B (8192"))
    x = planner_inputs(run)
    flags = ["--family", "llama", "--layers", run.layers, "--hidden", run.hidden, "--heads",
             run.heads, "--kv-heads", run.kv_heads, "--mlp-ratio", run.ffn_hidden / run.hidden,
             "--vocab", run.vocab, "--seq", run.seq, "--no-tie-embeddings", "--gpus",
             run.n_gpus, "--gpu", run.gpu, "--tp", run.tp, "--pp", run.pp, "--dp", run.dp,
             "--zero", run.zero, "--virtual-stages", x.layout.virtual_stages,
             "--sequence-parallel", "--micro-batch", x.trainings[0].micro_batch,
             "--global-batch", run.global_batch, "--recompute", run.recompute,
             "--network", run.network, "--nics-per-node", run.nics_per_node]  # fmt: skip
    out = _json_here(capsys, *map(str, flags))
    assert out["step_time_s"] == pytest.approx(predicted_step_s(run), rel=1e-9)
    assert out["model"]["family"] == "llama" and out["model"]["n_kv_heads"] == 8
    assert out["model"]["mlp_width"] == run.ffn_hidden


@pytest.mark.parametrize(
    "args,words",
    [
        (["--params", "inf", "--gpus", "8"], ["--params", "finite"]),
        (["--params", "1e9", "--gpus", "8", "--framework", "megatron-lm"], ["--framework"]),
        (["--params", "1e9", "--gpus", "8", "--attention", "eager"], ["--attention"]),
        (["--params", "1e9", "--gpus", "8", "--network", "foo-400g"], ["--network", "foo-400g"]),
        (["--params", "1e9", "--gpus", "8", "--network", "roce-0g"], ["port rate"]),
        (["--model", "llama-8b", "--gpus", "8", "--global-batch", "8", "--kv-heads", "4"],
         ["--kv-heads with --model"]),
        (["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "99", "--seq", "8",
          "--gpus", "1", "--global-batch", "1", "--kv-heads", "3"], ["--kv-heads 3"]),
        (["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "99", "--seq", "8",
          "--gpus", "1", "--global-batch", "1", "--family", "t5"], ["--family"]),
        # the tied head, which the given pp breaks, not a value the search tried
        (["--model", "gpt2-124m", "--gpus", "8", "--pp", "2", "--global-batch", "64"],
         ["tie_embeddings", "--no-tie-embeddings"]),
    ],
)  # fmt: skip
def test_flags_that_cannot_apply_are_refused_in_one_line(capsys, args, words):
    assert_one_line_error(_plan_here(capsys, *args), *words)


def test_a_measured_profile_refuses_the_links_it_measured(tmp_path, capsys):
    profile = tmp_path / "cpu.json"
    profile.write_text(json.dumps({"matmul_flops_per_s": 5e10, "allreduce_busbw_bytes_per_s": 1e9,
                                   "memory_bytes": 1.6e10}))  # fmt: skip
    refused = _plan_here(capsys, "--params", "1e9", "--gpus", "2", "--cpu-profile",
                         str(profile), "--network", "ib-hdr")  # fmt: skip
    assert_one_line_error(refused, "--profile and --network")
