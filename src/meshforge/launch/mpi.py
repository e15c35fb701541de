"""Run a job under OpenMPI's `mpirun`: one `meshforge worker` per MPI rank.

mpirun places the ranks (on this host, or on the hosts of a hostfile, filling each
host's slots in order) and starts them; each worker takes its rank, world size, local
rank and local world size from OpenMPI's variables (runtime/env.py). MPI carries no
traffic: the ranks meet in torch.distributed's env:// rendezvous at
MASTER_ADDR:MASTER_PORT, which mpirun hands to every rank with `-x`, together with the
environment a rank on another host needs (PATH, PYTHONPATH, thread and NCCL/gloo
settings). When mpirun fails, the ranks' own failure records (RUN_DIR/health, written
by train/worker.py) name the rank that failed and why, as under the elastic agent.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from meshforge.errors import ConfigError
from meshforge.launch.local import (
    clear_recorded_failures,
    describe_exit,
    free_port,
    recorded_failures,
    root_cause,
)
from meshforge.runtime.runlock import hold_run_dir, mark_held_for_workers

INSTALL_OPENMPI = "install OpenMPI (Debian: apt-get install openmpi-bin)"

# Passed to every rank by name when set here: what a rank on another host needs to find
# the same Python and libraries, and the user's thread and transport settings.
FORWARDED_VARIABLES = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "OMP_NUM_THREADS")
FORWARDED_PREFIXES = ("MESHFORGE_", "NCCL_", "GLOO_")

# After a forwarded Ctrl-C / SIGTERM, how long mpirun gets to stop its ranks.
STOP_GRACE_S = 30.0


@dataclass(frozen=True)
class HostfileEntry:
    host: str
    slots: int | None  # None: mpirun counts the host's cores


@dataclass(frozen=True)
class MpiLaunch:
    """What `meshforge submit mpi` was asked for."""

    np: int
    hostfile: Path | None = None
    master_addr: str | None = None
    master_port: int | None = None
    iface: str | None = None
    oversubscribe: bool = False


def parse_hostfile(text: str, source: str = "hostfile") -> list[HostfileEntry]:
    """OpenMPI's hostfile syntax: one host a line, optional `slots=N` (also `max_slots=N`
    and other key=value settings, left to mpirun), `#` starts a comment."""
    entries = []
    for number, raw in enumerate(text.splitlines(), start=1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        host, slots = words[0], None
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key in ("slots", "count", "cpu"):
                if not value.isdigit() or int(value) < 1:
                    raise ConfigError(
                        f"{source} line {number}: slots must be a positive integer, got {word!r}"
                    )
                slots = int(value)
        entries.append(HostfileEntry(host.rpartition("@")[2], slots))  # user@host
    return entries


def read_hostfile(path: Path) -> list[HostfileEntry]:
    if not path.exists():
        raise ConfigError(f"hostfile {path} does not exist")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not a text file"
        raise ConfigError(f"hostfile {path} cannot be read: {reason}") from None
    entries = parse_hostfile(text, f"hostfile {path}")
    if not entries:
        raise ConfigError(f"hostfile {path} lists no hosts")
    return entries


def find_mpirun(mpirun: str | None = None) -> str:
    """The mpirun to run: `mpirun` (a name or a path) if given, else `mpirun` on PATH."""
    found = shutil.which(mpirun or "mpirun")
    if found is None:
        where = f" at {mpirun}" if mpirun else ""
        raise ConfigError(f"mpirun not found{where}: {INSTALL_OPENMPI}")
    return found


def check_iface(iface: str) -> None:
    from meshforge.runtime.netif import interface_address

    interface_address(iface)


def local_slots() -> int:
    """mpirun's slots on this host without a hostfile: its processor cores."""
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def check_launch(launch: MpiLaunch) -> list[HostfileEntry]:
    """Refuse what mpirun would refuse late or in a page of output; returns the hosts."""
    if launch.np < 1:
        raise ConfigError(f"-np must be at least 1, got {launch.np}")
    hosts = read_hostfile(launch.hostfile) if launch.hostfile is not None else []
    if hosts and not launch.oversubscribe and all(h.slots is not None for h in hosts):
        slots = sum(h.slots or 0 for h in hosts)
        if launch.np > slots:
            raise ConfigError(
                f"-np {launch.np} is more than the {slots} slot(s) in hostfile "
                f"{launch.hostfile}: add slots or pass --oversubscribe"
            )
    if not hosts and not launch.oversubscribe and launch.np > local_slots():
        raise ConfigError(
            f"-np {launch.np} is more than this host's {local_slots()} core(s), mpirun's "
            "slots without a hostfile: pass --oversubscribe or a --hostfile"
        )
    if launch.iface is not None:
        check_iface(launch.iface)
    return hosts


