"""Optimizer steps on the locals of broadcast global parameters (sbp.optim_step).

Every test trains the same float64 model with plain torch and with global tensors in one
process (a world of one: a broadcast local is the whole tensor, as on every rank of a
bigger world) and compares parameters and optimizer state; it also checks that the
steps after the first really ran on the locals (or, where they must not, did not).
"""

import copy
import warnings

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import sbp
from sbp import optim_step

B = sbp.broadcast
P1 = sbp.placement("cpu", [0])


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(5, 7)
        self.b = torch.nn.Linear(7, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "sgd-foreach-off": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=False),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
    # (their first step, on the global tensors, meets 0-dim local tensors: ASGD's eta and
    # mu, the step sizes Rprop picks with torch.where)
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
    "rprop-foreach": lambda ps: torch.optim.Rprop(ps, lr=1e-2, foreach=True),
    # (explicit foreach: torch's two ASGD loops differ by ~1e-10 in float64)
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=1, foreach=False),
    "asgd-foreach": lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=1, foreach=True),
    # (a tensor lr, torch's recipe for compiled steps: its foreach step refuses one)
    "adamw-tensor-lr": lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-2)),
}


def _batches(steps=4):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(6, 5, generator=g, dtype=torch.float64) for _ in range(steps)]


def _models():
    torch.manual_seed(0)
    plain = Net().double()
    glob = copy.deepcopy(plain).to_global(P1, B)
    return plain, glob


def _pair(name):
    """The plain and the global model, each with its optimizer `name`."""
    plain, glob = _models()
    return plain, glob, OPTIMIZERS[name](plain.parameters()), OPTIMIZERS[name](glob.parameters())


def _loss(model, x):
    if any(p.is_global for p in model.parameters()):
        x = sbp.to_global(x, P1, sbp.split(0))
    return model(x).square().mean()


@pytest.fixture
def swaps(monkeypatch):
    """How many steps ran on the locals."""
    made = []
    make = optim_step._Swap.make

    def counting(optimizer):
        swap = make(optimizer)
        made.append(swap is not None)
        return swap

    monkeypatch.setattr(optim_step._Swap, "make", staticmethod(counting))
    return made


def _train(model, opt, batches, between=None):
    for i, x in enumerate(batches):
        opt.zero_grad()
        _loss(model, x).backward()
        if between is not None:
            between(i)
        opt.step()


def _assert_same(plain, glob, popt, gopt):
    for p, g in zip(plain.parameters(), glob.parameters(), strict=True):
        torch.testing.assert_close(g.full_tensor(), p.detach(), rtol=1e-12, atol=1e-12)
    for p, g in zip(plain.parameters(), glob.parameters(), strict=True):
        want, got = popt.state[p], gopt.state[g]
        assert set(want) == set(got)
        for k, v in want.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                assert type(got[k]) is sbp.GlobalTensor and tuple(got[k].sbp) == (B,)
                torch.testing.assert_close(got[k].full_tensor(), v, rtol=1e-12, atol=1e-12)
            else:
                assert float(got[k]) == float(v)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_steps_on_locals_equal_plain_torch(name, swaps):
    plain, glob, popt, gopt = _pair(name)
    batches = _batches()
    _train(plain, popt, batches)
    _train(glob, gopt, batches)
    assert swaps == [True] * (len(batches) - 1)  # the first step creates the state
    _assert_same(plain, glob, popt, gopt)
    assert all(type(p) is sbp.GlobalTensor for g in gopt.param_groups for p in g["params"])
    assert all(p._local.grad is None for p in glob.parameters())
    assert gopt.param_groups[0].get("foreach") == popt.param_groups[0].get("foreach")


def test_lr_schedulers_made_before_and_after_the_first_step(swaps):
    plain, glob, popt, gopt = _pair("sgd")
    psched = torch.optim.lr_scheduler.StepLR(popt, step_size=1, gamma=0.5)
    gsched = torch.optim.lr_scheduler.StepLR(gopt, step_size=1, gamma=0.5)
    batches = _batches()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for model, opt, sched in ((plain, popt, psched), (glob, gopt, gsched)):
            _train(model, opt, batches[:2], between=None)
            sched.step()
            late = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)  # made after install
            _train(model, opt, batches[2:])
            late.step()
            sched.step()
    assert gopt.param_groups[0]["lr"] == popt.param_groups[0]["lr"]
    assert swaps == [True] * 3
    _assert_same(plain, glob, popt, gopt)


