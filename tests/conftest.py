"""Shared test settings: dofla's cache goes to a per-session temporary folder unless DOFLA_CACHE is set."""

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _dofla_cache(tmp_path_factory):
    if not os.environ.get("DOFLA_CACHE"):
        os.environ["DOFLA_CACHE"] = str(tmp_path_factory.mktemp("dofla_cache"))
    yield


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny models run fastest on one thread: torch's pool costs more than it gains at these sizes."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
