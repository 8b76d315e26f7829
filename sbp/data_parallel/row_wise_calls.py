"""Library functions that build a row-wise result of the batch, which the data-parallel
check lets through unjudged (sbp.data_parallel).

Some functions look at the whole batch's values only to pick a faster form of a result
whose rows each depend on their own sample: transformers skips an attention mask where
there is no padding. Run on a shard, they give that shard's rows exactly, in either form,
so the fast path's local run may call them on its shard, and its checking pass must not
fail them for the sums and `.all()` that mix samples.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator

from torch.utils._pytree import tree_flatten, tree_unflatten

from sbp.data_parallel.names_replaced import NamesReplaced
from sbp.ops import registry
from sbp.signature import is_all_broadcast
from sbp.tensor import GlobalTensor

# Functions of known libraries that build a row-wise result of the batch (each sample's
# rows from that sample's values alone) and may look at the batch's values to pick a faster
# form: transformers' attention masks (skipped where there is no padding, for sdpa's
# is_causal or flash attention). Run on a shard they give its rows exactly, so the checking
# pass does not judge the ops inside them (an index by `arange(batch_size)`, a sum over the
# batch, `.all()`), and the broadcast tensors they return with the batch's leading size are
# taken as laid out as the batch; the local run calls them on its shard. A check that only
# warns (transformers looks for pad tokens when no attention mask is given) is one too: it
# returns nothing. (module, qualname)
ROW_WISE = (
    ("transformers.masking_utils", "sdpa_mask"),
    ("transformers.masking_utils", "eager_mask"),
    ("transformers.masking_utils", "flash_attention_mask"),
    ("transformers.masking_utils", "_ignore_causal_mask_sdpa"),
    ("transformers.masking_utils", "_ignore_bidirectional_mask_sdpa"),
    ("transformers.modeling_attn_mask_utils", "AttentionMaskConverter._ignore_causal_mask_sdpa"),
    ("transformers.modeling_utils", "PreTrainedModel.warn_if_padding_and_no_attention_mask"),
)
# where transformers looks its mask functions up by the attention's name
_MASK_REGISTRY = ("transformers.masking_utils", "ALL_MASK_ATTENTION_FUNCTIONS")


_THIS_THREAD = threading.local()  # this thread's (check, logical batch size) while it checks


def _as_checked(f: Callable) -> Callable:
    """`f` as the checking pass of this thread calls it: unwatched, its broadcast results
    with as many rows as the batch, or as an argument laid out as the batch, laid out as
    the batch; as it is for any other caller."""

    @functools.wraps(f)
    def call(*args, **kwargs):
        current = getattr(_THIS_THREAD, "check", None)
        if current is None or current[0] not in registry.observers:
            return f(*args, **kwargs)
        check, batch = current
        rows = {batch} | {  # (a batch reshaped: `(B, choices, L)` as `(B * choices, L)`)
            a.shape[0]
            for a in tree_flatten((args, kwargs))[0]
            if isinstance(a, GlobalTensor) and a.dim() and tuple(a.sbp) == check.data_nd
        }
        registry.observers.remove(check)
        try:
            leaves, tree = tree_flatten(f(*args, **kwargs))
            for k, leaf in enumerate(leaves):
                if isinstance(leaf, GlobalTensor) and leaf.dim() and leaf.shape[0] in rows:
                    if is_all_broadcast(leaf.sbp):
                        leaves[k] = leaf.to_global(sbp=check.data_nd)
            return tree_unflatten(leaves, tree)
        finally:
            registry.observers.append(check)

    return call


def _install() -> list:
    """Replace the ROW_WISE functions of the libraries already imported by `_as_checked`,
    in their modules and in transformers' table of mask functions."""
    saved, wrapped = [], {}
    for module_name, qualname in ROW_WISE:
        owner = sys.modules.get(module_name)
        *path, name = qualname.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        raw = None if owner is None else owner.__dict__.get(name)
        if raw is None:
            continue
        f = raw.__func__ if isinstance(raw, staticmethod) else raw
        wrapped[f] = _as_checked(f)
        setattr(owner, name, staticmethod(wrapped[f]) if f is not raw else wrapped[f])
        saved.append((owner, name, raw))
    masks = getattr(sys.modules.get(_MASK_REGISTRY[0]), _MASK_REGISTRY[1], None)
    table = getattr(masks, "_global_mapping", None)
    for key, f in list((table or {}).items()):
        if f in wrapped:
            table[key] = wrapped[f]
            saved.append((table, key, f))
    return saved


_REPLACED = NamesReplaced(_install)


@contextlib.contextmanager
def unjudged(check, batch: int | None) -> Iterator[None]:
    """For the checking pass: the ROW_WISE functions run unjudged in this thread (their
    batch-sized results laid out as the batch: `batch` is its logical size). They stay
    replaced while any thread checks."""
    outer = getattr(_THIS_THREAD, "check", None)
    _THIS_THREAD.check = (check, batch)
    try:
        with _REPLACED.held():
            yield
    finally:
        _THIS_THREAD.check = outer
