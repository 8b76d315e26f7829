"""Random streams that agree across ranks, for dropout masks and other random ops.

Every rank keeps the same seed and the same count of draws (SPMD), so a draw
for a broadcast tensor is identical on every rank, and a draw for a split
tensor differs per shard by mixing in the shard's coordinates.
"""

from __future__ import annotations

import hashlib

_state = {"seed": 0, "draws": 0}


def manual_seed(seed: int) -> None:
    """Seed sbp's factories and random ops (call it with the same seed on every rank)."""
    _state["seed"], _state["draws"] = int(seed), 0


def draw_seed(*salt: object) -> int:
    """A fresh seed for one draw: same on every rank for the same salt, new for each draw."""
    _state["draws"] += 1
    text = repr((_state["seed"], _state["draws"], salt)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


# ------------------------------------------------ counter-based draws (one value per index)

_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # the constants of splitmix64, as signed int64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shr(z, k: int):
    """Logical right shift of int64 values (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z):
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def uniform_at(seed: int, index):
    """U[0, 1) in float64, a function of (seed, index) only: any rank can draw any element
    of a logical tensor alone, so the value does not depend on the layout (splitmix64)."""
    import torch

    base = int(_mix(torch.tensor(seed % 2**63, dtype=torch.int64)))
    z = _mix(index * _GOLDEN + base)
    return _shr(z, 11).to(torch.float64) * 2.0**-53


def normal_at(seed: int, index):
    """N(0, 1) in float64 per index (Box-Muller on two counter-based uniforms)."""
    import math

    import torch

    u1 = uniform_at(seed, 2 * index)
    u2 = uniform_at(seed, 2 * index + 1)
    return torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2 * math.pi * u2)