def test_a_step_that_raises_puts_everything_back(swaps):
    plain, glob, popt, gopt = _pair("adamw")
    batches = _batches(3)
    _train(plain, popt, batches[:2])
    _train(glob, gopt, batches[:2])
    fail = [True]

    def hook(optimizer, args, kwargs):
        if fail[0]:
            raise RuntimeError("step refused")

    handle = gopt.register_step_pre_hook(hook)
    gopt.zero_grad()
    _loss(glob, batches[2]).backward()
    with pytest.raises(RuntimeError, match="step refused"):
        gopt.step()
    assert all(type(p) is sbp.GlobalTensor for p in gopt.param_groups[0]["params"])
    assert all(type(k) is sbp.GlobalTensor for k in gopt.state)
    assert gopt.param_groups[0]["foreach"] is None
    fail[0] = False
    handle.remove()
    gopt.step()  # the same gradients, stepped now
    popt.zero_grad()
    _loss(plain, batches[2]).backward()
    popt.step()
    _assert_same(plain, glob, popt, gopt)


class _SGDOfItsOwn(torch.optim.SGD):
    """A subclass may compute otherwise: not taken as elementwise."""


def test_steps_that_stay_global(swaps):
    """A closure (it runs backward) and a group with a parameter that is not broadcast,
    for an optimizer not known to be elementwise, step on the global tensors, and still
    equal plain torch. (Split parameters of elementwise optimizers step on their locals:
    test_optim_step_split.py.)"""
    plain, glob = _models()
    glob.b.weight = torch.nn.Parameter(glob.b.weight.to_global(sbp=sbp.split(0)))
    popt = _SGDOfItsOwn(plain.parameters(), lr=0.05, momentum=0.9)
    gopt = _SGDOfItsOwn(glob.parameters(), lr=0.05, momentum=0.9)
    batches = _batches(3)
    _train(plain, popt, batches)
    _train(glob, gopt, batches)
    assert swaps == [False, False]

    plain, glob, popt, gopt = _pair("sgd")
    swaps.clear()
    for model, opt in ((plain, popt), (glob, gopt)):
        for x in batches:

            def closure(model=model, opt=opt, x=x):
                opt.zero_grad()
                loss = _loss(model, x)
                loss.backward()
                return loss

            opt.step(closure)
    assert swaps == []  # (a closure never swaps)
    _assert_same(plain, glob, popt, gopt)


def test_state_dict_after_local_steps_loads_into_a_fresh_optimizer(swaps):
    plain, glob, popt, gopt = _pair("adamw")
    batches = _batches(4)
    _train(plain, popt, batches[:2])
    _train(glob, gopt, batches[:2])
    fresh = OPTIMIZERS["adamw"](glob.parameters())
    fresh.load_state_dict(gopt.state_dict())
    _train(plain, popt, batches[2:])
    _train(glob, fresh, batches[2:])
    # the second step of each (an optimizer's first step installs the local one)
    assert swaps == [True, True]
    _assert_same(plain, glob, popt, fresh)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_state_made_during_a_local_step_is_kept(name, swaps):
    """A group unfrozen after some steps gets its state in a step on the locals (whose
    other group already has state): it stays, global where the per-op path makes it so."""
    plain, glob = _models()

    def groups(m):
        return [{"params": m.a.parameters()}, {"params": m.b.parameters(), "lr": 0.02}]

    popt, gopt = OPTIMIZERS[name](groups(plain)), OPTIMIZERS[name](groups(glob))
    batches = _batches(5)
    for model, opt in ((plain, popt), (glob, gopt)):

        def unfreeze(i, model=model):
            return [p.requires_grad_(i >= 2) for p in model.b.parameters()]

        for i, x in enumerate(batches):
            unfreeze(i)
            opt.zero_grad()
            _loss(model, x).backward()
            opt.step()
    assert swaps == [True] * 4
    _assert_same(plain, glob, popt, gopt)
    assert all(type(k) is sbp.GlobalTensor for k in gopt.state)


