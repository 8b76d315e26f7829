"""torch's recurrent functions (`torch.lstm` and the like, which `nn.LSTM`, `nn.GRU`,
`nn.RNN` call) in the data-parallel check (an op family of `sbp.data_parallel.families`).

They are row-wise in the batch: each sample's output and final state depend on its own
input and initial state alone. Op by op, though, they merge the sequence with the split
batch (`view(L * N, E)` for the input projection) or reach a kernel with no rule, which
moves the batch, so the check takes a call as a whole where its tensors are laid out as
the batch, runs it on the local tensors as the local run will, and lays its outputs out
as the batch. (A missing initial state is made global by `sbp.nn.torch_recurrent`.)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from sbp.data_parallel.batch_rows import moved_to, rows_as_global
from sbp.signature import is_all_broadcast
from sbp.tensor import GlobalTensor

CALLS = (torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu)


class _Padded(NamedTuple):
    """The arguments of `torch.lstm` and its kin on a padded batch (not a packed one)."""

    input: Any
    hx: Any  # a tensor, or a list of them (LSTM's h and c)
    params: list
    has_biases: bool
    num_layers: int
    dropout: float
    train: bool
    bidirectional: bool
    batch_first: bool

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> _Padded | None:
        """None for a packed sequence (`torch.lstm(data, batch_sizes, ...)`)."""
        if kwargs or len(args) != 9 or not isinstance(args[3], bool):
            return None
        return cls(*args)

    @property
    def states(self) -> list:
        return list(self.hx) if isinstance(self.hx, (tuple, list)) else [self.hx]


def why_not_row_wise(args: tuple, kwargs: dict, data_nd: tuple) -> str:
    """ "" where the call's local run on each rank's tensors gives that rank's rows of the
    logical result; else why not. Decided from the layouts alone, alike on every rank."""
    call = _Padded.of(args, kwargs)
    if call is None:
        return "a packed sequence"
    if call.dropout and call.train and call.num_layers > 1:
        return "dropout between layers, drawn inside torch's recurrent kernel"
    input = call.input
    if not isinstance(input, GlobalTensor) or input.dim() != 3:
        return "an unbatched input"
    batch_dim = 0 if call.batch_first else 1
    n = input.shape[batch_dim]
    if tuple(input.sbp) != moved_to(data_nd, batch_dim):
        return f"the input is laid out as {tuple(input.sbp)}"
    for h in call.states:
        if not isinstance(h, GlobalTensor) or tuple(h.sbp) != moved_to(data_nd, 1):
            return "the initial state is not laid out as the batch"
        if h.dim() != 3 or h.shape[1] != n:
            return "the initial state is not of the batch's size"
    for w in call.params:
        if not isinstance(w, GlobalTensor) or not is_all_broadcast(w.sbp):
            return "a weight is not broadcast"
    return ""


def run_whole(func, args: tuple, kwargs: dict, data_nd: tuple) -> tuple:
    """The call on this rank's local tensors, as the local run makes it (no collective, no
    fallback); its result (output, then final states) laid out as the batch."""
    call = _Padded(*args)
    hx = call.hx
    hx = [h._local for h in hx] if isinstance(hx, (tuple, list)) else hx._local
    local = call._replace(input=call.input._local, hx=hx, params=[w._local for w in call.params])
    output, *states = func(*local)
    batch_dim = 0 if call.batch_first else 1
    placement, n = call.input.placement, call.input.shape[batch_dim]
    return (
        rows_as_global(output, placement, moved_to(data_nd, batch_dim), batch_dim, n),
        *(rows_as_global(h, placement, moved_to(data_nd, 1), 1, n) for h in states),
    )
