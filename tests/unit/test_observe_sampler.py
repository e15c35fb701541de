"""The per-node system sampler and memory health: rows as the contract spells them, rates
that match known traffic, and a run that never notices a sampler's trouble."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from meshforge.observe import comm_bytes, sampler
from meshforge.observe.memhealth import cuda_memory_stats, fragmentation, memory_advice
from meshforge.observe.sampler import (
    SystemSampler,
    link_capacity_bytes_per_s,
    parse_net_dev,
    read_net_counters,
    sampler_path,
)

ROW_KEYS = {
    "time",
    "host",
    "addr",
    "node",
    "interval_s",
    "cpu_percent",
    "mem_used_bytes",
    "mem_total_bytes",
    "mem_available_bytes",
    "net",
    "gpus",
}
NET_KEYS = {"rx_bytes_per_s", "tx_bytes_per_s", "capacity_bytes_per_s", "utilization"}
GPU_KEYS = {
    "index",
    "name",
    "memory_used_bytes",
    "memory_total_bytes",
    "utilization_percent",
    "temperature_c",
    "power_w",
}
GIB = 1 << 30
WHERE = {"host": "node-a", "addr": "10.0.0.7", "node": 3}


def _wait_for(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the sampler"
        time.sleep(0.02)


# -- the rows ---------------------------------------------------------------------------------
def test_rows_carry_every_contract_key_and_a_timestamp(tmp_path: Path) -> None:
    path = sampler_path(tmp_path, WHERE["node"], WHERE["host"])
    rows: list[dict] = []
    s = SystemSampler(path, every_s=0.1, host=WHERE, on_sample=rows.append).start()
    try:
        _wait_for(lambda: len(rows) >= 3)
    finally:
        s.close()
    written = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(written) >= 3 and written == rows[: len(written)]
    before = time.time()
    for row in written:
        assert ROW_KEYS <= set(row) <= ROW_KEYS | {"gpu_error"}
        assert {k: row[k] for k in WHERE} == WHERE
        assert isinstance(row["time"], float) and 0 < before - row["time"] < 60
        assert row["interval_s"] > 0
        assert 0.0 <= row["cpu_percent"] <= 100.0
        assert row["mem_used_bytes"] + row["mem_available_bytes"] == row["mem_total_bytes"] > 0
        assert "lo" in row["net"]
        for rates in row["net"].values():
            assert set(rates) == NET_KEYS
            assert rates["rx_bytes_per_s"] >= 0 and rates["tx_bytes_per_s"] >= 0
    times = [row["time"] for row in written]
    assert times == sorted(times)
    assert s.latest == rows[-1]


def test_sampler_path_names_the_node_else_the_host(tmp_path: Path) -> None:
    assert sampler_path(tmp_path, 2, "gpu-7") == tmp_path / "system" / "node-2.jsonl"
    assert sampler_path(tmp_path, None, "gpu-7") == tmp_path / "system" / "gpu-7.jsonl"


def test_close_is_idempotent_and_works_unstarted() -> None:
    SystemSampler(None).close()
    s = SystemSampler(None, every_s=0.05).start()
    s.close()
    s.close()
    assert s.sample()["interval_s"] > 0  # sampling by hand still works, in memory


# -- the network ------------------------------------------------------------------------------
def _send_paced(rate_bytes_per_s: float, duration_s: float) -> list[tuple[float, int]]:
    """Send over a TCP connection on 127.0.0.1 at a steady rate; (time, bytes sent so far)
    after every chunk."""
    chunk = b"x" * (64 << 10)
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()

    def drain() -> None:
        buffer = bytearray(1 << 20)
        while client.recv_into(buffer):
            pass

    receiver = threading.Thread(target=drain, daemon=True)
    receiver.start()
    start = time.time()
    sent, log = 0, [(start, 0)]
    with conn, client:
        while (now := time.time()) < start + duration_s:
            due = start + (sent + len(chunk)) / rate_bytes_per_s
            if now < due:
                time.sleep(due - now)
            conn.sendall(chunk)
            sent += len(chunk)
            log.append((time.time(), sent))
        conn.shutdown(socket.SHUT_WR)
        receiver.join(timeout=10)
    return log


def _sent_by(log: list[tuple[float, int]], t: float) -> float:
    """Bytes sent by time t, interpolated between chunks."""
    for (t0, b0), (t1, b1) in zip(log, log[1:], strict=False):
        if t0 <= t <= t1:
            return b0 + (b1 - b0) * (t - t0) / max(t1 - t0, 1e-9)
    return float(log[-1][1] if t > log[-1][0] else 0)


def _loopback_measured_vs_sent() -> tuple[float, float]:
    rows: list[dict] = []
    s = SystemSampler(None, every_s=0.5, on_sample=rows.append).start()
    try:
        log = _send_paced(rate_bytes_per_s=32e6, duration_s=3.0)
    finally:
        s.close()
    # samples whose whole interval lies inside the sending window, integrated
    inside = [
        r for r in rows if r["time"] - r["interval_s"] >= log[0][0] and r["time"] <= log[-1][0]
    ]
    assert len(inside) >= 2, f"too few samples inside the sending window: {rows}"
    measured = sum(r["net"]["lo"]["tx_bytes_per_s"] * r["interval_s"] for r in inside)
    received = sum(r["net"]["lo"]["rx_bytes_per_s"] * r["interval_s"] for r in inside)
    assert received == pytest.approx(measured, rel=0.01)  # loopback: each byte out comes in
    start = min(r["time"] - r["interval_s"] for r in inside)
    end = max(r["time"] for r in inside)
    return measured, _sent_by(log, end) - _sent_by(log, start)


def test_loopback_rate_matches_traffic_we_send() -> None:
    # Other processes may talk over lo too (and only ever add to it): a few tries.
    tries = []
    for _ in range(3):
        measured, sent = _loopback_measured_vs_sent()
        tries.append((measured, sent))
        if measured == pytest.approx(sent, rel=0.2):
            return
    pytest.fail(f"lo bytes measured vs sent over the window, per try: {tries}")


def test_loopback_has_no_capacity_and_speed_is_read_in_mbit(tmp_path: Path) -> None:
    assert link_capacity_bytes_per_s("lo") is None
    for iface, speed in {"eth0": "10000\n", "ib0": "-1\n", "veth1": "garbage"}.items():
        (tmp_path / iface).mkdir()
        (tmp_path / iface / "speed").write_text(speed)
        (tmp_path / iface / "type").write_text("1\n")
    (tmp_path / "down0").mkdir()  # no speed file at all
    assert link_capacity_bytes_per_s("eth0", tmp_path) == 10_000e6 / 8
    assert link_capacity_bytes_per_s("ib0", tmp_path) is None
    assert link_capacity_bytes_per_s("veth1", tmp_path) is None
    assert link_capacity_bytes_per_s("down0", tmp_path) is None


NET_DEV = """\
Inter-|   Receive                                                |  Transmit
 face |bytes packets errs drop fifo frame compressed multicast|bytes packets errs drop ...
    lo: 1000 10 0 0 0 0 0 0 1000 10 0 0 0 0 0 0
  eth0: 5000 50 0 0 0 0 0 0 7000 70 0 0 0 0 0 0
