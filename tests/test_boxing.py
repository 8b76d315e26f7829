"""Boxing on 4 ranks: every conversion preserves the logical value exactly, gradients match the
single-process reference, plans count the bytes really sent, and bad input fails on every rank."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sbp
from sbp.testing.strategies import nd_sbps, placements, shapes

S0, S1, B = sbp.split(0), sbp.split(1), sbp.broadcast

# ---------------------------------------------------------------- reference, run on each rank


def logical_value(shape, seed, dtype=torch.float32):
    """Integer-valued data so partial sums are exact in float."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, tuple(shape), generator=g).to(dtype)


def reference_local(value, P, nd_sbp, coord, seed):
    """This coordinate's local tensor, built top-down: the logical value reduces the last
    hierarchy dim first, so each level's rule turns the parent's value into the child's."""
    for h, s in enumerate(nd_sbp):
        n, c = P.hierarchy[h], coord[h]
        if s.is_split:
            start = sum(_balanced(value.shape[s.dim], n)[:c])
            value = value.narrow(s.dim, start, _balanced(value.shape[s.dim], n)[c])
        elif s.is_partial:
            g = torch.Generator().manual_seed(hash((seed, h, coord[:h])) % 2**31)
            noise = [
                torch.randint(0, 4, value.shape, generator=g).to(value.dtype) for _ in range(n)
            ]
            if s.op == "sum":
                value = value - sum(noise[1:]) if c == 0 else noise[c]
            elif s.op == "max":
                value = value if c == 0 else value - noise[c]
            else:
                value = value if c == 0 else value + noise[c]
    return value.contiguous()


