"""Listeners and the rendezvous state, in one process on loopback (issue 26): where a
store listens, and that a rendezvous state meshforge did not write is refused before
anything unpickles it."""

from __future__ import annotations

import base64
import os
import pickle
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from listening import listeners
from meshforge.errors import ConfigError
from meshforge.launch import rendezvous
from meshforge.runtime import listen
from meshforge.runtime.dist import group_store
from meshforge.runtime.env import DistEnv


class _Payload:
    """What an attacker writes: unpickling it calls os.mkdir(marker) (tests/unit starts no
    process, so not os.system; any callable is as bad)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _mine(port: int) -> set[tuple[str, int]]:
    return {(addr, p) for _, addr, p in listeners(os.getpid()) if p == port}


def test_a_store_listens_on_the_address_it_is_given():
    store = listen.tcp_store_server("127.0.0.1", 0, timedelta(seconds=10))
    assert _mine(store.port) == {("127.0.0.1", store.port)}
    store.set("k", "v")
    client = dist.TCPStore("127.0.0.1", store.port, timeout=timedelta(seconds=10))
    assert client.get("k") == b"v"
    # torch's own server, for contrast: every interface
    plain = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    assert {addr for addr, _ in _mine(plain.port)} <= {"::", "0.0.0.0"}


def test_rank_zero_store_listens_on_master_addr_only():
    env = DistEnv(0, 1, 0, "127.0.0.1", 0, "torchrun", 1)
    store = group_store(env, timedelta(seconds=10))
    store.set("x", "1")  # a PrefixStore over a server on 127.0.0.1
    server = store
    while hasattr(server, "underlying_store"):
        server = server.underlying_store
    # this store's listener only: in the whole suite this process holds others (tests/gloo.py)
    ours = {addr for _, addr, port in listeners(os.getpid()) if port == server.port}
    assert ours == {"127.0.0.1"}, ours


def test_store_address_follows_master_addr_then_the_interface(monkeypatch):
    assert listen.store_address("localhost") == "127.0.0.1"
    assert listen.store_address("127.0.0.1") == "127.0.0.1"
    # 192.0.2.0/24 is TEST-NET-1: no host has it (binding is tried, nothing is sent)
    assert listen.store_address("192.0.2.123", environ={"GLOO_SOCKET_IFNAME": "lo"}) == (
        "127.0.0.1"
    )
    with pytest.raises(ConfigError, match=r"MASTER_ADDR 192\.0\.2\.123 is not an address"):
        listen.store_address("192.0.2.123", environ={})


def _handler(run_id: str, max_nodes: int = 1):
    rendezvous.register()
    params = RendezvousParameters(
        backend=rendezvous.C10D,
        endpoint="127.0.0.1:0",
        run_id=run_id,
        min_nodes=1,
        max_nodes=max_nodes,
        local_addr="127.0.0.1",
        is_host=True,
    )
    return get_rendezvous_handler(params)


def _read_state(handler) -> None:
    handler._state_holder._last_sync_time = -1.0  # past torch's one-second cache
    handler.num_nodes_waiting()


def _write(handler, run_id: str, raw: bytes) -> None:
    handler._store.set(f"torch.rendezvous.{run_id}", base64.b64encode(raw).decode())


def test_single_node_rendezvous_listens_on_loopback_and_signs(tmp_path):
    handler = _handler("sn")
    port = handler._store.port
    assert _mine(port) == {("127.0.0.1", port)}
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    raw = base64.b64decode(handler._store.get("torch.rendezvous.sn"))
    assert raw.startswith(b"meshforge-rdzv-v1:")  # signed with the launcher's own key
    # a well-formed state that this launcher did not sign is refused too
    _write(handler, "sn", pickle.dumps(_RendezvousState()))
    with pytest.raises(rendezvous.RendezvousRefused, match="not signed"):
        _read_state(handler)


@pytest.mark.parametrize("secret", [None, "s3cret"], ids=["no-secret", "secret"])
def test_a_pickled_payload_is_refused_before_unpickling(tmp_path, monkeypatch, secret):
    """The attack of issue 26: a pickle that runs code, written into the state's key."""
    if secret:
        monkeypatch.setenv(rendezvous.SECRET_ENV, secret)
    else:
        monkeypatch.delenv(rendezvous.SECRET_ENV, raising=False)
    marker = tmp_path / "ran"
    handler = _handler(f"attack-{bool(secret)}", max_nodes=2)  # no launcher key across nodes
    evil = pickle.dumps(_Payload(str(marker)))
    _write(handler, f"attack-{bool(secret)}", evil)
    with pytest.raises(rendezvous.RendezvousRefused) as refused:
        _read_state(handler)
    line = str(refused.value)
    assert "\n" not in line and "refused before unpickling" in line
    assert ("not signed" if secret else "posix.mkdir") in line, line
    time.sleep(0.2)
    assert not marker.exists()
    pickle.loads(evil)  # what torch's agent does with the state: the payload is live
    assert marker.exists()