def test_sgd_without_momentum_steps_on_locals(swaps):
    """(It keeps no state at all.)"""
    plain, glob = _models()
    popt = torch.optim.SGD(plain.parameters(), lr=0.1)
    gopt = torch.optim.SGD(glob.parameters(), lr=0.1)
    batches = _batches()
    _train(plain, popt, batches)
    _train(glob, gopt, batches)
    assert swaps == [True] * 3 and len(gopt.state) == 0
    _assert_same(plain, glob, popt, gopt)


def test_gradients_a_step_hook_changes_reach_the_parameters(swaps):
    """A post-hook that zeroes the gradients (set to None) on the locals drops the
    parameters' gradients too, so the next backward does not add to stale ones."""
    plain, glob, popt, gopt = _pair("sgd")
    for opt in (popt, gopt):
        opt.register_step_post_hook(lambda o, args, kwargs: o.zero_grad())
    for model, opt in ((plain, popt), (glob, gopt)):
        for x in _batches():
            _loss(model, x).backward()  # no zero_grad here: the hook does it
            opt.step()
    assert swaps == [True] * 3
    assert all(p.grad is None for p in glob.parameters())
    _assert_same(plain, glob, popt, gopt)


def _unrolled_meta_gradient(glob: bool) -> torch.Tensor:
    """Three differentiable SGD steps of a non-leaf parameter, differentiated through."""
    torch.manual_seed(0)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    leaf = w.to_global(P1, B) if glob else w
    p = leaf * 1.0
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, differentiable=True)
    for _ in range(3):
        (grad,) = torch.autograd.grad((p * p).sum(), p, create_graph=True)
        p.grad = grad
        opt.step()
    meta = p.full_tensor().sum() if glob else p.sum()
    (got,) = torch.autograd.grad(meta, leaf)
    return got.full_tensor() if glob else got


def test_a_differentiable_group_stays_global(swaps):
    torch.testing.assert_close(
        _unrolled_meta_gradient(True), _unrolled_meta_gradient(False), rtol=1e-12, atol=1e-12
    )
    assert swaps == [False, False]


def _split_weight_training(name):
    """A weight split over the ranks: every step runs on the global tensors (no swap), 0-dim
    local state included; the result equals one process's."""
    P = sbp.placement.all("cpu")
    plain, glob = _models()
    glob.to_global(P, B)
    glob.a.weight = torch.nn.Parameter(glob.a.weight.to_global(P, sbp.split(0)))
    popt, gopt = OPTIMIZERS[name](plain.parameters()), OPTIMIZERS[name](glob.parameters())
    for x in _batches():
        for model, opt, inp in ((plain, popt, x), (glob, gopt, sbp.to_global(x, P, B))):
            opt.zero_grad()
            model(inp).square().mean().backward()
            opt.step()
    return [
        float((g.full_tensor() - p.detach()).abs().max())
        for p, g in zip(plain.parameters(), glob.parameters(), strict=True)
    ]


@pytest.mark.parametrize("name", ["rprop", "asgd", "asgd-foreach"])
def test_zero_dim_state_on_split_parameters(pool2, name):
    for errors in pool2.run(_split_weight_training, name):
        assert max(errors) < 1e-12


def test_zero_dim_locals_are_trusted_only_inside_a_step():
    """Outside an optimizer's step (after one, and after one that raised), a 0-dim local
    tensor meeting a global one is an error again."""
    plain, glob, _, gopt = _pair("asgd")
    _train(glob, gopt, _batches(2))
    g = next(glob.parameters())
    with pytest.raises(sbp.PlacementError, match="local torch.Tensor of shape"):
        g * torch.tensor(2.0, dtype=torch.float64)

    def fail(optimizer, args, kwargs):
        raise RuntimeError("a hook failed")

    handle = gopt.register_step_post_hook(fail)
    with pytest.raises(RuntimeError, match="a hook failed"):
        _train(glob, gopt, _batches(1))
    handle.remove()
    with pytest.raises(sbp.PlacementError, match="local torch.Tensor of shape"):
        g * torch.tensor(2.0, dtype=torch.float64)