def _balanced(d, n):
    return [d // n + (1 if i < d % n else 0) for i in range(n)]


def _place(value, P, nd, seed):
    me = sbp.env.get_rank()
    if me in P:
        return reference_local(value, P, nd, P.coord(me), seed)
    return torch.empty(0, dtype=value.dtype)


def _convert(shape, src_p, src_nd, dst_p, dst_nd, seed):
    me = sbp.env.get_rank()
    value = logical_value(shape, seed)
    g = sbp.to_global(
        _place(value, src_p, src_nd, seed),
        src_p,
        src_nd,
        shape=shape,
        check_meta=False,
        sync_data=False,
    )
    plan = sbp.boxing.plan(g, dst_p, dst_nd)
    with sbp.comm_stats() as st:
        h = g.to_global(dst_p, dst_nd)
    out = {"sent": st.bytes, "planned": plan.bytes_sent(me), "shape": tuple(h.shape)}
    if me in dst_p:
        out["full_ok"] = torch.equal(h.full_tensor(), value)
        if not any(s.is_partial for s in h.sbp):
            expected = reference_local(value, dst_p, h.sbp, dst_p.coord(me), seed)
            out["local_ok"] = torch.equal(h.to_local(), expected)
    else:
        out["empty"] = h.to_local().numel() == 0
    return out


def _check_results(results, shape):
    for rank, r in enumerate(results):
        assert r["shape"] == tuple(shape)
        assert r["sent"] == r["planned"], (
            f"rank {rank} sent {r['sent']} B, plan said {r['planned']}"
        )
        assert r.get("full_ok", True), f"rank {rank}: logical value changed"
        assert r.get("local_ok", True), f"rank {rank}: local tensor is not its slice"
        assert r.get("empty", True)


@st.composite
def conversions(draw, same_placement=False):
    shape = draw(shapes(min_dims=0, max_dims=3, max_side=7))
    src_p = draw(placements(world_size=4))
    dst_p = src_p if same_placement else draw(placements(world_size=4))
    src_nd = draw(nd_sbps(src_p.ndim, len(shape)))
    dst_nd = draw(nd_sbps(dst_p.ndim, len(shape)))
    return shape, src_p, src_nd, dst_p, dst_nd, draw(st.integers(0, 2**20))


@settings(max_examples=250)
@given(conversions(same_placement=True))
def test_same_placement_conversion_preserves_value(pool4, case):
    _check_results(pool4.run(_convert, *case), case[0])


@settings(max_examples=250)
@given(conversions())
def test_any_placement_conversion_preserves_value(pool4, case):
    _check_results(pool4.run(_convert, *case), case[0])


# ---------------------------------------------------------------- gradients


def _grad(shape, src_p, src_nd, dst_p, dst_nd, seed):
    """loss = <y, W> over the logical y = to_global(x); d loss / d x must be W in x's grad sbp."""
    me = sbp.env.get_rank()
    value = logical_value(shape, seed)
    weight = logical_value(shape, seed + 1)
    x = _place(value, src_p, src_nd, seed).requires_grad_()
    g = sbp.to_global(x, src_p, src_nd, shape=shape, check_meta=False, sync_data=False)
    h = g.to_global(dst_p, dst_nd)
    w_local = _place(weight, dst_p, dst_nd, 0)
    (h.to_local() * w_local).sum().backward()
    if me not in src_p:
        return True
    grad_nd = tuple(sbp.broadcast if s.is_partial else s for s in g.sbp)
    expected = reference_local(weight, src_p, grad_nd, src_p.coord(me), 0)
    return torch.equal(x.grad, expected)


@settings(max_examples=120)
@given(
    conversions().filter(lambda c: not any(s.is_partial for s in c[4]))  # dst grads need no partial
)
def test_gradient_of_to_global_matches_reference(pool4, case):
    assert all(pool4.run(_grad, *case))


def _grad_sbp_override():
    P = sbp.placement("cpu", [0, 1, 2, 3])
    x = torch.ones(4, 3, requires_grad=True)
    g = sbp.to_global(x, P, sbp.broadcast, grad_sbp=sbp.partial_sum, check_meta=False)
    (g.to_global(sbp=sbp.split(0)).to_local() * 2).sum().backward()
    # the logical gradient is all 2s; as partial_sum it is held by the first rank only
    return x.grad.tolist()


def test_grad_sbp_overrides_the_gradient_signature(pool4):
    grads = pool4.run(_grad_sbp_override)
    total = sum(torch.tensor(g) for g in grads)
    assert torch.equal(total, torch.full((4, 3), 2.0))
    assert grads[0] == [[2.0] * 3] * 4 and grads[1] == [[0.0] * 3] * 4


# ---------------------------------------------------------------- communication


COMM_CASES = [
    (sbp.broadcast, sbp.split(0), {}),
    (sbp.broadcast, sbp.split(1), {}),
    (sbp.split(0), sbp.partial_sum, {}),
    (sbp.broadcast, sbp.partial_sum, {}),
    (sbp.broadcast, sbp.partial_max, {}),
    (sbp.split(0), sbp.broadcast, {"all_gather": 1}),
    (sbp.split(1), sbp.broadcast, {"all_gather": 1}),
    (sbp.partial_sum, sbp.broadcast, {"all_reduce": 1}),
    (sbp.partial_max, sbp.broadcast, {"all_reduce": 1}),
    (sbp.split(0), sbp.split(1), {"all_to_all": 1}),
    (sbp.split(1), sbp.split(0), {"all_to_all": 1}),
    (sbp.partial_sum, sbp.split(0), {"all_to_all": 1}),
]


def _count(src, dst, shape):
    P = sbp.placement("cpu", [0, 1, 2, 3])
    value = logical_value(shape, 3)
    g = sbp.to_global(_place(value, P, (src,), 3), P, src, shape=shape, check_meta=False)
    plan = sbp.boxing.plan(g, sbp=dst)
    with sbp.comm_stats() as st:
        h = g.to_global(sbp=dst)
    return (
        dict(st.by_kind),
        st.bytes,
        plan.bytes_sent(sbp.env.get_rank()),
        torch.equal(h.full_tensor(), value),
    )


@pytest.mark.parametrize("shape", [(8, 12), (7, 5)], ids=["even", "uneven"])
@pytest.mark.parametrize(
    "src, dst, kinds", COMM_CASES, ids=lambda v: repr(v) if not isinstance(v, dict) else ""
)
def test_conversions_run_exactly_their_primitive(pool4, src, dst, kinds, shape):
    for by_kind, sent, planned, ok in pool4.run(_count, src, dst, shape):
        assert by_kind == kinds
        assert sent == planned
        assert ok


def test_plan_prints_steps_collectives_and_bytes():
    P = sbp.placement("cpu", [[0, 1], [2, 3]])
    spec = sbp.layout.GlobalSpec(P, (sbp.split(0), sbp.partial_sum), (8, 4), torch.float32)
    dst = spec._replace(nd_sbp=(sbp.broadcast, sbp.broadcast))
    text = str(sbp.boxing.plan_specs(spec, dst))
    assert "hierarchy dim 1: P -> B" in text and "all_reduce" in text
    assert "hierarchy dim 0: S(0) -> B" in text and "all_gather" in text
    assert "bytes sent/received per rank: 0:" in text


def test_nd_plan_is_never_worse_than_through_broadcast():
    """(S(0), S(0)) -> (S(1), S(1)): the planner's route must not cost more than gathering
    everything and slicing."""
    from sbp.boxing.planner import plan_specs

    P = sbp.placement("cpu", [[0, 1], [2, 3]])
    S0, S1, B = sbp.split(0), sbp.split(1), sbp.broadcast
    for src_nd, dst_nd in [
        ((S0, S0), (S1, S1)),
        ((S0, S1), (S1, S0)),
        ((sbp.partial_sum, S0), (S0, B)),
    ]:
        src = sbp.layout.GlobalSpec(P, src_nd, (16, 16), torch.float32)
        direct = plan_specs(src, src._replace(nd_sbp=dst_nd))
        to_b = plan_specs(src, src._replace(nd_sbp=(B, B)))
        assert direct.cost <= to_b.cost
        assert all(s.collective != "all_reduce" for s in direct.steps) or src_nd[0].is_partial


# ---------------------------------------------------------------- local -> global


def _infer_split_shape():
    me = sbp.env.get_rank()
    P = sbp.placement("cpu", [0, 1, 2])
    value = torch.arange(7 * 3.0).reshape(7, 3)
    local = value[sbp.local_slices(value.shape, P, sbp.split(0), me)] if me in P else torch.empty(0)
    g = sbp.to_global(local, P, sbp.split(0))
    return tuple(g.shape), (torch.equal(g.full_tensor(), value) if me in P else None)


def test_split_shape_is_inferred_from_uneven_shards_on_every_rank(pool4):
    for rank, (shape, ok) in enumerate(pool4.run(_infer_split_shape)):
        assert shape == (7, 3)
        assert ok is (None if rank == 3 else True)


def _broadcast_syncs_first_rank():
    me = sbp.env.get_rank()
    P = sbp.placement("cpu", [2, 0, 1, 3])
    g = sbp.to_global(torch.full((2,), float(me)), P, sbp.broadcast)
    return g.to_local().tolist()


def test_broadcast_takes_the_placements_first_rank(pool4):
    assert pool4.run(_broadcast_syncs_first_rank) == [[2.0, 2.0]] * 4


def _mismatch(kind):
    me = sbp.env.get_rank()
    P = sbp.placement("cpu", [0, 1, 2, 3])
    x, s, place = torch.zeros(2, 3), sbp.split(0), P
    if kind == "dtype" and me == 1:
        x = x.double()
    if kind == "sbp" and me == 2:
        s = sbp.broadcast
    if kind == "placement" and me == 3:
        place = sbp.placement("cpu", [3, 2, 1, 0])
    if kind == "shape" and me == 0:
        x = torch.zeros(2, 4)
    if kind == "unbalanced" and me == 0:
        x = torch.zeros(1, 3)
    try:
        sbp.to_global(x, place, s)
    except sbp.MetaMismatchError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "kind, words",
    [
        ("dtype", "dtype differs"),
        ("sbp", "sbp differs"),
        ("placement", "placement differs"),
        ("shape", "not the balanced split"),
        ("unbalanced", "not the balanced split"),
    ],
)
def test_meta_mismatch_raises_on_every_rank(pool4, kind, words):
    for msg in pool4.run(_mismatch, kind):
        assert words in msg


