"""Per-rank settings that change no collective are compared, not left to drift silently:
an optimizer's hyper-parameters before each step, broadcast replicas before a checkpoint
or `full_state_dict` hands the state out.

Before: a learning rate set on one rank only made the replicas of every broadcast
parameter differ, and `full_tensor()` returned another "logical" value on each rank; a
checkpoint saved one rank's replicas as the logical value.
"""

from __future__ import annotations

import time

import pytest
import torch

import sbp
from sbp.comm import collectives, shm
from sbp.testing.pool import SpmdPool

B, S0 = sbp.broadcast, sbp.split(0)


def _model_and_optimizer(name: str):
    torch.manual_seed(0)
    P = sbp.placement.all("cpu")
    model = torch.nn.Linear(4, 3).double().to_global(P, B)
    if name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return P, model, opt


def _step(P, model, opt) -> None:
    x = torch.arange(8.0, dtype=torch.float64).reshape(2, 4).to_global(P, B)
    loss = model(x).square().sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _diverged_optimizer(name: str, change: str) -> tuple[str, float, list]:
    """Steps where rank 1 sets another learning rate (from the start, or after 2 steps):
    the error, its time, and the parameters (which must not have drifted)."""
    P, model, opt = _model_and_optimizer(name)
    one = sbp.env.get_rank() == 1
    if change == "from the start" and one:
        opt.param_groups[0]["lr"] *= 2
    start = time.monotonic()
    try:
        for i in range(4):
            if change == "after 2 steps" and i == 2 and one:
                opt.param_groups[0]["lr"] *= 2
            start = time.monotonic()
            _step(P, model, opt)
    except sbp.MetaMismatchError as e:
        params = [p.to_local().clone() for p in model.parameters()]
        return str(e), time.monotonic() - start, params
    return "no error", 0.0, []


@pytest.mark.parametrize("change", ["from the start", "after 2 steps"])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_a_learning_rate_on_one_rank_is_named_before_the_step(name, change, pool2):
    results = pool2.run(_diverged_optimizer, name, change)
    for message, seconds, _ in results:
        assert "param_groups[0]['lr'] differs" in message, message
        lr = 0.1 if name == "sgd" else 0.01
        assert f"rank 0: {lr}" in message and f"rank 1: {2 * lr}" in message
        assert seconds < 5
    for mine, other in zip(results[0][2], results[1][2], strict=True):  # no drift yet
        assert torch.equal(mine, other)


def _drifted_replica(where: str, directory: str) -> str:
    P, model, opt = _model_and_optimizer("sgd")
    _step(P, model, opt)
    if sbp.env.get_rank() == 1:
        model.bias.to_local().add_(1.0)  # (a write into one rank's replica)
    with pytest.raises(sbp.MetaMismatchError) as info:
        if where == "save":
            sbp.checkpoint.save({"model": model, "optim": opt}, directory)
        else:
            sbp.checkpoint.full_state_dict(model)
    in_step = collectives.all_reduce(torch.ones(2), "sum", (0, 1))
    assert torch.equal(in_step, torch.full((2,), 2.0))
    return str(info.value)


@pytest.mark.parametrize("where", ["save", "full_state_dict"])
def test_replicas_that_drifted_apart_are_named(where, pool2, tmp_path):
    for message in pool2.run(_drifted_replica, where, str(tmp_path / "c")):
        assert "'model.bias' (ranks [0] vs [1])" in message or "'bias' (ranks [0] vs [1])" in (
            message
        )
        assert "weight" not in message
    assert not (tmp_path / "c" / "sbp_checkpoint.json").exists()


def _equal_replicas_pass(directory: str) -> list:
    P, model, opt = _model_and_optimizer("adamw")
    for _ in range(2):
        _step(P, model, opt)
    sbp.checkpoint.save({"model": model, "optim": opt}, directory)
    return [t for t in sbp.checkpoint.full_state_dict(model).values()]


def test_equal_replicas_and_settings_pass(pool2, tmp_path):
    """The same training in one process: the checks pass and change no value."""
    rank0, rank1 = pool2.run(_equal_replicas_pass, str(tmp_path / "c"))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        x = torch.arange(8.0, dtype=torch.float64).reshape(2, 4)
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    for got0, got1, want in zip(rank0, rank1, model.state_dict().values(), strict=True):
        torch.testing.assert_close(got0, want, rtol=1e-12, atol=1e-12)
        assert torch.equal(got0, got1)


