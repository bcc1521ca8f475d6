"""A whole model's decoding step compiled on the CPU (``torch.compile``, inductor's C++ code), with a
fallback: ``compiled_method`` (``dofla.graph_decode.CapturedDecoder(compiled=True)``). Wherever compiling
fails (no C++ compiler, say) decoding goes on eagerly: once, with a warning, and never tried again in the
process.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

_FAILED: set[Callable] = set()


# and for a whole model's step: its wrapper in Python (in C++ it is one large file that g++ -O3 takes
# minutes over; the Python wrapper's calls, one per fused kernel, cost far less than the eager operators)
WHOLE_COMPILE_OPTIONS: dict = {}


def compiled_method(method: Callable, what: str) -> Callable:
    """The bound ``method`` compiled whole (``torch.compile``, one program: its first call traces and
    compiles it): a callable that runs it compiled and, once compiling has failed (one warning, naming
    ``what``; never tried again in this process), runs the method itself."""
    function = getattr(method, "__func__", method)
    kernel = None
    if function not in _FAILED:
        kernel = torch.compile(method, fullgraph=True, options=WHOLE_COMPILE_OPTIONS)

    def run(*args, **kwargs):
        nonlocal kernel
        if kernel is not None:
            try:
                return kernel(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - any backend failure (compiler missing, codegen): fall back
                if not _compile_failure(error):
                    raise
                kernel = None
                _give_up(function, error, what)
        return method(*args, **kwargs)

    return run


def _give_up(function: Callable, error: Exception, what: str) -> None:
    """Never compile ``function`` again in this process; say so once."""
    _FAILED.add(function)
    warnings.warn(
        f"dofla: compiling {what} failed ({type(error).__name__}: {_first_line(error)}); decoding goes on "
        "eagerly.",
        stacklevel=3,
    )


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else "no message"


def _compile_failure(error: Exception) -> bool:
    """Whether ``error`` came from compiling (dynamo or inductor), not from the step's inputs."""
    module = type(error).__module__
    return module.startswith(("torch._dynamo", "torch._inductor", "torch.fx")) or isinstance(
        error, (OSError, ImportError, NotImplementedError)
    )
