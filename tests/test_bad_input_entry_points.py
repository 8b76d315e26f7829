"""Every public entry point validates its arguments (issue 50): a named `sbp.SbpError` whose
message names the argument and the fix, on every rank, fast; and where one process has an
answer (torch.tensor of a list holding a global 0-dim tensor, topk of split logits), that
answer. Multi-rank cases run as in tests/test_bad_input.py: under a short timeout, each rank
returns its value or the name and message of the error it raised, and how long it took.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import warnings

import pytest
import torch
from test_bad_input import HANG, TIMEOUT, _run_case  # (the same harness)

import sbp
import sbp.nn
import sbp.utils.data


def _expect_error(pool, case, error, *args, match="", bad_rank=None):
    """Every rank raised `error` with `match` in its message, well within the timeout; ranks
    other than `bad_rank` (the one given the bad argument) name it."""
    results = pool.run(_run_case, case, *args, timeout=HANG)
    for rank, (kind, _, message, seconds) in enumerate(results):
        assert kind == error.__name__, f"rank {rank}: {kind} {message}"
        assert match in message, f"rank {rank}: {message}"
        assert seconds < TIMEOUT, f"rank {rank} took {seconds:.2f} s"
        if bad_rank is not None and rank != bad_rank:
            assert message.startswith(f"on rank {bad_rank}:"), message
    return results


def _expect_values(pool, case, *args):
    results = pool.run(_run_case, case, *args, timeout=HANG)
    for rank, (kind, _, message, _) in enumerate(results):
        assert kind == "ok", f"rank {rank}: {kind} {message}"
    return [r[1] for r in results]


def _all(world):
    return sbp.placement("cpu", list(range(world)))


ONE = sbp.placement("cpu", [0])  # the test process is a world of one


def _raises(error, match, fn, *args, **kwargs):
    with pytest.raises(error) as info:
        fn(*args, **kwargs)
    assert type(info.value) is error  # (not only a subclass of a builtin error)
    assert match in str(info.value), str(info.value)
    return info.value


# ---------------------------------------------------------------- 1. sbp.boxing.plan


def test_plan_names_a_plain_tensor_and_a_placement_that_is_a_string():
    """(AttributeError: 'Tensor' object has no attribute '_spec', and 'str' ... 'ndim'.)"""
    _raises(sbp.InputTypeError, "plain torch.Tensor", sbp.boxing.plan, torch.ones(2), ONE)
    g = sbp.to_global(torch.ones(2), ONE, sbp.broadcast)
    _raises(sbp.PlacementError, "sbp.placement", sbp.boxing.plan, g, "cpu", sbp.broadcast)
    assert sbp.boxing.plan(g, ONE, sbp.split(0)) is not None


# ---------------------------------------------------------------- 2. nested, quantized


def _unsupported_local(rank, world, kind, only_rank):
    x = torch.ones(2, 3)
    if only_rank is None or rank == only_rank:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (torch's prototype / deprecation warnings)
            if kind == "nested":
                x = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(1, 3)])
            elif kind == "jagged":
                x = torch.nested.nested_tensor(
                    [torch.ones(2, 3), torch.ones(1, 3)], layout=torch.jagged
                )
            else:
                x = torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)
    return sbp.to_global(x, _all(world), sbp.split(0))


@pytest.mark.parametrize(
    "kind, match",
    [("nested", "to_padded_tensor"), ("jagged", "nested"), ("quantized", "dequantize()")],
)
@pytest.mark.parametrize("only_rank", [None, 1], ids=["every rank", "rank 1 only"])
def test_to_global_of_nested_and_quantized_tensors(pool2, kind, match, only_rank):
    """(A strided nested tensor: torch's 'NestedTensorImpl doesn't support sizes'; a
    quantized one was made global silently, its scale left out of every rule.)"""
    _expect_error(
        pool2,
        _unsupported_local,
        sbp.InputTypeError,
        kind,
        only_rank,
        match=match,
        bad_rank=only_rank,
    )


def test_sbp_tensor_of_nested_and_quantized_data():
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    _raises(sbp.InputTypeError, "nested", sbp.tensor, nested, ONE, sbp.broadcast)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    _raises(sbp.InputTypeError, "dequantize()", sbp.tensor, q, ONE, sbp.broadcast)


# ---------------------------------------------------------------- 3. factories


def _integer_requires_grad(rank, world, factory):
    P, B = _all(world), sbp.broadcast
    make = {
        "zeros": lambda: sbp.zeros(2, placement=P, sbp=B, dtype=torch.int64, requires_grad=True),
        "ones": lambda: sbp.ones(2, placement=P, sbp=B, dtype=torch.int32, requires_grad=True),
        "empty": lambda: sbp.empty(2, placement=P, sbp=B, dtype=torch.bool, requires_grad=True),
        "full": lambda: sbp.full((2,), 3, placement=P, sbp=B, requires_grad=True),  # int64
        "arange": lambda: sbp.arange(4, placement=P, sbp=B, requires_grad=True),  # int64
        "tensor": lambda: sbp.tensor([1, 2], P, B, requires_grad=True),
    }
    return make[factory]()


@pytest.mark.parametrize("factory", ["zeros", "ones", "empty", "full", "arange", "tensor"])
def test_factories_refuse_requires_grad_of_an_integer_dtype(pool2, factory):
    """(torch's 'only Tensors of floating point dtype can require gradients', after placing.)"""
    _expect_error(
        pool2, _integer_requires_grad, sbp.InputTypeError, factory, match="requires_grad=True"
    )


def test_factories_take_requires_grad_as_a_bool():
    """(requires_grad="no" was true.)"""
    _raises(
        sbp.InputTypeError,
        "requires_grad must be True or False",
        sbp.zeros,
        2,
        placement=ONE,
        sbp=sbp.broadcast,
        requires_grad="no",
    )
    g = sbp.zeros(2, placement=ONE, sbp=sbp.broadcast, requires_grad=True)
    assert g.requires_grad and g.dtype == torch.float32


# ---------------------------------------------------------------- 4. timeouts


@pytest.mark.parametrize(
    "timeout, error, match",
    [
        (float("inf"), sbp.InputValueError, "finite"),
        (float("nan"), sbp.InputValueError, "finite"),
        (0, sbp.InputValueError, "positive"),
        (-5, sbp.InputValueError, "positive"),
        (1e300, sbp.InputValueError, "finite"),
        (datetime.timedelta(seconds=-1), sbp.InputValueError, "positive"),
        (True, sbp.InputTypeError, "number of seconds"),
        ("5min", sbp.InputTypeError, "number of seconds"),
    ],
    ids=repr,
)
def test_init_timeout(timeout, error, match):
    """(inf: OverflowError inside datetime; True: taken as 1 s; nan, 0: a bare SbpError.)"""
    before = sbp.env.get_timeout()
    _raises(error, match, sbp.env.init, timeout=timeout)
    assert sbp.env.get_timeout() == before  # a refused timeout changes nothing


def test_init_backend_is_a_string():
    _raises(sbp.InputTypeError, "backend must be a string", sbp.env.init, backend=3)


@pytest.mark.parametrize("text", ["5min", "0", "-5", "inf"])
def test_sbp_timeout_variable_is_checked(monkeypatch, text):
    monkeypatch.setenv("SBP_TIMEOUT", text)
    fallback, error = sbp.env._timeout_from_environment()
    assert isinstance(error, sbp.InputValueError) and "SBP_TIMEOUT" in str(error)
    assert fallback == datetime.timedelta(seconds=300)
    monkeypatch.setattr(sbp.env, "_ENVIRONMENT_ERROR", error)
    _raises(sbp.InputValueError, "SBP_TIMEOUT", sbp.env._as_timedelta, None)
    monkeypatch.setenv("SBP_TIMEOUT", "12.5")
    assert sbp.env._timeout_from_environment() == (datetime.timedelta(seconds=12.5), None)


def test_a_bad_sbp_timeout_fails_at_first_use_not_at_import():
    """(`import sbp` raised ValueError: could not convert string to float: '5min'.) The first
    use raises the named error; init(timeout=...) overrides the variable."""
    code = (
        "import sbp\n"
        "try:\n"
        "    sbp.env.get_rank()\n"
        "except sbp.InputValueError as e:\n"
        "    print('raised', e)\n"
        "sbp.env.init(timeout=7)\n"
        "print('rank', sbp.env.get_rank(), sbp.env.get_timeout().total_seconds())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "SBP_TIMEOUT": "5min"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "raised SBP_TIMEOUT='5min' is not a number of seconds" in out.stdout
    assert "rank 0 7.0" in out.stdout


# ---------------------------------------------------------------- 5. data_parallel


def _global_model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2).to_global(ONE, sbp.broadcast)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"fast": "no"}, sbp.InputTypeError, "fast must be True or False"),
        ({"fast": 0}, sbp.InputTypeError, "fast must be True or False"),
        ({"batch_norm": 1}, sbp.InputTypeError, "batch_norm"),
        ({"batch_norm": "sync"}, sbp.InputValueError, "'global' or 'local'"),
        ({"bucket_mb": True}, sbp.InputTypeError, "bucket_mb"),
        ({"bucket_mb": 0}, sbp.InputValueError, "positive"),
        ({"compile": "yes"}, sbp.InputTypeError, "compile"),
        ({"compile": {1: 2}}, sbp.InputTypeError, "str keys"),
    ],
    ids=repr,
)
def test_data_parallel_checks_every_option(kwargs, error, match):
    """(fast="no" was taken as true; the others raised the bare SbpError, or nothing.)"""
    _raises(error, match, sbp.nn.data_parallel, _global_model(), **kwargs)


