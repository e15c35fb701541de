"""A cluster on one machine, for the tests marked `cluster`: hosts made of network
namespaces, and a real Slurm cluster whose nodes are those hosts.

    with netns_hosts(2, rate="1gbit") as hosts:        # hosts[0].addr, .name, .iface
        with slurm_cluster(hosts) as slurm:            # slurm.env has SLURM_CONF
            slurm.run(["sbatch", ...])                 # a client, in the controller's host

Hosts: one network namespace each, joined on one L2 segment (a veth pair for two
hosts, a bridge in its own namespace for more), the interface named the same on every
host (`ci0`), IPv6 off, loopback up, an optional `tbf` rate cap on every host's
interface. Names and subnet carry this process's pid, so parallel test runs never
clash. Teardown always runs, also when setup fails halfway or the block raises.

Slurm: munged (its own key and socket), slurmctld in host 0 and one `slurmd -N nK`
per host, all entered with `nsenter --net` (`ip netns exec` remounts /sys, and slurmd
then dies on the missing cgroup mount); every path under one temp dir. Node names do
not resolve: each node's NodeAddr is its host's address. The controller is reachable
only inside the hosts' segment, so Slurm's clients run inside host 0 (`slurm.run`,
`slurm.client_argv`). See ../shared/CLUSTER-TESTBED.md for how each piece was found.

MooseFS: a real distributed file system over those hosts (master in host 0, one chunk
server in each other host, goal = their number), mounted with FUSE at a path every
process on this machine sees:

    with netns_hosts(3) as hosts, moosefs(hosts, tmp_path / "mfs") as fs:
        (fs.mount / "shards").mkdir()                  # fs.mount: a plain POSIX path

All three are context managers that skip the calling test (pytest.skip, with the
reason) where this machine cannot run them: not root, no /dev/fuse, or the tools
missing. `moosefs_unavailable()` says why beforehand (for benchmarks).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

IFACE = "ci0"
_instances = itertools.count()  # several host sets in one process get distinct names


@dataclass(frozen=True)
class Host:
    """One host: a network namespace with one interface on the shared segment."""

    name: str  # the namespace's name (/run/netns/NAME)
    addr: str  # IPv4 address on `iface`
    iface: str

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.name}"

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """`ip netns exec`: for ordinary processes."""
        return ["ip", "netns", "exec", self.name, *argv]

    def nsenter_argv(self, argv: Sequence[str]) -> list[str]:
        """`nsenter --net`: only the network namespace changes (mounts and /sys stay),
        which daemons such as slurmd need."""
        return ["nsenter", f"--net={self.netns_path}", *argv]

    def run(
        self, argv: Sequence[str], *, timeout: float = 30, check: bool = True, **kwargs
    ) -> subprocess.CompletedProcess:
        """Run a command inside this host with a time bound; text output captured."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.exec_argv(argv), timeout=timeout, check=check, **kwargs)

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.exec_argv(argv), **kwargs)


