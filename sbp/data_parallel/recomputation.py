"""Does a forward call `torch.utils.checkpoint`? Watched in a layout's first local run.

A checkpointed block runs its forward again in backward, after the fast path's local run
has given the module its global parameters back: the recomputation would mix them with
the local activations it saved. Such a module runs op by op, where the recomputation is
global too. Non-reentrant checkpoints (`use_reentrant=False`, Hugging Face's default) push
torch's `_checkpoint_hook` saved-tensor hooks around the block's ops; reentrant ones leave a
`CheckpointFunctionBackward` node in the output's graph.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

REASON = "its forward calls torch.utils.checkpoint, which runs part of it again in backward"


def _is_checkpoint_hook(pack: Any) -> bool:
    return getattr(pack, "__module__", None) == "torch.utils.checkpoint" and getattr(
        pack, "__qualname__", ""
    ).startswith("_checkpoint_hook.")


class Recomputation(TorchFunctionMode):
    """Sees every torch call of the run; `found(outputs)` (its global outputs) says whether
    any was checkpointed."""

    def __init__(self) -> None:
        super().__init__()
        self.hooked = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.hooked:
            hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
            self.hooked = hooks is not None and _is_checkpoint_hook(hooks[0])
        return func(*args, **(kwargs or {}))

    def found(self, outputs: Iterable[torch.Tensor]) -> bool:
        return self.hooked or _reentrant_checkpoint_in(outputs)


def _reentrant_checkpoint_in(outputs: Iterable[torch.Tensor]) -> bool:
    """Is a reentrant checkpoint's node in the graph behind `outputs`? (Each node once.)"""
    with torch._C.DisableTorchFunctionSubclass():  # (a fast-path output's own getters)
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            return True
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return False
