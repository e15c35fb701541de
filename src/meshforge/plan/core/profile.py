"""A measured machine profile: what a run measures about its own host, so that the
planner can predict that run (matmul rate, loopback collective bandwidth, memory).

The JSON form (`meshforge plan --profile FILE`) has the same keys as the dataclass:

    {"name": "cpu", "matmul_flops_per_s": 9.0e10, "allreduce_busbw_bytes_per_s": 2.0e9,
     "allreduce_latency_s": 5e-5, "memory_bytes": 6.4e10,
     "memory_bandwidth_bytes_per_s": 1.0e10, "matmul_overhead_s": 0.0}

Only the first three numbers after `name` are required.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from meshforge.errors import ConfigError
from meshforge.plan.core.efficiency import ComputeCurve
from meshforge.plan.core.hardware import Cluster, DeviceSpec, LinkSpec


@dataclass(frozen=True)
class MachineProfile:
    """One machine, measured in place. All ranks of a run share it.

    matmul_flops_per_s: rate of a matmul of the run's own size and precision; it is
      taken as reachable (f_max = 1), so measure it at the size the model uses.
    allreduce_busbw_bytes_per_s / allreduce_latency_s: the bus bandwidth
      (nccl-tests convention) and per-step latency of an all-reduce between the
      ranks of this machine (gloo over loopback on a CPU host).
    memory_bytes: memory the ranks share (host RAM on a CPU machine, else per device
      when per_device_memory is true).
    memory_bandwidth_bytes_per_s: for the optimizer step, which is memory-bound.
    matmul_overhead_s: fixed cost per layer-sized unit of work (t0 of efficiency.py).
    """

    matmul_flops_per_s: float
    allreduce_busbw_bytes_per_s: float
    memory_bytes: float
    name: str = "cpu"
    allreduce_latency_s: float = 0.0
    memory_bandwidth_bytes_per_s: float = 10e9
    matmul_overhead_s: float = 0.0
    per_device_memory: bool = False

    def __post_init__(self) -> None:
        for name in ("matmul_flops_per_s", "allreduce_busbw_bytes_per_s", "memory_bytes",
                     "memory_bandwidth_bytes_per_s"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"profile.{name} must be a positive number, got {value!r}")
        for name in ("allreduce_latency_s", "matmul_overhead_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"profile.{name} must be a number >= 0, got {value!r}")

    def to_cluster(self, world_size: int) -> Cluster:
        """The profile as a one-node cluster of `world_size` ranks."""
        if world_size < 1:
            raise ConfigError(f"world size must be >= 1, got {world_size}")
        per_rank = self.memory_bytes if self.per_device_memory else self.memory_bytes / world_size
        device = DeviceSpec(
            name=self.name,
            peak_flops_per_s={p: self.matmul_flops_per_s for p in ("fp32", "bf16", "fp16")},
            memory_bytes=per_rank,
            memory_bandwidth_bytes_per_s=self.memory_bandwidth_bytes_per_s,
            curve=ComputeCurve(f_max=1.0, t0_s=self.matmul_overhead_s),
            reserved_bytes=0.0,
            calibration="measured",
        )
        bw, lat = self.allreduce_busbw_bytes_per_s, self.allreduce_latency_s
        link = LinkSpec("loopback", bw, bw, lat)
        return Cluster(device, world_size, world_size, link, link, nics_per_node=1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any, where: str = "profile") -> MachineProfile:
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a JSON object of profile fields")
        known = {f.name for f in fields(cls)}
        for key in raw:
            if key not in known:
                raise ConfigError(f"{where}: unknown key '{key}'")
        for key in ("matmul_flops_per_s", "allreduce_busbw_bytes_per_s", "memory_bytes"):
            if key not in raw:
                raise ConfigError(f"{where}: missing key '{key}'")
        return cls(**raw)

    @classmethod
    def from_json_file(cls, path: str | Path) -> MachineProfile:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"profile file not found: {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError, IsADirectoryError):
            raise ConfigError(f"profile file is not valid JSON: {path}") from None
        if (
            isinstance(raw, dict)
            and raw
            and all(isinstance(v, dict) and "profile" in v for v in raw.values())
        ):  # the cache a training run writes (machine_profiles.json): one entry per machine
            if len(raw) > 1:
                raise ConfigError(
                    f"{path} holds {len(raw)} measured machines; save the `profile` of one "
                    f"of them to a file of its own (keys: {', '.join(sorted(raw))})"
                )
            (entry,) = raw.values()
            return cls.from_dict(entry["profile"], where=f"{path} profile")
        return cls.from_dict(raw, where=str(path))