def test_data_parallel_checks_before_applying_any_option():
    """A bad option leaves the module as it was (compile was set before batch_norm failed)."""
    model = _global_model()
    _raises(
        sbp.InputValueError,
        "batch_norm",
        sbp.nn.data_parallel,
        model,
        compile=True,
        fast=False,
        batch_norm="x",
    )
    state = sbp.nn.fast_path.state(model)
    assert state.compile_options is None and state.enabled


@pytest.mark.parametrize("fn", [sbp.nn.data_parallel, sbp.nn.no_sync, sbp.nn.fast_path.state])
def test_data_parallel_of_what_is_not_a_module(fn):
    """(no_sync("m"): AttributeError '__dict__'; a tensor: 'Tensor has no fast path'.)"""

    def call():
        out = fn(torch.ones(2))
        if hasattr(out, "__enter__"):
            out.__enter__()

    _raises(sbp.InputTypeError, "nn.Module", call)


# ---------------------------------------------------------------- 6. torch.tensor([g, n])


def _tensor_of_running_values(rank, world):
    """pytorch/examples' AverageMeter.all_reduce: torch.tensor([self.sum, self.count]), sum a
    global 0-dim tensor (here a partial sum, a broadcast value and a split one's element)."""
    logical = torch.arange(4.0 * world, dtype=torch.float64).reshape(2 * world, 2)
    g = sbp.to_global(logical[2 * rank : 2 * rank + 2], _all(world), sbp.split(0))
    acc = g.sum()  # partial
    top = g.amax()
    first = g[-1, 1]
    return (
        torch.tensor([acc, 2 * world]),
        torch.tensor([[acc], [top]], dtype=torch.float32),
        torch.as_tensor((first, acc, 1.5)),
        logical,
    )


