"""`meshforge cost`: TCO arithmetic on a hand-worked example, run costs, bad cluster files."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from helpers import assert_one_line_error, meshforge
from meshforge.cost.cluster import load_cluster, parse_cluster
from meshforge.cost.run import run_cost_from_plan, run_cost_from_report
from meshforge.cost.tco import tco
from meshforge.errors import ConfigError
from meshforge.plan.core.flops import GPTShape
from meshforge.plan.core.hardware import Cluster, gpu_spec, link_spec
from meshforge.plan.core.layout import Layout, Training
from meshforge.plan.core.predict import evaluate

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cluster.yaml"

# One node of 8 GPUs, numbers chosen so that everything can be checked by hand.
HAND = {
    "name": "hand",
    "gpus": {"count": 8, "unit_price_usd": 25000},
    "nodes": {"count": 1, "unit_price_usd": 50000, "power_kw": 10},
    "power": {"electricity_usd_per_kwh": 0.10, "pue": 1.5},
    "staff": {"fte": 0.1, "cost_per_fte_year_usd": 100000},
    "amortisation_years": 4,
    "utilisation": 0.5,
    "cloud": {"price_per_gpu_hour_usd": 4.0},
}


def test_breakeven_arithmetic_on_a_hand_worked_example():
    costs = tco(parse_cluster(HAND))
    # CAPEX = 8 x 25,000 + 50,000 = 250,000
    assert costs.capex_usd == pytest.approx(250_000)
    # energy = 10 kW x 8760 h x 1.5 x $0.10 = 13,140; staff = 10,000; OPEX = 23,140
    assert costs.opex_breakdown_usd["energy"] == pytest.approx(13_140)
    assert costs.opex_per_year_usd == pytest.approx(23_140)
    # owned per year = 250,000 / 4 + 23,140 = 85,640 over 8 x 8760 x 0.5 = 35,040 GPU-hours
    assert costs.owned_per_year_usd == pytest.approx(85_640)
    assert costs.gpu_hours_per_year == pytest.approx(35_040)
    assert costs.owned_per_gpu_hour_usd == pytest.approx(85_640 / 35_040)  # $2.444
    # renting the same hours: 4 x 35,040 = 140,160 a year
    assert costs.cloud_per_year_usd == pytest.approx(140_160)
    # breakeven: 250,000 / ((140,160 - 23,140) / 12) = 25.64 months
    assert costs.breakeven_months == pytest.approx(25.636, abs=1e-3)
    # breakeven utilisation: 85,640 / (4 x 8 x 8760) = 30.55 %
    assert costs.breakeven_utilisation == pytest.approx(0.30551, abs=1e-5)


def test_breakeven_utilisation_makes_owned_equal_rented():
    raw = copy.deepcopy(HAND)
    raw["nodes"]["idle_power_kw"] = 2.0  # energy now depends on utilisation
    cluster = parse_cluster(raw)
    u_star = tco(cluster).breakeven_utilisation
    at_breakeven = tco(cluster, utilisation=u_star)
    assert at_breakeven.owned_per_gpu_hour_usd == pytest.approx(4.0)


def test_renting_cheaper_than_running_never_breaks_even():
    raw = copy.deepcopy(HAND)
    raw["cloud"]["price_per_gpu_hour_usd"] = 0.01
    costs = tco(parse_cluster(raw))
    assert costs.breakeven_months is None
    assert costs.breakeven_utilisation > 1  # owning would need more than every hour


def test_example_cluster_file_loads_and_is_consistent():
    cluster = load_cluster(EXAMPLE)
    costs = tco(cluster)
    assert cluster.gpus_per_node == 8
    assert costs.capex_usd == pytest.approx(sum(costs.capex_breakdown_usd.values()))
    # owning costs more per hour than renting exactly when breakeven is past amortisation
    owned_dearer = costs.owned_per_gpu_hour_usd > costs.cloud_per_gpu_hour_usd
    assert owned_dearer == (costs.breakeven_months > 12 * cluster.amortisation_years)


def test_run_cost_from_a_run_directory(tmp_path):
    report = {"world_size": 4, "steps": 100, "step_time_s": 1.5, "wall_time_s": 180.0,
              "time_breakdown": {"compute": 0.7, "exposed_comm": 0.25, "data": 0.05}}  # fmt: skip
    (tmp_path / "report.json").write_text(json.dumps(report))
    costs = tco(parse_cluster(HAND))
    run = run_cost_from_report(tmp_path, costs)
    assert run.gpu_hours == pytest.approx(4 * 180 / 3600)  # 0.2 GPU-hours
    assert run.rented_usd == pytest.approx(0.8)
    assert run.owned_usd == pytest.approx(0.2 * 85_640 / 35_040)
    assert run.sync_loss_rented_usd == pytest.approx(0.2)


def test_a_run_resumed_at_another_world_size_costs_each_segments_gpu_seconds(tmp_path):
    # 100 s on 4 ranks, then resumed on 1 rank for 50 s: 450 GPU-seconds, not 1 x 150
    segments = [{"segment": 1, "world_size": 4, "wall_s": 100.0},
                {"segment": 2, "world_size": 1, "wall_s": 50.0}]  # fmt: skip
    report = {"world_size": 1, "steps": 30, "step_time_s": 1.0, "wall_time_s": 150.0,
              "segments": segments}  # fmt: skip
    (tmp_path / "report.json").write_text(json.dumps(report))
    costs = tco(parse_cluster(HAND))
    run = run_cost_from_report(tmp_path, costs)
    assert run.gpu_hours == pytest.approx((4 * 100 + 1 * 50) / 3600)
    assert run.rented_usd == pytest.approx(450 / 3600 * 4.0)
    assert (run.gpus, run.wall_s) == (1, 150.0)  # the last segment's size, the whole wall time
    # a report without segments (an older run) keeps world_size x wall_time_s
    (tmp_path / "report.json").write_text(json.dumps({**report, "segments": None}))
    assert run_cost_from_report(tmp_path, costs).gpu_hours == pytest.approx(150 / 3600)


def test_run_cost_from_a_plan():
    shape = GPTShape(24, 2048, 16, 50304, 2048)
    cluster = Cluster(gpu_spec("h100"), 8, 8, link_spec("nvlink4"), link_spec("ib-ndr"), 8)
    prediction = evaluate(shape, Layout(dp=8), Training(global_batch=64), cluster)
    costs = tco(parse_cluster(HAND))
    run = run_cost_from_plan(prediction, 64 * 2048 * 1000, costs)  # exactly 1000 steps
    assert run.steps == 1000
    assert run.wall_s == pytest.approx(1000 * prediction.step_time_s)
    assert run.rented_usd == pytest.approx(8 * run.wall_s / 3600 * 4.0)
    expected = prediction.time.exposed_comm_s / prediction.step_time_s
    assert run.exposed_comm_fraction == pytest.approx(expected)


@pytest.mark.parametrize(
    "edit,words",
    [
        (lambda r: r["power"].update(pue=0.8), ["power.pue", "0.8"]),
        (lambda r: r["gpus"].pop("count"), ["gpus.count"]),
        (lambda r: r["nodes"].update(colour="red"), ["nodes.colour"]),
        (lambda r: r.update(utilisation=1.5), ["utilisation"]),
        (lambda r: r["gpus"].update(kind="tpu-v9"), ["gpus.kind", "tpu-v9"]),
        (lambda r: r["nodes"].update(count=3), ["gpus.count=8", "nodes.count=3"]),
        (
            lambda r: r["cloud"].update(price_per_gpu_hour_usd="cheap"),
            ["cloud.price_per_gpu_hour_usd"],
        ),
        (lambda r: r.update(network={"inter": "tin-cans"}), ["network.inter"]),
    ],
)
def test_bad_cluster_files_exit_2_naming_the_field(tmp_path, edit, words):
    raw = copy.deepcopy(HAND)
    edit(raw)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert_one_line_error(meshforge(["cost", str(path)], timeout=60), *words)


@pytest.mark.parametrize("text", ["gpus: [unclosed", "- just\n- a list\n"])
def test_unreadable_cluster_files_exit_2(tmp_path, text):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    assert_one_line_error(meshforge(["cost", str(path)], timeout=60), str(path))


def test_cost_cli_json_and_planned_run():
    proc = meshforge(
        ["cost", str(EXAMPLE), "--tokens", "1e10", "--layers", "24", "--hidden", "2048",
         "--heads", "16", "--vocab", "50304", "--seq", "2048", "--global-batch", "256", "--json"],
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["run"]["source"] == "planned" and out["run"]["gpus"] == 64
    assert out["run"]["rented_usd"] == pytest.approx(out["run"]["gpu_hours"] * 3.0)
    assert {"capex_usd", "opex_per_year_usd", "breakeven_months"} <= out.keys()
    lay = out["run"]["layout"]  # which layout the planned run is costed with
    assert lay["dp"] * lay["tp"] * lay["pp"] == 64 and lay["micro_batch"] >= 1


def _cost_here(capsys, *args: str):
    """`meshforge cost ARGS` in this process: (exit code, stdout, stderr)."""
    import subprocess

    from meshforge.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["cost", str(EXAMPLE), *args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, stop.value.code, out.out, out.err)


@pytest.mark.parametrize(
    "args,words",
    [
        (["--tokens", "inf"], ["--tokens", "finite"]),
        (["--tokens", "1e9", "--gpus", "0"], ["--gpus", "between 1 and the cluster's 64"]),
        (["--tokens", "1e9", "--gpus", "128"], ["--gpus", "64", "128"]),
        # a preset is planned as the job that trains it: gpt2's 50257 words refuse tp 2
        (["--tokens", "1e9", "--tp", "2"], ["tp=2 does not divide model.vocab_size=50257"]),
        (["--tp", "2"], ["--model plans a run", "--tokens"]),  # no run to plan: refused
    ],
)
def test_a_planned_run_refuses_what_cannot_be_costed(capsys, args, words):
    preset = ["--model", "gpt2-124m", "--global-batch", "256"]
    assert_one_line_error(_cost_here(capsys, *preset, *args), *words)


def test_parse_cluster_names_the_file():
    with pytest.raises(ConfigError, match=r"^somewhere\.yaml: missing key 'cloud'"):
        parse_cluster({k: v for k, v in HAND.items() if k != "cloud"}, "somewhere.yaml")
