"""`meshforge preflight`: the parsers on recorded tool output, the classification of
gathered reports (FAIL for versions that must agree, WARN for the rest), and the command
end to end at 2 ranks: healthy, with one rank made to report another torch, and bad input."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from helpers import assert_one_line_error, meshforge, unused_port
from meshforge.errors import ConfigError
from meshforge.health import preflight, probes
from meshforge.health.preflight import FAIL, PASS, SKIP, WARN, evaluate
from meshforge.health.probes import ToolOutput

SAMPLES = Path(__file__).parents[1] / "data" / "preflight"
DEVINFO_FAILED = ToolOutput(255, "", (SAMPLES / "ibv_devinfo-no-devices.txt").read_text())
DEVINFO_ONE_CA = ToolOutput(0, (SAMPLES / "ibv_devinfo-one-ca-two-ports.txt").read_text())
IBSTAT_ONE_CA = ToolOutput(0, (SAMPLES / "ibstat-one-ca-two-ports.txt").read_text())
IBSTAT_EMPTY = ToolOutput(0, (SAMPLES / "ibstat-empty.txt").read_text())
H100_NODE = ToolOutput(0, (SAMPLES / "nvidia-smi-8x-h100.csv").read_text())
MIXED_NODE = ToolOutput(0, (SAMPLES / "nvidia-smi-mixed.csv").read_text())
GiB = 1024**3


# --- parsers on recorded samples ---------------------------------------------------------


def test_ibstat_reads_state_physical_state_and_rate_of_each_port():
    ports = probes.parse_ibstat(IBSTAT_ONE_CA.stdout)
    assert [(p["ca"], p["port"]) for p in ports] == [("mlx5_0", 1), ("mlx5_0", 2)]
    up, down = ports
    assert (up["state"], up["physical_state"], up["rate_gbps"]) == ("Active", "LinkUp", 200.0)
    assert (down["state"], down["physical_state"]) == ("Down", "Polling")
    assert probes.port_is_up(up) and not probes.port_is_up(down)


def test_ibstat_rate_with_width_and_speed_reads_as_gbps():
    text = "CA 'mlx5_1'\n\tPort 1:\n\t\tState: Active\n\t\tRate: 200 Gb/sec (4X HDR)\n"
    assert probes.parse_ibstat(text)[0]["rate_gbps"] == 200.0


def test_no_infiniband_when_ibv_devinfo_fails_even_though_ibstat_exits_0():
    assert probes.parse_ibstat(IBSTAT_EMPTY.stdout) == []
    ib = probes.infiniband_summary(DEVINFO_FAILED, IBSTAT_EMPTY)
    assert ib["present"] is False and ib["ports"] == []
    assert "Failed to get IB devices list" in ib["detail"]


def test_silent_ibstat_is_never_read_as_ports_active():
    """A device listed by ibv_devinfo while ibstat prints nothing: the port states come
    from ibv_devinfo, and its down port is a warning, not a pass."""
    ib = probes.infiniband_summary(DEVINFO_ONE_CA, IBSTAT_EMPTY)
    assert ib["present"] is True and ib["source"] == "ibv_devinfo"
    assert [(p["port"], p["state"]) for p in ib["ports"]] == [(1, "Active"), (2, "Down")]
    no_ports = probes.infiniband_summary(ToolOutput(0, "hca_id:\tmlx5_0\n"), IBSTAT_EMPTY)
    check = evaluate_one("infiniband", [report(0, "a", ib=no_ports)])
    assert check.status == WARN and "no port state" in check.detail


def test_missing_ib_tools_mean_not_checked():
    ib = probes.infiniband_summary(ToolOutput(127, "", "ibv_devinfo: not found"), IBSTAT_EMPTY)
    assert ib["present"] is None
    assert evaluate_one("infiniband", [report(0, "a", ib=ib)]).status == SKIP


def test_nvidia_smi_csv_for_eight_h100():
    gpus = probes.gpu_summary(H100_NODE)
    assert gpus["status"] == "ok" and gpus["driver"] == "535.129.03"
    assert [g["index"] for g in gpus["gpus"]] == list(range(8))
    assert {(g["name"], g["memory_mib"]) for g in gpus["gpus"]} == {
        ("NVIDIA H100 80GB HBM3", 81559)
    }
    assert gpus["detail"] == "8x NVIDIA H100 80GB HBM3 (81559 MiB)"


def test_nvidia_smi_csv_for_a_mixed_node():
    gpus = probes.gpu_summary(MIXED_NODE)["gpus"]
    assert [g["memory_mib"] for g in gpus] == [81920, 81920, 40960, None]
    assert probes.describe_gpus(gpus) == (
        "2x NVIDIA A100-SXM4-80GB (81920 MiB), 1x NVIDIA A100-SXM4-40GB (40960 MiB), "
        "1x NVIDIA A100-SXM4-40GB (memory n/a)"
    )
    check = evaluate_one("gpus", [report(0, "a", gpus=probes.gpu_summary(MIXED_NODE))])
    assert check.status == WARN and "mixed GPU models on a" in check.detail


def test_no_gpu_is_reported_cleanly():
    gpus = probes.gpu_summary(ToolOutput(127, "", "nvidia-smi: not found"))
    assert gpus == {"status": "none", "gpus": [], "driver": None, "detail": "nvidia-smi not found"}
    checks = {c.name: c for c in evaluate([report(0, "a", gpus=gpus)])}
    assert checks["gpus"].status == PASS and "no GPU" in checks["gpus"].detail
    assert checks["driver"].status == PASS
    broken = probes.gpu_summary(ToolOutput(9, "", "NVIDIA-SMI has failed"))
    assert broken["status"] == "error" and "exit 9" in broken["detail"]


def test_node_probe_runs_the_tools_and_reads_their_output(tmp_path, monkeypatch):
    """Recorded output played back by stand-in tools on PATH: ibstat exits 0 printing
    nothing while ibv_devinfo fails, as on a host without InfiniBand."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for name, sample, rc in [
        ("nvidia-smi", "nvidia-smi-8x-h100.csv", 0),
        ("ibv_devinfo", "ibv_devinfo-no-devices.txt", 255),
        ("ibstat", "ibstat-empty.txt", 0),
    ]:
        (tools / name).write_text(f"#!/bin/sh\ncat '{SAMPLES / sample}'\nexit {rc}\n")
        (tools / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}:/usr/bin:/bin")
    node = probes.node_report(tmp_path / "run")
    assert node["gpus"]["status"] == "ok" and len(node["gpus"]["gpus"]) == 8
    assert node["infiniband"]["present"] is False
    assert node["disk"]["writable"] and node["disk"]["free_bytes"] > 0
    assert list((tmp_path / "run").iterdir()) == []  # the write test leaves nothing behind