# A bad argument on one rank only: that rank raises its error, and the others, which go on
# into the re-box's collectives (its layouts were checked before, so they skip the
# exchange), raise `RankFailedError` naming it there. Before: they waited out the timeout
# (the pools' is 60 s) and raised CommTimeoutError.
BAD_ARGUMENTS = {
    "placement": lambda x, P: x.to_global(placement="cpu", sbp=B),
    "sbp": lambda x, P: x.to_global(P, sbp.split(5)),
    "grad_sbp": lambda x, P: x.to_global(P, B, grad_sbp="split"),
}


def _bad_argument_on_rank_one(bad: str, numel: int, everywhere: bool) -> tuple:
    """A checked re-box of a (numel, 1) split(0) tensor to broadcast; then rank 1 (or every
    rank) passes a bad argument, the others the same re-box: each rank's error and time,
    then the same re-box again on every rank (the world goes on)."""
    P = sbp.placement.all("cpu")
    x = sbp.arange(numel, dtype=torch.float32, placement=P, sbp=S0).reshape(numel, 1)
    x.to_global(P, B)  # checked: from now on this re-box skips the exchange
    start = time.monotonic()
    try:
        if sbp.env.get_rank() == 1 or everywhere:
            BAD_ARGUMENTS[bad](x, P)
        else:
            x.to_global(P, B)
        name, message = "no error", ""
    except sbp.SbpError as e:
        name, message = type(e).__name__, str(e)
    seconds = time.monotonic() - start
    again = x.to_global(P, B).to_local()
    return (
        name,
        message,
        seconds,
        torch.equal(again.view(-1), torch.arange(numel, dtype=torch.float32)),
    )


def _through(transport: str, fn, *args):
    """`fn(*args)` on this rank with the shared segments (one host) or without them
    (gloo alone, as between hosts: the peers wait inside gloo's frame, `inline`)."""
    saved = shm._ENABLED
    shm._ENABLED = saved and transport == "shared memory"
    try:
        return fn(*args)
    finally:
        shm._ENABLED = saved


TRANSPORTS = ["shared memory", "gloo"]

ERRORS = {
    "placement": "PlacementError",
    "sbp": "SbpSignatureError",
    "grad_sbp": "SbpSignatureError",
}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("bad", sorted(BAD_ARGUMENTS))
@pytest.mark.parametrize("world", [2, 4])
def test_a_bad_argument_on_one_rank_is_named_on_every_rank_at_once(
    bad, world, transport, pool2, pool4
):
    """Through gloo (no shared segment) the others wait inside the frame of the re-box's
    first collective; before: they waited out the timeout there."""
    pool = pool2 if world == 2 else pool4
    for rank, (name, message, seconds, usable) in enumerate(
        pool.run(_through, transport, _bad_argument_on_rank_one, bad, 6, False)
    ):
        if rank == 1:
            assert name == ERRORS[bad], message
        else:
            assert name == "RankFailedError", message
            assert message.startswith(f"rank 1 raised {ERRORS[bad]}: "), message
            assert "all_gather of" in message
        assert seconds < 10  # the pools' timeout is 60 s
        assert usable


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_bad_argument_is_named_before_a_collective_through_gloo(transport, pool2):
    """A re-box of 1.2 MB per rank runs through gloo (or the large segment) after the
    fingerprint's meeting in the small segment, or in gloo's frame: the others raise at
    that meeting."""
    for rank, (name, message, seconds, usable) in enumerate(
        pool2.run(_through, transport, _bad_argument_on_rank_one, "sbp", 300_000, False)
    ):
        assert name == ("SbpSignatureError" if rank == 1 else "RankFailedError"), message
        assert seconds < 10 and usable


