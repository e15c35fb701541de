"""meshforge: distributed deep-learning training on PyTorch."""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Fabric", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `import meshforge` (and `meshforge plan`/`cost`) does not import torch.
    if name == "Fabric":
        from meshforge.api import Fabric

        return Fabric
    raise AttributeError(f"module 'meshforge' has no attribute {name!r}")