# --- classification of gathered reports (pure) -------------------------------------------


def report(
    rank: int,
    host: str,
    *,
    versions: dict | None = None,
    env: dict | None = None,
    gpus: dict | None = None,
    ib: dict | None = None,
    free_bytes: int = 500 * GiB,
    write_error: str | None = None,
    node: bool = True,
) -> dict:
    """One rank's report as probes.process_report/node_report shape it (node: its host's)."""
    return {
        "rank": rank,
        "local_rank": 0,
        "host": host,
        "addr": f"10.0.0.{ord(host[0])}",
        "pid": 100 + rank,
        "versions": {
            "python": "3.11.7",
            "torch": "2.5.1+cu124",
            "torch_git": "a8d6afb511a69687bbb2b7e88a3cf67917e1697e",
            "cuda": "12.4",
            "cudnn": "90100",
            "nccl": "2.21.5",
            "meshforge": "0.1.0",
        }
        | (versions or {}),
        "env": env or {},
        "node": {
            "gpus": gpus or probes.gpu_summary(H100_NODE),
            "infiniband": ib or probes.infiniband_summary(DEVINFO_FAILED, IBSTAT_EMPTY),
            "disk": {
                "path": "/runs/job",
                "free_bytes": free_bytes,
                "writable": write_error is None,
                "error": write_error,
            },
        }
        if node
        else None,
    }