def test_torch_tensor_of_a_list_holding_global_tensors(pool2):
    """(torch's 'data is not allocated yet'.) Each element is its logical value, as in one
    process."""
    for a, b, c, logical in _expect_values(pool2, _tensor_of_running_values):
        assert type(a) is torch.Tensor
        torch.testing.assert_close(
            a, torch.tensor([logical.sum(), 4]), rtol=0, atol=0
        )  # float64 (promoted by the element), as torch gives
        torch.testing.assert_close(
            b, torch.tensor([[logical.sum()], [logical.max()]], dtype=torch.float32)
        )
        torch.testing.assert_close(c, torch.as_tensor((logical[-1, 1], logical.sum(), 1.5)))


def test_torch_tensor_without_global_tensors_is_torch_s():
    assert hasattr(torch.tensor, "__sbp_wrapped__")  # (installed once, by import sbp)
    with pytest.raises(ValueError, match="only one element"):  # torch's own errors
        torch.tensor([torch.ones(2), torch.ones(3)])
    assert torch.equal(torch.tensor([1, 2]), torch.arange(1, 3))
    with sbp.global_mode(ONE):  # still made global inside the mode
        g = torch.tensor([1.0, 2.0])
        h = torch.tensor([sbp.to_global(torch.tensor(3.0), ONE, sbp.broadcast), 1.0])
    assert isinstance(g, sbp.GlobalTensor) and isinstance(h, sbp.GlobalTensor)
    assert h.tolist() == [3.0, 1.0]


