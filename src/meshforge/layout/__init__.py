"""The layout, torch-free: every mesh dimension, the pipeline schedules, the stage
split and every layout rule, once, named in the caller's own field names."""

from meshforge.layout.dims import MESH_DIMS, ParallelDims
from meshforge.layout.rules import (
    JOB_NAMES,
    LayoutRequest,
    ModelShape,
    Names,
    check,
    derive,
    first_problem,
)

__all__ = [
    "JOB_NAMES",
    "MESH_DIMS",
    "LayoutRequest",
    "ModelShape",
    "Names",
    "ParallelDims",
    "check",
    "derive",
    "first_problem",
]
