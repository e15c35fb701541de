"""The machine around the ranks: CPU, host memory, network per interface and GPUs, sampled
per node by a background thread into RUN_DIR/system/node-<N>.jsonl.

One JSON object per sample (the run directory's contract):

    {"time", "host", "addr", "node", "interval_s", "cpu_percent",
     "mem_used_bytes", "mem_total_bytes", "mem_available_bytes",
     "net": {iface: {"rx_bytes_per_s", "tx_bytes_per_s", "capacity_bytes_per_s", "utilization"}},
     "gpus": [{"index", "name", "memory_used_bytes", "memory_total_bytes",
               "utilization_percent", "temperature_c", "power_w"}],
     "gpu_error": str}   # only when NVML cannot be used; "gpus" is then []

Rates are differences of the kernel's counters between two readings divided by the
monotonic time between them (`interval_s`); `start()` takes the first reading, so the
first row already covers a full interval. CPU percent is the busy share of all cores
over the interval (psutil's definition: everything but idle and iowait), computed here
rather than by `psutil.cpu_percent`, whose baseline any other caller in the process moves.
Host memory used is total - available. A link's capacity is its negotiated speed
(/sys/class/net/IF/speed); its utilisation is max(rx, tx) / capacity, the busier direction
of a full-duplex link. GPUs come from NVML (the nvidia-ml-py package), initialised once
per process; without it a row says why instead.

Sampling reads a few /proc and /sys files and asks NVML; nothing is spawned. Nothing
here raises into the run: a write that fails (a full disk) is warned about once and
sampling carries on in memory, `latest` included, and so does a failing `on_sample`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from meshforge.fileio import open_nofollow

log = logging.getLogger(__name__)

_LOOPBACK = 772  # ARPHRD_LOOPBACK, /sys/class/net/IF/type


def sampler_path(run_dir: str | os.PathLike[str], node: int | None, host: str) -> Path:
    """RUN_DIR/system/node-N.jsonl, or RUN_DIR/system/<host>.jsonl where the launcher
    numbers no nodes."""
    name = f"node-{node}" if node is not None else host.replace(os.sep, "_")
    return Path(run_dir) / "system" / f"{name}.jsonl"


# -- network --------------------------------------------------------------------------------
def parse_net_dev(text: str) -> dict[str, tuple[int, int]]:
    """Interface -> (rx_bytes, tx_bytes) from the text of /proc/net/dev."""
    counters = {}
    for line in text.splitlines()[2:]:  # two header lines
        if ":" not in line:
            continue
        iface, rest = line.split(":", 1)
        fields = rest.split()
        # rx: bytes packets errs drop fifo frame compressed multicast; then tx: bytes ...
        if len(fields) >= 9 and fields[0].isdigit() and fields[8].isdigit():
            counters[iface.strip()] = (int(fields[0]), int(fields[8]))
    return counters


def read_net_counters(path: str | os.PathLike[str] = "/proc/net/dev") -> dict[str, tuple[int, int]]:
    """Interface -> (rx_bytes, tx_bytes) since boot, from the kernel's counters for this
    network namespace; {} where they cannot be read."""
    try:
        return parse_net_dev(Path(path).read_text())
    except OSError:
        return {}


def link_capacity_bytes_per_s(
    iface: str, sys_net: str | os.PathLike[str] = "/sys/class/net"
) -> float | None:
    """The link's negotiated speed in bytes/s (/sys/class/net/IF/speed is in Mbit/s);
    None for loopback and for links that do not say (virtual, down: -1 or unreadable)."""
    base = Path(sys_net) / iface
    try:
        if iface == "lo" or int((base / "type").read_text()) == _LOOPBACK:
            return None
    except (OSError, ValueError):
        pass
    try:
        mbit_s = int((base / "speed").read_text())
    except (OSError, ValueError):
        return None
    return mbit_s * 1e6 / 8 if mbit_s > 0 else None


# -- GPUs -----------------------------------------------------------------------------------
_nvml_lock = threading.Lock()
_nvml: Any = None  # the pynvml module once initialised
_nvml_error: str | None = None


def _nvml_module() -> tuple[Any, str | None]:
    """pynvml, initialised once per process, or the reason it cannot be."""
    global _nvml, _nvml_error
    with _nvml_lock:
        if _nvml is None and _nvml_error is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                _nvml = pynvml
            except ImportError:
                _nvml_error = "NVML unavailable: the nvidia-ml-py package is not installed"
            except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, no driver, ...
                _nvml_error = f"NVML unavailable: {_describe(exc)}"
        return _nvml, _nvml_error


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def _optional(read: Callable[[], Any]) -> Any:
    """A field a GPU may not support (power on some boards, utilisation under MIG)."""
    try:
        return read()
    except Exception:  # noqa: BLE001 - NVMLError_NotSupported and kin
        return None


def read_gpus() -> tuple[list[dict[str, Any]], str | None]:
    """Every GPU NVML sees, and an error when NVML cannot be used or a GPU cannot be read
    (a GPU fallen off the bus); the GPUs that can be read are still listed."""
    nvml, error = _nvml_module()
    if nvml is None:
        return [], error
    try:
        count = nvml.nvmlDeviceGetCount()
    except Exception as exc:  # noqa: BLE001
        return [], f"NVML: {_describe(exc)}"
    gpus, failed = [], []
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = nvml.nvmlDeviceGetName(handle)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        except Exception as exc:  # noqa: BLE001
            failed.append(f"GPU {index}: {_describe(exc)}")
            continue
        utilization = _optional(lambda h=handle: float(nvml.nvmlDeviceGetUtilizationRates(h).gpu))
        temperature = _optional(
            lambda h=handle: float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))
        )
        power_mw = _optional(lambda h=handle: nvml.nvmlDeviceGetPowerUsage(h))
        gpus.append(
            {
                "index": index,
                "name": name.decode() if isinstance(name, bytes) else str(name),
                "memory_used_bytes": int(memory.used),
                "memory_total_bytes": int(memory.total),
                "utilization_percent": utilization,
                "temperature_c": temperature,
                "power_w": power_mw / 1000.0 if power_mw is not None else None,
            }
        )
    return gpus, ("; ".join(failed) if failed else None)


# -- CPU ------------------------------------------------------------------------------------
def _cpu_busy_total() -> tuple[float, float]:
    """(busy, total) CPU seconds of all cores since boot, as psutil.cpu_percent counts them."""
    t = psutil.cpu_times()
    total = sum(t)
    # Linux counts guest time inside user and nice already
    total -= getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
    idle = t.idle + getattr(t, "iowait", 0.0)
    return total - idle, total


class _Reading:
    """The counters rates are differences of."""

    def __init__(self) -> None:
        self.monotonic = time.monotonic()
        self.net = read_net_counters()
        try:
            self.cpu: tuple[float, float] | None = _cpu_busy_total()
        except Exception:  # noqa: BLE001
            self.cpu = None


# -- the sampler ----------------------------------------------------------------------------
class SystemSampler:
    """Samples this node every `every_s` seconds on a daemon thread, appending one JSON
    line per sample to `path` (None: keep samples in memory only). `latest` is the newest
    sample; `on_sample` is called with each one (a sink: Prometheus, TensorBoard)."""

    def __init__(
        self,
        path: Path | None,
        every_s: float = 2.0,
        *,
        host: dict[str, Any] | None = None,
        warn: Callable[[str], None] | None = None,
        on_sample: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.every_s = every_s
        where = host or {}
        self.host = {
            "host": where.get("host") or socket.gethostname(),
            "addr": where.get("addr"),
            "node": where.get("node"),
        }
        self._warn = warn or log.warning
        self.on_sample = on_sample
        self.latest: dict[str, Any] | None = None
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._previous: _Reading | None = None
        self._fd: int | None = None
        self._torn = False  # the last write stopped mid-line
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> SystemSampler:
        """Take the baseline reading and start sampling."""
        if self._thread is not None:
            return self
        with self._lock:
            self._previous = _Reading()
        self._thread = threading.Thread(target=self._loop, name="meshforge-sampler", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                row = self.sample()
            except Exception as exc:  # noqa: BLE001 - a sampler must never end the run
                self._warn_once("sample", f"system sampler: a sample failed ({_describe(exc)})")
                continue
            self._write(row)
            if self.on_sample is not None:
                try:
                    self.on_sample(row)
                except Exception as exc:  # noqa: BLE001
                    self._warn_once(
                        "on_sample", f"system sampler: on_sample failed ({_describe(exc)})"
                    )

    def close(self) -> None:
        """Stop the thread (waiting a bounded time), write a last sample covering the time
        since the previous one (a run shorter than one interval still gets a row), and
        close the file; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(1.0, 2 * self.every_s))
            previous = self._previous
            if previous is not None and time.monotonic() - previous.monotonic >= 0.05:
                try:
                    self._write(self.sample())
                except Exception as exc:  # noqa: BLE001 - a sampler must never end the run
                    self._warn_once("sample", f"system sampler: a sample failed ({_describe(exc)})")
        with self._lock:
            self._closed = True  # a thread outliving the join writes no more
            if self._fd is not None:
                try:
                    os.close(self._fd)
                except OSError:
                    pass
                self._fd = None

    # -- one sample ------------------------------------------------------------------------
    def sample(self) -> dict[str, Any]:
        """One sample now; rates cover the time since the previous reading (since this call
        when there was none: call start() first)."""
        with self._lock:
            previous = self._previous or _Reading()
            now = _Reading()
            self._previous = now
        interval_s = max(now.monotonic - previous.monotonic, 1e-9)
        memory = psutil.virtual_memory()
        gpus, gpu_error = read_gpus()
        row: dict[str, Any] = {
            "time": time.time(),
            **self.host,
            "interval_s": interval_s,
            "cpu_percent": _cpu_percent(previous.cpu, now.cpu),
            "mem_used_bytes": int(memory.total - memory.available),
            "mem_total_bytes": int(memory.total),
            "mem_available_bytes": int(memory.available),
            "net": _net_rates(previous.net, now.net, interval_s),
            "gpus": gpus,
        }
        if gpu_error is not None:
            row["gpu_error"] = gpu_error
        self.latest = row
        return row

    # -- the file ------------------------------------------------------------------------------
    def _write(self, row: dict[str, Any]) -> None:
        if self.path is None:
            return
        data = (("\n" if self._torn else "") + json.dumps(row) + "\n").encode()
        with self._lock:
            if self._closed:
                return
            try:
                if self._fd is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
                    self._fd = open_nofollow(self.path, flags)  # umask mode, no link
                written = 0
                try:
                    while written < len(data):
                        written += os.write(self._fd, data[written:])
                finally:
                    if written:  # a line cut short is ended before the next one
                        self._torn = written < len(data)
            except OSError as exc:
                self._warn_once(
                    "write",
                    f"system sampler: cannot write {self.path} ({exc}); sampling goes on in memory",
                )

    def _warn_once(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        try:
            self._warn(message)
        except Exception:  # noqa: BLE001
            pass


def _cpu_percent(previous: tuple[float, float] | None, now: tuple[float, float] | None) -> float:
    if previous is None or now is None or now[1] <= previous[1]:
        return 0.0
    busy = max(now[0] - previous[0], 0.0)
    return min(100.0, 100.0 * busy / (now[1] - previous[1]))


def _net_rates(
    previous: dict[str, tuple[int, int]], now: dict[str, tuple[int, int]], interval_s: float
) -> dict[str, dict[str, float | None]]:
    """Per-interface rates; an interface that appeared since the previous reading shows up
    in the next sample, and a counter that went backwards (interface recreated) counts 0."""
    rates: dict[str, dict[str, float | None]] = {}
    for iface, (rx, tx) in now.items():
        if iface not in previous:
            continue
        rx_0, tx_0 = previous[iface]
        rx_s = max(rx - rx_0, 0) / interval_s
        tx_s = max(tx - tx_0, 0) / interval_s
        capacity = link_capacity_bytes_per_s(iface)
        rates[iface] = {
            "rx_bytes_per_s": rx_s,
            "tx_bytes_per_s": tx_s,
            "capacity_bytes_per_s": capacity,
            "utilization": max(rx_s, tx_s) / capacity if capacity else None,
        }
    return rates