def test_kept_group_swaps_follow_changes_between_steps(swaps, monkeypatch):
    """A group's locals and state are reused from step to step (`_GroupSwap`), and made
    anew when what they came from changed between steps: a state tensor replaced, a
    parameter's data replaced, the state loaded, a state tensor swapped with another
    (`torch.utils.swap_tensors`: the same object, which the swap would not re-read if
    the rebinding went uncounted). A params list replaced by an equal one keeps them, and
    gets its own list back after the step."""
    made = []
    of = optim_step._GroupSwap.of
    monkeypatch.setattr(
        optim_step._GroupSwap,
        "of",
        staticmethod(lambda g, st, *rest: made.append(1) or of(g, st, *rest)),
    )
    plain, glob, popt, gopt = _pair("sgd")
    batches = _batches(8)
    lists = {}

    def change(model, opt, i):
        params = list(model.parameters())
        as_model = (lambda t: t.to_global(P1, B)) if model is glob else (lambda t: t)
        if i == 2:
            opt.state[params[0]]["momentum_buffer"] = as_model(torch.full((7, 5), 0.01).double())
        elif i == 3:
            params[2].data = as_model(torch.full((3, 7), 0.2).double())
        elif i == 4:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        elif i == 5:
            lists[model] = opt.param_groups[0]["params"] = list(opt.param_groups[0]["params"])
        elif i == 6:  # (the same tensor object, holding another: torch's Module._apply does so)
            torch.utils.swap_tensors(
                opt.state[params[1]]["momentum_buffer"], as_model(torch.full((7,), 0.02).double())
            )

    for model, opt in ((plain, popt), (glob, gopt)):
        for i, x in enumerate(batches):
            opt.zero_grad()
            _loss(model, x).backward()
            change(model, opt, i)
            opt.step()
    assert swaps == [True] * 7
    # made at steps 2 (the state is new), 3, 4, 5 and 7: reused at 6 and 8
    assert len(made) == 5
    assert gopt.param_groups[0]["params"] is lists[glob]
    _assert_same(plain, glob, popt, gopt)


def test_a_step_sees_the_state_of_the_locals_and_keeps_what_it_adds(swaps):
    """Every state entry a parameter's: the step sees the locals' state alone (kept from step
    to step), and an entry a step hook adds under another key stays in the optimizer's
    state after the step."""
    plain, glob, popt, gopt = _pair("adamw")
    seen = []
    extra = torch.zeros(1)

    def look(optimizer, args, kwargs):
        seen.append({type(k) for k in optimizer.state})
        if len(seen) == 3:  # (a hook's own entry, on one step)
            optimizer.state[extra]["note"] = 1

    gopt.register_step_pre_hook(look)
    batches = _batches(5)
    _train(plain, popt, batches)
    _train(glob, gopt, batches)
    assert swaps == [True] * 4
    # (the first step makes the state; the hook's entry, kept, then sits beside the
    # parameters' in the optimizer's state, where the locals' entries are added)
    T, G = torch.Tensor, sbp.GlobalTensor
    assert seen == [set(), {T}, {T}, {G, T}, {G, T}]
    assert gopt.state[extra] == {"note": 1}
    del gopt.state[extra]
    _assert_same(plain, glob, popt, gopt)


