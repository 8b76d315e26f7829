"""Local tensors to global ones: `to_global` of a plain tensor (or a nest of them) and the
metadata exchange through which the ranks agree on the layout, the dtype and the range.

Every rank of the world calls it (SPMD). One exchange (a small all-gather over the world)
carries every rank's local shape, dtype, requires_grad and, for small integer tensors,
range (`sbp.ranges`); a bad argument on any rank is raised on every rank.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import torch

from sbp import comm, env
from sbp.boxing.executor import empty_local, local_device
from sbp.comm import agreement, failure
from sbp.errors import (
    DeviceMismatchError,
    InputTypeError,
    MetaMismatchError,
    PlacementError,
    SbpError,
    SbpSignatureError,
)
from sbp.layout import GlobalSpec, check_shape, logical_size_along
from sbp.placement import placement as Placement
from sbp.ranges import local_bounds, record_range
from sbp.signature import NdSbp, format_nd_sbp, normalize_nd_sbp
from sbp.tensor import GlobalTensor, check_options, from_local, grad_nd_sbp

_DTYPES = sorted(
    {v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=lambda d: str(d)
)


def _meta_row(
    x: torch.Tensor,
    P: Placement,
    sbp: Any,
    shape: Any,
    check_meta: bool,
    data_hash: int | None = None,
) -> tuple[dict, list[int]]:
    """What this rank tells the others about `x` in `to_global`'s metadata exchange.

    With `check_meta`, ranks first agree on placement, sbp, dtype and device type;
    running over the whole world (every rank calls `to_global`, SPMD) also catches
    ranks that disagree on the placement itself, and tells ranks outside the
    placement the logical shape and dtype: their own tensor's are ignored (OneFlow's rule).
    Placement ranks must also agree on `requires_grad` and, given `data_hash` (broadcast
    without sync_data), on their data.
    """
    me = env.get_rank()
    description = {}
    if check_meta:
        description = {
            "placement": repr(P),
            "sbp": format_nd_sbp(normalize_nd_sbp(sbp, P.ndim)),
            "device type": x.device.type if me in P else P.type,
            "shape=": None if shape is None else tuple(shape),
        }
    extra = [int(x.requires_grad), data_hash or 0] if check_meta else []
    bounds = local_bounds(x)
    mine = [1, _DTYPES.index(x.dtype), x.dim(), *x.shape, *extra, *bounds] if me in P else [0]
    return description, mine


def _read_rows(
    rows: list[tuple[int, ...]], P: Placement, sbp: Any, check_meta: bool
) -> tuple[dict[int, tuple[int, ...]], torch.dtype, tuple[int, int] | None]:
    """Every placement rank's local shape, the dtype and the logical range (integer tensors),
    from every world rank's row."""
    inside = {r: row for r, row in enumerate(rows) if row[0] == 1}
    dtypes = {r: _DTYPES[row[1]] for r, row in inside.items()}
    if check_meta and len(set(dtypes.values())) > 1:
        per_rank = ", ".join(f"rank {r}: {str(d)!r}" for r, d in dtypes.items())
        raise MetaMismatchError(f"ranks disagree on to_global: dtype differs ({per_rank})")
    if check_meta:
        _check_agreement({r: row[3 + row[2] :] for r, row in inside.items()}, P, sbp)
    shapes = {r: tuple(row[3 : 3 + row[2]]) for r, row in inside.items()}
    return shapes, dtypes[P.flat_ranks[0]], _global_bounds(inside, 2 if check_meta else 0)


def _global_bounds(inside: dict[int, tuple[int, ...]], n_extra: int) -> tuple[int, int] | None:
    """The range over every placement rank's reported [min, max] (empty ranks report none)."""
    bounds = [row[3 + row[2] + n_extra :] for row in inside.values()]
    if not bounds or any(len(b) not in (0, 2) for b in bounds):
        return None
    reported = [b for b in bounds if b]
    sizes = [math.prod(row[3 : 3 + row[2]]) for row in inside.values()]
    if not reported or len(reported) != sum(1 for n in sizes if n > 0):
        return None  # a nonempty rank without a range (too large to scan)
    return min(b[0] for b in reported), max(b[1] for b in reported)


