"""dofla: distil softmax attention into linear attention with per-layer feature dimensions chosen by DoF."""

from dofla.errors import DoflaError

__version__ = "0.1.0"

__all__ = ["DoflaError", "__version__"]
