"""What one process and one node say about themselves before a run: versions, GPUs,
InfiniBand, the NCCL_/GLOO_ variables, and the run directory's disk.

The parsers are pure functions of a tool's text, tested on recorded samples
(tests/data/preflight/). The probes run the tools with a deadline and never raise: a
tool that is missing or fails is a fact to report, not an error.

InfiniBand is detected by `ibv_devinfo`'s exit code, never by `ibstat` alone: on a host
without IB, `ibstat` can print nothing and exit 0, which must not read as "every port
active". Port state comes from `ibstat` (State, Physical state, Rate), else from
`ibv_devinfo` (state only)."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshforge.errors import ConfigError
from meshforge.runtime import netif
from meshforge.train.faults import FAULT_ENV
from meshforge.version import __version__

NVIDIA_SMI_QUERY = [
    "nvidia-smi",
    "--query-gpu=index,name,memory.total,driver_version",
    "--format=csv,noheader,nounits",
]
COMM_ENV_PREFIXES = ("NCCL_", "GLOO_")
WRITE_TEST_BYTES = 4096


@dataclass(frozen=True)
class ToolOutput:
    rc: int  # 127: not installed, 124: no answer within the deadline
    stdout: str
    stderr: str = ""

    @property
    def first_line(self) -> str:
        for line in (self.stderr + "\n" + self.stdout).splitlines():
            if line.strip():
                return line.strip()
        return ""


def run_tool(argv: list[str], timeout_s: float = 10.0) -> ToolOutput:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        return ToolOutput(127, "", f"{argv[0]}: not found")
    except subprocess.TimeoutExpired:
        return ToolOutput(124, "", f"{argv[0]}: no answer within {timeout_s:g} s")
    except OSError as exc:
        return ToolOutput(126, "", f"{argv[0]}: {exc.strerror or exc}")
    return ToolOutput(proc.returncode, proc.stdout, proc.stderr)


# --- GPUs (nvidia-smi) -------------------------------------------------------------


def parse_nvidia_smi(text: str) -> list[dict[str, Any]]:
    """Rows of `nvidia-smi --query-gpu=index,name,memory.total,driver_version
    --format=csv,noheader,nounits`: one GPU a line, memory in MiB ("[N/A]" -> None)."""
    gpus = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4 or not fields[0].isdigit():
            continue  # a warning or a blank line, not a GPU
        index, name, memory, driver = fields
        gpus.append(
            {
                "index": int(index),
                "name": name,
                "memory_mib": int(memory) if memory.isdigit() else None,
                "driver": driver if driver and not driver.startswith("[") else None,
            }
        )
    return gpus


def gpu_summary(out: ToolOutput) -> dict[str, Any]:
    """status: ok (GPUs listed), none (no nvidia-smi, or it lists none), error."""
    if out.rc == 127:
        return {"status": "none", "gpus": [], "driver": None, "detail": "nvidia-smi not found"}
    if out.rc != 0:
        detail = f"nvidia-smi exit {out.rc}: {out.first_line}"
        return {"status": "error", "gpus": [], "driver": None, "detail": detail}
    gpus = parse_nvidia_smi(out.stdout)
    if not gpus:
        return {"status": "none", "gpus": [], "driver": None, "detail": "nvidia-smi lists no GPU"}
    drivers = sorted({g["driver"] for g in gpus if g["driver"]})
    return {
        "status": "ok",
        "gpus": gpus,
        "driver": drivers[0] if drivers else None,
        "detail": describe_gpus(gpus),
    }


def describe_gpus(gpus: list[dict[str, Any]]) -> str:
    """'8x NVIDIA H100 80GB HBM3 (81559 MiB)', models in the order they first appear."""
    counts: dict[str, int] = {}
    for g in gpus:
        memory = f"{g['memory_mib']} MiB" if g["memory_mib"] is not None else "memory n/a"
        key = f"{g['name']} ({memory})"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n}x {key}" for key, n in counts.items()) or "no GPU"


# --- InfiniBand (ibv_devinfo, ibstat) ------------------------------------------------

_DEVINFO_STATES = {"ACTIVE": "Active", "DOWN": "Down", "INIT": "Initializing", "ARMED": "Armed"}


def parse_ibstat(text: str) -> list[dict[str, Any]]:
    """One dict per port of `ibstat`'s output: ca, port, state, physical_state,
    rate_gbps (ibstat prints `Rate: 200`; `200 Gb/sec (4X HDR)` reads the same), link_layer."""
    ports: list[dict[str, Any]] = []
    ca = None
    port: dict[str, Any] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if m := re.match(r"CA '([^']+)'", line):
            ca, port = m.group(1), None
        elif (m := re.match(r"Port (\d+):$", line)) and ca is not None:
            port = _new_port(ca, int(m.group(1)))
            ports.append(port)
        elif port is not None and ":" in line:
            key, value = (part.strip() for part in line.split(":", 1))
            if key == "State":
                port["state"] = value
            elif key == "Physical state":
                port["physical_state"] = value
            elif key == "Link layer":
                port["link_layer"] = value
            elif key == "Rate" and (rate := re.match(r"\d+(\.\d+)?", value)):
                port["rate_gbps"] = float(rate.group(0))
    return ports


def _new_port(ca: str, number: int) -> dict[str, Any]:
    return {"ca": ca, "port": number, "state": None, "physical_state": None,
            "rate_gbps": None, "link_layer": None}  # fmt: skip


def parse_ibv_devinfo(text: str) -> tuple[list[str], list[dict[str, Any]]]:
    """Devices (hca_id) and their ports' states from `ibv_devinfo`."""
    devices: list[str] = []
    ports: list[dict[str, Any]] = []
    port: dict[str, Any] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if m := re.match(r"hca_id:\s*(\S+)", line):
            devices.append(m.group(1))
            port = None
        elif (m := re.match(r"port:\s*(\d+)$", line)) and devices:
            port = _new_port(devices[-1], int(m.group(1)))
            ports.append(port)
        elif port is not None and (m := re.match(r"state:\s*PORT_(\w+)", line)):
            port["state"] = _DEVINFO_STATES.get(m.group(1), m.group(1).title())
        elif port is not None and (m := re.match(r"link_layer:\s*(\S+)", line)):
            port["link_layer"] = m.group(1)
    return devices, ports