def test_a_group_of_plain_parameters_keeps_its_state(swaps):
    """A group of plain tensors beside a global one: the global group steps on its locals
    (their state added to the optimizer's for the step), the plain one as torch does."""
    plain, glob = _models()
    extra_p, extra_g = torch.nn.Linear(3, 2).double(), torch.nn.Linear(3, 2).double()
    extra_g.load_state_dict(extra_p.state_dict())

    def groups(m, extra):
        return [{"params": m.parameters()}, {"params": extra.parameters(), "lr": 0.02}]

    popt = OPTIMIZERS["sgd"](groups(plain, extra_p))
    gopt = OPTIMIZERS["sgd"](groups(glob, extra_g))
    batches = _batches(4)
    for model, extra, opt in ((plain, extra_p, popt), (glob, extra_g, gopt)):
        for x in batches:
            opt.zero_grad()
            h = model(sbp.to_global(x, P1, sbp.split(0)) if model is glob else x)
            h = h.full_tensor() if model is glob else h
            (h.square().mean() + extra(h).square().mean()).backward()
            opt.step()
    assert swaps == [True] * 3
    _assert_same(plain, glob, popt, gopt)
    for p, g in zip(extra_p.parameters(), extra_g.parameters(), strict=True):
        torch.testing.assert_close(g.detach(), p.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(
            gopt.state[g]["momentum_buffer"],
            popt.state[p]["momentum_buffer"],
            rtol=1e-12,
            atol=1e-12,
        )


class _SgdThatClears(torch.optim.SGD):
    """An optimizer of the user's whose step drops the gradients it used."""

    def step(self, closure=None):
        out = super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None
        return out


@pytest.mark.parametrize("hook", ["subclass", "global hook"])
def test_gradients_an_optimizer_of_the_users_changes_reach_the_parameters(swaps, hook):
    """A step that is not torch's alone (the user's optimizer class, or a global step hook)
    may change the gradients on the locals, which then reach the parameters: here it drops
    them, so the next backward starts afresh, as in one process."""
    plain, glob = _models()
    handle = None
    if hook == "subclass":
        popt, gopt = (_SgdThatClears(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, glob))
    else:
        popt, gopt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, glob))
        handle = register_optimizer_step_post_hook(lambda o, args, kwargs: o.zero_grad())
    try:
        for model, opt in ((plain, popt), (glob, gopt)):
            for x in _batches():
                _loss(model, x).backward()  # (no zero_grad: the step drops them)
                opt.step()
    finally:
        if handle is not None:
            handle.remove()
    assert swaps == [True] * 3
    assert all(p.grad is None for p in glob.parameters())
    _assert_same(plain, glob, popt, gopt)


def test_a_step_after_zero_grad_changes_nothing(swaps):
    """zero_grad, then a step with no backward between: every gradient is None, so the
    step leaves parameters and state as they are, as torch's."""
    plain, glob, popt, gopt = _pair("sgd")
    batches = _batches(3)
    for model, opt in ((plain, popt), (glob, gopt)):
        _train(model, opt, batches)
        opt.zero_grad()
        opt.step()
    assert all(p.grad is None for p in glob.parameters())
    _assert_same(plain, glob, popt, gopt)


def _trained_across_to_global(name, world, stepped_before):
    """An optimizer made before `model.to_global` (as before torch's `model.to(device)`),
    two steps, a re-box of every parameter to split(0) with the same optimizer (its
    state too), two steps more. The parameters (logical values), or the error raised
    when the optimizer had stepped before `to_global`."""
    torch.manual_seed(0)
    model = Net().double()
    opt = OPTIMIZERS[name](model.parameters())
    batches = _batches()
    if stepped_before:
        _train(model, opt, batches[:1])
    P = None if world is None else sbp.placement("cpu", list(range(world)))

    def loss_of(x):
        if P is None:
            return model(x).square().mean()
        return model(sbp.to_global(x, P, B)).square().mean()

    if P is not None:
        model.to_global(P, B)
    try:
        for i, x in enumerate(batches):
            if i == 2 and P is not None:
                model.to_global(P, sbp.split(0))
            opt.zero_grad()
            loss_of(x).backward()
            opt.step()
    except sbp.PlacementError as e:
        return str(e)
    return [p.detach() if P is None else p.full_tensor() for p in model.parameters()]