# ---------------------------------------------------------------- 7. load_state_dict


def test_loading_a_global_state_dict_into_a_plain_model_points_the_right_way():
    """(It said the model's own parameter was 'a local tensor: make it global first
    (x.to_global...)', as if the state dict's value were the local one.)"""
    plain = torch.nn.Linear(3, 2)
    with pytest.raises(RuntimeError) as info:  # torch's load_state_dict collects the errors
        plain.load_state_dict(_global_model().state_dict())
    message = str(info.value)
    assert "writes a global tensor into a local torch.Tensor" in message
    assert "model.to_global(placement, sbp), then load_state_dict" in message
    assert "sbp.checkpoint.full_state_dict" in message


# ---------------------------------------------------------------- 8. topk, sort, argmax


def _selections(rank, world):
    """topk, sort, kthvalue, argmax, argmin, eq over the class dim of logits split by rows
    (float64): their layouts, the collectives they ran, their values and gradients."""
    torch.manual_seed(0)
    x = torch.randn(2 * world + 1, 5, dtype=torch.float64)  # (uneven rows)
    P = _all(world)
    y = sbp.tensor(torch.arange(2 * world + 1) % 5, placement=P, sbp=sbp.split(0))
    g = sbp.tensor(x, placement=P, sbp=sbp.split(0)).requires_grad_()
    with warnings.catch_warnings(), sbp.comm_stats() as stats:
        warnings.simplefilter("error")  # no op may fall back to broadcast inputs
        values, indices = torch.topk(g, 3, dim=1)
        s, si = torch.sort(g, dim=-1, descending=True, stable=True)
        k, ki = torch.kthvalue(g, 2, dim=1, keepdim=True)
        am, an = g.argmax(1), g.argmin(dim=-1)
        correct = indices.eq(y.unsqueeze(1))  # top-k accuracy's test
        loss = values.sum() + s[:, :2].sum() * 2 + k.sum() * 3
        loss.backward()
        outs = (values, indices, s, si, k, ki, am, an, correct)
    layouts = [o.sbp for o in outs] + [g.grad.sbp]
    return stats.calls, layouts, [o.full_tensor() for o in outs], g.grad.full_tensor(), x


def test_selections_over_the_class_dim_keep_a_row_split(pool2):
    """(topk, sort, kthvalue and topk's backward had no rule: they gathered the logits on
    every rank, with a warning.) Equal to one process's, indices included."""
    for calls, layouts, got, grad, x in _expect_values(pool2, _selections):
        assert calls == 0  # the backward's gradient stays split too
        assert all(layout == (sbp.split(0),) for layout in layouts), layouts
        x = x.clone().requires_grad_()
        values, indices = torch.topk(x, 3, dim=1)
        s, si = torch.sort(x, dim=-1, descending=True, stable=True)
        k, ki = torch.kthvalue(x, 2, dim=1, keepdim=True)
        y = torch.arange(x.shape[0]) % 5
        want = (values, indices, s, si, k, ki, x.argmax(1), x.argmin(-1), indices.eq(y[:, None]))
        (values.sum() + s[:, :2].sum() * 2 + k.sum() * 3).backward()
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
        torch.testing.assert_close(grad, x.grad, rtol=0, atol=0)


def _topk_over_a_split_dim(rank, world):
    torch.manual_seed(1)
    x = torch.randn(3, 4 * world, dtype=torch.float64)
    g = sbp.tensor(x, placement=_all(world), sbp=sbp.split(1))
    values, indices = torch.topk(g, 2, dim=1, largest=False)
    return values.full_tensor(), indices.full_tensor(), x


def test_topk_over_a_split_dim_gives_logical_indices(pool2):
    for values, indices, x in _expect_values(pool2, _topk_over_a_split_dim):
        want = torch.topk(x, 2, dim=1, largest=False)
        torch.testing.assert_close(values, want.values, rtol=0, atol=0)
        torch.testing.assert_close(indices, want.indices, rtol=0, atol=0)