def _exchange_rows(
    descriptions: list[dict], mine: list[list[int]], error: Exception | None
) -> list[list[tuple[int, ...]]]:
    """One metadata exchange over the world for several tensors: per tensor, every rank's row."""
    world = tuple(range(env.get_world_size()))
    if len(mine) == 1:
        return [comm.exchange(descriptions[0], world, mine[0], "to_global", error=error)]
    description = {f"{k} (tensor {i})": v for i, d in enumerate(descriptions) for k, v in d.items()}
    ints = [len(mine)] + [v for row in mine for v in (len(row), *row)]
    out: list[list[tuple[int, ...]]] = [[] for _ in mine]
    for packed in comm.exchange(description, world, ints, "to_global", error=error):
        if packed[0] != len(mine):
            raise MetaMismatchError(
                f"ranks disagree on to_global: {packed[0]} and {len(mine)} tensors in the nest"
            )
        at = 1
        for i in range(len(mine)):
            n = packed[at]
            out[i].append(tuple(packed[at + 1 : at + 1 + n]))
            at += 1 + n
    return out


def _check_agreement(extra: dict[int, tuple[int, ...]], P: Placement, sbp: Any) -> None:
    """Placement ranks agree on requires_grad, and on data along broadcast hierarchy dims."""
    grads = {r: bool(e[0]) for r, e in extra.items()}
    if len(set(grads.values())) > 1:
        raise MetaMismatchError(
            f"to_global: ranks disagree on requires_grad of the local tensor: {grads}"
        )
    nd = normalize_nd_sbp(sbp, P.ndim)
    for h, s in enumerate(nd):
        if not s.is_broadcast:
            continue
        for r in P.flat_ranks:
            group = P.group_ranks(r, h)
            if len({extra[q][1] for q in group}) > 1:
                raise MetaMismatchError(
                    f"to_global(sync_data=False): sbp is broadcast but the local data of ranks "
                    f"{list(group)} differ; pass sync_data=True to take rank {group[0]}'s value"
                )


@functools.lru_cache(maxsize=256)
def _agreed_layout(
    ordered: tuple[tuple[int, ...], ...], P: Placement, nd: NdSbp, shape: tuple[int, ...] | None
) -> tuple[NdSbp, tuple[int, ...]]:
    """The sbp (split dims normalised) and logical shape that every placement rank's local
    shape (`ordered`, in flat rank order) fits, checked against the balanced layout.

    Cached: a training loop passes batches of the same shapes step after step, and the
    check walks every rank's layout (a failed check raises and is not cached)."""
    if shape is not None:
        logical = shape
    elif any(s.is_split for s in nd):
        if len({len(s) for s in ordered}) != 1:
            raise MetaMismatchError(
                f"to_global: ranks {list(P.flat_ranks)} pass local tensors of different ndim: "
                f"{list(ordered)}"
            )
        nd = normalize_nd_sbp(nd, P.ndim, len(ordered[0]))
        logical = tuple(
            logical_size_along([s[d] for s in ordered], P.hierarchy, nd, d)
            for d in range(len(ordered[0]))
        )
    else:
        logical = ordered[0]
    nd = normalize_nd_sbp(nd, P.ndim, len(logical))
    spec = GlobalSpec(P, nd, logical, None)
    expected = [spec.local_shape(r) for r in P.flat_ranks]
    if list(ordered) != expected:
        raise MetaMismatchError(
            f"to_global: local shapes {list(ordered)} of ranks {list(P.flat_ranks)} are not the "
            f"balanced split of logical shape {spec.shape} by sbp {format_nd_sbp(spec.nd_sbp)} "
            f"(expected {expected})"
        )
    return nd, logical


