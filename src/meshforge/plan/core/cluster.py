"""The cluster a plan is made for: a catalogue GPU cluster, or one measured machine."""

from __future__ import annotations

from pathlib import Path

from meshforge.plan.core.hardware import DEFAULT_INTRA_LINK, Cluster, gpu_spec, link_spec
from meshforge.plan.core.profile import MachineProfile


def build_cluster(
    gpus: int,
    gpu: str = "h100",
    gpus_per_node: int = 8,
    network: str = "ib-ndr",
    intra_network: str | None = None,
    nics_per_node: int | None = None,
    profile: str | Path | None = None,
) -> Cluster:
    """A catalogue GPU cluster, or (with a profile file) one measured machine."""
    if profile is not None:
        return MachineProfile.from_json_file(profile).to_cluster(gpus)
    device = gpu_spec(gpu)
    intra = link_spec(intra_network or DEFAULT_INTRA_LINK[device.name], "--intra-network")
    return Cluster(
        device=device,
        n_gpus=gpus,
        gpus_per_node=gpus_per_node,
        intra=intra,
        inter=link_spec(network),
        nics_per_node=nics_per_node if nics_per_node is not None else gpus_per_node,
    )
