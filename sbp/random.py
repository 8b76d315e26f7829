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