def evaluate_one(name: str, reports: list[dict]) -> preflight.Check:
    return next(c for c in evaluate(reports) if c.name == name)


def two_nodes(**node_b) -> list[dict]:
    """Ranks 0-1 on node-a, 2-3 on node-b; NODE_B's keywords apply to node-b's ranks."""
    return [
        report(0, "node-a"),
        report(1, "node-a", node=False),
        report(2, "node-b", **node_b),
        report(3, "node-b", node=False, **node_b),
    ]


def test_identical_nodes_pass_every_check():
    checks = evaluate(two_nodes())
    assert {c.status for c in checks} == {PASS}, [c for c in checks if c.status != PASS]
    assert preflight.overall_status(checks) == PASS


@pytest.mark.parametrize("key", ["torch", "cuda", "cudnn", "nccl", "meshforge"])
def test_a_version_that_must_agree_fails_naming_the_odd_rank_and_host(key):
    reports = two_nodes()
    reports[3]["versions"][key] = "0.0.1"
    check = evaluate_one(key, reports)
    assert check.status == FAIL
    assert check.ranks == [3] and check.hosts == ["node-b"]
    assert "0.0.1 on rank 3 (node-b)" in check.detail
    assert preflight.collective_blocker(evaluate(reports)) is not None


def test_python_fails_on_minor_and_warns_on_patch():
    assert evaluate_one("python", two_nodes(versions={"python": "3.12.1"})).status == FAIL
    assert evaluate_one("python", two_nodes(versions={"python": "3.11.9"})).status == WARN


def test_driver_fails_across_branches_and_warns_within_one():
    def with_driver(driver: str) -> dict:
        return probes.gpu_summary(ToolOutput(0, H100_NODE.stdout.replace("535.129.03", driver)))

    assert evaluate_one("driver", two_nodes(gpus=with_driver("550.54.15"))).status == FAIL
    check = evaluate_one("driver", two_nodes(gpus=with_driver("535.161.08")))
    assert check.status == WARN and check.hosts == ["node-b"]


def same_driver_as_h100(node: ToolOutput) -> dict:
    return probes.gpu_summary(ToolOutput(0, node.stdout.replace("550.54.15", "535.129.03")))


def test_the_rest_only_warns():
    cases = {
        "gpus": two_nodes(gpus=same_driver_as_h100(MIXED_NODE)),
        "env": two_nodes(env={"NCCL_SOCKET_IFNAME": "eth1"}),
        "infiniband": two_nodes(ib=probes.infiniband_summary(DEVINFO_ONE_CA, IBSTAT_ONE_CA)),
        "disk": two_nodes(free_bytes=2 * GiB),
    }
    for name, reports in cases.items():
        checks = evaluate(reports)
        check = next(c for c in checks if c.name == name)
        assert check.status == WARN, (name, check)
        assert "node-b" in check.hosts, (name, check)
        assert preflight.overall_status(checks) == WARN, name
        assert preflight.collective_blocker(checks) is None


def test_infiniband_port_down_names_the_port():
    ib = probes.infiniband_summary(DEVINFO_ONE_CA, IBSTAT_ONE_CA)
    check = evaluate_one("infiniband", [report(0, "a", ib=ib), report(1, "b", ib=ib)])
    assert check.status == WARN
    assert "mlx5_0 port 2: Down/Polling" in check.detail and "port 1" not in check.detail


def test_a_run_directory_that_cannot_be_written_fails():
    check = evaluate_one("disk", two_nodes(write_error="Read-only file system: /runs/job"))
    assert check.status == FAIL and check.hosts == ["node-b"]


