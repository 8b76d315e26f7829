"""torch's recurrent layers (`nn.LSTM`, `nn.GRU`, `nn.RNN`, and their cells) on global
tensors: their forward makes a missing initial state with `torch.zeros` of the batch's
size, a local tensor that a global input cannot mix with. `module.to_global` gives each of
them `zero_state`, a forward pre-hook that passes a global initial state instead: one
process's zeros, laid out as the batch (split on its batch dim where the input's batch is
split, else broadcast). It makes no collective. (The data-parallel check's handling of
torch's recurrent functions is a family of its own: `sbp.data_parallel.families.recurrent`.)
"""

from __future__ import annotations

import torch

from sbp import env
from sbp.layout import GlobalSpec
from sbp.signature import broadcast, split
from sbp.tensor import GlobalTensor

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
