"""Where the metrics go besides metrics.jsonl: TensorBoard, Prometheus, Weights & Biases.

Rank 0 writes each logged row to every sink it has (``Sinks.write``). The first rank of
each node serves a Prometheus endpoint for all the node's ranks (``PrometheusExporter``):
on each scrape it reads the ranks' flight records from the run directory (step, phase,
step time, memory: observe/flight.py), the node's newest system sample
(observe/sampler.py) and, on rank 0, the newest row. Metric names are ``meshforge_*``
with ``rank`` and ``host`` labels.

A sink serves the people watching; it must never stop the training it watches. Each
is wrapped in ``Guarded``: its first failure (a full disk, a port already taken, a
package that breaks) is reported once through ``warn`` and the sink is dropped; the run
goes on, and metrics.jsonl stays the record.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshforge.redact import redact_tree

log = logging.getLogger(__name__)

Warn = Callable[[str], None]

# metrics.jsonl keys written to TensorBoard, under these tags
_TB_TAGS = {
    "loss": "train/loss",
    "val_loss": "val/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "loss_scale": "train/loss_scale",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "step_time_s": "time/step_s",
    "data_s": "time/data_s",
    "compute_s": "time/compute_s",
    "comm_s": "time/exposed_comm_s",
    "bubble_s": "time/pipeline_bubble_s",
    "other_s": "time/other_s",
    "peak_memory_bytes": "memory/peak_bytes",
    "activation_bytes": "memory/activation_bytes",
    "comm_bytes": "comm/payload_bytes_per_step",
    "net_tx_bytes": "comm/net_tx_bytes_per_step",
}


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


class Guarded:
    """A sink whose first failure warns once and turns it off."""

    def __init__(self, name: str, sink: Any, warn: Warn) -> None:
        self.name, self.sink, self.warn = name, sink, warn
        self.failed = False

    def call(self, method: str, *args: Any) -> None:
        if self.failed:
            return
        try:
            getattr(self.sink, method)(*args)
        except Exception as exc:  # noqa: BLE001 - any failure: warn once, go on
            self.failed = True
            self.warn(f"{self.name} stopped: {type(exc).__name__}: {exc}; training goes on")


class TensorBoardSink:
    """Scalars in RUN_DIR/tensorboard, written by the tensorboard package's event writer
    (through torch.utils.tensorboard); system samples under system/."""

    def __init__(self, logdir: Path, resumed_from: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run logs again the steps after its checkpoint: TensorBoard drops the
        # earlier attempt's events from there on (purge_step), so no step shows twice
        purge = resumed_from + 1 if resumed_from else None
        self.writer = SummaryWriter(log_dir=str(logdir), flush_secs=10, purge_step=purge)
        self.step = resumed_from or 0

    def write(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        self.step = step
        walltime = row.get("time")
        for key, tag in _TB_TAGS.items():
            value = _finite(row.get(key))
            if value is not None:
                self.writer.add_scalar(tag, value, step, walltime=walltime)
        for key, tag in (
            ("step_time_s_per_rank", "ranks/step_s"),
            ("memory_bytes_per_rank", "ranks/memory_bytes"),
        ):
            values = row.get(key) or []
            for rank, value in enumerate(values):
                if _finite(value) is not None:
                    self.writer.add_scalar(f"{tag}/rank{rank}", value, step, walltime=walltime)

    def write_system(self, sample: dict[str, Any]) -> None:
        when = sample.get("time")
        scalars = {
            "system/cpu_percent": sample.get("cpu_percent"),
            "system/mem_used_bytes": sample.get("mem_used_bytes"),
        }
        for iface, net in (sample.get("net") or {}).items():
            scalars[f"system/net_rx_bytes_per_s/{iface}"] = net.get("rx_bytes_per_s")
            scalars[f"system/net_tx_bytes_per_s/{iface}"] = net.get("tx_bytes_per_s")
        for gpu in sample.get("gpus") or []:
            for key in ("memory_used_bytes", "utilization_percent", "power_w"):
                scalars[f"system/gpu{gpu.get('index')}/{key}"] = gpu.get(key)
        for tag, value in scalars.items():
            if _finite(value) is not None:
                self.writer.add_scalar(tag, value, self.step, walltime=when)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run in RUN_DIR/wandb (offline unless configured online)."""

    def __init__(
        self,
        run_dir: Path,
        cfg: Any,
        redone: tuple[int, int] | None = None,
        warn: Warn = log.warning,
    ) -> None:
        import wandb

        w = cfg.observe.wandb
        # one W&B run per run directory: a resumed run continues it (its id is kept in
        # RUN_DIR/wandb/meshforge-run-id)
        folder = Path(run_dir) / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "meshforge-run-id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=w.project,
            entity=w.entity,
            mode=w.mode,
            name=cfg.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=redact_tree(cfg.model_dump(mode="json")),  # no URL credential to W&B
            settings=wandb.Settings(silent=True, console="off"),
        )
        self.where = folder if w.mode == "offline" else self.run.url
        # steps an earlier segment logged and this one trains again: a W&B run takes
        # steps in rising order only (its rewind is a private preview), so it keeps the
        # earlier values; they are not sent again
        self.logged_through = redone[1] if redone else 0
        if redone:
            warn(
                f"Weights & Biases keeps the earlier segment's values of steps {redone[0]}-"
                f"{redone[1]}, trained again now (a W&B run cannot log a step twice); "
                "metrics.jsonl and TensorBoard have the latest"
            )

    def write(self, row: dict[str, Any]) -> None:
        if int(row["step"]) <= self.logged_through:
            return
        values = {k: v for k in _TB_TAGS if (v := _finite(row.get(k))) is not None}
        self.run.log(values, step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()


class PrometheusExporter:
    """One HTTP endpoint per node serving `meshforge_*` gauges for the node's ranks."""

    def __init__(
        self,
        run_dir: Path,
        addr: str,
        port: int,
        here: dict[str, Any],
        sampler: Any = None,
    ) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self.run_dir, self.here, self.sampler = Path(run_dir), here, sampler
        self.latest_row: dict[str, Any] | None = None  # rank 0's newest row
        self.host = here.get("host") or socket.gethostname()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        self.server, self.thread = start_http_server(port, addr=addr, registry=registry)
        self.url = f"http://{addr}:{port}/metrics"

    # prometheus_client's collector protocol
    def describe(self) -> list[Any]:
        return []

    def _ours(self, record: dict[str, Any]) -> bool:
        """A flight record of a rank on this node."""
        node, here = record.get("node"), self.here.get("node")
        if node is not None and here is not None:
            return node == here
        return record.get("host") == self.host and record.get("addr") == self.here.get("addr")

    def collect(self) -> list[Any]:
        from prometheus_client.core import GaugeMetricFamily

        from meshforge.observe.flight import read_flight_records

        def family(name: str, doc: str, labels: tuple[str, ...]) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"meshforge_{name}", doc, labels=list(labels))

        rank_labels = ("rank", "host")
        per_rank = {
            "step": family("step", "Steps this rank has finished", rank_labels),
            "step_time": family(
                "step_time_seconds", "Wall time of the rank's last step", rank_labels
            ),
            "rss": family("memory_rss_bytes", "Resident memory of the rank's process", rank_labels),
            "cuda_alloc": family("cuda_allocated_bytes", "GPU memory held by tensors", rank_labels),
            "cuda_res": family(
                "cuda_reserved_bytes", "GPU memory reserved by the allocator", rank_labels
            ),
            "age": family(
                "record_age_seconds", "Seconds since the rank last wrote its record", rank_labels
            ),
            "phase": family("phase", "The rank's current phase (value 1)", (*rank_labels, "phase")),
        }
        now = time.time()
        for rec in read_flight_records(self.run_dir / "health"):
            if not self._ours(rec):
                continue
            labels = [str(rec.get("rank")), str(rec.get("host") or self.host)]
            memory = rec.get("memory") or {}
            values = {
                "step": rec.get("step"),
                "step_time": rec.get("step_time_s"),
                "rss": memory.get("rss_bytes"),
                "cuda_alloc": memory.get("cuda_allocated_bytes"),
                "cuda_res": memory.get("cuda_reserved_bytes"),
                "age": now - rec["time"] if _finite(rec.get("time")) is not None else None,
            }
            for key, value in values.items():
                if _finite(value) is not None:
                    per_rank[key].add_metric(labels, float(value))
            per_rank["phase"].add_metric([*labels, str(rec.get("phase"))], 1.0)
        out: list[Any] = list(per_rank.values())
        row = self.latest_row
        if row is not None:
            labels = ["0", self.host]
            for key, name, doc in (
                ("loss", "loss", "Training loss at the newest logged step"),
                ("val_loss", "val_loss", "Validation loss at the newest evaluation"),
                ("tokens_per_s", "tokens_per_second", "Training throughput of the job"),
                ("mfu", "mfu", "Model FLOPs utilisation"),
                ("lr", "learning_rate", "Learning rate"),
                ("grad_norm", "grad_norm", "Gradient norm before clipping"),
                ("comm_s", "exposed_comm_seconds", "Communication not hidden behind compute"),
            ):
                value = _finite(row.get(key))
                if value is not None:
                    gauge = family(name, doc, rank_labels)
                    gauge.add_metric(labels, value)
                    out.append(gauge)
        sample = self.sampler.latest if self.sampler is not None else None
        if sample:
            out.extend(_system_families(sample, family))
        return out

    def update(self, row: dict[str, Any]) -> None:
        self.latest_row = row

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _system_families(sample: dict[str, Any], family: Callable[..., Any]) -> list[Any]:
    host = str(sample.get("host"))
    out = []
    for key, name, doc in (
        ("cpu_percent", "cpu_percent", "CPU use of the host, percent"),
        ("mem_used_bytes", "host_memory_used_bytes", "Host memory in use"),
        ("mem_total_bytes", "host_memory_total_bytes", "Host memory in all"),
    ):
        value = _finite(sample.get(key))
        if value is not None:
            gauge = family(name, doc, ("host",))
            gauge.add_metric([host], value)
            out.append(gauge)
    net_labels = ("host", "interface")
    rx = family("network_receive_bytes_per_second", "Bytes received per second", net_labels)
    tx = family("network_transmit_bytes_per_second", "Bytes sent per second", net_labels)
    util = family("network_utilization", "Share of the link's capacity in use", net_labels)
    for iface, net in (sample.get("net") or {}).items():
        for gauge, key in ((rx, "rx_bytes_per_s"), (tx, "tx_bytes_per_s"), (util, "utilization")):
            value = _finite(net.get(key))
            if value is not None:
                gauge.add_metric([host, iface], value)
    out += [rx, tx, util]
    gpu_labels = ("host", "gpu")
    for key, name, doc in (
        ("memory_used_bytes", "gpu_memory_used_bytes", "GPU memory in use (NVML)"),
        ("utilization_percent", "gpu_utilization_percent", "GPU utilisation (NVML)"),
        ("temperature_c", "gpu_temperature_celsius", "GPU temperature (NVML)"),
        ("power_w", "gpu_power_watts", "GPU power draw (NVML)"),
    ):
        gauge = family(name, doc, gpu_labels)
        for gpu in sample.get("gpus") or []:
            value = _finite(gpu.get(key))
            if value is not None:
                gauge.add_metric([host, str(gpu.get("index"))], value)
        out.append(gauge)
    return out


