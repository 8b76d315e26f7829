"""Optimizer steps on the locals of broadcast global parameters: moved to
`sbp.data_parallel.optim_step`; this module keeps the names imported from here."""

from sbp.data_parallel.optim_step import (
    _GroupSwap,
    _Swap,
    install,
    prefer_foreach,
    repoint,
    restore_foreach,
)

__all__ = ["_GroupSwap", "_Swap", "install", "prefer_foreach", "repoint", "restore_foreach"]
