"""Runs the kernels of boxing.cu on CUDA tensors with CuPy.

Each module (one word width for pack/unpack, one dtype for reduce) is compiled by NVRTC on
first use and kept; CuPy also caches the binary on disk. Every launch goes to torch's current
stream, so it is ordered with the torch work around it (torch's caching allocator reuses
memory in stream order, so the tensors' memory stays theirs until the kernel has run) and
nothing waits on the host.

Tensors reach the kernels as their device addresses, without a copy. DLPack would say the
same thing at a price: torch's `__dlpack__` negotiates streams in Python, ~70 us per tensor (cProfile)
on an H100 host, three tensors a launch, against a kernel of a few microseconds.
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


class _StreamHandle:
    """A raw stream handle in the CUDA stream protocol, which `Stream.from_external` reads."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def external_stream(handle: int, device_index: int) -> cupy.cuda.Stream:
    """The stream `handle` (not CuPy's: CuPy never destroys it) as a CuPy stream."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:  # CuPy < 14, where ExternalStream is not yet deprecated
        return cupy.cuda.ExternalStream(handle, device_index)
    with cupy.cuda.Device(device_index):  # the protocol names no device: CuPy takes the current
        return from_external(_StreamHandle(handle))


def _argument(a):
    """A kernel argument: a tensor as its address (a pointer parameter is 8 bytes, as is a
    uint64), an int as the kernels' 64-bit integer."""
    if isinstance(a, torch.Tensor):
        return numpy.uint64(a.data_ptr())
    return numpy.int64(a)


class CupyLauncher:
    threads = 256

    def __init__(self) -> None:
        self._modules: dict[tuple[int, str], cupy.RawModule] = {}
        self._functions: dict[tuple[int, str], object] = {}
        self._tables: OrderedDict = OrderedDict()
        self._max_blocks: dict[int, int] = {}
        self._streams: dict[tuple[int, int], cupy.cuda.Stream] = {}

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

    def _stream(self, device: torch.device) -> cupy.cuda.Stream:
        """torch's current stream on `device`, as CuPy sees it."""
        handle = torch.cuda.current_stream(device).cuda_stream
        stream = self._streams.get((device.index, handle))
        if stream is None:
            stream = external_stream(handle, device.index)
            self._streams[(device.index, handle)] = stream
        return stream

    def launch(self, kernel: str, instance: str, grid: tuple[int, int], args: Sequence) -> None:
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        fn = self.function(device, kernel, instance)
        with cupy.cuda.Device(device.index), self._stream(device):
            fn(grid, (self.threads,), tuple(_argument(a) for a in args))