def _bad_factory_argument_on_rank_one(columns: int) -> tuple:
    """A factory of a layout no rank made before (its first use exchanges the layout; a
    `columns` of its own per test): rank 1 passes a bad sbp, the others a good one; then
    every rank makes it again. (A collective first: the marks live in the rank set's
    shared segment, or are written for its next frame, made by its first collective.)"""
    P = sbp.placement.all("cpu")
    sbp.ones(2, placement=P, sbp=B).to_global(P, S0).full_tensor()
    start = time.monotonic()
    try:
        layout = sbp.split(7) if sbp.env.get_rank() == 1 else S0
        sbp.ones(5, columns, placement=P, sbp=layout)
        name, message = "no error", ""
    except sbp.SbpError as e:
        name, message = type(e).__name__, str(e)
    seconds = time.monotonic() - start
    again = sbp.ones(5, columns, placement=P, sbp=S0).full_tensor()
    return name, message, seconds, torch.equal(again, torch.ones(5, columns))


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [2, 4])
def test_a_bad_factory_argument_on_one_rank_is_named_on_every_rank_at_once(
    world, transport, pool2, pool4
):
    """Before: the others waited in the layout's exchange for the full timeout."""
    pool = pool2 if world == 2 else pool4
    for rank, (name, message, seconds, usable) in enumerate(
        pool.run(
            _through, transport, _bad_factory_argument_on_rank_one, TRANSPORTS.index(transport) + 3
        )
    ):
        if rank == 1:
            assert name == "SbpSignatureError", message
        else:
            assert name == "RankFailedError", message
            assert message.startswith("rank 1 raised SbpSignatureError: "), message
        assert seconds < 10  # the pools' timeout is 60 s
        assert usable


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_same_bad_argument_on_every_rank_raises_it_alone(transport, pool2):
    """Every rank raised at the same call: none names another, and the next call meets."""
    for name, message, seconds, usable in pool2.run(
        _through, transport, _bad_argument_on_rank_one, "sbp", 6, True
    ):
        assert name == "SbpSignatureError", message
        assert seconds < 1 and usable


def _retried_on_error() -> tuple:
    """Rank 1's first argument is bad; every rank handles the error alike (retrying the
    re-box), whichever error it got: the ranks meet in the retry, the values right."""
    P = sbp.placement.all("cpu")
    x = sbp.arange(4, dtype=torch.float32, placement=P, sbp=S0)
    x.to_global(P, B)
    errors = []
    for _ in range(3):
        target = sbp.split(3) if sbp.env.get_rank() == 1 and not errors else B
        try:
            y = x.to_global(P, target)
            break
        except sbp.SbpError as e:
            errors.append(type(e).__name__)
    return errors, y.to_local().tolist()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_ranks_meet_again_after_a_bad_argument_on_one_rank(transport, pool2):
    for rank, (errors, values) in enumerate(pool2.run(_through, transport, _retried_on_error)):
        assert errors == (["SbpSignatureError"] if rank == 1 else ["RankFailedError"])
        assert values == [0.0, 1.0, 2.0, 3.0]


def _unchecked_local_to_global() -> tuple:
    """`to_global(check_meta=False)` of a local tensor (no exchange of the metadata) with a
    bad sbp on rank 1: the others go on into the broadcast of `sync_data`."""
    P = sbp.placement.all("cpu")
    nd = sbp.split(4) if sbp.env.get_rank() == 1 else B
    start = time.monotonic()
    try:
        torch.ones(3).to_global(P, nd, check_meta=False)
        name = "no error"
    except sbp.SbpError as e:
        name = type(e).__name__
    return name, time.monotonic() - start


def test_an_unchecked_local_tensor_with_a_bad_argument_is_named_at_once(pool2):
    names = [name for name, _ in pool2.run(_unchecked_local_to_global)]
    assert names == ["RankFailedError", "SbpSignatureError"]
    assert all(seconds < 10 for _, seconds in pool2.run(_unchecked_local_to_global))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_arguments_on_alternating_ranks_keep_the_ranks_in_step(transport, pool2):
    """A rank that failed before answered its peer's later failure as if both had failed
    at the same call: its re-box then paired with the failing rank's next collective."""
    (outcomes0, in_step0), (outcomes1, in_step1) = pool2.run(
        _through, transport, _tries, [[1], [0], []]
    )
    assert outcomes0 == ["RankFailedError", "SbpSignatureError", "ok"]
    assert outcomes1 == ["SbpSignatureError", "RankFailedError", "ok"]
    assert in_step0 and in_step1


