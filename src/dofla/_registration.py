"""Run :mod:`dofla.auto` (which registers the "dofla" model type with transformers) once transformers is
imported, so ``import dofla`` stays quick (no torch) and the registration is in place whenever
``AutoModelForCausalLM`` can be used."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MODEL_TYPE = "dofla"  # the model_type of a converted folder's config.json (dofla.auto.DoflaConfig)


def _register() -> None:
    importlib.import_module("dofla.auto")  # registers at the end of its import


class _AfterTransformersImport(importlib.abc.MetaPathFinder):
    """A one-shot import hook: the first import of ``transformers`` runs :func:`_register` after it."""

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            _register()

        spec.loader.exec_module = exec_module
        return spec


def register_when_transformers_is_imported() -> None:
    if "transformers" in sys.modules:
        _register()
    elif not any(isinstance(finder, _AfterTransformersImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterTransformersImport())