def _sync_broadcast_dims(x: torch.Tensor, P: Placement, nd: NdSbp) -> torch.Tensor:
    """Copy the first rank's value along every broadcast hierarchy dim."""
    me = env.get_rank()
    for h, s in enumerate(nd):
        if s.is_broadcast and P.hierarchy[h] > 1:
            group = P.group_ranks(me, h)
            x = comm.broadcast(
                x.detach().clone(memory_format=torch.contiguous_format), group[0], group
            )
    return x


def local_to_global(
    x: torch.Tensor,
    placement: Placement,
    sbp: Any,
    *,
    shape: Any = None,
    sync_data: bool = True,
    check_meta: bool = True,
    grad_sbp: Any = None,
) -> GlobalTensor:
    """`x` is this rank's local tensor; make the global tensor it is a part of (see docs/api.md).

    Every rank of the world calls this (SPMD); ranks outside `placement` pass any
    tensor of the right dtype and get a metadata-only global tensor. A bad argument on
    any rank raises on every rank (with `check_meta`). With `check_meta` and
    `sync_data=False`, a broadcast tensor's data is hashed and compared (about 1 GB/s);
    with `check_meta=False` nothing is checked: equal data is trusted.
    """
    return locals_to_global([x], placement, sbp, shape, sync_data, check_meta, grad_sbp)[0]


@failure.user_call
def locals_to_global(
    xs: list[torch.Tensor],
    placement: Placement,
    sbp: Any,
    shape: Any = None,
    sync_data: bool = True,
    check_meta: bool = True,
    grad_sbp: Any = None,
) -> list[GlobalTensor]:
    """`local_to_global` of several tensors with one metadata exchange (a batch's inputs and
    labels: each exchange is a collective, ~0.5-4 ms on a busy host)."""
    try:
        check_options(sync_data, check_meta)
        errors = [bad_input(x, placement, sbp, shape) for x in xs]
        if grad_sbp is not None and isinstance(placement, Placement):
            normalize_nd_sbp(grad_sbp, placement.ndim)
    except SbpError as e:
        errors = [e]
    bad = next((e for e in errors if e is not None), None)
    if bad is not None:  # every rank raises it at once, not only this one
        if check_meta is not False:
            agreement.raise_everywhere(bad)
        agreement.announce(bad)  # (unchecked: the others go on; over the world, where
        raise bad  # a placement of some ranks makes them exchange its layout)
    me = env.get_rank()
    inside = me in placement
    if shape is not None:
        shape = check_shape(shape)
    error = next((e for e in (_device_error(x, placement) for x in xs) if e is not None), None)
    nd = normalize_nd_sbp(sbp, placement.ndim)
    splits = any(s.is_split for s in nd)
    world = env.get_world_size()
    # (in a world of one there is no other rank to agree with: the local tensor is the
    # logical one, and the exchange would only read back this rank's own row)
    if world > 1 and (check_meta or (splits and shape is None) or placement.size < world):
        rows = []
        for x in xs:
            checksum = None
            if check_meta and not sync_data and inside and error is None:
                if any(s.is_broadcast for s in nd):
                    checksum = agreement.data_hash(x)
            rows.append(_meta_row(x, placement, sbp, shape, check_meta, checksum))
        exchanged = _exchange_rows([d for d, _ in rows], [m for _, m in rows], error)
        metas = [_read_rows(r, placement, sbp, check_meta) for r in exchanged]
    elif error is not None:
        agreement.announce(error, placement)
        raise error
    else:  # trusted; in a world of one, this rank's range is the logical tensor's
        metas = [
            (None, x.dtype, tuple(local_bounds(x)) or None if world == 1 else None) for x in xs
        ]
    return [
        _local_to_global(x, placement, sbp, shape, sync_data, grad_sbp, *meta)
        for x, meta in zip(xs, metas, strict=True)
    ]