def _bad_argument_on_a_mesh() -> tuple:
    """A checked re-box on a 2 x 2 mesh that gathers over the rows ({0, 1}, {2, 3}), then
    over the columns ({0, 2}, {1, 3}); then rank 1 passes a bad sbp; then every rank
    re-boxes again and gathers the whole (a new conversion: an exchange over the world)."""
    P = sbp.placement("cpu", [[0, 1], [2, 3]])
    x = sbp.arange(8, dtype=torch.float32, placement=P, sbp=(S0, S0)).reshape(8, 1)
    x.to_global(P, (B, S0))  # checked: from now on this re-box skips the exchange
    start = time.monotonic()
    try:
        x.to_global(P, (sbp.split(5), S0) if sbp.env.get_rank() == 1 else (B, S0))
        name, message = "no error", ""
    except sbp.SbpError as e:
        name, message = type(e).__name__, str(e)
    seconds = time.monotonic() - start
    again = x.to_global(P, (B, S0)).full_tensor()
    right = torch.equal(again.view(-1), torch.arange(8, dtype=torch.float32))
    return name, message, seconds, right


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_bad_argument_on_a_mesh_is_named_on_every_rank(transport, pool4):
    """Rank 0 waits for rank 1 in the rows' gather and raises; it then skips the columns'
    gather too, as rank 1 did, so it fails too: rank 2, waiting for it there, raises
    naming it. Before: rank 2's column gather paired with rank 0's next call (mixed data
    or a hang)."""
    results = pool4.run(_through, transport, _bad_argument_on_a_mesh)
    names = [name for name, _, _, _ in results]
    assert names == ["RankFailedError", "SbpSignatureError", "RankFailedError", "RankFailedError"]
    assert results[0][1].startswith("rank 1 raised SbpSignatureError: ")
    assert results[2][1].startswith("rank 0 raised RankFailedError: rank 1 raised ")
    assert results[3][1].startswith("rank 1 raised SbpSignatureError: ")
    assert all(seconds < 10 and right for _, _, seconds, right in results)


def _expected(rank: int, bad_on: list[list[int]]) -> list[str]:
    """Each try's outcome on `rank`: its own error where its argument is bad, the peers'
    `RankFailedError` where another rank's is, else none."""
    return [
        "SbpSignatureError" if rank in bad else ("RankFailedError" if bad else "ok")
        for bad in bad_on
    ]


def _tries(bad_on: list[list[int]]) -> tuple[list[str], bool]:
    """A checked re-box tried once per entry of `bad_on` (the ranks whose argument is bad
    at that try): each try's outcome on this rank, then a re-box of another tensor and a
    sum over every rank (the ranks in step, the values right)."""
    P = sbp.placement.all("cpu")
    x = sbp.arange(4, dtype=torch.float32, placement=P, sbp=S0)
    x.to_global(P, B)  # checked: from now on this re-box skips the exchange
    me, world, outcomes = sbp.env.get_rank(), sbp.env.get_world_size(), []
    for bad in bad_on:
        start = time.monotonic()
        try:
            x.to_global(P, sbp.split(3) if me in bad else B)
            outcomes.append("ok")
        except sbp.SbpError as e:
            outcomes.append(type(e).__name__)
        assert time.monotonic() - start < 10  # the pools' timeout is 60 s
    after = sbp.ones(2, placement=P, sbp=S0).to_global(P, B).to_local()
    total = collectives.all_reduce(torch.full((3,), me + 1.0), "sum", tuple(range(world)))
    return outcomes, torch.equal(after, torch.ones(2)) and total.tolist() == [
        world * (world + 1) / 2
    ] * 3


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("bad_on", [[[1], [1], []], [[0, 1], [1], []], [[1], [0, 1], []]])
def test_failures_in_a_row_are_each_named(bad_on, transport, pool2):
    """A rank that fails again before its peers saw its first failure: in shared memory its
    second mark overwrote the first, so rank 0 raised once, and its second try paired with
    rank 1's third (found in review); through gloo the second mark took the first's call."""
    for rank, (outcomes, in_step) in enumerate(pool2.run(_through, transport, _tries, bad_on)):
        assert outcomes == _expected(rank, bad_on)
        assert in_step


