"""`sbp.nn.parallel.DistributedDataParallel`: torch DDP, started from `sbp.env`.

The OneFlow seed wraps a model with `ddp(m)` and nothing else: no
`init_process_group`, no `device_ids`. This subclass keeps torch DDP's semantics
and arguments and only fills in what a launcher already told us:

* the process group is started by `sbp.env.init()` (torchrun or Slurm variables);
  a script run without a launcher gets a one-process gloo group, so it runs unchanged;
* a module on CUDA is moved to `cuda:LOCAL_RANK` and `device_ids=[LOCAL_RANK]` is set,
  so `model.to("cuda")` on every rank does not pile all ranks onto GPU 0;
* attributes the wrapper lacks are looked up on the wrapped module (`ddp(m).w`),
  as OneFlow's DDP allows.
"""

from __future__ import annotations

import atexit
from typing import Any

import torch
import torch.distributed as dist

from sbp import env
from sbp.boxing.executor import local_device

__all__ = ["DistributedDataParallel", "local_device"]


def _ensure_process_group() -> None:
    """Start the launcher's process group, or a one-process gloo group when there is none."""
    env.init()
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        atexit.register(_destroy)


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _module_device(module: torch.nn.Module) -> torch.device | None:
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return None


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """torch's `DistributedDataParallel` with the process group and device taken from `sbp.env`.

    Arguments are torch's (`device_ids`, `bucket_cap_mb`, `find_unused_parameters`, ...);
    `device_ids` defaults to `[LOCAL_RANK]` for a CUDA module and to `None` on CPU.
    """

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        _ensure_process_group()
        device = _module_device(module)
        if device is not None and device.type == "cuda" and not args and "device_ids" not in kwargs:
            target = local_device("cuda")
            module = module.to(target)
            kwargs["device_ids"] = [target.index]
        super().__init__(module, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None:
                raise
            return getattr(inner, name)