@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("world", [1, 2])
def test_an_optimizer_made_before_to_global(request, name, world):
    """`to_global` cannot make a plain parameter global in place: the optimizer's groups
    are pointed at the new ones at its next step, and a re-box of global parameters keeps
    them (`p.data =`), with their state (before: the optimizer stepped the old objects,
    which nothing used: the model silently did not train)."""
    want = _trained_across_to_global(name, None, False)
    pool = request.getfixturevalue(f"pool{world}")
    for got in pool.run(_trained_across_to_global, name, world, False):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    for message in pool.run(_trained_across_to_global, name, world, True):
        assert "holds state for a parameter that module.to_global has since replaced" in message


def _pipeline_stages(world):
    """Two stages of a model on placements of one rank each, one optimizer over both."""
    g = torch.Generator().manual_seed(0)
    w0, w1 = torch.randn(4, 3, generator=g).double(), torch.randn(2, 4, generator=g).double()
    x = torch.randn(5, 3, generator=g).double()
    stages = [sbp.placement("cpu", [0]), sbp.placement("cpu", [world - 1])] if world else None
    a = torch.nn.Parameter(w0 if world is None else sbp.tensor(w0, stages[0], sbp.broadcast))
    b = torch.nn.Parameter(w1 if world is None else sbp.tensor(w1, stages[1], sbp.broadcast))
    results = []
    for make in (torch.optim.Adam, torch.optim.SGD):
        p, q = torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(b.detach().clone())
        opt = make([p, q], lr=0.1)  # (foreach left to torch's choice)
        for _ in range(3):
            opt.zero_grad()
            h = x if world is None else sbp.tensor(x, stages[0], sbp.broadcast)
            h = h @ p.t()
            h = h if world is None else h.to_global(placement=stages[1], sbp=sbp.broadcast)
            (h @ q.t()).square().sum().backward()
            opt.step()
        results += [t.detach() if world is None else t.full_tensor() for t in (p, q)]
    return results


def test_one_optimizer_over_parameters_on_different_placements(pool2):
    """sbp chose foreach kernels for a group of global parameters left to torch's choice,
    and a list op takes one placement: pipeline stages raised PlacementError at the step."""
    want = _pipeline_stages(None)
    for rank, got in enumerate(pool2.run(_pipeline_stages, 2)):
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            if rank == (0 if i % 2 == 0 else 1):  # (the rank holding that stage)
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _resume_from_a_one_process_optimizer(world, nd):
    """Two Adam steps in one process, its state_dict through torch.save, then three more
    steps on global parameters (or in one process: the reference)."""
    import io

    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, generator=g).double()
    grads = [torch.randn(6, 4, generator=g).double() for _ in range(5)]
    p = torch.nn.Parameter(w.clone())
    opt = torch.optim.Adam([p], lr=0.1, amsgrad=True)
    for grad in grads[:2]:
        p.grad = grad.clone()
        opt.step()
    saved = io.BytesIO()
    torch.save({"param": p.detach(), "optim": opt.state_dict()}, saved)
    saved.seek(0)
    state = torch.load(saved)
    P = sbp.placement("cpu", list(range(world))) if world else None
    q = torch.nn.Parameter(state["param"] if P is None else sbp.tensor(state["param"], P, nd))
    opt = torch.optim.Adam([q], lr=0.1, amsgrad=True)
    opt.load_state_dict(state["optim"])
    for grad in grads[2:]:
        q.grad = grad.clone() if P is None else sbp.tensor(grad, P, nd)
        opt.step()
    values = [q, *(v for v in opt.state[q].values() if v.dim())]
    return [v.detach() if P is None else v.full_tensor() for v in values]


@pytest.mark.parametrize("nd", [B, sbp.split(0)], ids=["B", "S0"])
def test_load_a_one_process_optimizer_state_dict(pool2, nd):
    """A plain state tensor is the logical value, as model.load_state_dict takes plain
    tensors (before: torch's load left it plain, and the first step raised PlacementError
    on a foreach op, naming neither the load nor the state)."""
    want = _resume_from_a_one_process_optimizer(None, None)
    for got in pool2.run(_resume_from_a_one_process_optimizer, 2, nd):
        assert len(got) == len(want) == 4  # (the parameter, exp_avg, exp_avg_sq, max_...)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
