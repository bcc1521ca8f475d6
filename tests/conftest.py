"""Shared test settings: dofla's cache goes to a per-session temporary folder unless DOFLA_CACHE is set."""

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _dofla_cache(tmp_path_factory):
    if not os.environ.get("DOFLA_CACHE"):
        os.environ["DOFLA_CACHE"] = str(tmp_path_factory.mktemp("dofla_cache"))
    yield
