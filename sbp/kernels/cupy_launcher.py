"""Runs the kernels of boxing.cu on CUDA tensors with CuPy.

Each module (one word width for pack/unpack, one dtype for reduce) is compiled by NVRTC on
first use and kept; CuPy also caches the binary on disk. Tensors reach the kernels through
DLPack without a copy, and every launch goes to torch's current stream, so it is ordered
with the torch work around it and nothing waits on the host.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import cupy
import numpy
import torch

from sbp.kernels import raw

TABLE_CACHE = 1024  # chunk tables kept on the device (plans repeat, so tables do too)


def compile_options() -> tuple[str, ...]:
    return ("--std=c++17", *(f"-I{d}" for d in raw.include_dirs()))


def _cupy_stream(stream: torch.cuda.Stream):
    if hasattr(cupy.cuda.Stream, "from_external") and hasattr(stream, "__cuda_stream__"):
        return cupy.cuda.Stream.from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index)


def _as_cupy(a):
    """A tensor as a CuPy array on the same memory (bytes: CuPy has no bfloat16); ints as
    the kernels' 64-bit integers."""
    if isinstance(a, torch.Tensor):
        return cupy.from_dlpack(a.view(torch.uint8))
    return numpy.int64(a)


class CupyLauncher:
    threads = 256

    def __init__(self) -> None:
        self._modules: dict[tuple[int, str], cupy.RawModule] = {}
        self._functions: dict[tuple[int, str], object] = {}
        self._tables: OrderedDict = OrderedDict()
        self._max_blocks: dict[int, int] = {}

    def max_blocks(self, device: torch.device) -> int:
        # Enough blocks to fill every SM several times over; grid-stride loops do the rest.
        n = self._max_blocks.get(device.index)
        if n is None:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            n = self._max_blocks[device.index] = sms * 16
        return n

    def table(self, values: tuple[int, ...], device: torch.device) -> torch.Tensor:
        stream = torch.cuda.current_stream(device)
        key = (device.index, stream.cuda_stream, values)
        t = self._tables.get(key)
        if t is None:
            # Pinned memory and non_blocking: the copy is queued on the stream, the host
            # does not wait (torch keeps the pinned block until the copy is done).
            host = torch.tensor(values, dtype=torch.int64).pin_memory()
            t = self._tables[key] = host.to(device, non_blocking=True)
            if len(self._tables) > TABLE_CACHE:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(key)
        return t

    def function(self, device: torch.device, kernel: str, instance: str):
        key = (device.index, kernel)
        fn = self._functions.get(key)
        if fn is None:
            module = self._modules.get((device.index, instance))
            if module is None:
                module = cupy.RawModule(code=raw.source([instance]), options=compile_options())
                self._modules[(device.index, instance)] = module
            with cupy.cuda.Device(device.index):  # NVRTC runs here, once per module
                fn = self._functions[key] = module.get_function(kernel)
        return fn

    def launch(self, kernel: str, instance: str, grid: tuple[int, int], args: Sequence) -> None:
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        fn = self.function(device, kernel, instance)
        with cupy.cuda.Device(device.index), _cupy_stream(torch.cuda.current_stream(device)):
            fn(grid, (self.threads,), tuple(_as_cupy(a) for a in args))
