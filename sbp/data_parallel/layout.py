"""What the checking pass found for one input layout (`Layout`), and the spec a gradient
enters the local graph with (`_share_spec`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sbp.layout import GlobalSpec
from sbp.signature import broadcast, partial_sum


@dataclass
class Layout:
    """What the checking pass found for one input layout."""

    ok: bool
    reason: str = ""
    out_specs: list = field(default_factory=list)  # GlobalSpec or a plain value, per output leaf
    bn_counts: list[int] = field(default_factory=list)  # logical count of each train-mode BN
    dropouts: int = 0  # random draws of dropout
    by_name_dropouts: int = 0  # of them, in attention called by name (`_by_name_replaced`)
    losses: int = 0  # cross-entropy (or nll) losses of the batch inside the forward
    # Every BatchNorm and dropout call came from a BatchNorm or Dropout module, or from an
    # attention called through `torch.nn.functional`'s attribute, and every loss through
    # those attributes: the local run then intercepts them there only (a mode over the
    # whole forward costs ~5% of a mobilenet_v2 forward, ~20% of a small GPT-2's)
    in_modules: bool = True
    # (the module input's position, or keyword, and the limit an op checked it against):
    # index tensors of embeddings and gathers that are inputs (`sbp.ops.registry.IndexLimit`)
    index_inputs: list = field(default_factory=list)
    # per output leaf on this rank, found at the first local run: (rank, [(local shape, the
    # gradient's spec) or None for a plain value]); the layout's inputs fix data_nd
    exits: tuple | None = None
    # a rank's part of the batch is empty (fewer samples than parts): its local forward runs
    # eagerly, as Inductor's convolution backward fails on an empty batch (torch 2.14)
    empty_part: bool = False
    tried: bool = False  # a local run of it completed (`DataParallel._first_local_run`)
    # the checking pass's outputs' local tensors and the buffers it left, until then
    expected: tuple | None = None

    def exits_on(self, rank: int, data_nd: tuple) -> list:
        """Each global output's local shape on `rank` and the spec its gradient comes in."""
        if self.exits is None or self.exits[0] != rank:
            self.exits = (
                rank,
                [
                    (s.local_shape(rank), _share_spec(s, data_nd))
                    if isinstance(s, GlobalSpec)
                    else None
                    for s in self.out_specs
                ],
            )
        return self.exits[1]


def _share_spec(spec: GlobalSpec, data_nd: tuple) -> GlobalSpec:
    """How a gradient enters the local graph at a tensor laid out as `spec`: this rank's
    share. A broadcast value's gradient as a partial sum on the hierarchy dims the batch
    splits; a partial sum's (the batch's loss) whole, as each rank's part counts fully."""
    nd = tuple(
        partial_sum if d.is_split and s.is_broadcast else broadcast if s.is_partial else s
        for s, d in zip(spec.nd_sbp, data_nd, strict=True)
    )
    return spec._replace(nd_sbp=nd)