def test_busbw_factor_is_two_n_minus_one_over_n():
    assert [preflight.busbw_factor(n) for n in (1, 2, 4, 8)] == [0.0, 1.0, 1.5, 1.75]


def test_version_fault_hook_changes_only_its_rank():
    mine, other = report(1, "a"), report(0, "a")
    env = {
        "MESHFORGE_FAULT": "crash:3,preflight_version:1:torch=2.0.0,preflight_version:1:nccl=2.18.1"
    }
    probes.inject_version_fault(mine, env)
    probes.inject_version_fault(other, env)
    assert (mine["versions"]["torch"], mine["versions"]["nccl"]) == ("2.0.0", "2.18.1")
    assert other["versions"]["torch"] == "2.5.1+cu124"
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        probes.inject_version_fault(mine, {"MESHFORGE_FAULT": "preflight_version:1:gpu=x"})


# --- the command, end to end (2 gloo ranks) ----------------------------------------------


ALL_CHECKS = {
    "python", "torch", "cuda", "cudnn", "nccl", "meshforge", "driver", "gpus",
    "infiniband", "env", "disk", "rendezvous", "port", "allreduce", "bandwidth",
}  # fmt: skip


def test_healthy_two_rank_run_passes_with_json(tmp_path):
    run_dir = tmp_path / "run"
    args = ["preflight", "--nproc", "2", "--run-dir", str(run_dir), "--bandwidth-mb", "1"]
    proc = meshforge([*args, "--port", str(unused_port()), "--json"], timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    checks = {c["name"]: c for c in doc["checks"]}
    assert set(checks) == ALL_CHECKS
    assert not [c for c in checks.values() if c["status"] == FAIL]
    assert doc["world_size"] == 2 and len(doc["ranks"]) == 2
    assert checks["allreduce"]["status"] == PASS
    assert all(r["ok"] for r in doc["communication"]["allreduce"]["results"])
    assert checks["port"]["status"] == PASS and checks["rendezvous"]["status"] == PASS
    assert doc["communication"]["bandwidth"]["busbw_gbps"] > 0
    assert json.loads((run_dir / "health" / "preflight.json").read_text()) == doc


def test_a_rank_reporting_another_torch_fails_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    proc = meshforge(
        ["preflight", "--nproc", "2", "--run-dir", str(run_dir), "--bandwidth-mb", "1"],
        env={"MESHFORGE_FAULT": "preflight_version:1:torch=2.0.0"},
        timeout=180,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAIL" in proc.stdout and "torch" in proc.stdout
    doc = json.loads((run_dir / "health" / "preflight.json").read_text())
    torch_check = next(c for c in doc["checks"] if c["name"] == "torch")
    assert torch_check["status"] == FAIL
    assert torch_check["ranks"] == [1] and torch_check["hosts"] == [socket.gethostname()]
    assert "2.0.0 on rank 1" in torch_check["detail"]
    assert doc["status"] == FAIL


def test_under_an_existing_launcher_a_port_in_use_fails(tmp_path):
    """RANK/WORLD_SIZE set (torchrun, srun, mpirun) and no launch flag: the process runs
    the checks itself. A --port that another program holds would fail a rendezvous."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(unused_port())}
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        args = ["preflight", "--run-dir", str(tmp_path), "--port", str(port), "--json"]
        proc = meshforge(args, env=env, timeout=120)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    checks = {c["name"]: c for c in doc["checks"]}
    assert doc["world_size"] == 1 and doc["status"] == FAIL
    assert checks["port"]["status"] == FAIL and "in use" in checks["port"]["detail"]
    assert checks["allreduce"]["status"] == PASS and checks["bandwidth"]["status"] == SKIP


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--nproc", "0"], "nproc"),
        (["--bandwidth-mb", "-1"], "--bandwidth-mb"),
        (["--no-such-flag"], "--no-such-flag"),
        (["--worker", "--nproc", "2"], "--worker"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, fragment):
    assert_one_line_error(meshforge(["preflight", *args], timeout=60), fragment)