def _mesh_tries(bad_on: list[list[int]]) -> tuple[list[str], bool]:
    """`_bad_argument_on_a_mesh` tried once per entry of `bad_on`; then the whole gathered
    (a new conversion) and a sum over the world."""
    P = sbp.placement("cpu", [[0, 1], [2, 3]])
    x = sbp.arange(8, dtype=torch.float32, placement=P, sbp=(S0, S0)).reshape(8, 1)
    x.to_global(P, (B, S0))  # checked
    me, outcomes = sbp.env.get_rank(), []
    for bad in bad_on:
        try:
            x.to_global(P, (sbp.split(5), S0) if me in bad else (B, S0))
            outcomes.append("ok")
        except sbp.SbpError as e:
            outcomes.append(type(e).__name__)
    whole = x.to_global(P, (B, B)).to_local().view(-1)
    total = collectives.all_reduce(torch.full((3,), me + 1.0), "sum", (0, 1, 2, 3))
    return outcomes, torch.equal(whole, torch.arange(8.0)) and total.tolist() == [10.0] * 3


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("bad_on", [[[0], [3], []], [[1, 2], [0], [3], []], [[1], [1], []]])
def test_failures_on_a_mesh_in_a_row_are_each_named(bad_on, transport, pool4):
    """A rank fails, then another (or the same one again): every other rank raises at each
    try, once. Before: in shared memory a second failure before the first settled waited
    out the timeout (a segment held one mark per rank, and the answers the failing rank
    waited for were owed by a rank waiting for it in another rank set)."""
    results = pool4.run(_through, transport, _mesh_tries, bad_on)
    for rank, (outcomes, in_step) in enumerate(results):
        assert outcomes == _expected(rank, bad_on) and in_step


def _first_call_fails() -> tuple[str, float, bool]:
    """`_unchecked_local_to_global` as the world's first call, then a sum over the world."""
    name, seconds = _unchecked_local_to_global()
    total = collectives.all_reduce(torch.full((2,), sbp.env.get_rank() + 1.0), "sum", (0, 1))
    return name, seconds, total.tolist() == [3.0, 3.0]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_bad_argument_in_a_rank_sets_first_call_is_named(transport):
    """No call ran over the world before (a pool of its own): the failing rank marks the
    call's own rank set too, for its first gloo frame, which in shared memory is the one
    that makes the segment. Before: rank 0 waited out the timeout (gloo's frame, or
    making the segment)."""
    pool = SpmdPool(2, comm_timeout=30)
    try:
        (name0, seconds0, in_step0), (name1, _, in_step1) = pool.run(
            _through, transport, _first_call_fails
        )
    finally:
        pool.close()
    assert (name0, name1) == ("RankFailedError", "SbpSignatureError")
    assert seconds0 < 5
    assert in_step0 and in_step1


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "bad_on",
    [[[1, 2], [], []], [[1], [1, 2], [2], []], [[1, 2], [1], [0], []], [[1], [3], [1], [0, 2], []]],
)
def test_failures_on_several_ranks_at_once_are_each_named_once(bad_on, transport, pool4):
    """Two ranks failing at one call, then others: in shared memory the others answered
    only the first mark they saw and raised again at their next call; later plans went
    out of step (`MetaMismatchError` at the next call), since a segment held one mark per
    rank. Now every mark is one per call, in the store, on both transports."""
    results = pool4.run(_through, transport, _tries, bad_on)
    for rank, (outcomes, in_step) in enumerate(results):
        assert outcomes == _expected(rank, bad_on)
        assert in_step


def _every_rank_set() -> list[list[float]]:
    """A sum over each rank set of a 2 x 2 mesh, and over the world: rank r gives r + 1."""
    me = sbp.env.get_rank()
    sets = [(0, 1), (2, 3), (0, 2), (1, 3), (0, 1, 2, 3)]
    return [
        collectives.all_reduce(torch.full((2,), me + 1.0), "sum", s).tolist()
        for s in sets
        if me in s
    ]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_failures_leave_no_marks_that_later_calls_trip_on(transport, pool4):
    """Failure sequences on several ranks, one after another in one pool, then sums over
    every rank set: each is the single-process sum. Before: in shared memory such
    sequences left marks unanswered, and a later call in another rank set raised for an
    old failure (it failed CI twice)."""
    for plan in ([[1, 2], [1], []], [[0], [2, 3], []], [[3], [0, 1], []]):
        for tries in (_tries, _mesh_tries):
            results = pool4.run(_through, transport, tries, plan)
            for rank, (outcomes, in_step) in enumerate(results):
                assert outcomes == _expected(rank, plan) and in_step
    want = {(0, 1): 3.0, (2, 3): 7.0, (0, 2): 4.0, (1, 3): 6.0, (0, 1, 2, 3): 10.0}
    for rank, sums in enumerate(pool4.run(_through, transport, _every_rank_set)):
        expected = [[total] * 2 for s, total in want.items() if rank in s]
        assert sums == expected