def master_address(launch: MpiLaunch, hosts: list[HostfileEntry]) -> str:
    """Where rank 0 runs: mpirun puts it on the hostfile's first host (by slot)."""
    if launch.master_addr:
        return launch.master_addr
    return hosts[0].host if hosts else "127.0.0.1"


def mpirun_command(
    mpirun: str,
    launch: MpiLaunch,
    *,
    master_addr: str,
    master_port: int,
    config_file: Path,
    run_dir: Path,
    environ: Mapping[str, str] | None = None,
    as_root: bool | None = None,
    on_terminal: bool | None = None,
    python: str | None = None,
) -> list[str]:
    """The mpirun command line that runs the job's workers (pure: nothing is started)."""
    environ = os.environ if environ is None else environ
    as_root = os.geteuid() == 0 if as_root is None else as_root
    on_terminal = sys.stdout.isatty() if on_terminal is None else on_terminal
    cmd = [mpirun, "-np", str(launch.np)]
    if launch.hostfile is not None:
        cmd += ["--hostfile", str(launch.hostfile)]
    if launch.oversubscribe:
        cmd.append("--oversubscribe")
    if as_root:
        cmd.append("--allow-run-as-root")
    # Fill each host's slots in order (ranks 0..k-1 on the first host, rank 0 where
    # MASTER_ADDR points); no binding, so each worker's threads can use the cores it
    # shares with its node's other workers (runtime/dist.py divides them).
    cmd += ["--map-by", "slot", "--bind-to", "none"]
    given = {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "PYTHONUNBUFFERED": "1",
    }
    if not on_terminal:
        # mpirun hands local ranks a pseudo-terminal even when its own output goes to a
        # file; without this, rank 0 would draw its live progress bar into the log.
        given["TTY_COMPATIBLE"] = "0"
    if launch.iface is not None:
        given["GLOO_SOCKET_IFNAME"] = launch.iface
        given["NCCL_SOCKET_IFNAME"] = launch.iface
    for name, value in given.items():
        cmd += ["-x", f"{name}={value}"]
    forwarded = [name for name in FORWARDED_VARIABLES if name in environ]
    forwarded += sorted(
        name for name in environ if name.startswith(FORWARDED_PREFIXES) and name not in given
    )
    for name in forwarded:
        cmd += ["-x", name]
    run_dir = Path(run_dir).absolute()  # the same path on every host (shared storage)
    cmd += [python or sys.executable, "-u", "-m", "meshforge", "worker"]
    cmd += [str(Path(config_file).absolute()), "--run-dir", str(run_dir)]
    return cmd