def _bad_input(kind):
    P = sbp.placement("cpu", [0, 1])
    x = torch.zeros(4, 2)
    try:
        if kind == "split dim":
            sbp.to_global(x, P, sbp.split(2))
        elif kind == "nd length":
            sbp.to_global(x, P, (sbp.split(0), sbp.broadcast))
        elif kind == "world":
            sbp.to_global(x, sbp.placement("cpu", [0, 7]), sbp.broadcast)
        elif kind == "device":
            sbp.to_global(x, sbp.placement("cuda", [0, 1]), sbp.broadcast)
        elif kind == "mixed":
            g = sbp.to_global(x, P, sbp.broadcast)
            g + torch.ones(4, 2)
    except sbp.SbpError as e:
        return type(e).__name__, str(e)
    return None, "no error"


@pytest.mark.parametrize(
    "kind, error, words",
    [
        ("split dim", "SbpSignatureError", "split dim 2"),
        ("nd length", "SbpSignatureError", "hierarchy has 1"),
        ("world", "PlacementError", "outside the world"),
        ("device", "DeviceMismatchError", "placement type is 'cuda'"),
        ("mixed", "PlacementError", "local torch.Tensor"),
    ],
)
def test_bad_input_raises_its_error_on_every_rank(pool4, kind, error, words):
    for name, msg in pool4.run(_bad_input, kind, timeout=60):
        assert name == error, msg
        assert words in msg