def port_is_up(port: dict[str, Any]) -> bool:
    """Active, and LinkUp where the physical state is known (ibv_devinfo does not say)."""
    return port["state"] == "Active" and port["physical_state"] in (None, "LinkUp")


def infiniband_summary(devinfo: ToolOutput, ibstat: ToolOutput) -> dict[str, Any]:
    """present: True (ibv_devinfo lists devices), False (it fails or lists none), None
    (ibv_devinfo is not installed: not checked). Ports from ibstat, else ibv_devinfo."""
    if devinfo.rc == 127:
        return {
            "present": None,
            "devices": [],
            "ports": [],
            "source": None,
            "detail": "ibv_devinfo not installed: InfiniBand not checked",
        }
    devices, devinfo_ports = parse_ibv_devinfo(devinfo.stdout) if devinfo.rc == 0 else ([], [])
    if not devices:
        reason = devinfo.first_line or f"ibv_devinfo exit {devinfo.rc}"
        return {
            "present": False,
            "devices": [],
            "ports": [],
            "source": None,
            "detail": f"no InfiniBand device ({reason})",
        }
    ports = parse_ibstat(ibstat.stdout) if ibstat.rc == 0 else []
    source = "ibstat"
    if not ports:  # ibstat missing, failing, or silent: fall back to ibv_devinfo's view
        ports, source = devinfo_ports, "ibv_devinfo"
    return {
        "present": True,
        "devices": devices,
        "ports": ports,
        "source": source if ports else None,
        "detail": describe_ports(ports) if ports else "no port state reported",
    }


def describe_port(port: dict[str, Any]) -> str:
    rate = f" {port['rate_gbps']:g} Gb/s" if port["rate_gbps"] is not None else ""
    states = "/".join(s for s in (port["state"], port["physical_state"]) if s) or "state unknown"
    return f"{port['ca']} port {port['port']}: {states}{rate}"


def describe_ports(ports: list[dict[str, Any]]) -> str:
    return "; ".join(describe_port(p) for p in ports)


# --- this process, this node -----------------------------------------------------------


def versions() -> dict[str, str | None]:
    """What every rank of a job must share (and Python, compared by major.minor)."""
    import torch

    nccl = None
    if torch.version.cuda is not None:
        try:
            raw = torch.cuda.nccl.version()
            nccl = ".".join(map(str, raw)) if isinstance(raw, tuple) else str(raw)
        except (RuntimeError, AttributeError):
            nccl = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "cuda": torch.version.cuda,
        "cudnn": str(cudnn) if cudnn is not None else None,
        "nccl": nccl,
        "meshforge": __version__,
    }


def comm_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    env = os.environ if environ is None else environ
    return {k: env[k] for k in sorted(env) if k.startswith(COMM_ENV_PREFIXES)}


