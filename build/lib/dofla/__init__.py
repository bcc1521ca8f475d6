"""dofla: distil softmax attention into linear attention with per-layer feature dimensions chosen by DoF."""

from dofla._registration import register_when_transformers_is_imported
from dofla.errors import DoflaError

# converted folders open with transformers' AutoModelForCausalLM (see dofla.auto)
register_when_transformers_is_imported()

__version__ = "0.1.0"

__all__ = ["DoflaError", "__version__"]