def _cannot_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool in ("ip", "tc", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (iproute2, util-linux)"
    return None


def _sh(*argv: str, timeout: float = 30) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")


def _add_namespace(name: str, made: list[str]) -> None:
    # A namespace with our pid in its name can only be left over from a dead process
    # that had this pid before us.
    if Path(f"/run/netns/{name}").exists():
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    _sh("ip", "netns", "add", name)
    made.append(name)
    # IPv6 off before any interface appears (no stray link-local addresses); a kernel
    # without IPv6 has no such sysctl, which is just as good.
    subprocess.run(
        [
            "ip", "netns", "exec", name, "sysctl", "-qw",
            "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1",
        ],
        capture_output=True,
        timeout=30,
    )  # fmt: skip
    _sh("ip", "-n", name, "link", "set", "lo", "up")


@contextmanager
def netns_hosts(
    n: int, rate: str | None = None, prefix: str = "mf", iface: str = IFACE
) -> Iterator[list[Host]]:
    """N hosts on one L2 segment, 10.X.Y.1..N/24 with X.Y unique to this process.
    `rate` (e.g. "1gbit", "200mbit") caps every host's interface with `tbf`."""
    if n < 1:
        raise ValueError("netns_hosts needs at least one host")
    reason = _cannot_make_namespaces()
    if reason:
        pytest.skip(reason)
    pid, k = os.getpid(), next(_instances)
    tag = f"{prefix}{pid}-{k}"
    subnet = f"10.{100 + (pid // 250 + k) % 100}.{pid % 250}"
    hosts = [Host(f"{tag}-h{i}", f"{subnet}.{i + 1}", iface) for i in range(n)]
    made: list[str] = []
    try:
        try:
            _add_namespace(hosts[0].name, made)
        except RuntimeError as exc:
            pytest.skip(f"cannot create network namespaces here: {exc}")
        for h in hosts[1:]:
            _add_namespace(h.name, made)
        if n == 2:  # a veth pair, the same interface name at both ends
            a, b = hosts
            _sh("ip", "link", "add", iface, "netns", a.name, "type", "veth",
                "peer", "name", iface, "netns", b.name)  # fmt: skip
        elif n > 2:  # a bridge in its own namespace, one veth per host
            bridge = f"{tag}-br"
            _add_namespace(bridge, made)
            _sh("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", bridge, "link", "set", "br0", "up")
            for i, h in enumerate(hosts):
                _sh("ip", "link", "add", iface, "netns", h.name, "type", "veth",
                    "peer", "name", f"p{i}", "netns", bridge)  # fmt: skip
                _sh("ip", "-n", bridge, "link", "set", f"p{i}", "master", "br0", "up")
        else:  # one host: a dummy interface, so `iface` exists all the same
            _sh("ip", "-n", hosts[0].name, "link", "add", iface, "type", "dummy")
        for h in hosts:
            _sh("ip", "-n", h.name, "addr", "add", f"{h.addr}/24", "dev", iface)
            _sh("ip", "-n", h.name, "link", "set", iface, "up")
            if rate:
                _sh("tc", "-n", h.name, "qdisc", "add", "dev", iface, "root", "tbf",
                    "rate", rate, "burst", "256kb", "latency", "50ms")  # fmt: skip
        yield hosts
    finally:
        for name in reversed(made):  # deleting a namespace removes its veth ends too
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def namespace_exists(name: str) -> bool:
    return Path(f"/run/netns/{name}").exists()


@pytest.fixture
def two_hosts() -> Iterator[list[Host]]:
    """Two namespace hosts joined by a veth pair (`ci0` at both ends)."""
    with netns_hosts(2) as hosts:
        yield hosts


# --- Slurm ---------------------------------------------------------------------------

SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo")


@dataclass
class SlurmCluster:
    """A running Slurm cluster. Its clients (sbatch, squeue, scontrol, sinfo) need
    `env` (SLURM_CONF) and must run inside `head`, the controller's host."""

    conf: Path
    partition: str
    hosts: list[Host]
    nodes: list[str]  # Slurm node names, nodes[i] runs in hosts[i]
    root: Path  # the temp dir holding config, state, spool and logs
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict, repr=False)

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def env(self) -> dict[str, str]:
        """The caller's environment plus SLURM_CONF, for Slurm's client commands."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def client_argv(self, argv: Sequence[str]) -> list[str]:
        """argv run inside the controller's host, where the cluster's addresses route."""
        return self.head.nsenter_argv(argv)

    def run(
        self, argv: Sequence[str], *, timeout: float = 30, check: bool = True, **kwargs
    ) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("env", self.env)
        return subprocess.run(self.client_argv(argv), timeout=timeout, check=check, **kwargs)

    def node_states(self) -> dict[str, str]:
        proc = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False, timeout=15)
        if proc.returncode != 0:
            return {}
        return dict(line.split(None, 1) for line in proc.stdout.splitlines() if " " in line)

    def logs(self, tail_chars: int = 3000) -> str:
        """The daemons' log tails, for an assertion message."""
        parts = []
        for path in sorted((self.root / "log").glob("*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail_chars:]}")
        return "\n".join(parts)


def _cannot_run_slurm() -> str | None:
    reason = _cannot_make_namespaces()
    if reason:
        return reason
    missing = [t for t in SLURM_TOOLS if shutil.which(t) is None]
    if missing:
        return f"needs {', '.join(missing)} (Debian: apt-get install slurm-wlm munge)"
    return None


def _slurm_conf(
    root: Path, hosts: list[Host], nodes: list[str], partition: str, ports: tuple[int, int]
) -> str:
    hostname = socket.gethostname().split(".")[0]  # slurmctld checks it runs on this name
    cpus = os.cpu_count() or 1
    lines = [
        f"ClusterName=mf{os.getpid()}",
        f"SlurmctldHost={hostname}({hosts[0].addr})",
        f"SlurmctldPort={ports[0]}",
        f"SlurmdPort={ports[1]}",  # each slurmd has its own address: one port fits all
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge/munge.socket",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/run/slurmctld.pid",
        f"SlurmdPidFile={root}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd-%n.log",
        # No systemd, no cgroups, no accounting daemon on these machines.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "PropagateResourceLimits=NONE",
        # Trust the node lines below (every slurmd sees the same machine) and keep a
        # node that once went down usable when it registers again.
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "SchedulerType=sched/backfill",
        "MessageTimeout=10",
        "SlurmdTimeout=60",
        "InactiveLimit=0",
        "KillWait=5",
        "MinJobAge=300",  # finished jobs stay visible to `scontrol show job`
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    for node, host in zip(nodes, hosts, strict=True):
        lines.append(
            f"NodeName={node} NodeHostname={hostname} NodeAddr={host.addr} "
            f"CPUs={cpus} State=UNKNOWN"
        )
    lines.append(
        f"PartitionName={partition} Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP"
    )
    return "\n".join(lines) + "\n"


def _start_munged(root: Path) -> subprocess.Popen:
    """munged with its own key and socket: a system munged, if any, is left alone."""
    mdir = root / "munge"
    mdir.mkdir(mode=0o755)  # munged wants o+x on every directory above its socket
    key = mdir / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o600)
    proc = subprocess.Popen(
        [
            "munged", "--foreground", f"--socket={mdir}/munge.socket", f"--key-file={key}",
            f"--log-file={root}/log/munged.log", f"--pid-file={mdir}/munged.pid",
            f"--seed-file={mdir}/munged.seed",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    _wait_for(lambda: (mdir / "munge.socket").exists(), 15, "munged's socket", proc)
    return proc


def _wait_for(ready, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the daemon exited ({proc.returncode})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not ready within {timeout_s:.0f} s")
        time.sleep(0.2)


def _stop(proc: subprocess.Popen, grace_s: float = 10) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@contextmanager
def slurm_cluster(
    hosts: list[Host], partition: str = "ci", ready_timeout_s: float = 60
) -> Iterator[SlurmCluster]:
    """A real Slurm cluster over `hosts`: controller in hosts[0], node nK in hosts[K-1].
    Yields once `sinfo` shows every node idle; always shuts down and cleans up."""
    reason = _cannot_run_slurm()
    if reason:
        pytest.skip(reason)
    pid = os.getpid()
    ports = (17000 + 2 * (pid % 1000), 17001 + 2 * (pid % 1000))
    nodes = [f"n{i + 1}" for i in range(len(hosts))]
    root = Path(tempfile.mkdtemp(prefix=f"mf-slurm-{pid}-"))
    root.chmod(0o755)
    for sub in ("state", "spool", "run", "log"):
        (root / sub).mkdir()
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, hosts, nodes, partition, ports))
    cluster = SlurmCluster(conf, partition, list(hosts), nodes, root)
    try:
        cluster._procs["munged"] = _start_munged(root)

        def daemon(name: str, host: Host, argv: list[str]) -> None:
            with open(root / "log" / f"{name}.out", "wb") as log:
                cluster._procs[name] = subprocess.Popen(
                    host.nsenter_argv(argv), env=cluster.env, stdout=log, stderr=log
                )

        daemon("slurmctld", hosts[0], ["slurmctld", "-D", "-c", "-f", str(conf)])
        for node, host in zip(nodes, hosts, strict=True):
            daemon(f"slurmd-{node}", host, ["slurmd", "-D", "-N", node, "-f", str(conf)])

        def all_idle() -> bool:
            for name, proc in cluster._procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode})")
            states = cluster.node_states()
            return len(states) == len(nodes) and all(s == "idle" for s in states.values())

        try:
            _wait_for(all_idle, ready_timeout_s, "Slurm nodes idle")
        except RuntimeError as exc:
            raise RuntimeError(f"Slurm cluster did not start: {exc}\n{cluster.logs()}") from None
        yield cluster
    finally:
        _teardown(cluster)