def _bad_argument_after_a_first_large_call() -> tuple[str, bool]:
    """A checked re-box, then the rank set's first all-reduce of 80 KB (in shared memory:
    its large segment's first call), then rank 1 passes a bad sbp; then a re-box and a sum
    over both ranks."""
    P = sbp.placement.all("cpu")
    me = sbp.env.get_rank()
    x = sbp.arange(4, dtype=torch.float32, placement=P, sbp=S0)
    x.to_global(P, B)  # checked
    collectives.all_reduce(torch.ones(20_000), "sum", (0, 1))
    try:
        x.to_global(P, sbp.split(3) if me == 1 else B)
        name = "ok"
    except sbp.SbpError as e:
        name = type(e).__name__
    after = sbp.ones(2, placement=P, sbp=S0).to_global(P, B).to_local()
    total = collectives.all_reduce(torch.full((3,), me + 1.0), "sum", (0, 1))
    return name, torch.equal(after, torch.ones(2)) and total.tolist() == [3.0] * 3


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_bad_argument_after_a_first_large_call_is_named(transport):
    """Before: the large segment's first call took the small one's place as the count of
    the rank set's calls, so the failure marked a call no peer waited in: rank 0 waited
    out the timeout, and the ranks went out of step (found in review). A pool of its own:
    the large segment's first call happens once per pool."""
    pool = SpmdPool(2, comm_timeout=30)
    try:
        results = pool.run(_through, transport, _bad_argument_after_a_first_large_call)
    finally:
        pool.close()
    assert results == [("RankFailedError", True), ("SbpSignatureError", True)]


def _bad_argument_then_save(directory: str, late: int) -> list[str]:
    """Rank 1 passes a bad sbp, rank `late` a little late (rank 0 waits for it in the
    re-box's gather, or rank 1 waits in the save's arrival for rank 0, which then finds
    the failure's mark there), then every rank saves a checkpoint, then sums over both
    ranks: each step's outcome."""
    import torch.distributed.checkpoint  # noqa: F401 - (imported: save arrives at once)

    P = sbp.placement.all("cpu")
    me = sbp.env.get_rank()
    x = sbp.arange(4, dtype=torch.float32, placement=P, sbp=S0)
    x.to_global(P, B)  # checked
    window, sbp.checkpoint.ARRIVAL_WINDOW_S = sbp.checkpoint.ARRIVAL_WINDOW_S, 5.0
    outcomes = []
    try:
        for step in ("re-box", "save", "sum"):
            start = time.monotonic()
            try:
                if step == "re-box":
                    time.sleep(0.1 if me == late else 0)
                    x.to_global(P, sbp.split(3) if me == 1 else B)
                elif step == "save":
                    sbp.checkpoint.save({"w": torch.full((2,), 7.0)}, directory)
                else:
                    total = collectives.all_reduce(torch.full((3,), me + 1.0), "sum", (0, 1))
                    assert total.tolist() == [3.0] * 3
                outcomes.append("ok")
            except sbp.SbpError as e:
                outcomes.append(type(e).__name__)
            assert time.monotonic() - start < 2.5  # (the arrival's window is 5 s)
    finally:
        sbp.checkpoint.ARRIVAL_WINDOW_S = window
    return outcomes


@pytest.mark.parametrize("late", [1, 0])
def test_a_failing_rank_that_goes_on_into_a_save_keeps_the_ranks_in_step(late, pool2, tmp_path):
    """Before: rank 1 marked itself away in the save's arrival while rank 0 still waited in
    the call rank 1 skipped; rank 0 took that call back as out of step instead of
    answering the failure, and the save and the next sums waited out the timeout (found in
    review). Now a rank settles its failures before it waits in an arrival, and a rank
    that comes to the call later looks for the failure's mark before the arrival's (it
    raised `MetaMismatchError` instead, found in review)."""
    directory = str(tmp_path / "c")
    results = pool2.run(_through, "shared memory", _bad_argument_then_save, directory, late)
    assert results == [["RankFailedError", "ok", "ok"], ["SbpSignatureError", "ok", "ok"]]
