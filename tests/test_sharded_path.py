"""The sharded data-parallel path's mechanics (sbp/data_parallel/sharded/): the collectives
per step in ZeRO-3 and ZeRO-2, the order of gathers and reductions (prefetch, reductions
during backward), the units the policy picks, its options, and `sbp.nn.memory_report`.
Exactness against one process: tests/test_sharded_data_parallel.py."""

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sbp
from sbp.data_parallel.sharded.units import chosen

S0, B = sbp.split(0), sbp.broadcast


def _stack(width=16, depth=4):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 3)).double()


def _steps(reshard, steps=3, units=None, trace=False, shared_memory=True):
    """Train the stack sharded on this rank's placement; per step: the collectives by kind,
    the sharded path's events (if `trace`), and the loss minus one process's. Without
    `shared_memory`, the large collectives go through gloo (as between hosts)."""
    from sbp.comm import shm

    configured = shm.BIG_SLOT_BYTES
    shm.BIG_SLOT_BYTES = configured if shared_memory else 0
    try:
        return _train_steps(reshard, steps, units, trace)
    finally:
        shm.BIG_SLOT_BYTES = configured


def _train_steps(reshard, steps, units, trace):
    P = sbp.placement("cpu", list(range(sbp.env.get_world_size())))
    ref = _stack()
    model = copy.deepcopy(ref).to_global(P, S0)
    sbp.nn.data_parallel(model, reshard_after_forward=reshard, units=units)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (8,), generator=g)
        xg, yg = _global(x, y, P)
        sharding = sbp.nn.fast_path.state(model)._sharding
        if sharding is not None:
            sharding.trace = [] if trace else None
        with sbp.comm_stats() as stats:
            loss = F.cross_entropy(model(xg), yg)
            opt.zero_grad()
            loss.backward()
        opt.step()
        want = F.cross_entropy(ref(x), y)
        ref_opt.zero_grad()
        want.backward()
        ref_opt.step()
        events = list(sbp.nn.fast_path.state(model)._sharding.trace or [])
        out.append((dict(stats.by_kind), events, abs(loss.item() - want.item())))
    params = max(
        (p.full_tensor() - q).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    )
    return out, params, sbp.nn.fast_path.state(model).last_path


def _global(x, y, P):
    me = P.coord(sbp.env.get_rank())
    parts = [t[sbp.local_slices(t.shape, P, S0, me)] for t in (x, y)]
    return sbp.to_global(tuple(parts), P, S0)


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "gloo"])
@pytest.mark.parametrize("reshard", [True, False])
def test_collectives_per_step(pool2, reshard, shared_memory):
    """5 units (4 hidden layers and the head), after the first step (which checks the layout):
    ZeRO-3 gathers each unit in forward and again in backward those whose weights backward
    needs (the last too, freed after its forward as FSDP2 frees it; not the first, whose
    input needs no gradient); ZeRO-2 once;
    both reduce each unit's gradient once (through shared memory on one host; through gloo
    an all-to-all and a local sum, faster there than its reduce-scatter)."""
    for steps, params, path in pool2.run(_steps, reshard, 3, None, False, shared_memory):
        assert path == "sharded"
        assert params < 1e-12
        for kinds, _, gap in steps[1:]:
            assert gap < 1e-12
            gathers = 5 + 4 if reshard else 5
            reduction = "reduce_scatter" if shared_memory else "all_to_all"
            assert kinds == {"all_gather": gathers, reduction: 5}


def test_named_units_gather_together(pool2):
    """units=["0", "2"]: two units of one layer each, the rest (three layers) the root, gathered
    once for the call and kept for backward."""
    for steps, params, _ in pool2.run(_steps, True, 3, ["0", "2"]):
        assert params < 1e-12
        kinds = steps[-1][0]
        # root + 2 units forward; "2" again in backward (freed after its forward, though
        # last); not "0": the first layer's backward needs its input, not its weight
        assert kinds == {"all_gather": 4, "reduce_scatter": 3}


def test_prefetch_and_reductions_during_backward(pool2):
    """Through gloo, in forward, the next units' gathers are issued before the current unit's
    compute ends (its "freed" event); in backward, the previous unit's gather is issued before the current
    one's gradient is ready, and a unit's reduction starts before the last gradient is."""
    for steps, _, _ in pool2.run(_steps, True, 2, None, True, False):  # (through gloo)
        events = steps[-1][1]
        forward = events[: events.index(("grad", "8"))]
        assert forward.index(("gather", "2")) < forward.index(("freed", "0"))
        assert forward.index(("gather", "4")) < forward.index(("freed", "0"))
        backward = events[len(forward) :]
        assert backward.index(("gather", "4")) < backward.index(("grad", "6"))
        last_grad = max(i for i, e in enumerate(backward) if e[0] == "grad")
        assert backward.index(("reduce", "8")) < last_grad
        assert [e for e in backward if e[0] == "reduce"] == [
            ("reduce", n) for n in ("8", "6", "4", "2", "0")
        ]


