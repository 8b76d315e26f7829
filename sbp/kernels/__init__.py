"""Pack, unpack and reduce of boxing buffers.

The executor only calls these functions; they run torch ops on any device
today, and are the seam where CuPy raw kernels for CUDA plug in later.
"""

from sbp.kernels.reference import (
    empty_cache,
    fill_value,
    pack_chunks,
    reduce_chunks,
    staging,
    unpack_chunks,
)

__all__ = [
    "empty_cache",
    "fill_value",
    "pack_chunks",
    "reduce_chunks",
    "staging",
    "unpack_chunks",
]
