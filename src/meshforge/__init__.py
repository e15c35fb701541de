"""meshforge: distributed deep-learning training on PyTorch."""

from typing import Any

from meshforge.version import __version__

__all__ = ["Fabric", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `import meshforge` (and `meshforge plan`/`cost`) does not import torch.
    if name == "Fabric":
        from meshforge.fabric import Fabric

        return Fabric
    raise AttributeError(f"module 'meshforge' has no attribute {name!r}")
