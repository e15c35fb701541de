"""The one N-D DeviceMesh of a job, built from its checked layout (layout.ParallelDims)."""

from __future__ import annotations

import warnings

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshforge.layout import MESH_DIMS, ParallelDims


def build_mesh(dims: ParallelDims, device: torch.device) -> DeviceMesh:
    """One DeviceMesh over the world with named dimensions ("pp", "dp", "tp"); a
    dimension of size 1 is kept so every layout names the same dimensions.

    Expert parallel cuts dp into ("edp", "ep") and flattens them back into "dp".
    Context parallel (cp > 1) adds "cp" between the data-parallel dimensions and "tp",
    and flattens the data-parallel ones with it into "dp_cp": the ranks that hold the
    same weights, over which gradients are reduced (`gradient_mesh`); with expert
    parallel also ("edp", "cp") into "edp_cp", the ranks that hold the same experts
    (`expert_replica_dim`)."""
    if dims.parameter_server:
        raise ValueError("a parameter-server layout has no device mesh")
    if not dims.ep_enabled and not dims.cp_enabled:
        return init_device_mesh(device.type, dims.mesh_shape, mesh_dim_names=MESH_DIMS)
    names, shape = dims.mesh_layout()
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    data = ("edp", "ep") if dims.ep_enabled else ("dp",)
    if dims.ep_enabled:
        # ep innermost in dp, flattened back into "dp" so that everything else names
        # the same dimensions
        mesh["edp", "ep"]._flatten("dp")
    if dims.cp_enabled:
        mesh[(*data, "cp")]._flatten("dp_cp")
    if dims.ep_enabled and dims.cp_enabled:
        # the ranks that hold the same experts: the cp ranks replicate them too
        mesh["edp", "cp"]._flatten("edp_cp")
    # torch warns on every `mesh["dp"]` that slicing a flattened dimension from the root
    # is to be deprecated; every layout names "dp" the same way, so it is sliced so here
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
    return mesh


def gradient_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The ranks that hold the same weights and reduce (or, under ZeRO, shard) their
    gradients: "dp", and under context parallelism "dp_cp" (the cp ranks of a
    sequence train the same weights on different tokens of it)."""
    return mesh["dp_cp"] if dims.cp_enabled else mesh["dp"]


def expert_replica_dim(dims: ParallelDims) -> str:
    """The mesh dimension of the ranks that hold the same experts under expert
    parallelism: "edp", and "edp_cp" under context parallelism."""
    return "edp_cp" if dims.cp_enabled else "edp"


def data_parallel_mesh(device: torch.device, dp: int) -> DeviceMesh:
    """A one-dimensional ("dp",) mesh over the world: a Fabric user's model (or a timed
    block of the planner's) has no other dimension to name."""
    return init_device_mesh(device.type, (dp,), mesh_dim_names=("dp",))
