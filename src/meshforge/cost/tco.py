"""Total cost of ownership: CAPEX, yearly OPEX, and owning versus renting.

With u the expected utilisation, G the GPU count, H = 8760 hours a year:

    CAPEX        = GPUs + nodes + switches + cables + NICs + storage
    energy/year  = (nodes·(u·P_load + (1-u)·P_idle) + P_network + P_storage)·H·PUE·price
    OPEX/year    = energy + staff + maintenance·CAPEX + other
    owned/year   = CAPEX / amortisation_years + OPEX
    owned $/GPU-h = owned/year ÷ (G·H·u)          (only used hours count)
    cloud/year   = cloud $/GPU-h · G·H·u          (renting the same used hours)

Breakeven months: owning costs CAPEX + OPEX·t, renting cloud·t, so
t* = CAPEX ÷ (cloud/year - OPEX/year) × 12 (none when renting is cheaper than
running the cluster). Breakeven utilisation: the u at which owned $/GPU-h equals
the cloud price over the amortisation period, linear in u:
u* = (CAPEX/years + fixed OPEX + energy at u=0) ÷ (cloud·G·H - d(energy)/du).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from meshforge.cost.cluster import ClusterFile

HOURS_PER_YEAR = 8760.0  # 365 days


@dataclass(frozen=True)
class Tco:
    capex_usd: float
    capex_breakdown_usd: dict[str, float]
    opex_per_year_usd: float
    opex_breakdown_usd: dict[str, float]
    owned_per_year_usd: float
    gpu_hours_per_year: float  # used GPU-hours at the expected utilisation
    owned_per_gpu_hour_usd: float
    cloud_per_gpu_hour_usd: float
    cloud_per_year_usd: float
    breakeven_months: float | None  # None: renting never costs more than running
    breakeven_utilisation: float | None  # > 1: owning never pays; None: never
    utilisation: float

    def to_dict(self) -> dict:
        return asdict(self)


def capex(cluster: ClusterFile) -> dict[str, float]:
    net = cluster.network
    return {
        "gpus": cluster.gpus.count * cluster.gpus.unit_price_usd,
        "nodes": cluster.nodes.count * cluster.nodes.unit_price_usd,
        "switches": net.switches.cost_usd,
        "cables": net.cables.cost_usd,
        "nics": net.nics.cost_usd,
        "storage": cluster.storage.cost_usd,
    }


def energy_per_year_usd(cluster: ClusterFile, utilisation: float) -> float:
    """Electricity for a year at utilisation u, facility overhead (PUE) included."""
    nodes = cluster.nodes
    idle = nodes.power_kw if nodes.idle_power_kw is None else nodes.idle_power_kw
    it_kw = nodes.count * (utilisation * nodes.power_kw + (1.0 - utilisation) * idle)
    it_kw += cluster.network.power_kw + cluster.storage.power_kw
    return it_kw * HOURS_PER_YEAR * cluster.power.pue * cluster.power.electricity_usd_per_kwh


def opex_per_year(cluster: ClusterFile, utilisation: float, capex_usd: float) -> dict[str, float]:
    return {
        "energy": energy_per_year_usd(cluster, utilisation),
        "staff": cluster.staff.fte * cluster.staff.cost_per_fte_year_usd,
        "maintenance": cluster.maintenance_fraction_per_year * capex_usd,
        "other": cluster.other_opex_usd_per_year,
    }


def tco(cluster: ClusterFile, utilisation: float | None = None) -> Tco:
    """The cost of owning `cluster` at `utilisation` (default: the file's), and renting."""
    u = cluster.utilisation if utilisation is None else utilisation
    capex_parts = capex(cluster)
    capex_usd = sum(capex_parts.values())
    opex_parts = opex_per_year(cluster, u, capex_usd)
    opex_usd = sum(opex_parts.values())
    owned_year = capex_usd / cluster.amortisation_years + opex_usd
    gpu_hours = cluster.gpus.count * HOURS_PER_YEAR * u
    cloud_rate = cluster.cloud.price_per_gpu_hour_usd
    cloud_year = cloud_rate * gpu_hours

    saving_per_year = cloud_year - opex_usd
    breakeven_months = 12.0 * capex_usd / saving_per_year if saving_per_year > 0 else None

    fixed = capex_usd / cluster.amortisation_years + opex_usd - opex_parts["energy"]
    energy_at_zero = energy_per_year_usd(cluster, 0.0)
    energy_slope = energy_per_year_usd(cluster, 1.0) - energy_at_zero
    denominator = cloud_rate * cluster.gpus.count * HOURS_PER_YEAR - energy_slope
    breakeven_u = (fixed + energy_at_zero) / denominator if denominator > 0 else None

    return Tco(
        capex_usd=capex_usd,
        capex_breakdown_usd=capex_parts,
        opex_per_year_usd=opex_usd,
        opex_breakdown_usd=opex_parts,
        owned_per_year_usd=owned_year,
        gpu_hours_per_year=gpu_hours,
        owned_per_gpu_hour_usd=owned_year / gpu_hours,
        cloud_per_gpu_hour_usd=cloud_rate,
        cloud_per_year_usd=cloud_year,
        breakeven_months=breakeven_months,
        breakeven_utilisation=breakeven_u,
        utilisation=u,
    )
