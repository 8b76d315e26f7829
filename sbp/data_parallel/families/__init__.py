"""Op families with global semantics on the data-parallel path: one module per family,
each holding what the checking pass judges of it and what the local run does instead,
looked up by op or function here (no if-chains in `check` or `local_run`).

A family module provides any of:
- `JUDGED`, `judge(check, func, args)`: aten ops the checking pass judges itself (a
  `_Check` is `check`); a true result takes the op as a whole (the ops its rule runs are
  not watched);
- `WATCHED`, `watch(check, args, kwargs)`: torch functions the checking pass sees as
  called (before any op of theirs), to refuse what the local run cannot reproduce;
- `LOCAL`, `run_local(run, func, args, kwargs)`: torch functions (torch's own, before a
  name replacement: `by_name`) the local run calls instead, with the op-by-op path's
  semantics (a `_Run` is `run`: the layout it follows, its counters);
- `CALLS`, `why_not_row_wise(args, kwargs, data_nd)`, `run_whole(func, args, kwargs,
  data_nd)`: torch functions row-wise in the batch, taken whole by the check where their
  tensors are laid out as the batch (`attention`, `recurrent`, `embedding_bag`).
"""

from sbp.data_parallel.families import (
    attention,
    batch_norm,
    dropout,
    embedding_bag,
    losses,
    recurrent,
    sdpa,
)

FAMILIES = (
    batch_norm,
    dropout,
    losses,
    sdpa,
    attention,
    recurrent,
    embedding_bag,
)


def _table(protocol: str) -> dict:
    return {f: family for family in FAMILIES for f in getattr(family, protocol, ())}


JUDGES = _table("JUDGED")  # aten op: its family (`judge`)
WATCHES = _table("WATCHED")  # torch function: its family (`watch`)
LOCAL = _table("LOCAL")  # torch function: its family (`run_local`)
WHOLE_CALLS = _table("CALLS")  # torch function: its family (`why_not_row_wise`, `run_whole`)
