"""Test session set-up: hypothesis profiles and the shared SPMD worker pool."""

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.register_profile(
    "slow",
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("SBP_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def pool1():
    """One SPMD rank (a world of one with a process group)."""
    from sbp.testing import get_pool

    return get_pool(1)


@pytest.fixture(scope="session")
def pool4():
    """Four SPMD ranks on gloo for the whole session."""
    from sbp.testing import get_pool

    return get_pool(4)


@pytest.fixture(scope="session")
def pool2():
    """Two SPMD ranks on gloo for the whole session."""
    from sbp.testing import get_pool

    return get_pool(2)
