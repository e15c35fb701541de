"""What the planner knows about hardware: the GPU catalogue, link presets, and the
cluster they make up. Pure data; every GPU figure comes from the one table in
`plan/core/gpus.py` (vendor datasheets), which the trainer's MFU reads too.

Achievable bandwidths are lower than the nominal ones: each link preset carries the
bus bandwidth (nccl-tests convention) that an all-reduce typically reaches on it.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from meshforge.errors import ConfigError
from meshforge.plan.core.efficiency import ComputeCurve, curve_for
from meshforge.plan.core.gpus import ALIASES, GPUS, Gpu, gpu_key

GIB = 1024**3
GB = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or one CPU rank, from a measured profile)."""

    name: str
    peak_flops_per_s: dict[str, float]  # dense matmul peak by precision: bf16, fp16, tf32, fp32
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    curve: ComputeCurve  # achievable fraction of peak for a given matmul size
    reserved_bytes: float  # CUDA context, NCCL and cuBLAS workspaces: never available
    calibration: str  # what `curve` was fitted on: a GPU generation, or "measured"

    def peak(self, precision: str) -> float:
        try:
            return self.peak_flops_per_s[precision]
        except KeyError:
            have = ", ".join(sorted(p for p, v in self.peak_flops_per_s.items() if v))
            raise ConfigError(
                f"device {self.name} has no peak for precision={precision} "
                f"(it has: {have}; e.g. --precision {'fp16' if 'fp16' in have else 'fp32'})"
            ) from None


def _device(gpu: Gpu) -> DeviceSpec:
    curve, calibration = curve_for(gpu.key)
    return DeviceSpec(
        name=gpu.key,
        peak_flops_per_s=gpu.peak_flops_per_s(),
        memory_bytes=gpu.memory_gb * GB,
        memory_bandwidth_bytes_per_s=gpu.memory_bandwidth_tbs * 1e12,
        curve=curve,
        reserved_bytes=1.0 * GIB,
        calibration=calibration,
    )


# Every GPU of the table, by key. The planner plans in "fp32" as plain FP32 (its
# peak is the CUDA-core figure): meshforge does not turn TF32 on. The achievable-
# fraction curve is efficiency.curve_for's, named in DeviceSpec.calibration.
GPU_CATALOGUE: dict[str, DeviceSpec] = {gpu.key: _device(gpu) for gpu in GPUS}
GPU_ALIASES = ALIASES


def gpu_spec(name: str) -> DeviceSpec:
    key = gpu_key(name)
    if key is None:
        known = ", ".join(GPU_CATALOGUE)
        close = difflib.get_close_matches(name.lower(), [*GPU_CATALOGUE, *GPU_ALIASES], n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"--gpu {name!r} is not in the catalogue ({known}){hint}")
    return GPU_CATALOGUE[key]


@dataclass(frozen=True)
class LinkSpec:
    """A link as one rank sees it.

    busbw_bytes_per_s is the bus bandwidth one GPU's all-reduce reaches on it
    (nccl-tests: busbw = algbw x 2(n-1)/n), so a ring all-reduce of S bytes over n
    ranks takes 2(n-1)/n·S/busbw + 2(n-1)·latency_s. For a network it is per port."""

    name: str
    nominal_bytes_per_s: float
    busbw_bytes_per_s: float
    latency_s: float


# Nominal rates from REFERENCES.md. Achievable fractions are the usual nccl-tests
# figures: ~230 GB/s all-reduce busbw on DGX A100 NVLink 3 (300 GB/s each way),
# ~360 GB/s on H100 NVLink 4 without NVLS (450 GB/s each way), ~92% of line rate on
# InfiniBand, ~88% on RoCE, ~90% of TCP line rate on Ethernet. NVLink 2 (V100, 300
# GB/s per GPU) and PCIe 3/5 x16 (16/64 GB/s each way) take the fraction of their
# neighbour generation (NVLink 3's, PCIe 4's): scaled, not measured.
LINK_PRESETS: dict[str, LinkSpec] = {
    link.name: link
    for link in (
        LinkSpec("nvlink2", 300 * GB, 115 * GB, 2e-6),
        LinkSpec("nvlink3", 600 * GB, 230 * GB, 2e-6),
        LinkSpec("nvlink4", 900 * GB, 360 * GB, 2e-6),
        LinkSpec("pcie3", 16 * GB, 11 * GB, 3e-6),
        LinkSpec("pcie4", 32 * GB, 22 * GB, 3e-6),
        LinkSpec("pcie5", 64 * GB, 44 * GB, 3e-6),
        LinkSpec("ib-hdr", 25 * GB, 23 * GB, 5e-6),
        LinkSpec("ib-ndr", 50 * GB, 46 * GB, 5e-6),
        LinkSpec("roce-100", 12.5 * GB, 11 * GB, 8e-6),
        LinkSpec("eth-25", 3.125 * GB, 2.8 * GB, 30e-6),
        LinkSpec("eth-10", 1.25 * GB, 1.12 * GB, 50e-6),
    )
}
DEFAULT_INTRA_LINK = {gpu.key: gpu.intra_link for gpu in GPUS}


