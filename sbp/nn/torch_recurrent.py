"""torch's recurrent layers (`nn.LSTM`, `nn.GRU`, `nn.RNN`, and their cells) on global
tensors.

- Their forward makes a missing initial state with `torch.zeros` of the batch's size, a
  local tensor that a global input cannot mix with. `module.to_global` gives each of them
  `zero_state`, a forward pre-hook that passes a global initial state instead: one
  process's zeros, laid out as the batch (split on its batch dim where the input's batch
  is split, else broadcast). It makes no collective.
- torch's recurrent functions (`torch.lstm` and the like, which those modules call) are
  row-wise in the batch: each sample's output and final state depend on its own input and
  initial state alone. Op by op, though, they merge the sequence with the split batch
  (`view(L * N, E)` for the input projection) or reach a kernel with no rule, which moves
  the batch, so the data-parallel check (sbp.data_parallel) takes a call as a whole where
  its tensors are laid out as the batch, runs it on the local tensors as the local run
  will, and lays its outputs out as the batch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from sbp import env
from sbp.layout import GlobalSpec
from sbp.nn.batch_rows import moved_to, rows_as_global
from sbp.signature import broadcast, is_all_broadcast, split
from sbp.tensor import GlobalTensor

CALLS = (torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu)
_RECURRENT = (torch.nn.RNNBase, torch.nn.RNNCellBase)
_HOOKED = "_sbp_zero_state"  # the module attribute holding the hook's handle


def attach(module: torch.nn.Module) -> None:
    """Give each recurrent layer and cell inside `module` the `zero_state` pre-hook, once."""
    for m in module.modules():
        if isinstance(m, _RECURRENT) and _HOOKED not in m.__dict__:
            handle = m.register_forward_pre_hook(zero_state, with_kwargs=True)
            m.__dict__[_HOOKED] = handle


def zero_state(module: torch.nn.Module, args: tuple, kwargs: dict):
    """A global input given no initial state gets one process's zeros, laid out as the
    batch (torch's forward would make a local tensor of them)."""
    input = args[0] if args else kwargs.get("input")
    given = args[1] if len(args) > 1 else kwargs.get("hx")
    if given is not None or not isinstance(input, GlobalTensor):
        return None
    if isinstance(module, torch.nn.RNNCellBase):  # (input (N, E) or (E,); state (N, H))
        batch_dim, size, layers = 0, input.shape[:-1], ()
        out_size = cell_size = module.hidden_size
        lstm = isinstance(module, torch.nn.LSTMCell)
    else:  # (input (N, L, E), (L, N, E) or (L, E); state (layers, N, H))
        batch_dim = 0 if module.batch_first else 1
        size = (input.shape[batch_dim],) if input.dim() == 3 else ()
        layers = (module.num_layers * (2 if module.bidirectional else 1),)
        out_size, cell_size = module.proj_size or module.hidden_size, module.hidden_size
        lstm = isinstance(module, torch.nn.LSTM)
    batch_dim = batch_dim if size else None
    h = _zeros(input, (*layers, *size, out_size), batch_dim, len(layers))
    if lstm:
        h = (h, _zeros(input, (*layers, *size, cell_size), batch_dim, len(layers)))
    if len(args) > 1:
        return (args[0], h, *args[2:]), kwargs
    return args, {**kwargs, "hx": h}


def _zeros(input: GlobalTensor, shape: tuple, batch_dim: int | None, at: int) -> GlobalTensor:
    """Zeros of `shape` (an initial state: its batch on dim `at`), split on `at` where
    `input` splits `batch_dim`, else broadcast."""
    spec = input._spec
    nd = tuple(split(at) if s.is_split and s.dim == batch_dim else broadcast for s in spec.nd_sbp)
    state = GlobalSpec(spec.placement, nd, shape, spec.dtype)
    local = torch.zeros(state.local_shape(env.get_rank()), dtype=spec.dtype)
    return GlobalTensor(local.to(input._local.device), state)


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
