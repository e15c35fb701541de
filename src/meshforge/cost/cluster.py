"""The cluster file of `meshforge cost`: a YAML document validated by pydantic v2.

Unknown keys are rejected and every error names the field, e.g.
``cluster.yaml: power.pue: Input should be greater than or equal to 1 (got 0.8)``.
See examples/cluster.yaml for a complete file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from meshforge.config import read_yaml_file
from meshforge.errors import ConfigError
from meshforge.plan.core.gpus import GPU_BY_KEY, gpu_key
from meshforge.plan.core.hardware import LINK_PRESETS


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GpuSection(_Section):
    count: int = Field(ge=1)
    unit_price_usd: float = Field(ge=0)
    kind: str | None = None  # plan/core/gpus.py key (a100-80gb, h100, ...), for planned runs

    @model_validator(mode="after")
    def _known_kind(self) -> GpuSection:
        if self.kind is not None:
            if gpu_key(self.kind) is None:
                known = ", ".join(GPU_BY_KEY)
                raise ValueError(f"gpus.kind {self.kind!r} is not in the catalogue ({known})")
        return self


class NodeSection(_Section):
    count: int = Field(ge=1)
    unit_price_usd: float = Field(ge=0)  # one server without its GPUs
    power_kw: float = Field(gt=0)  # one node at full load, GPUs included
    idle_power_kw: float | None = Field(None, ge=0)  # when idle; default: power_kw


class PricedItems(_Section):
    count: int = Field(0, ge=0)
    unit_price_usd: float = Field(0.0, ge=0)

    @property
    def cost_usd(self) -> float:
        return self.count * self.unit_price_usd


class NetworkSection(_Section):
    switches: PricedItems = PricedItems()
    cables: PricedItems = PricedItems()
    nics: PricedItems = PricedItems()  # when not part of the node price
    power_kw: float = Field(0.0, ge=0)  # all switches together
    intra: str | None = None  # link preset inside a node (default: by GPU kind)
    inter: str = "ib-ndr"  # link preset between nodes
    nics_per_node: int | None = Field(None, ge=1)  # default: one per GPU

    @model_validator(mode="after")
    def _known_links(self) -> NetworkSection:
        for name in ("intra", "inter"):
            value = getattr(self, name)
            if value is not None and value.lower() not in LINK_PRESETS:
                known = ", ".join(LINK_PRESETS)
                raise ValueError(f"network.{name} {value!r} is not a link preset ({known})")
        return self


class StorageSection(_Section):
    capacity_tb: float = Field(0.0, ge=0)
    price_per_tb_usd: float = Field(0.0, ge=0)
    power_kw: float = Field(0.0, ge=0)

    @property
    def cost_usd(self) -> float:
        return self.capacity_tb * self.price_per_tb_usd


class PowerSection(_Section):
    electricity_usd_per_kwh: float = Field(ge=0)
    pue: float = Field(1.0, ge=1.0)  # power usage effectiveness: facility / IT power


class StaffSection(_Section):
    fte: float = Field(0.0, ge=0)
    cost_per_fte_year_usd: float = Field(0.0, ge=0)


class CloudSection(_Section):
    price_per_gpu_hour_usd: float = Field(gt=0)


class ClusterFile(_Section):
    name: str = "cluster"
    gpus: GpuSection
    nodes: NodeSection
    network: NetworkSection = NetworkSection()
    storage: StorageSection = StorageSection()
    power: PowerSection
    staff: StaffSection = StaffSection()
    amortisation_years: float = Field(gt=0)
    utilisation: float = Field(gt=0, le=1)  # expected share of GPU-hours in use
    maintenance_fraction_per_year: float = Field(0.0, ge=0)  # of CAPEX: support contracts
    other_opex_usd_per_year: float = Field(0.0, ge=0)  # rack space, colocation, licences
    cloud: CloudSection

    @model_validator(mode="after")
    def _whole_nodes(self) -> ClusterFile:
        if self.gpus.count % self.nodes.count:
            raise ValueError(
                f"gpus.count={self.gpus.count} is not divisible by nodes.count={self.nodes.count}"
            )
        return self

    @property
    def gpus_per_node(self) -> int:
        return self.gpus.count // self.nodes.count


def _format_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(part) for part in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        return f"unknown key '{loc}'"
    if err["type"] == "missing":
        return f"missing key '{loc}'"
    if not loc:
        return msg
    value = err.get("input")
    shown = "" if isinstance(value, dict | list) else f" (got {value!r})"
    return f"{loc}: {msg}{shown}"


def parse_cluster(raw: Any, where: str = "cluster file") -> ClusterFile:
    if raw is None:
        raise ConfigError(f"{where}: the file is empty")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: top level must be a mapping of sections")
    try:
        return ClusterFile.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{where}: {_format_error(exc)}") from None


def load_cluster(path: str | Path) -> ClusterFile:
    raw = read_yaml_file(path, kind="cluster file")
    return parse_cluster(raw, str(path))