def test_signatures_between_nodes(monkeypatch):
    """Two backends over one store, as two nodes: the same secret reads the other's state;
    another secret, or none, is refused in one line naming the cause."""
    monkeypatch.setenv(rendezvous.SECRET_ENV, "one")
    store = listen.tcp_store_server("127.0.0.1", 0, timedelta(seconds=10))
    where = f"127.0.0.1:{store.port}"
    writer = rendezvous.GuardedC10dBackend(store, "job", rendezvous.job_secret(), where)
    state = _RendezvousState()
    state.participants = {_NodeDesc("10.0.0.1", 1, 0): 0}
    bits = pickle.dumps(state)
    _, token, has_set = writer.set_state(bits)
    assert has_set
    same = rendezvous.GuardedC10dBackend(store, "job", b"one", where)
    assert same.get_state()[0] == bits
    with pytest.raises(rendezvous.RendezvousRefused, match="signed with another key"):
        rendezvous.GuardedC10dBackend(store, "job", b"two", where).get_state()
    with pytest.raises(rendezvous.RendezvousRefused, match="no MESHFORGE_JOB_SECRET"):
        rendezvous.GuardedC10dBackend(store, "job", None, where).get_state()
    # a state signed for another run id does not pass either
    other = rendezvous.GuardedC10dBackend(store, "other-job", b"one", where)
    _, _, ok = other.set_state(bits)
    assert ok
    raw = store.get("torch.rendezvous.other-job")
    store.set("torch.rendezvous.job", raw)
    with pytest.raises(rendezvous.RendezvousRefused, match="signed with another key"):
        same.get_state()


def test_the_allowlist_admits_a_real_state_only():
    state = _RendezvousState()
    node = _NodeDesc("h", 1, 0)
    state.participants, state.wait_list = {node: 0}, {node}
    from datetime import UTC, datetime

    state.last_heartbeats = {node: datetime.now(UTC)}
    state.deadline = datetime.now(UTC)
    assert rendezvous.check_state_types(pickle.dumps(state)) is None
    assert rendezvous.check_state_types(pickle.dumps(_Payload("x"))) == "posix.mkdir"
    assert rendezvous.check_state_types(b"not a pickle") == "an unreadable pickle"


def test_secure_puts_a_single_node_on_loopback(tmp_path):
    from meshforge.launch.local import NodeSpec, launch_config

    config = launch_config(2, NodeSpec(), tmp_path)
    assert config.rdzv_backend == rendezvous.C10D
    assert config.local_addr == "127.0.0.1"  # the workers' MASTER_ADDR
    assert config.rdzv_endpoint.startswith("127.0.0.1:")
    multi = launch_config(2, NodeSpec(nnodes=2, rdzv_endpoint="10.9.0.1:29400"), tmp_path)
    assert (multi.rdzv_backend, multi.rdzv_endpoint) == (rendezvous.C10D, "10.9.0.1:29400")
    assert multi.local_addr is None
    static = launch_config(1, NodeSpec(nnodes=2, master_addr="10.9.0.1"), tmp_path)
    assert static.rdzv_backend == rendezvous.STATIC


def test_launch_pins_a_single_node_to_loopback_and_warns_unsigned_nodes(monkeypatch):
    from meshforge.launch.local import _listeners
    from meshforge.launch.torchrun import parse_launch_args

    for key in list(os.environ):
        if key.startswith("PET_") or key in ("MESHFORGE_IFACE", rendezvous.SECRET_ENV):
            monkeypatch.delenv(key)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth9")
    single = parse_launch_args(["job.yaml", "--nproc", "2"])
    _listeners(single)
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    assert any("loopback only" in n and "eth9" in n for n in single.notes), single.notes
    assert not single.warnings
    flags = ["job.yaml", "--nnodes", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", "192.0.2.77:29400", "--rdzv-conf", "is_host=0"]  # fmt: skip
    multi = parse_launch_args(flags)
    _listeners(multi)
    unsigned = [w for w in multi.warnings if rendezvous.SECRET_ENV in w]
    assert len(unsigned) == 1 and "192.0.2.77:29400" in unsigned[0], multi.warnings
    monkeypatch.setenv(rendezvous.SECRET_ENV, "s")
    keyed = parse_launch_args(flags)
    _listeners(keyed)
    assert not [w for w in keyed.warnings if rendezvous.SECRET_ENV in w]


def test_a_name_on_loopback_here_listens_on_the_job_interface(monkeypatch):
    """A host name that resolves to loopback on this host only (Debian's 127.0.1.1),
    while the job names its interface: the store listens on that interface's address."""
    monkeypatch.setattr(listen, "own_address", lambda host: "127.0.1.1")
    monkeypatch.setattr(listen.netif, "ipv4_of", lambda iface: "10.9.0.5")
    assert listen.store_address("node0", environ={"GLOO_SOCKET_IFNAME": "eth1"}) == "10.9.0.5"
    assert listen.store_address("node0", environ={}) == "127.0.1.1"
    # an explicit loopback address stays loopback (every node on this host)
    monkeypatch.setattr(listen, "own_address", lambda host: "127.0.0.1")
    assert listen.store_address("127.0.0.1", environ={"GLOO_SOCKET_IFNAME": "eth1"}) == (
        "127.0.0.1"
    )
