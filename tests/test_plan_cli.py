"""`meshforge plan` as scripts call it: the issue's exact form, --params, search, errors."""

from __future__ import annotations

import json

import pytest

from helpers import assert_one_line_error, meshforge

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
    assert "MFU / HFU" in proc.stdout and "dp16 tp8 pp8" in proc.stdout


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
        (["--params", "1e9", "--gpus", "8", "--network", "carrier-pigeon"], ["--network"]),
        (["--params", "1e9", "--gpus", "8", "--memory-convention", "ds"], ["--memory-convention"]),
        (["--params", "1e9", "--gpus", "8", "--precision", "fp8"], ["--precision"]),
        (["--params", "1e9", "--gpus", "8", "--dp", "4", "--tp", "1", "--pp", "1"], ["--gpus 8"]),
        (["--params", "1e9"], ["--gpus"]),
        (["--params", "1e9", "--gpus", "8", "--cpu-profile", "/nonexistent.json"], ["profile"]),
        (["--params", "abc", "--gpus", "8"], ["--params"]),
    ],
)
def test_bad_input_exits_2_with_one_line_naming_it(args, words):
    assert_one_line_error(_plan(*args), *words)