class Sinks:
    """The sinks of one process: rows to TensorBoard, W&B and the Prometheus exporter
    (rank 0), system samples to TensorBoard; each guarded."""

    def __init__(self, warn: Warn) -> None:
        self.warn = warn
        self.guarded: list[Guarded] = []
        self.exporter: PrometheusExporter | None = None
        self.wandb: WandbSink | None = None

    def add(self, name: str, make: Callable[[], Any]) -> Any:
        """Start a sink; one that cannot start warns once and is left out."""
        try:
            sink = make()
        except Exception as exc:  # noqa: BLE001 - a port taken, a broken package
            self.warn(f"{name} not started: {type(exc).__name__}: {exc}; training goes on")
            return None
        self.guarded.append(Guarded(name, sink, self.warn))
        return sink

    def write(self, row: dict[str, Any]) -> None:
        for g in self.guarded:
            if hasattr(g.sink, "write"):
                g.call("write", row)
            elif hasattr(g.sink, "update"):
                g.call("update", row)

    def write_system(self, sample: dict[str, Any]) -> None:
        for g in self.guarded:
            if hasattr(g.sink, "write_system"):
                g.call("write_system", sample)

    def close(self) -> None:
        for g in self.guarded:
            if not g.failed:
                try:
                    g.sink.close()
                except Exception as exc:  # noqa: BLE001
                    log.warning("%s did not close cleanly: %s", g.name, exc)
        self.guarded = []


