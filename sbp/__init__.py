"""`sbp`: OneFlow-style global tensors (placement + SBP signature) for PyTorch."""

from sbp import boxing, checkpoint, env, nn, utils  # checkpoint: registers torch.load's safe global
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


def _install_methods() -> None:
    """`import sbp` adds `to_global` (and `is_global`) to torch.Tensor and nn.Module if absent."""
    import torch

    def tensor_to_global(self, placement=None, sbp=None, **kwargs):
        return to_global(self, placement, sbp, **kwargs)

    if not hasattr(torch.Tensor, "to_global"):
        torch.Tensor.to_global = tensor_to_global
    if not hasattr(torch.Tensor, "is_global"):
        torch.Tensor.is_global = property(lambda self: False)

    def module_to_global(self, placement, sbp, **kwargs):
        from sbp.nn.module import module_to_global

        return module_to_global(self, placement, sbp, **kwargs)

    if not hasattr(torch.nn.Module, "to_global"):
        torch.nn.Module.to_global = module_to_global

    # torch.tensor([g, n]) of a global 0-dim g: its logical value (see sbp.tensor_data)
    from sbp import tensor_data

    tensor_data.install()

    # Let clip_grad_norm_ and foreach optimizers batch global tensors like DTensor does.
    from torch.utils import _foreach_utils

    if GlobalTensor not in _foreach_utils._foreach_supported_types:
        _foreach_utils._foreach_supported_types.append(GlobalTensor)
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        from sbp.optim_step import install, prefer_foreach, restore_foreach

        register_optimizer_step_pre_hook(install)  # steps after the first run on locals
        register_optimizer_step_pre_hook(prefer_foreach)
        register_optimizer_step_post_hook(restore_foreach)


_install_methods()

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
