"""The Python API: Fabric, data parallel / ZeRO training of a user's own nn.Module."""

from meshforge.fabric.api import PRECISIONS, STRATEGIES, Fabric, FabricWorkerError

__all__ = ["PRECISIONS", "STRATEGIES", "Fabric", "FabricWorkerError"]
