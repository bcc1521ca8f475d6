"""Decoding steps compiled on the CPU (``torch.compile``, inductor's C++ code), with a fallback.

A converted layer's decoding step is a few dozen small operators; at batch 1 on a CPU each costs its
dispatch more than its arithmetic. ``run_compiled`` runs one layer's pure step function (the ``step.py`` of
an op folder) through one generated kernel per shape; ``compiled_method`` compiles a whole model's step
(``dofla.graph_decode.CapturedDecoder``). Wherever compiling fails (no C++ compiler, say) decoding goes on
eagerly: once, with a warning, and never tried again in the process.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

_COMPILED: dict[Callable, Callable] = {}
_FAILED: set[Callable] = set()


# inductor's options for one layer's step: the generated wrapper in C++ too (a call costs microseconds, not
# tens of them)
COMPILE_OPTIONS = {"cpp_wrapper": True}


# and for a whole model's step: its wrapper in Python (in C++ it is one large file that g++ -O3 takes
# minutes over; the Python wrapper's calls, one per fused kernel, cost far less than the eager operators)
WHOLE_COMPILE_OPTIONS: dict = {}


def compiled(function: Callable) -> Callable | None:
    """``function`` compiled by ``torch.compile`` (kept per function; None once compiling it has failed)."""
    if function in _FAILED:
        return None
    kept = _COMPILED.get(function)
    if kept is None:
        kept = _COMPILED[function] = torch.compile(
            function, fullgraph=True, dynamic=None, options=COMPILE_OPTIONS
        )
    return kept


def run_compiled(function: Callable, *args, **kwargs):
    """``function(*args, **kwargs)`` through its compiled kernel; None (nothing run) where it cannot compile,
    with one warning per function. Inside a program ``torch.compile`` is tracing (a compiled whole step),
    ``function`` itself, traced into that program."""
    if torch.compiler.is_compiling():
        return function(*args, **kwargs)
    kernel = compiled(function)
    if kernel is None:
        return None
    try:
        return kernel(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - any backend failure (compiler missing, codegen): fall back
        if not _compile_failure(error):
            raise
        _COMPILED.pop(function, None)
        _give_up(function, error, "the decoding step")
        return None


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
            except Exception as error:  # noqa: BLE001 - see run_compiled
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
