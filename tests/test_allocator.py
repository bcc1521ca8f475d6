"""The allocator tuning of the command line: applied on glibc, left alone where the user chose."""

import ctypes
import sys

import pytest

from dofla.allocator import tune_allocator, user_chose_allocator


@pytest.mark.parametrize(
    "environment, chosen",
    [
        ({}, None),
        ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "MALLOC_MMAP_THRESHOLD_"),
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_"),
        ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "LD_PRELOAD"),
        ({"DOFLA_ALLOCATOR": "Default"}, "DOFLA_ALLOCATOR=default"),
        ({"DOFLA_ALLOCATOR": "tuned", "LD_PRELOAD": " "}, None),
    ],
)
def test_the_users_own_allocator_settings_are_left_alone(environment, chosen):
    assert user_chose_allocator(environment) == chosen
    if chosen is not None:
        assert tune_allocator(environment) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_glibc_accepts_the_thresholds():
    try:
        ctypes.CDLL("libc.so.6").gnu_get_libc_version  # noqa: B018 (glibc only)
    except (OSError, AttributeError):
        pytest.skip("not glibc")
    assert tune_allocator({}) is True