"""


def test_net_counters_parse_rx_and_tx_per_interface(tmp_path: Path) -> None:
    assert parse_net_dev(NET_DEV) == {"lo": (1000, 1000), "eth0": (5000, 7000)}
    (tmp_path / "dev").write_text(NET_DEV)
    assert read_net_counters(tmp_path / "dev") == {"lo": (1000, 1000), "eth0": (5000, 7000)}
    assert read_net_counters(tmp_path / "missing") == {}
    assert "lo" in read_net_counters()
    # comm_bytes reads the same counters: the host's transmitted bytes, every interface
    assert comm_bytes.host_tx_bytes(tmp_path / "dev") == 8000
    assert comm_bytes.host_tx_bytes(tmp_path / "missing") is None


# -- GPUs ---------------------------------------------------------------------------------------
def _check_gpus(row: dict) -> None:
    if "gpu_error" in row:
        assert row["gpus"] == [] and row["gpu_error"].startswith("NVML")
        return
    assert row["gpus"], "NVML works but lists no GPU and says nothing"
    for gpu in row["gpus"]:
        assert set(gpu) == GPU_KEYS
        assert 0 < gpu["memory_used_bytes"] <= gpu["memory_total_bytes"]
        assert isinstance(gpu["name"], str) and gpu["name"]


def test_gpus_come_from_nvml_or_say_why_not() -> None:
    s = SystemSampler(None).start()
    _check_gpus(s.sample())
    s.close()


def test_nvml_package_missing_degrades_to_no_gpus_and_a_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    monkeypatch.setattr(sampler, "_nvml", None)
    monkeypatch.setattr(sampler, "_nvml_error", None)
    row = SystemSampler(None).sample()
    assert row["gpus"] == []
    assert "nvidia-ml-py" in row["gpu_error"]


# -- trouble never reaches the run --------------------------------------------------------------
def test_a_full_disk_warns_once_and_sampling_goes_on() -> None:
    warnings: list[str] = []
    rows: list[dict] = []
    s = SystemSampler(Path("/dev/full"), every_s=0.05, warn=warnings.append, on_sample=rows.append)
    s.start()
    try:
        _wait_for(lambda: len(rows) >= 4)
    finally:
        s.close()
    assert len(warnings) == 1 and "/dev/full" in warnings[0]
    assert s.latest is rows[-1]


def test_a_failing_on_sample_warns_once_and_the_thread_lives() -> None:
    warnings: list[str] = []
    calls: list[dict] = []

    def broken_sink(row: dict) -> None:
        calls.append(row)
        raise RuntimeError("sink is down")

    s = SystemSampler(None, every_s=0.05, warn=warnings.append, on_sample=broken_sink).start()
    try:
        _wait_for(lambda: len(calls) >= 4)
    finally:
        s.close()
    assert len(warnings) == 1 and "sink is down" in warnings[0]
    assert s.latest is calls[-1]


# -- memory health ------------------------------------------------------------------------------
def _rank(rank: int, allocated: int = 4 * GIB, reserved: int = 5 * GIB, retries=0, ooms=0):
    return {
        "rank": rank,
        "allocated_bytes": allocated,
        "reserved_bytes": reserved,
        "alloc_retries": retries,
        "ooms": ooms,
    }


def test_fragmentation_is_the_unused_share_of_reserved() -> None:
    assert fragmentation(6 * GIB, 8 * GIB) == 0.25
    assert fragmentation(0, 0) == 0.0


def test_healthy_ranks_get_no_advice() -> None:
    cpu_rank = {"rank": 1, "allocated_bytes": None, "reserved_bytes": None}
    cpu_rank |= {"alloc_retries": None, "ooms": None}
    host = {"mem_available_bytes": 30 * GIB, "mem_total_bytes": 64 * GIB, "host": "n0"}
    assert memory_advice([_rank(0), cpu_rank], host) == []


def test_fragmented_rank_is_told_about_expandable_segments() -> None:
    (advice,) = memory_advice([_rank(0), _rank(1, allocated=4 * GIB, reserved=8 * GIB)])
    assert advice.startswith("Rank 1 ") and "50%" in advice
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in advice
    assert "train.activation_checkpointing" in advice


def test_small_reservations_are_not_judged_fragmented() -> None:
    assert memory_advice([_rank(0, allocated=1 << 20, reserved=100 << 20)]) == []


def test_allocator_retries_advise_checkpointing_or_a_smaller_micro_batch() -> None:
    (advice,) = memory_advice([_rank(0), _rank(1, retries=7)])
    assert advice.startswith("Rank 1 ") and "7" in advice
    assert "train.activation_checkpointing" in advice and "train.micro_batch" in advice


def test_ooms_are_named_first() -> None:
    advice = memory_advice([_rank(0, retries=3, ooms=2)])
    assert len(advice) == 2
    assert advice[0].startswith("Rank 0 ") and "2 CUDA out-of-memory errors" in advice[0]
    assert "retried" in advice[1]


def test_ranks_sharing_advice_are_grouped_in_one_sentence() -> None:
    ranks = [_rank(r, allocated=4 * GIB, reserved=8 * GIB) for r in (0, 1, 2, 3, 6)]
    (advice,) = memory_advice([*ranks, _rank(4), _rank(5)])
    assert advice.startswith("Ranks 0-3 and 6 ")
    ranks = [_rank(0, retries=2), _rank(1), _rank(2, retries=9)]
    (advice,) = memory_advice(ranks)
    assert advice.startswith("Ranks 0 and 2 ") and "2-9" in advice


def test_low_host_memory_is_nearly_exhausted() -> None:
    host = {"mem_available_bytes": 3 * GIB, "mem_total_bytes": 64 * GIB, "host": "node-a"}
    (advice,) = memory_advice([_rank(0)], host)
    assert "node-a" in advice and "5%" in advice and "nearly exhausted" in advice


def test_cuda_memory_stats_is_none_off_cuda() -> None:
    assert cuda_memory_stats(torch.device("cpu")) is None
    assert cuda_memory_stats("cpu") is None
    assert cuda_memory_stats(None) is None
    if torch.cuda.is_available():
        stats = cuda_memory_stats(torch.device("cuda", 0))
        assert set(stats) == {
            "allocated_bytes",
            "reserved_bytes",
            "alloc_retries",
            "ooms",
            "peak_bytes",
        }