def open_sinks(
    cfg: Any,
    run_dir: Path,
    rank: int,
    local_rank: int,
    here: dict[str, Any],
    warn: Warn,
    resumed_from: int | None = None,
    logged_through: int | None = None,
) -> Sinks:
    """The sinks this process runs: rank 0 writes rows to TensorBoard and W&B; a node's
    first rank serves its Prometheus endpoint. `logged_through`: the newest step an
    earlier segment logged (steps after `resumed_from` up to it are trained again)."""
    o = cfg.observe
    sinks = Sinks(warn)
    if rank == 0 and o.tensorboard:
        sinks.add(
            "TensorBoard", lambda: TensorBoardSink(Path(run_dir) / "tensorboard", resumed_from)
        )
    if rank == 0 and o.wandb is not None:
        start = (resumed_from or 0) + 1
        redone = (start, logged_through) if logged_through and logged_through >= start else None
        sinks.wandb = sinks.add(
            "Weights & Biases", lambda: WandbSink(Path(run_dir), cfg, redone, warn)
        )
    if local_rank == 0 and o.prometheus_port:
        port, addr = o.prometheus_port, o.prometheus_addr
        sinks.exporter = sinks.add(
            f"Prometheus endpoint on {addr}:{port}",
            lambda: PrometheusExporter(run_dir, addr, port, here),
        )
    return sinks