# A link by its port rate, "<kind>-<N>g" (roce-200g, omnipath-100g, ib-400g): N Gb/s
# ports of a known fabric at its achievable fraction of line rate and latency: the
# InfiniBand and Ethernet presets' own; RoCE's for RoCE and for the fabrics without a
# preset of their own (Omni-Path, AWS EFA, Slingshot), latency between RoCE's and
# Ethernet's: a stated assumption.
PORT_KINDS: dict[str, tuple[float, float]] = {
    "ib": (0.92, 5e-6),
    "roce": (0.88, 8e-6),
    "eth": (0.9, 30e-6),
    "omnipath": (0.88, 8e-6),
    "efa": (0.88, 8e-6),
    "slingshot": (0.88, 8e-6),
}
MAX_PORT_GBPS = 10_000  # a port rate beyond any shipping NIC (1.6 Tb/s in 2026): a typo
_PORT_RATE = re.compile(r"([a-z]+)-(\d+(?:\.\d+)?)g")


def link_spec(name: str, flag: str = "--network") -> LinkSpec:
    """A link preset, or "<kind>-<N>g": a port of N Gb/s of a PORT_KINDS fabric."""
    key = name.lower()
    if key in LINK_PRESETS:
        return LINK_PRESETS[key]
    match = _PORT_RATE.fullmatch(key)
    if match is not None and match.group(1) in PORT_KINDS:
        gbps = float(match.group(2))
        if not 0 < gbps <= MAX_PORT_GBPS:
            raise ConfigError(
                f"{flag} {name!r}: a port rate must be above 0 and at most {MAX_PORT_GBPS} Gb/s"
            )
        fraction, latency = PORT_KINDS[match.group(1)]
        line = gbps / 8 * GB
        return LinkSpec(key, line, fraction * line, latency)
    known = ", ".join(LINK_PRESETS)
    raise ConfigError(
        f"{flag} {name!r} is not a known link preset ({known}) or a port rate "
        f"<kind>-<N>g of a fabric ({', '.join(PORT_KINDS)}; roce-200g: 200 Gb/s ports)"
    )


@dataclass(frozen=True)
class Cluster:
    """Devices, how many share a node, and the two links between them.

    nics_per_node: inter-node ports per node (DGX-class nodes: one per GPU). A group
    of k ranks per node that spans nodes can drive k·nics_per_node/gpus_per_node ports."""

    device: DeviceSpec
    n_gpus: int
    gpus_per_node: int
    intra: LinkSpec
    inter: LinkSpec
    nics_per_node: int

    def __post_init__(self) -> None:
        if self.n_gpus < 1:
            raise ConfigError(f"--gpus must be >= 1, got {self.n_gpus}")
        if self.gpus_per_node < 1:
            raise ConfigError(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")
        if self.nics_per_node < 1:
            raise ConfigError(f"--nics-per-node must be >= 1, got {self.nics_per_node}")
        if self.n_gpus > self.gpus_per_node and self.n_gpus % self.gpus_per_node:
            raise ConfigError(
                f"--gpus {self.n_gpus} is not a whole number of nodes of "
                f"--gpus-per-node {self.gpus_per_node}"
            )

    def group_busbw(self, size: int, stride: int) -> tuple[float, float]:
        """(bus bandwidth, per-step latency) of a collective over `size` ranks whose
        global ranks are `stride` apart.

        Inside a node: the intra link. Across nodes the node's egress carries the
        ring's traffic, so busbw = k·(nics_per_node/gpus_per_node)·port busbw for
        k group members per node, capped by the intra link (NCCL multi-rail rings)."""
        span = size * stride
        if span <= self.gpus_per_node:
            return self.intra.busbw_bytes_per_s, self.intra.latency_s
        per_node = max(1, self.gpus_per_node // stride) if stride < self.gpus_per_node else 1
        per_node = min(per_node, size)
        ports = per_node * self.nics_per_node / self.gpus_per_node
        busbw = min(self.intra.busbw_bytes_per_s, ports * self.inter.busbw_bytes_per_s)
        return busbw, self.inter.latency_s

    def p2p_bandwidth(self, size: int, stride: int) -> tuple[float, float]:
        """(bytes/s, latency) of the slowest hop of a chain of `size` ranks `stride`
        apart (pipeline stages). Across nodes the concurrent senders of a node share
        its ports."""
        if size * stride <= self.gpus_per_node:
            return self.intra.busbw_bytes_per_s, self.intra.latency_s
        ports = self.nics_per_node / self.gpus_per_node
        return ports * self.inter.busbw_bytes_per_s, self.inter.latency_s
