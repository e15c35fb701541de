"""The cluster fixtures themselves (tests/cluster.py): namespace hosts reach each other
and nothing else, a rate cap is applied, teardown always runs, and a real Slurm cluster
runs a job on every host."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import namespace_exists, netns_hosts, slurm_cluster

pytestmark = pytest.mark.cluster

# A one-connection echo server and its client, each bounded by a socket timeout.
SERVER = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
srv.settimeout(20)
print("listening", flush=True)
for _ in range(int(sys.argv[3])):
    conn, _ = srv.accept()
    conn.sendall(conn.recv(64).upper())
    conn.close()
"""
CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as s:
    s.sendall(sys.argv[3].encode())
    print(s.recv(64).decode())
"""


def _echo_between(server, clients) -> list[str]:
    """Start an echo server in host `server`; each client host sends its name; the
    upper-cased replies come back in order."""
    port = "29611"
    srv = server.popen(
        [sys.executable, "-c", SERVER, server.addr, port, str(len(clients))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert srv.stdout.readline().strip() == "listening", srv.stderr.read()
        replies = [
            c.run([sys.executable, "-c", CLIENT, server.addr, port, c.name]).stdout.strip()
            for c in clients
        ]
        assert srv.wait(timeout=20) == 0
        return replies
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait(timeout=10)


def test_two_hosts_talk_tcp_over_one_interface_name():
    with netns_hosts(2) as (a, b):
        assert a.iface == b.iface == "ci0"
        assert a.addr != b.addr
        assert _echo_between(b, [a]) == [a.name.upper()]
        # Each host sees only its own address on ci0, and no IPv6.
        shown = a.run(["ip", "-o", "addr", "show"]).stdout
        assert f"inet {a.addr}/24" in shown and b.addr not in shown
        assert "inet6" not in shown


def test_more_than_two_hosts_share_a_bridge():
    with netns_hosts(3) as hosts:
        assert _echo_between(hosts[2], hosts[:2]) == [h.name.upper() for h in hosts[:2]]


def test_rate_cap_is_a_tbf_qdisc_on_every_host():
    with netns_hosts(2, rate="200mbit") as hosts:
        for h in hosts:
            qdisc = h.run(["tc", "qdisc", "show", "dev", h.iface]).stdout
            assert "tbf" in qdisc and "rate 200Mbit" in qdisc, qdisc


def test_namespaces_are_removed_after_an_error_inside_the_block():
    with pytest.raises(RuntimeError, match="inside"):
        with netns_hosts(3) as hosts:
            names = [h.name for h in hosts]
            assert all(namespace_exists(n) for n in names)
            raise RuntimeError("failure inside the block")
    assert not any(namespace_exists(n) for n in names)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)


def test_namespaces_are_removed_when_setup_fails_halfway():
    before = set(Path("/run/netns").iterdir()) if Path("/run/netns").exists() else set()
    with pytest.raises(RuntimeError, match="tbf"):
        with netns_hosts(2, rate="not-a-rate", prefix="mfbad"):
            pass  # never reached: tc refuses the rate after both namespaces exist
    after = set(Path("/run/netns").iterdir())
    assert not [p for p in after - before if p.name.startswith("mfbad")]


def test_slurm_runs_one_task_in_each_namespace_host(tmp_path):
    script = tmp_path / "where.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"#SBATCH --output={tmp_path}/where-%j.out\n"
        "srun --ntasks-per-node=1 bash -c 'echo \"$SLURMD_NODENAME $(hostname -I)\"'\n"
    )
    with netns_hosts(2) as hosts, slurm_cluster(hosts) as slurm:
        assert slurm.node_states() == {"n1": "idle", "n2": "idle"}
        job = slurm.run(["sbatch", "--parsable", "--nodes=2", str(script)]).stdout.strip()
        deadline = time.monotonic() + 60
        while True:
            state = slurm.run(["scontrol", "-o", "show", "job", job]).stdout
            if "JobState=COMPLETED" in state or "JobState=FAILED" in state:
                break
            assert time.monotonic() < deadline, f"job still {state}\n{slurm.logs()}"
            time.sleep(0.5)
        assert "JobState=COMPLETED" in state, f"{state}\n{slurm.logs()}"
    lines = sorted((tmp_path / f"where-{job}.out").read_text().split("\n"))
    assert [line.split() for line in lines if line] == [
        ["n1", hosts[0].addr],
        ["n2", hosts[1].addr],
    ]
