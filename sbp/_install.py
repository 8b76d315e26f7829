"""What `import sbp` changes in torch itself, in one place (docs/design.md, "Torch-wide side
effects"). `install()` runs once from `sbp/__init__.py`; each step is idempotent: run
again, it finds its change made and does nothing.

Changes sbp makes elsewhere, on first use or for the length of a call, are listed in the
design doc beside these, with the file that makes each.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils import _foreach_utils

from sbp import optim_step, tensor_data
from sbp.local_to_global import to_global
from sbp.nn import module_to_global as module_with_fast_path
from sbp.tensor import GlobalTensor


def install() -> None:
    _methods()
    tensor_data.install()  # torch.tensor([g, n]) of a global 0-dim g: its logical value
    _foreach_and_optimizer_steps()
    _dynamo_skips_global_tensor_making()


def _methods() -> None:
    """`to_global` (and `is_global`) on torch.Tensor and nn.Module, where absent."""

    def tensor_to_global(self, placement=None, sbp=None, **kwargs):
        return to_global(self, placement, sbp, **kwargs)

    if not hasattr(torch.Tensor, "to_global"):
        torch.Tensor.to_global = tensor_to_global
    if not hasattr(torch.Tensor, "is_global"):
        torch.Tensor.is_global = property(lambda self: False)

    def module_to_global(self, placement, sbp, **kwargs):
        return module_with_fast_path(self, placement, sbp, **kwargs)

    if not hasattr(torch.nn.Module, "to_global"):
        torch.nn.Module.to_global = module_to_global


def _foreach_and_optimizer_steps() -> None:
    """clip_grad_norm_ and foreach optimizers batch global tensors, as they do DTensors; every
    optimizer's step gets sbp's pre- and post-hooks (`sbp.optim_step`: the step on locals
    after the first run, and the foreach choice)."""
    if GlobalTensor in _foreach_utils._foreach_supported_types:
        return
    _foreach_utils._foreach_supported_types.append(GlobalTensor)
    register_optimizer_step_pre_hook(optim_step.install)  # steps after the first run on locals
    register_optimizer_step_pre_hook(optim_step.prefer_foreach)
    register_optimizer_step_post_hook(optim_step.restore_foreach)


def _dynamo_skips_global_tensor_making() -> None:
    """Dynamo never traces sbp's dispatch. Reached from the eager part of a compiled function
    (after a graph break: `loss.backward()` making its gradient of ones), Dynamo would break
    the graph at the wrapper's allocation in `__new__` and resume on a half-made tensor
    ("GlobalTensor has no attribute '_local'"). So for the wrapper's making: AOT autograd's
    backward rebuilds its global tensors (`__tensor_unflatten__`) while a compiled
    function's frame callback is still on. (torch's C module: importing torch._dynamo would
    cost every `import sbp` seconds.)"""
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )
    except ImportError:
        return
    for code in (
        GlobalTensor.__torch_dispatch__.__func__.__code__,
        GlobalTensor.__new__.__code__,
        GlobalTensor.__tensor_unflatten__.__code__,
    ):
        set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