def test_disjoint_moves_spread_over_rank_pairs():
    """B on [0, 1] -> B on [2, 3]: each source sends one copy; no rank funnels the data."""
    from sbp.boxing.planner import plan_specs

    src = sbp.layout.GlobalSpec(sbp.placement("cpu", [0, 1]), (B,), (64, 8), torch.float32)
    dst = src._replace(placement=sbp.placement("cpu", [2, 3]))
    plan = plan_specs(src, dst)
    assert plan.collectives == ["send/recv"]
    full = 64 * 8 * 4
    assert [plan.bytes_sent(r) for r in range(4)] == [full, full, 0, 0]
    assert [plan.bytes_received(r) for r in range(4)] == [0, 0, full, full]
    # S(0) on [0, 1, 2, 3] -> S(1) on [3, 2]: every source sends only what each target lacks
    src = sbp.layout.GlobalSpec(sbp.placement("cpu", [0, 1, 2, 3]), (S0,), (8, 8), torch.float32)
    plan = plan_specs(src, src._replace(placement=sbp.placement("cpu", [3, 2]), nd_sbp=(S1,)))
    assert max(plan.bytes_sent(r) for r in range(4)) == 2 * (2 * 4 * 4)  # a (2, 4) piece per target


def _partner_never_comes():
    if sbp.env.get_rank() == 0:
        try:
            sbp.to_global(torch.ones(2), sbp.placement("cpu", [0, 1]), sbp.split(0))
        except sbp.CommTimeoutError as e:
            return "timeout: " + str(e)[:60]
        return "no error"
    return "stayed away"


def test_to_global_with_a_missing_partner_times_out_cleanly():
    from sbp.testing import SpmdPool

    pool = SpmdPool(2, timeout=60, comm_timeout=2.0)
    try:
        first, second = pool.run(_partner_never_comes)
        assert first.startswith("timeout: all_gather over ranks [0, 1]") and second == "stayed away"
    finally:
        pool.close()