@contextlib.contextmanager
def _forward_signals(proc: subprocess.Popen, received: list[tuple[int, float]]) -> Iterator[None]:
    """Pass SIGINT/SIGTERM on to mpirun (which stops its ranks) instead of dying first;
    each signal is noted in `received` with the time it came."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, _frame) -> None:
        received.append((signum, time.monotonic()))
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def session_members(sid: int) -> list[int]:
    """The live processes of session `sid` (from Linux's /proc; [] without it)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid pgrp session ...": comm may hold spaces and ")".
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            pids.append(int(stat.parent.name))
    return pids


def _kill_session(sid: int) -> None:
    for pid in session_members(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def run_mpirun(cmd: list[str], grace_s: float = STOP_GRACE_S) -> tuple[int, int | None]:
    """Run mpirun with its output streaming through; returns (exit code, the signal that
    stopped it or None).

    mpirun leads a session of its own, so a terminal's Ctrl-C reaches it once, through
    us, and so its local ranks can be found after it exits: mpirun may return while
    the ranks it stopped are still exiting. They get `grace_s` (counted from a forwarded
    signal, or from mpirun's exit) before whatever is left of the session is killed."""
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
    received: list[tuple[int, float]] = []
    with _forward_signals(proc, received):
        while True:
            try:
                rc = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if received and time.monotonic() - received[0][1] > grace_s:
                _kill_session(proc.pid)
        deadline = time.monotonic() + grace_s
        while session_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        _kill_session(proc.pid)
    return rc, (received[0][0] if received else None)


def diagnose(run_dir: Path, mpirun_rc: int) -> dict | None:
    """The failure that caused mpirun's non-zero exit, from the ranks' own records, in the
    shape launch/local.py writes (RUN_DIR/health/diagnosis.json); None when no rank
    recorded one (mpirun could not start them, or a rank was killed by a signal)."""
    recorded = recorded_failures(run_dir / "health")
    cause = root_cause(recorded, [])
    if cause is None:
        return None
    exit_line = f"mpirun {describe_exit(mpirun_rc)}"

    def entry(record: dict) -> dict:
        log = run_dir / "logs" / f"rank-{record['rank']}.log"
        return {
            "rank": record["rank"],
            "exit": exit_line,
            "error": record["error"],
            "log": str(log),
        }

    diagnosis = {
        "time": time.time(),
        "launcher": "mpirun",
        "first_failure": entry(cause),
        "failures": [entry(r) for r in sorted(recorded, key=lambda r: r["rank"])],
    }
    health = run_dir / "health"
    health.mkdir(parents=True, exist_ok=True)
    (health / "diagnosis.json").write_text(json.dumps(diagnosis, indent=2))
    return diagnosis


def submit_mpi(
    config: Path,
    overrides: list[str],
    launch: MpiLaunch,
    *,
    run_dir: Path | None = None,
    mpirun: str | None = None,
    dry_run: bool = False,
) -> int:
    """`meshforge submit mpi`: validate, write the job, run it under mpirun; the exit code."""
    from meshforge.launch.train import layout_line, prepare_job, report_failure

    hosts = check_launch(launch)
    mpirun_path = find_mpirun(mpirun)
    prepared = prepare_job(
        config,
        overrides,
        nproc_per_node=launch.np,
        min_nodes=1,
        max_nodes=1,
        run_dir=run_dir,
        lock=hold_run_dir,
    )
    if prepared.finished is not None:  # nothing to train, nothing written
        print(prepared.finished)
        return 0
    if not dry_run:
        mark_held_for_workers(prepared.run_dir)  # before mpirun_command: it is forwarded
    for line in (prepared.auto_line, prepared.history_line):
        if line:
            print(line)
    if prepared.schedule_warning:
        print(prepared.schedule_warning, file=sys.stderr)
    print(layout_line(prepared.cfg, launch.np, prepared.run_dir))
    cmd = mpirun_command(
        mpirun_path,
        launch,
        master_addr=master_address(launch, hosts),
        master_port=launch.master_port or free_port(),
        config_file=prepared.config_file,
        run_dir=prepared.run_dir,
    )
    if dry_run:
        print(shlex.join(cmd))
        return 0
    sys.stdout.flush()
    clear_recorded_failures(prepared.run_dir / "health")
    rc, stopped_by = run_mpirun(cmd)
    if stopped_by is not None and rc != 0:
        name = signal.Signals(stopped_by).name
        print(f"meshforge: stopped by {name}; mpirun {describe_exit(rc)}", file=sys.stderr)
        return 128 + stopped_by
    if rc == 0:
        return 0
    diagnosis = diagnose(prepared.run_dir, rc)
    if diagnosis is not None:
        return report_failure(prepared.run_dir, diagnosis)
    print(
        f"meshforge: mpirun {describe_exit(rc)} and no rank recorded an error "
        f"(see mpirun's output above and {prepared.run_dir / 'logs'})",
        file=sys.stderr,
    )
    return 1