def _teardown(cluster: SlurmCluster) -> None:
    """`scontrol shutdown` (the controller tells every slurmd), then each daemon we
    started, by its pid: slurmds, controller, munged last (the others need it to stop)."""
    procs = cluster._procs
    try:
        if "slurmctld" in procs and procs["slurmctld"].poll() is None:
            try:
                cluster.run(["scontrol", "shutdown"], check=False, timeout=15)
            except subprocess.TimeoutExpired:
                pass
        order = [n for n in procs if n.startswith("slurmd-")] + ["slurmctld", "munged"]
        for name in order:
            if name in procs:
                _stop(procs[name])
    finally:
        shutil.rmtree(cluster.root, ignore_errors=True)


# --- training across hosts -------------------------------------------------------------


def train_on_hosts(
    hosts: Sequence[Host],
    config: Path,
    run_dir: Path,
    *extra: str,
    nproc_per_node: int | Sequence[int] = 1,
    timeout_s: float = 300,
    env: dict[str, str] | None = None,
) -> list[tuple[str, str]]:
    """`meshforge train` on every host at once (one node each, c10d rendezvous served by
    host 0, collectives on the hosts' interface); waits, bounded, for all of them and
    raises with their output when one fails. `nproc_per_node` may differ per host.
    Returns (stdout, stderr) per host."""
    import sys

    port = 29500 + (os.getpid() + next(_instances)) % 400
    base = {
        k: v
        for k, v in (env or os.environ).items()
        if k != "MESHFORGE_FAULT" and not k.startswith(("PET_", "GLOO_", "NCCL_"))
    }
    nprocs = [nproc_per_node] * len(hosts) if isinstance(nproc_per_node, int) else nproc_per_node
    procs = [
        subprocess.Popen(
            h.exec_argv(
                [
                    sys.executable,
                    "-m",
                    "meshforge",
                    "train",
                    str(config),
                    "--run-dir",
                    str(run_dir),
                    "--nnodes",
                    str(len(hosts)),
                    "--nproc-per-node",
                    str(n),
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    f"{hosts[0].addr}:{port}",
                    "--rdzv-id",
                    f"mf-{port}",
                    "--iface",
                    h.iface,
                    *extra,
                ]
            ),
            env=base,
            cwd=str(Path(__file__).resolve().parents[1]),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for h, n in zip(hosts, nprocs, strict=True)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout_s))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    if any(p.returncode for p in procs):
        raise AssertionError(
            "meshforge train failed: "
            + "\n".join(
                f"--- host {i} exit {p.returncode}:\n{out[-1500:]}\n{err[-6000:]}"
                for i, (p, (out, err)) in enumerate(zip(procs, outputs, strict=True))
            )
        )
    return outputs