def test_no_prefetch_through_shared_memory(pool2):
    """Through shared memory a gather completes when it starts: gathering ahead would only
    hold the unit longer, so each unit is gathered when it runs."""
    for steps, params, _ in pool2.run(_steps, True, 2, None, True):
        assert params < 1e-12
        events = steps[-1][1]
        gathers = [i for i, e in enumerate(events) if e[0] == "gather"]
        assert gathers
        for i in gathers:
            assert events[i + 1] == ("gathered", events[i][1])


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.norm = nn.LayerNorm(4)
        self.stages = nn.Sequential(nn.ReLU(), nn.Sequential(nn.Linear(4, 4)))


def test_unit_policy():
    """The children holding parameters of every container met from the root; without
    containers, the root's children with parameters."""
    assert chosen(_Model()) == ["blocks.0", "blocks.1", "stages.1"]
    assert chosen(_Block()) == ["fc"]
    assert chosen(_stack(depth=2)) == ["0", "2", "4"]


def _bad_option(kwargs):
    P = sbp.placement("cpu", [0, 1])
    model = _Model().to_global(P, S0)
    try:
        sbp.nn.data_parallel(model, **kwargs)
    except sbp.SbpError as e:
        return type(e).__name__, str(e)
    return "no error", ""


@pytest.mark.parametrize(
    "kwargs, error, named",
    [
        ({"reshard_after_forward": "yes"}, "InputTypeError", "reshard_after_forward"),
        ({"units": "blocks.0"}, "InputTypeError", "units"),
        ({"units": ["blocks.9"]}, "InputValueError", "'blocks.9'"),
        ({"units": ["stages", "stages.1"]}, "InputValueError", "'stages.1' lies inside 'stages'"),
        ({"units": ["blocks"]}, "InputValueError", "'blocks', a ModuleList with no forward"),
    ],
)
def test_bad_options_raise_on_every_rank(pool2, kwargs, error, named):
    for kind, message in pool2.run(_bad_option, kwargs):
        assert kind == error
        assert named in message


def _memory(reshard):
    P = sbp.placement("cpu", [0, 1])
    report = {}
    for name, nd in (("sharded", S0), ("broadcast", B)):
        model = _stack(width=32).to_global(P, nd)
        if nd == S0:
            sbp.nn.data_parallel(model, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(model.parameters())
        x, y = _global(torch.randn(8, 32, dtype=torch.float64), torch.zeros(8, dtype=torch.long), P)
        for _ in range(2):
            F.cross_entropy(model(x), y).backward()
            opt.step()
        report[name] = sbp.nn.memory_report(model, opt)
    return report


@pytest.mark.parametrize("reshard", [True, False])
def test_memory_report(pool2, reshard):
    """Parameters, gradients and AdamW's two moments take half the broadcast model's bytes
    per rank (the head's 3 rows split 2 + 1); the gathered parameters' peak is at most the
    whole model (ZeRO-2) and below it with ZeRO-3; none are left alive after backward."""
    whole = (4 * (32 * 32 + 32) + 3 * 32 + 3) * 8
    for report in pool2.run(_memory, reshard):
        sharded, broadcast = report["sharded"], report["broadcast"]
        assert broadcast["parameters"] == broadcast["gradients"] == whole
        assert broadcast["optimizer_state"] >= 2 * whole
        # (the hidden layers' 16 rows each, and 2 or 1 of the head's 3)
        assert sharded["parameters"] in (8 * (4 * 16 * 33 + 2 * 33), 8 * (4 * 16 * 33 + 33))
        assert 0.45 < sharded["total"] / broadcast["total"] < 0.55
        assert sharded["gathered_now"] == 0
        assert broadcast["gathered_peak"] == 0
        if reshard:
            assert 0 < sharded["gathered_peak"] < whole
        else:
            assert sharded["gathered_peak"] == whole


def _diverging(option):
    """One rank with another sharding setting than the other's."""
    P = sbp.placement("cpu", [0, 1])
    model = _stack().to_global(P, S0)
    first = sbp.env.get_rank() == 0
    if option == "reshard":
        sbp.nn.data_parallel(model, reshard_after_forward=first)
    else:
        sbp.nn.data_parallel(model, units=["0", "2"] if first else "auto")
    x, y = _global(torch.randn(8, 16, dtype=torch.float64), torch.zeros(8, dtype=torch.long), P)
    start = time.monotonic()
    try:
        for _ in range(3):
            F.cross_entropy(model(x), y).backward()
    except sbp.MetaMismatchError as e:
        return str(e), time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.parametrize("option", ["reshard", "units"])
def test_ranks_with_other_sharding_settings_raise_on_every_rank(pool2, option):
    """ZeRO-3 on one rank and ZeRO-2 on the other (or other units) run other collectives:
    named on every rank at the first that differs, well within the timeout."""
    for message, took in pool2.run(_diverging, option):
        assert "collectives out of step" in message
        assert took < 30
