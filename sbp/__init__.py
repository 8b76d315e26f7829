"""`sbp`: OneFlow-style global tensors (placement + SBP signature) for PyTorch."""

from sbp import _install, boxing, checkpoint, env, nn, utils
from sbp.errors import (
    CommTimeoutError,
    DeviceMismatchError,
    ImplicitCommunicationError,
    IndexRangeError,
    InputTypeError,
    InputValueError,
    LabelRangeError,
    MetaMismatchError,
    PlacementError,
    RankFailedError,
    SbpError,
    SbpSignatureError,
)
from sbp.factories import arange, empty, full, manual_seed, ones, rand, randn, tensor, zeros
from sbp.layout import local_shape, local_slices
from sbp.local_constants import global_mode, implicit_replication
from sbp.local_to_global import to_global
from sbp.placement import placement
from sbp.signature import broadcast, partial_max, partial_min, partial_sum, split
from sbp.tensor import GlobalTensor
from sbp.trace import comm_stats, strict

__version__ = "0.1.0"


_install.install()  # every change `import sbp` makes to torch (docs/design.md)

__all__ = [
    "CommTimeoutError",
    "GlobalTensor",
    "DeviceMismatchError",
    "InputTypeError",
    "InputValueError",
    "IndexRangeError",
    "LabelRangeError",
    "MetaMismatchError",
    "PlacementError",
    "RankFailedError",
    "SbpError",
    "SbpSignatureError",
    "boxing",
    "broadcast",
    "checkpoint",
    "comm_stats",
    "strict",
    "ImplicitCommunicationError",
    "env",
    "local_shape",
    "local_slices",
    "partial_max",
    "partial_min",
    "partial_sum",
    "placement",
    "split",
    "to_global",
    "arange",
    "empty",
    "full",
    "global_mode",
    "implicit_replication",
    "manual_seed",
    "nn",
    "ones",
    "rand",
    "randn",
    "tensor",
    "utils",
    "zeros",
]