def advertised_address(environ: Mapping[str, str] | None = None) -> str | None:
    """The address peers reach this process at: GLOO_SOCKET_IFNAME's, else the host name's."""
    env = os.environ if environ is None else environ
    iface = env.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    return (netif.ipv4_of(iface) if iface else None) or netif.hostname_address()


def disk_probe(run_dir: Path) -> dict[str, Any]:
    """Free bytes in the run directory, and whether a file there can be created,
    written, fsync'ed and deleted (checkpoints need all four)."""
    run_dir = Path(run_dir)
    result: dict[str, Any] = {
        "path": str(run_dir.resolve()),
        "free_bytes": None,
        "writable": False,
        "error": None,
    }
    probe = run_dir / f".preflight-write-{socket.gethostname()}-{os.getpid()}.tmp"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        result["free_bytes"] = shutil.disk_usage(run_dir).free
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\0" * WRITE_TEST_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
        probe.unlink()
        result["writable"] = True
    except OSError as exc:
        result["error"] = f"{exc.strerror or type(exc).__name__}: {exc.filename or run_dir}"
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
    return result


def process_report(rank: int, local_rank: int) -> dict[str, Any]:
    return {
        "rank": rank,
        "local_rank": local_rank,
        "host": socket.gethostname(),
        "addr": advertised_address(),
        "pid": os.getpid(),
        "versions": versions(),
        "env": comm_env(),
        "node": None,  # filled on one rank per node
    }


def node_report(run_dir: Path, tool_timeout_s: float = 10.0) -> dict[str, Any]:
    return {
        "gpus": gpu_summary(run_tool(NVIDIA_SMI_QUERY, tool_timeout_s)),
        "infiniband": infiniband_summary(
            run_tool(["ibv_devinfo"], tool_timeout_s), run_tool(["ibstat"], tool_timeout_s)
        ),
        "disk": disk_probe(run_dir),
    }


def data_read_probe(path: Path, seconds: float = 1.0) -> dict[str, Any]:
    """How fast this node reads the training data at `path`, as the loader does (random
    order, one reader, its files' page cache dropped first): `meshforge bench io`'s
    measurement, one row. {path, bytes_per_s, bytes_per_token, cached, error}."""
    from meshforge.bench.io import IoBenchOptions, run_bench
    from meshforge.errors import MeshforgeError

    try:
        options = IoBenchOptions(str(path), readers=(1,), orders=("random",), seconds=seconds)
        result = run_bench(options)
    except (MeshforgeError, OSError, ValueError) as exc:
        return {"path": str(path), "bytes_per_s": None, "error": str(exc)}
    row = result.rows[0]
    return {
        "path": str(path),
        "bytes_per_s": row.mb_per_s * 1e6,
        "bytes_per_token": result.data.token_bytes,
        "cached": bool(row.cached_before and row.cached_before > 0.05),
        "error": None,
    }


def tcp_connect(host: str, port: int, timeout_s: float) -> dict[str, Any]:
    """Open and close a TCP connection: {ok, connect_s, error}."""
    start = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except TimeoutError:
        return {"ok": False, "connect_s": None, "error": f"no answer within {timeout_s:g} s"}
    except OSError as exc:
        return {"ok": False, "connect_s": None, "error": exc.strerror or str(exc)}
    return {"ok": True, "connect_s": time.perf_counter() - start, "error": None}


# --- test hook ---------------------------------------------------------------------------

VERSION_FAULT = "preflight_version"


def inject_version_fault(report: dict[str, Any], environ: Mapping[str, str] | None = None) -> None:
    """Test hook, never set in production: MESHFORGE_FAULT=preflight_version:RANK:KEY=VALUE
    makes RANK report VALUE for KEY (torch, nccl, cuda, ...). Several faults are separated
    by commas, as in train/faults.py."""
    env = os.environ if environ is None else environ
    for spec in env.get(FAULT_ENV, "").split(","):
        kind, _, rest = spec.partition(":")
        if kind != VERSION_FAULT:
            continue
        rank, _, assignment = rest.partition(":")
        key, sep, value = assignment.partition("=")
        if not rank.isdigit() or not sep or key not in report["versions"]:
            keys = ", ".join(report["versions"])
            raise ConfigError(
                f"{FAULT_ENV}: {spec!r}: expected {VERSION_FAULT}:RANK:KEY=VALUE, KEY in {keys}"
            )
        if int(rank) == report["rank"]:
            report["versions"][key] = value
