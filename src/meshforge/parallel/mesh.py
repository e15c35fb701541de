"""The one N-D DeviceMesh of a job, built from its checked layout (layout.ParallelDims)."""

from __future__ import annotations

import warnings

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshforge.layout import MESH_DIMS, ParallelDims


def build_mesh(dims: ParallelDims, device: torch.device) -> DeviceMesh:
    """One DeviceMesh over the world with named dimensions ("pp", "dp", "tp"); a
    dimension of size 1 is kept so every layout names the same dimensions."""
    if dims.parameter_server:
        raise ValueError("a parameter-server layout has no device mesh")
    if not dims.ep_enabled:
        return init_device_mesh(device.type, dims.mesh_shape, mesh_dim_names=MESH_DIMS)
    # expert parallel: dp cut into ("edp", "ep"), ep innermost, and flattened back
    # into "dp" so that everything else names the same dimensions
    shape = (dims.pp, dims.edp, dims.ep, dims.tp)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("pp", "edp", "ep", "tp"))
    mesh["edp", "ep"]._flatten("dp")
    # torch warns on every `mesh["dp"]` that slicing a flattened dimension from the root
    # is to be deprecated; every layout names "dp" the same way, so it is sliced so here
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
    return mesh


def data_parallel_mesh(device: torch.device, dp: int) -> DeviceMesh:
    """A one-dimensional ("dp",) mesh over the world: a Fabric user's model (or a timed
    block of the planner's) has no other dimension to name."""
    return init_device_mesh(device.type, (dp,), mesh_dim_names=("dp",))
