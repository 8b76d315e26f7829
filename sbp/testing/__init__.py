"""Tools to test SPMD code: a worker pool, hypothesis strategies, a reference checker."""

from sbp.testing.pool import SpmdError, SpmdPool, get_pool, spmd

__all__ = ["SpmdError", "SpmdPool", "get_pool", "spmd"]