def _device_error(x: torch.Tensor, placement: Placement) -> SbpError | None:
    """What is wrong with the device of this rank's local tensor (ranks outside: nothing)."""
    me = env.get_rank()
    if me not in placement:
        return None
    if x.device.type != placement.type:
        return DeviceMismatchError(
            f"to_global: the local tensor is on {x.device} but the placement type is "
            f"{placement.type!r}; move it first (x.to({placement.type!r}))"
        )
    if placement.type == "cuda" and x.device != local_device("cuda"):
        return DeviceMismatchError(
            f"to_global: the local tensor is on {x.device}; a cuda placement keeps rank "
            f"{me}'s data on {local_device('cuda')} (cuda:LOCAL_RANK)"
        )
    return None


def _local_to_global(
    x: torch.Tensor,
    placement: Placement,
    sbp: Any,
    shape: Any,
    sync_data: bool,
    grad_sbp: Any,
    shapes: dict[int, tuple[int, ...]] | None,
    dtype: torch.dtype,
    bounds: tuple[int, int] | None,
) -> GlobalTensor:
    """The global tensor, once every rank's local shape is known (or trusted)."""
    me = env.get_rank()
    inside = me in placement
    if shapes is not None:
        ordered = tuple(shapes[r] for r in placement.flat_ranks)
        nd, logical = _agreed_layout(
            ordered, placement, normalize_nd_sbp(sbp, placement.ndim), shape
        )
    else:
        logical = shape if shape is not None else tuple(x.shape)
        nd = normalize_nd_sbp(sbp, placement.ndim, len(logical))
    spec = GlobalSpec(placement, nd, tuple(logical), dtype)
    if shapes is None and inside and tuple(x.shape) != spec.local_shape(me):
        raise MetaMismatchError(
            f"to_global: local shape {tuple(x.shape)} on rank {me} does not match shape="
            f"{spec.shape} with sbp {format_nd_sbp(nd)} (expected {spec.local_shape(me)})"
        )
    if inside:
        data = _sync_broadcast_dims(x, placement, nd) if sync_data else x
    else:
        data = empty_local(spec)
    grad_nd = grad_nd_sbp(spec, grad_sbp)
    if x.requires_grad and torch.is_grad_enabled():
        if data is not x:
            data = _Reattach.apply(x, data)
        return from_local(data, spec, grad_nd)
    out = GlobalTensor(data.detach(), spec)
    if bounds is not None:
        record_range(out, bounds)
    return out


def unsupported_kind(x: torch.Tensor) -> str | None:
    """What kind of tensor `x` is where global tensors cannot hold it, and the way out; None
    for a dense tensor. A global tensor is a dense tensor split by rows of its logical shape:
    a nested tensor has no one shape (torch's own error was 'NestedTensorImpl doesn't
    support sizes'), and a quantized one would be made global silently, its scale and zero
    point left out of every op's rule."""
    if x.is_nested:
        return (
            "a nested tensor (torch.nested); global tensors are dense: pass "
            "x.to_padded_tensor(0), or each of x.unbind() on its own"
        )
    if x.layout != torch.strided:
        return f"a {x.layout} tensor; global tensors are dense: pass x.to_dense()"
    if x.is_quantized:
        return (
            f"a quantized tensor ({x.dtype}); global tensors hold plain dtypes: pass "
            "x.dequantize(), and quantize the global result's local tensors if needed"
        )
    return None


def bad_input(x: Any, placement: Any, sbp: Any, shape: Any) -> SbpError | None:
    """What is wrong with this rank's arguments to `to_global`, found without communication."""
    if not isinstance(x, torch.Tensor):
        return InputTypeError(
            f"to_global: expected a torch.Tensor (or a dict/list/tuple of them), got "
            f"{type(x).__name__}; make it one first (torch.as_tensor(x))"
        )
    kind = unsupported_kind(x)
    if kind is not None:
        return InputTypeError(f"to_global: x is {kind}")
    if placement is None:
        return PlacementError(
            "to_global: a local tensor needs placement= (an sbp.placement, such as "
            "sbp.placement.all('cpu')); placement=None keeps a global tensor's own"
        )
    if not isinstance(placement, Placement):
        return PlacementError(f"to_global: placement must be an sbp.placement, got {placement!r}")
    if sbp is None:
        return SbpSignatureError(
            "to_global: a local tensor needs sbp= (sbp.split(d), sbp.broadcast or "
            "sbp.partial_sum); sbp=None keeps a global tensor's own"
        )
    try:
        placement.check_in_world(env.get_world_size())
        local_device(placement.type)  # a cuda placement with no GPU
        ndim = x.dim() if env.get_rank() in placement else None
        normalize_nd_sbp(sbp, placement.ndim, ndim)
        if shape is not None:
            check_shape(shape)
    except SbpError as e:
        return e
    return None