# --- MooseFS ---------------------------------------------------------------------------

MOOSEFS_TOOLS = ("mfsmaster", "mfschunkserver", "mfsmount", "mfssetgoal", "mfscheckfile")
MOOSEFS_PACKAGES = "moosefs-master moosefs-chunkserver moosefs-client"
MOOSEFS_EMPTY_METADATA = Path("/var/lib/mfs/metadata.mfs.empty")
_COPIES = re.compile(r"chunks with (\d+) cop(?:y|ies):\s+(\d+)")


@dataclass
class MooseFS:
    """A running MooseFS: `mount` is an ordinary directory for every process here.
    Its admin tools (mfssetgoal, mfscheckfile, ...) reach the master over the hosts'
    segment, so they run inside the master's host (`fs.run`)."""

    mount: Path
    master: Host
    chunkservers: list[Host]
    goal: int  # copies of every chunk: one per chunk server
    root: Path  # configs, daemon state and logs (the mount point is root/mnt)
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict, repr=False)

    def run(
        self, argv: Sequence[str], *, timeout: float = 30, check: bool = True, **kwargs
    ) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(
            self.master.nsenter_argv(argv), timeout=timeout, check=check, **kwargs
        )

    def chunk_copies(self, path: Path) -> dict[int, int]:
        """{copies: chunks} of one file on the mount (`mfscheckfile`)."""
        out = self.run(["mfscheckfile", str(path)], timeout=15).stdout
        return {int(k): int(n) for k, n in _COPIES.findall(out)}

    @property
    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self._procs.items()}

    def logs(self, tail_chars: int = 3000) -> str:
        """The daemons' and the client's output tails, for an assertion message."""
        parts = []
        for path in sorted(self.root.glob("*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail_chars:]}")
        return "\n".join(parts)


def moosefs_unavailable() -> str | None:
    """Why MooseFS cannot run here, or None."""
    reason = _cannot_make_namespaces()
    if reason:
        return reason
    missing = [t for t in MOOSEFS_TOOLS if shutil.which(t) is None]
    if missing or not MOOSEFS_EMPTY_METADATA.is_file():
        what = ", ".join(missing) or str(MOOSEFS_EMPTY_METADATA)
        return f"needs {what} (Debian: apt-get install {MOOSEFS_PACKAGES})"
    try:  # a container may list /dev/fuse and still refuse it
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as exc:
        return f"FUSE unusable: /dev/fuse: {exc.strerror}"
    return None


def _mfs_configs(root: Path, master: Host, chunkservers: list[Host]) -> None:
    # The daemons run as root: they stay out of the way of a pytest temp dir (0700, which
    # the packages' `mfs` user could not enter), and only ever see this test's files.
    common = [
        "WORKING_USER = root",
        "WORKING_GROUP = root",
        "NICE_LEVEL = 0",  # 2 shared cores: no priority over the test itself
        "DISABLE_OOM_KILLER = 0",
    ]
    (root / "master").mkdir()
    shutil.copyfile(MOOSEFS_EMPTY_METADATA, root / "master" / "metadata.mfs")
    (root / "mfsexports.cfg").write_text("* / rw,alldirs,admin,maproot=0:0\n* . rw\n")
    (root / "mfstopology.cfg").write_text("")
    (root / "mfsmount.cfg").write_text("")  # not /etc/mfs/mfsmount.cfg
    (root / "mfsmaster.cfg").write_text(
        "\n".join(
            [
                *common,
                f"DATA_PATH = {root}/master",
                f"EXPORTS_FILENAME = {root}/mfsexports.cfg",
                f"TOPOLOGY_FILENAME = {root}/mfstopology.cfg",
                f"MATOML_LISTEN_HOST = {master.addr}",
                f"MATOCS_LISTEN_HOST = {master.addr}",
                f"MATOCL_LISTEN_HOST = {master.addr}",
                "REPLICATIONS_DELAY_INIT = 0",
            ]
        )
        + "\n"
    )
    for i, host in enumerate(chunkservers):
        cs = root / f"cs{i}"
        (cs / "hdd").mkdir(parents=True)
        (cs / "mfshdd.cfg").write_text(f"{cs}/hdd\n")
        (root / f"mfschunkserver-{i}.cfg").write_text(
            "\n".join(
                [
                    *common,
                    f"DATA_PATH = {cs}",
                    f"HDD_CONF_FILENAME = {cs}/mfshdd.cfg",
                    "HDD_LEAVE_SPACE_DEFAULT = 1GiB",
                    f"MASTER_HOST = {master.addr}",
                    f"BIND_HOST = {host.addr}",
                    f"CSSERV_LISTEN_HOST = {host.addr}",
                ]
            )
            + "\n"
        )


def _mounted(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mounts") as mounts:  # no stat(): a dead FUSE mount would hang it
        return any(line.split()[1] == target for line in mounts if len(line.split()) > 1)


@contextmanager
def moosefs(
    hosts: Sequence[Host],
    root: Path,
    *,
    mount_options: Sequence[str] = (),
    ready_timeout_s: float = 30,
) -> Iterator[MooseFS]:
    """A real MooseFS over `hosts`: the master in hosts[0], a chunk server in each other
    host (in hosts[0] when it is the only one), goal = the number of chunk servers, the
    FUSE client mounted at `root/mnt` (entered with `nsenter --net`, so the mount is
    visible to every process). Yields once a file written there has `goal` copies; on
    exit unmounts and stops every daemon it started, by its pid."""
    reason = moosefs_unavailable()
    if reason:
        pytest.skip(reason)
    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    master, chunkservers = hosts[0], list(hosts[1:]) or [hosts[0]]
    mount = root / "mnt"
    mount.mkdir()
    _mfs_configs(root, master, chunkservers)
    fs = MooseFS(mount, master, chunkservers, len(chunkservers), root)

    def daemon(name: str, host: Host, argv: list[str]) -> None:
        with open(root / f"{name}.log", "wb") as log:  # -f: stays our child, logs here
            fs._procs[name] = subprocess.Popen(
                host.nsenter_argv(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # a ^C to the test reaches us, not the daemons
            )

    def alive() -> None:
        for name, proc in fs._procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode})")

    try:
        daemon("mfsmaster", master, ["mfsmaster", "-f", "-c", f"{root}/mfsmaster.cfg"])
        for i, host in enumerate(chunkservers):
            cfg = f"{root}/mfschunkserver-{i}.cfg"
            daemon(f"mfschunkserver-{i}", host, ["mfschunkserver", "-f", "-c", cfg])

        def master_listens() -> bool:  # for clients (9421); the client gives up at once
            alive()
            return bool(
                fs.run(["ss", "-Hltn", "sport = :9421"], timeout=10, check=False).stdout.strip()
            )

        def has_space() -> bool:  # the master counts a chunk server's disk once it registered
            alive()
            if not _mounted(mount):
                return False
            proc = subprocess.run(
                ["stat", "-f", "-c", "%b", str(mount)], capture_output=True, text=True, timeout=10
            )
            return proc.returncode == 0 and int(proc.stdout.strip() or 0) > 0

        probe = mount / f".probe-{os.getpid()}"

        def probe_has_goal_copies() -> bool:
            # Every chunk server has registered once a new chunk gets `goal` copies.
            alive()
            subprocess.run(
                ["dd", "if=/dev/zero", f"of={probe}", "bs=64k", "count=1", "conv=fsync"],
                capture_output=True,
                timeout=15,
                check=True,
            )
            copies = fs.chunk_copies(probe)
            probe.unlink()
            return copies.get(fs.goal, 0) >= 1

        deadline = time.monotonic() + ready_timeout_s
        try:
            _wait_for(master_listens, ready_timeout_s, "mfsmaster listening")
            options = [
                f"mfscfgfile={root}/mfsmount.cfg",
                "mfsnice=0",
                "mfsallowoomkiller",
                "mfsioretries=10",  # an unreachable chunk fails a read in seconds, not minutes
            ]
            daemon(
                "mfsmount",
                master,
                ["mfsmount", str(mount), "-f", "-H", master.addr,
                 "-o", ",".join([*options, *mount_options])],
            )  # fmt: skip
            _wait_for(has_space, max(1.0, deadline - time.monotonic()), "MooseFS mounted")
            fs.run(["mfssetgoal", "-r", str(fs.goal), str(mount)])
            _wait_for(
                probe_has_goal_copies,
                max(1.0, deadline - time.monotonic()),
                f"a new file with {fs.goal} copies",
            )
        except (RuntimeError, subprocess.SubprocessError) as exc:
            raise RuntimeError(f"MooseFS did not start: {exc}\n{fs.logs()}") from None
        yield fs
    finally:
        _moosefs_teardown(fs)


def _moosefs_teardown(fs: MooseFS) -> None:
    """Unmount, then stop the client, the chunk servers and the master (it saves its
    metadata on SIGTERM) together, each by the pid we started it with. Chunk data is
    removed; configs and logs stay in `root`."""
    procs = fs._procs
    try:
        if _mounted(fs.mount):
            done = subprocess.run(["umount", str(fs.mount)], capture_output=True, timeout=30)
            if done.returncode != 0:  # busy (a reader still inside): detach it all the same
                subprocess.run(["umount", "-l", str(fs.mount)], capture_output=True, timeout=30)
        alive = [proc for proc in procs.values() if proc.poll() is None]
        for proc in alive:  # all at once: each takes a second or three to wind down
            proc.send_signal(signal.SIGTERM)
        for proc in alive:
            _stop(proc, grace_s=15)
        if _mounted(fs.mount):  # the client died first: a dead mount is left to detach
            subprocess.run(["umount", "-l", str(fs.mount)], capture_output=True, timeout=30)
        # The master forks to save its metadata on exit: wait for every process still
        # working in our directories (no one else's can be), and kill what outstays.
        try:
            _wait_for(lambda: not _processes_in(fs.root), 15, "MooseFS processes gone")
        except RuntimeError:
            for pid in _processes_in(fs.root):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    finally:
        for i in range(len(fs.chunkservers)):
            shutil.rmtree(fs.root / f"cs{i}" / "hdd", ignore_errors=True)


def _processes_in(root: Path) -> list[int]:
    """Processes whose working directory lies under `root` (MooseFS daemons chdir to
    their DATA_PATH, which is ours alone)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cwd = Path(os.readlink(entry / "cwd"))
            except OSError:  # gone, or a zombie: nothing to wait for
                continue
            if cwd == root or root in cwd.parents:
                pids.append(int(entry.name))
    return pids
