"""`sbp.nn`: module-level helpers for data-parallel training."""

from sbp.nn import parallel

__all__ = ["parallel"]