class _Reattach(torch.autograd.Function):
    """Use synced data in forward while the gradient still reaches the caller's tensor."""

    @staticmethod
    def forward(ctx, x, data):
        ctx.shape = x.shape
        return data.detach()

    @staticmethod
    def backward(ctx, grad):
        if grad.shape != ctx.shape:  # ranks outside the placement: nothing flows back
            grad = grad.new_zeros(ctx.shape)
        return grad, None


def to_global(obj: Any, placement: Placement | None = None, sbp: Any = None, **kwargs: Any) -> Any:
    """`sbp.to_global`: a tensor, a GlobalTensor (re-box), or nested dict/list/tuple of them.

    In a dict/list/tuple, leaves that are not tensors (ints, strings, None) pass through
    unchanged; anything else given alone (a numpy array, a number) is an `InputTypeError`
    on every rank.
    """
    unknown = sorted(set(kwargs) - LOCAL_OPTIONS)
    if unknown:
        raise InputTypeError(
            f"to_global: unknown keyword argument(s) {', '.join(unknown)}; it takes placement=, "
            "sbp=, shape=, sync_data=, check_meta= and grad_sbp= (a global tensor's re-box: "
            "shape= and grad_sbp=)"
        )
    if not isinstance(obj, (torch.Tensor, Mapping, list, tuple)):
        if placement is None or sbp is None:
            raise InputTypeError(f"to_global: expected a torch.Tensor, got {type(obj).__name__}")
        return local_to_global(obj, placement, sbp, **kwargs)
    return _tree_to_global(obj, placement, sbp, **kwargs)


LOCAL_OPTIONS = frozenset(("shape", "sync_data", "check_meta", "grad_sbp"))


def _tree_to_global(obj: Any, placement: Any, sbp: Any, **kwargs: Any) -> Any:
    def rebox(t: GlobalTensor) -> GlobalTensor:
        return t.to_global(placement, sbp, **kwargs)

    local = [t for t in _leaves(obj) if not isinstance(t, GlobalTensor)]
    if len(local) > 1 and placement is not None and sbp is not None:
        done = iter(locals_to_global(local, placement, sbp, **kwargs))  # one exchange
        return _rebuild(obj, rebox, lambda t: next(done))
    return _rebuild(obj, rebox, _one_to_global(placement, sbp, kwargs))


def _one_to_global(placement: Any, sbp: Any, kwargs: dict):
    def convert(t: torch.Tensor) -> GlobalTensor:
        # (a missing placement= or sbp= is `bad_input`'s: raised on every rank at once)
        return local_to_global(t, placement, sbp, **kwargs)

    return convert


def _leaves(obj: Any) -> list[torch.Tensor]:
    """The tensors of a nest of dicts, lists and tuples, in `_rebuild`'s order."""
    out: list[torch.Tensor] = []
    _rebuild(obj, out.append, out.append)
    return out


def _rebuild(obj: Any, on_global, on_local) -> Any:
    """The nest with each GlobalTensor replaced by `on_global(t)`, each tensor by `on_local(t)`."""
    if isinstance(obj, GlobalTensor):
        return on_global(obj)
    if isinstance(obj, torch.Tensor):
        return on_local(obj)
    if isinstance(obj, Mapping):
        return type(obj)((k, _rebuild(v, on_global, on_local)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_rebuild(v, on_global, on_local) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuild(v, on_global, on_local) for v in obj)
    return obj
