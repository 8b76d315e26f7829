"""`sbp`: OneFlow-style global tensors (placement + SBP signature) for PyTorch."""

from sbp import env
from sbp.comm.stats import comm_stats
from sbp.errors import (
    CommTimeoutError,
    DeviceMismatchError,
    MetaMismatchError,
    PlacementError,
    SbpError,
    SbpSignatureError,
)
from sbp.layout import local_shape, local_slices
from sbp.placement import placement
from sbp.signature import broadcast, partial_max, partial_min, partial_sum, split

__version__ = "0.1.0"

__all__ = [
    "CommTimeoutError",
    "DeviceMismatchError",
    "MetaMismatchError",
    "PlacementError",
    "SbpError",
    "SbpSignatureError",
    "broadcast",
    "comm_stats",
    "env",
    "local_shape",
    "local_slices",
    "partial_max",
    "partial_min",
    "partial_sum",
    "placement",
    "split",
]
