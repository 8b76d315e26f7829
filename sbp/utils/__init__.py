"""`sbp.utils`: data loading helpers for data-parallel training."""

from sbp.utils import data

__all__ = ["data"]