# ---------------------------------------------------------------- 9. the rest of the API


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: sbp.manual_seed("x"), sbp.InputTypeError, "seed must be an int"),
        (lambda: sbp.manual_seed(1.5), sbp.InputTypeError, "seed must be an int"),
        (
            lambda: sbp.local_shape((4,), "cpu", sbp.split(0), 0),
            sbp.PlacementError,
            "sbp.placement",
        ),
        (lambda: sbp.local_shape((-4,), ONE, sbp.split(0), 0), sbp.InputValueError, "negative"),
        (lambda: sbp.local_slices("ab", ONE, sbp.split(0), 0), sbp.InputTypeError, "ints"),
        (
            lambda: sbp.to_global(torch.ones(2), ONE, sbp.broadcast, sync_data="no"),
            sbp.InputTypeError,
            "sync_data must be True or False",
        ),
        (
            lambda: sbp.to_global(torch.ones(2), ONE, sbp.broadcast, check_meta=1),
            sbp.InputTypeError,
            "check_meta must be True or False",
        ),
        (
            lambda: sbp.to_global(torch.ones(2), ONE, sbp.broadcast, sync=False),
            sbp.InputTypeError,
            "unknown keyword argument(s) sync",
        ),
        (
            lambda: torch.nn.Linear(2, 2).to_global(ONE, sbp.broadcast, check=False),
            sbp.InputTypeError,
            "unknown keyword argument(s) check",
        ),
        (
            lambda: sbp.global_mode(ONE, check="yes").__enter__(),
            sbp.InputTypeError,
            "check must be True or False",
        ),
        (
            lambda: sbp.implicit_replication(check=1).__enter__(),
            sbp.InputTypeError,
            "check must be True or False",
        ),
        (
            lambda: sbp.utils.data.DistributedSampler(range(8), rank=5),
            sbp.InputValueError,
            "rank must be in [0, 1)",
        ),
        (
            lambda: sbp.utils.data.DistributedSampler(range(8), num_replicas=0),
            sbp.InputValueError,
            "num_replicas must be at least 1",
        ),
        (
            lambda: sbp.utils.data.DistributedSampler(range(8), shuffle="no"),
            sbp.InputTypeError,
            "shuffle must be True or False",
        ),
        (
            lambda: sbp.utils.data.DistributedSampler(range(8), seed=0.5),
            sbp.InputTypeError,
            "seed must be an int",
        ),
        (lambda: sbp.nn.parallel.local_device("tpu"), sbp.InputValueError, "'cpu' or 'cuda'"),
    ],
    ids=lambda v: getattr(v, "__name__", None) if isinstance(v, type) else None,
)
def test_the_rest_of_the_api(call, error, match):
    """(Before: ValueError, AttributeError, Python's TypeError naming an internal function,
    or nothing: a string taken as true, a float seed truncated, 'tpu' taken as the CPU.)"""
    _raises(error, match, call)


def test_a_global_tensor_takes_a_local_tensor_s_options_in_a_nest():
    """`sbp.to_global((g, x), P, S, sync_data=False)`: the re-box of `g` raised Python's
    TypeError (unexpected keyword argument 'sync_data')."""
    g = sbp.to_global(torch.ones(2), ONE, sbp.broadcast)
    out = sbp.to_global((g, torch.zeros(2)), ONE, sbp.split(0), sync_data=False)
    assert [t.sbp for t in out] == [(sbp.split(0),)] * 2


# ---------------------------------------------------------------- one rank's bad argument


def _missing_on_one_rank(rank, world, what):
    P, S = _all(world), sbp.split(0)
    bad = rank == world - 1
    if what == "placement":
        return sbp.to_global(torch.ones(2), None if bad else P, S)
    if what == "sbp":
        return sbp.to_global(torch.ones(2), P, None if bad else S)
    if what == "sync_data":
        return sbp.to_global(torch.ones(2), P, S, sync_data="no" if bad else True)
    return sbp.to_global([torch.ones(2), torch.ones(2)], P, S, grad_sbp="x" if bad else None)


@pytest.mark.parametrize(
    "what, error, match",
    [
        ("placement", sbp.PlacementError, "needs placement="),
        ("sbp", sbp.SbpSignatureError, "needs sbp="),
        ("sync_data", sbp.InputTypeError, "sync_data"),
        ("grad_sbp", sbp.SbpSignatureError, "'x'"),
    ],
)
def test_a_bad_argument_on_one_rank_reaches_every_rank(pool4, what, error, match):
    """(placement=None or sbp=None on one rank raised there alone, before the metadata
    exchange, and the others waited for it until the timeout.)"""
    _expect_error(pool4, _missing_on_one_rank, error, what, match=match, bad_rank=3)
