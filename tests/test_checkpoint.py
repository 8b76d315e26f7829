"""Checkpoints: saved on N ranks through torch.distributed.checkpoint (DCP), loaded on M.

Worlds of 4 and 2 are the session's pools; a world of 1 is this pytest process itself
(no process group, as a one-process user runs). A world of 3 is a 3-rank placement
inside the world of 4 (ranks [1, 2, 3], and [2, 0, 1] for another rank order): the
fourth rank still takes part in dcp.load, holds nothing and reads nothing. Starting a
separate 3-process world would cost ~10 s of start-up on this 2-core box and exercise
the same per-rank read plan (every rank reads the saved chunks overlapping its part).
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import sbp
from sbp import checkpoint_files
from sbp.checkpoint import CheckpointError

S0, S1, B, PS = sbp.split(0), sbp.split(1), sbp.broadcast, sbp.partial_sum
W4, W22 = [0, 1, 2, 3], [[0, 1], [2, 3]]

# name -> (logical shape, ranks, nd_sbp) as saved on 4 ranks; uneven over 2 and over 4.
SAVED = {
    "s0": ((7, 5), W4, (S0,)),
    "s1": ((5, 9), W4, (S1,)),
    "b": ((6, 4), W4, (B,)),
    "p": ((5, 3), W4, (PS,)),
    "s0s1": ((7, 9), W22, (S0, S1)),
    "bs1": ((3, 10), W22, (B, S1)),
    "scalar": ((), W4, (B,)),
}

# Loads: name -> (ranks, nd_sbp) per world.
LOAD_4 = {
    "s0": (W4, (S1,)),
    "s1": (W22, (S0, S1)),
    "b": ([3, 2, 1, 0], (S0,)),
    "p": (W4, (PS,)),
    "s0s1": (W22, (S1, S0)),
    "bs1": (W4, (B,)),
}
LOAD_3 = {
    "s0": ([1, 2, 3], (S1,)),
    "s1": ([1, 2, 3], (S0,)),
    "b": ([2, 0, 1], (B,)),
    "p": ([1, 2, 3], (S0,)),
    "s0s1": ([2, 0, 1], (S0,)),
    "bs1": ([1, 2, 3], (S1,)),
}
LOAD_2 = {
    "s0": ([0, 1], (S0,)),
    "s1": ([1, 0], (B,)),
    "b": ([0, 1], (S1,)),
    "p": ([0, 1], (PS,)),
    "s0s1": ([[0], [1]], (S1, S0)),
    "bs1": ([0, 1], (S0,)),
    "scalar": ([1, 0], (B,)),
}
LOAD_1 = {name: ([0], (S1,) if name == "s1" else (B,)) for name in SAVED}


def _logical(name: str) -> torch.Tensor:
    shape = SAVED[name][0]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _make(name: str) -> sbp.GlobalTensor:
    """The saved tensor, built from its local parts (partial: rank r holds (r+1)/10 of it)."""
    shape, ranks, nd = SAVED[name]
    P = sbp.placement("cpu", ranks)
    me = sbp.env.get_rank()
    x = _logical(name)
    if nd == (PS,):
        local = x * (P.index(me) + 1) / 10
    else:
        local = x[sbp.local_slices(shape, P, nd, P.coord(me))]
    return sbp.to_global(local.clone(), P, nd, shape=shape)


def _save_all(directory: str) -> None:
    sbp.checkpoint.save({name: _make(name) for name in SAVED}, directory)


def _load_all(directory: str, targets: dict) -> dict:
    """Load every saved tensor into zeros of the target placement and sbp; logical values."""
    state = {}
    for name, (ranks, nd) in targets.items():
        shape = SAVED[name][0]
        zeros = torch.zeros(shape, dtype=torch.float64)  # sbp.zeros(()) fails in factories
        state[name] = sbp.tensor(zeros, placement=sbp.placement("cpu", ranks), sbp=nd)
    sbp.checkpoint.load(state, directory)
    out = {}
    for name, g in state.items():
        assert tuple(g.sbp) == targets[name][1]  # loaded in place: placement and sbp kept
        full = g.full_tensor()
        out[name] = full if sbp.env.get_rank() in g.placement else None
    return out


def _check_values(results: list[dict]) -> None:
    for rank_values in results:
        for name, got in rank_values.items():
            if got is not None:
                torch.testing.assert_close(got, _logical(name), rtol=1e-12, atol=1e-12)


def _generation(directory: str | Path) -> Path:
    """The folder of the generation the checkpoint's marker commits."""
    folder = checkpoint_files.read_marker(Path(directory)).folder
    assert sbp.checkpoint.committed_folder(directory) == folder
    return folder


def _stored_chunks(directory: str) -> dict[str, list[tuple[tuple, int, int]]]:
    """fqn -> [(global offsets, writing rank, bytes)] from the checkpoint's metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(_generation(directory)).read_metadata()
    out = defaultdict(list)
    for index, info in md.storage_data.items():
        rank = int(os.path.basename(info.relative_path).split("_")[2])  # "__{rank}_{n}.distcp"
        out[index.fqn].append((tuple(index.offset), rank, info.length))
    return out


@pytest.fixture(scope="module")
def saved4(tmp_path_factory, pool4):
    directory = str(tmp_path_factory.mktemp("ckpt4"))
    pool4.run(_save_all, directory)
    return directory


def test_each_rank_writes_its_own_shards_and_replicas_once(saved4):
    chunks = _stored_chunks(saved4)
    P4 = sbp.placement("cpu", W4)
    # torch.save's cost per chunk, from the 1-chunk tensors (+ up to 63 B of data alignment)
    header = max(length - _logical(n).nbytes for n in ("b", "p") for _, _, length in chunks[n])
    assert 0 < header < 2048
    header += 64
    for name in ("s0", "s1"):  # one chunk per rank, written by that rank: its own shard
        shape, _, nd = SAVED[name]
        slices = {r: sbp.local_slices(shape, P4, nd, r) for r in range(4)}
        want = {tuple(s.start for s in slices[r]): r for r in range(4)}
        assert {offset: rank for offset, rank, _ in chunks[name]} == want
        for _, rank, length in chunks[name]:
            shard_bytes = _logical(name)[slices[rank]].nbytes
            assert shard_bytes <= length <= shard_bytes + header
    P22 = sbp.placement("cpu", W22)
    want = {
        tuple(s.start for s in sbp.local_slices((7, 9), P22, (S0, S1), c))
        for c in [(0, 0), (0, 1), (1, 0), (1, 1)]
    }
    assert {offset for offset, _, _ in chunks["s0s1"]} == want
    # Replicas: a broadcast tensor (and the reduced partial one) is one chunk in all, a
    # (B, S(1)) tensor one chunk per S(1) part, not one per rank.
    assert len(chunks["b"]) == 1 and len(chunks["p"]) == 1
    assert sorted(offset for offset, _, _ in chunks["bs1"]) == [(0, 0), (0, 5)]
    # Bytes: each tensor's data is written once in all (no chunk carries a replica).
    per_rank = defaultdict(int)
    for name, items in chunks.items():
        assert sum(length for _, _, length in items) <= _logical(name).nbytes + header * len(items)
        assert sum(length for _, _, length in items) >= _logical(name).nbytes
        for _, rank, length in items:
            per_rank[rank] += length
    assert sorted(per_rank) == [0, 1, 2, 3]  # every rank wrote (DCP spreads the replicas)


def test_load_on_4_ranks_into_other_placements_and_sbps(saved4, pool4):
    _check_values(pool4.run(_load_all, saved4, LOAD_4))


def test_load_on_3_ranks_of_4(saved4, pool4):
    results = pool4.run(_load_all, saved4, LOAD_3)
    _check_values(results)
    assert results[0]["s0"] is None  # rank 0 is outside [1, 2, 3]: it holds nothing


def test_load_on_2_ranks(saved4, pool2):
    _check_values(pool2.run(_load_all, saved4, LOAD_2))


def test_load_on_1_rank_in_this_process(saved4):
    _check_values([_load_all(saved4, LOAD_1)])


def _load_split_with_recorded_reads(directory: str) -> list[tuple]:
    """Plain dcp.load (no sbp wrapper) of "s0" split(0) on 2 ranks; the saved chunks read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Recording(DefaultLoadPlanner):
        def finish_plan(self, new_plan):
            self.reads = [tuple(item.storage_index.offset) for item in new_plan.items]
            return super().finish_plan(new_plan)

    P = sbp.placement("cpu", [0, 1])
    g = sbp.zeros(7, 5, placement=P, sbp=S0, dtype=torch.float64)
    planner = Recording()
    folder = sbp.checkpoint.committed_folder(directory)  # (where DCP's own reader looks)
    dcp.load({"s0": g}, checkpoint_id=folder, planner=planner)
    torch.testing.assert_close(g.full_tensor(), _logical("s0"), rtol=0, atol=0)
    return sorted(planner.reads)


def test_each_rank_reads_only_the_chunks_it_needs(saved4, pool2):
    # Saved split(0) of 7 rows on 4 ranks: rows [0,2) [2,4) [4,6) [6,7). Loaded on 2 ranks
    # rank 0 holds rows [0,4) and rank 1 rows [4,7): each reads two of the four chunks.
    reads = pool2.run(_load_split_with_recorded_reads, saved4)
    assert reads == [[(0, 0), (2, 0)], [(4, 0), (6, 0)]]


# ---------------------------------------------------------------- training resumes


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 10)
        self.fc2 = torch.nn.Linear(10, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _model() -> MLP:
    torch.manual_seed(3)
    return MLP().double()


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [
        (
            torch.randn(8, 6, generator=g, dtype=torch.float64),
            torch.randn(8, 3, generator=g, dtype=torch.float64),
        )
        for _ in range(6)
    ]


def _train_global(
    opt_name: str,
    load_dir,
    save_dir: str,
    steps: range,
    split_fc1: bool,
    held=False,
    optimizer_first=False,
):
    """Data-parallel steps on the whole world; fc1.weight split(0) over ranks if asked;
    with `held`, the parameters hold gradients (of a backward) when the state is loaded;
    with `optimizer_first`, the optimizer is made before `to_global` (of the plain ones)."""
    P = sbp.placement.all("cpu")
    model = _model()
    if optimizer_first:
        opt = _optimizer(opt_name, model.parameters())
    model.to_global(P, B)  # then fc1.weight re-split (to_global re-boxes globals)
    if split_fc1:
        w = model.fc1.weight.detach()
        model.fc1.weight = torch.nn.Parameter(w.to_global(sbp=S0))
    if not optimizer_first:
        opt = _optimizer(opt_name, model.parameters())
    batches = _batches()
    if held:
        x = sbp.to_global(batches[0][0], P, B)
        model(x).square().sum().backward()
    assert sbp.checkpoint.load_training_state(load_dir, model, opt) == steps.start
    if held:
        assert len(opt.state) == len(list(model.parameters()))
    for i in steps:
        _train_step(model, opt, P, batches[i])
    sbp.checkpoint.save_training_state(save_dir, model, opt, steps.stop)
    return [p.full_tensor() for p in model.parameters()], tuple(model.fc1.weight.sbp)


def _train_step(model, opt, P, batch) -> None:
    """One data-parallel step on the logical `batch`, split(0) over `P` (None: one process,
    plain tensors)."""
    x, y = batch
    if P is None:
        loss = F.mse_loss(model(x), y)
    else:
        part = sbp.local_slices(x.shape, P, S0, P.coord(sbp.env.get_rank()))
        loss = F.mse_loss(model(sbp.to_global(x[part], P, S0)), sbp.to_global(y[part[:1]], P, S0))
    opt.zero_grad()
    loss.backward()
    opt.step()


def _train_one_process(opt_name: str):
    model = _model()
    opt = _optimizer(opt_name, model.parameters())
    for batch in _batches():
        _train_step(model, opt, None, batch)
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_train_3_steps_on_4_ranks_resume_3_on_2(opt_name, pool4, pool2, tmp_path):
    """3 steps on 4 ranks (fc1.weight split), save, load on 2 ranks (all broadcast), 3 more:
    the parameters equal 6 uninterrupted steps in one process (momentum, Adam moments and
    step counts came through). The result also loads in this process (a world of 1)."""
    a, b, c = (str(tmp_path / n) for n in "abc")
    _, sbp4 = pool4.run(_train_global, opt_name, None, a, range(0, 3), True)[0]
    params, sbp2 = pool2.run(_train_global, opt_name, a, b, range(3, 6), False)[0]
    assert (sbp4, sbp2) == ((S0,), (B,))
    want = _train_one_process(opt_name)
    for got, ref in zip(params, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    params1, _ = _train_global(opt_name, b, c, range(6, 6), True)
    for got, ref in zip(params1, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_resume_into_parameters_holding_gradients(opt_name, pool2, tmp_path):
    """A load after a backward (gradients held) restores the optimizer's state too (before:
    its state stayed empty, silently: momentum and Adam's moments started afresh)."""
    a, b = (str(tmp_path / n) for n in "ab")
    pool2.run(_train_global, opt_name, None, a, range(0, 3), False)
    params, _ = pool2.run(_train_global, opt_name, a, b, range(3, 6), False, True)[0]
    for got, ref in zip(params, _train_one_process(opt_name), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_resume_into_an_optimizer_made_before_to_global(opt_name, pool2, tmp_path):
    """The optimizer holds the plain parameters until its next step points it at the global
    ones (`sbp.optim_step.repoint`); the load points it first (before: it made no state
    for the global parameters, and the load dropped the saved state, silently)."""
    a, b = (str(tmp_path / n) for n in "ab")
    pool2.run(_train_global, opt_name, None, a, range(0, 3), False)
    params, _ = pool2.run(_train_global, opt_name, a, b, range(3, 6), False, False, True)[0]
    for got, ref in zip(params, _train_one_process(opt_name), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_resume_from_a_checkpoint_saved_before_the_first_step(opt_name, pool2, tmp_path):
    """At step 0 the optimizer has no state: the load gives it none (before: it made state
    to fill and DCP asked the checkpoint for it, 'Missing key' on every rank)."""
    a, b = (str(tmp_path / n) for n in "ab")
    pool2.run(_train_global, opt_name, None, a, range(0, 0), False)
    params, _ = pool2.run(_train_global, opt_name, a, b, range(0, 6), False)[0]
    for got, ref in zip(params, _train_one_process(opt_name), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def _train_fc2_frozen_before_3(opt_name: str, load_dir, save_dir, steps: range):
    """Steps with fc2 frozen before step 3, so that only fc1 has optimizer state then.
    Before a load, the optimizer steps once with fc1 frozen: it holds fc2's state alone,
    which the checkpoint lacks, and lacks fc1's, which the checkpoint holds. Returns the
    logical parameters (plain in one process) and the state's indices after the load."""
    P = sbp.placement.all("cpu") if sbp.env.is_distributed() else None
    model = _model() if P is None else _model().to_global(P, B)
    opt = _optimizer(opt_name, model.parameters())
    batches = _batches()
    loaded = None
    if load_dir is not None:
        model.fc1.requires_grad_(False)
        _train_step(model, opt, P, batches[0])
        model.fc1.requires_grad_(True)
        sbp.checkpoint.load({"model": model, "optim": opt}, load_dir)
        loaded = sorted(opt.state_dict()["state"])
    for i in steps:
        model.fc2.requires_grad_(i >= 3)
        _train_step(model, opt, P, batches[i])
    if save_dir is not None:
        sbp.checkpoint.save({"model": model, "optim": opt}, save_dir)
    params = [p.detach() if P is None else p.full_tensor() for p in model.parameters()]
    return params, loaded


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_resume_where_parameters_had_no_optimizer_state(opt_name, pool2, tmp_path):
    """A parameter with no state in the checkpoint (frozen, or never given a gradient) has
    none after the load, whatever the target held, and one with state gets it even where
    the target had stepped others already (before: 'Missing key', or fc1's momentum and
    moments silently dropped)."""
    a = str(tmp_path / "a")
    pool2.run(_train_fc2_frozen_before_3, opt_name, None, a, range(0, 3))
    for params, loaded in pool2.run(_train_fc2_frozen_before_3, opt_name, a, None, range(3, 6)):
        assert loaded == [0, 1]  # fc1's weight and bias
        want, _ = _train_fc2_frozen_before_3(opt_name, None, None, range(0, 6))
        for got, ref in zip(params, want, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- failures


def _load_expecting_error(directory: str | list[str]) -> str:
    if isinstance(directory, list):  # one directory per rank
        directory = directory[sbp.env.get_rank()]
    g = sbp.zeros(7, 5, placement=sbp.placement.all("cpu"), sbp=S0, dtype=torch.float64)
    with pytest.raises(CheckpointError) as info:
        sbp.checkpoint.load({"s0": g}, directory)
    return str(info.value)


def test_missing_checkpoint_is_an_error_on_every_rank(saved4, pool2, tmp_path):
    messages = pool2.run(_load_expecting_error, str(tmp_path / "nothing-here"), timeout=60)
    for message in messages:
        assert "nothing-here" in message and "no checkpoint there" in message
        assert "on ranks [0, 1]" in message
    # Only rank 1 misses it (say, a disk not shared): rank 0 raises too instead of waiting.
    dirs = [saved4, str(tmp_path / "nothing-here")]
    for message in pool2.run(_load_expecting_error, dirs, timeout=60):
        assert "no checkpoint there" in message and "on ranks [1]" in message


def test_truncated_checkpoint_is_an_error_on_every_rank(saved4, pool2, tmp_path):
    """A committed generation's file cut short fails its checksum; without a marker (a
    folder DCP wrote itself, or sbp before generations) DCP's own read fails."""
    import shutil

    for victim in ("__1_0.distcp", ".metadata"):
        committed = tmp_path / ("committed" + victim.strip("._"))
        shutil.copytree(saved4, committed)
        bare = tmp_path / ("bare" + victim.strip("._"))
        shutil.copytree(_generation(saved4), bare)
        for path in (_generation(committed) / victim, bare / victim):
            path.write_bytes(path.read_bytes()[:100])
        for message in pool2.run(_load_expecting_error, str(committed), timeout=60):
            assert "damaged files on ranks" in message and victim in message
            assert "bytes where" in message
        for message in pool2.run(_load_expecting_error, str(bare), timeout=60):
            assert "failed on ranks" in message and victim.strip("._") in message


def _failed_loads(directory: str) -> list:
    """Loads that fail on every rank, each leaving its targets as they were: an optimizer
    into a checkpoint without one (then one step, which must be a fresh optimizer's), a
    tensor where a Python value was saved, and a state that is not a dict."""
    P = sbp.placement.all("cpu")
    model = _model().to_global(P, B)
    sbp.checkpoint.save({"model": model, "n": 3}, directory)
    opt = _optimizer("adamw", model.parameters())
    messages = []
    with pytest.raises(CheckpointError) as info:
        sbp.checkpoint.load({"model": model, "optim": opt}, directory)
    messages.append(str(info.value))
    empty = len(opt.state) == 0
    _train_step(model, opt, P, _batches()[0])
    target = sbp.zeros(2, placement=P, sbp=B, dtype=torch.float64)
    with pytest.raises(CheckpointError) as info:
        sbp.checkpoint.load({"n": target}, directory)
    messages.append(str(info.value))
    for bad in ([model], model):
        with pytest.raises(CheckpointError) as info:
            sbp.checkpoint.save(bad, directory)
        messages.append(str(info.value))
    return empty, [p.full_tensor() for p in model.parameters()], messages


def test_a_failed_load_leaves_its_targets_as_they_were(pool2, tmp_path):
    """(Before: the optimizer kept the state made to be filled, a first step taken, so the
    next step was Adam's second; a tensor target silently stayed as it was; a list for the
    state raised AttributeError.)"""
    model = _model()
    _train_step(model, _optimizer("adamw", model.parameters()), None, _batches()[0])
    for empty, params, messages in pool2.run(_failed_loads, str(tmp_path / "a")):
        assert empty
        for got, ref in zip(params, model.parameters(), strict=True):
            torch.testing.assert_close(got, ref.detach(), rtol=1e-10, atol=1e-12)
        missing, wrong_type, not_a_dict, a_module = messages
        assert "failed on ranks [0, 1]" in missing and "param_groups" in missing
        assert "'n' is a tensor here" in wrong_type and "int" in wrong_type
        assert "must be a dict" in not_a_dict and "list" in not_a_dict
        assert "must be a dict" in a_module and "MLP" in a_module


def _full_state_dict_off_the_placement():
    model = _model().to_global(sbp.placement("cpu", [1]), B)
    return sbp.checkpoint.full_state_dict(model)


def test_full_state_dict_on_ranks_outside_the_placement(pool2):
    """rank=None gives every rank of the world the logical values (before: empty tensors
    on ranks outside the model's placement)."""
    want = _model().state_dict()
    for got in pool2.run(_full_state_dict_off_the_placement):
        assert got.keys() == want.keys()
        for key, value in got.items():
            torch.testing.assert_close(value, want[key], rtol=0, atol=0)


# ---------------------------------------------------------------- plain hand-off


def _mixed_model(P) -> torch.nn.Module:
    """fc1.weight split(0), fc2.weight split(1), biases broadcast."""
    model = _model().to_global(P, B)  # then re-split (to_global re-boxes global parameters)
    for layer, s in ((model.fc1, S0), (model.fc2, S1)):
        layer.weight = torch.nn.Parameter(layer.weight.detach().to_global(sbp=s))
    return model


def _hand_off(directory: str):
    me = sbp.env.get_rank()
    P = sbp.placement.all("cpu")
    model = _mixed_model(P)
    everywhere = sbp.checkpoint.full_state_dict(model)
    on_zero = sbp.checkpoint.full_state_dict(model, rank=0)
    if me == 0:
        torch.save(on_zero, os.path.join(directory, "model.pt"))
    torch.distributed.barrier()
    # Another model with other values and sbps loads the plain file: each parameter is
    # distributed by its own sbp.
    torch.manual_seed(100)  # sbp.tensor takes the same logical value on every rank
    other = MLP().double().to_global(P, B)
    other.fc1.weight = torch.nn.Parameter(other.fc1.weight.detach().to_global(sbp=S1))
    plain = torch.load(os.path.join(directory, "model.pt"), weights_only=True)
    other.load_state_dict(plain)
    loaded = {k: v.full_tensor() for k, v in other.state_dict().items()}
    types = {k: type(v).__name__ for k, v in everywhere.items()}
    return everywhere, sorted(on_zero), loaded, types, tuple(other.fc1.weight.sbp)


def test_full_state_dict_to_one_file_and_back_into_other_sbps(pool4, tmp_path):
    want = _model().state_dict()
    for rank, (everywhere, on_zero, loaded, types, sbp_fc1) in enumerate(
        pool4.run(_hand_off, str(tmp_path))
    ):
        assert set(types.values()) == {"Tensor"}  # plain tensors, ready for torch.save
        assert on_zero == (sorted(want) if rank == 0 else [])
        assert sbp_fc1 == (S1,)
        for key, value in want.items():
            torch.testing.assert_close(everywhere[key], value, rtol=0, atol=0)
            torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)


def _load_plain_batch_norm():
    """A plain state dict with BatchNorm's 0-dim `num_batches_tracked` (a PlacementError
    before: a 0-dim plain source was not taken as the logical value)."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).double()
    plain(torch.randn(5, 4, dtype=torch.float64))
    plain(torch.randn(5, 4, dtype=torch.float64))
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).double()
    model.to_global(sbp.placement.all("cpu"), B)
    model.load_state_dict(plain.state_dict())
    return plain.state_dict(), {k: v.full_tensor() for k, v in model.state_dict().items()}


def test_load_a_plain_state_dict_with_batch_norm(pool2):
    for want, got in pool2.run(_load_plain_batch_norm):
        assert got["1.num_batches_tracked"].item() == 2
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0)


def _copy_plain_into_partial():
    P = sbp.placement("cpu", [[0, 1], [2, 3]])
    x = _logical("s0s1")
    g = sbp.zeros(7, 9, placement=P, sbp=(PS, S1), dtype=torch.float64)
    with torch.no_grad():
        g.copy_(x)
    return g.full_tensor()


def test_copy_of_a_plain_value_into_a_partial_tensor(pool4):
    for full in pool4.run(_copy_plain_into_partial):
        torch.testing.assert_close(full, _logical("s0s1"), rtol=0, atol=0)


# ---------------------------------------------------------------- torch.save / torch.load


def _pickle_round_trip(directory: str):
    me = sbp.env.get_rank()
    P = sbp.placement("cpu", [0, 1])
    g = sbp.tensor(_logical("s0"), placement=P, sbp=S0).requires_grad_()
    torch.save({"g": g}, os.path.join(directory, f"rank{me}.pt"))
    torch.distributed.barrier()
    back = torch.load(os.path.join(directory, f"rank{me}.pt"), weights_only=True)["g"]
    other = os.path.join(directory, f"rank{1 - me}.pt")
    with pytest.raises(sbp.MetaMismatchError, match="holds rank"):
        torch.load(other, weights_only=True)
    return (
        type(back).__name__,
        back.placement == P,
        tuple(back.sbp),
        back.requires_grad,
        (back.full_tensor()),
    )


def test_torch_save_and_weights_only_load_of_a_global_tensor(pool2, tmp_path):
    for name, same_placement, nd, grad, full in pool2.run(_pickle_round_trip, str(tmp_path)):
        assert (name, same_placement, nd, grad) == ("GlobalTensor", True, (S0,), True)
        torch.testing.assert_close(full.detach(), _logical("s0"), rtol=0, atol=0)
    # This process is a world of 1: ranks [0, 1] cannot exist here.
    with pytest.raises(sbp.PlacementError, match=r"needs ranks \[1\]"):
        torch.load(str(tmp_path / "rank0.pt"), weights_only=True)


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16)
    config.bos_token_id = config.eos_token_id = 0
    return GPT2LMHeadModel(config)


def _save_pretrained_from_rank_0(directory: str) -> None:
    model = _tiny_gpt2()
    P = sbp.placement.all("cpu")
    with torch.no_grad():  # ranks start apart: to_global syncs them from rank 0
        for p in model.parameters():
            p.add_(sbp.env.get_rank())
    model.to_global(P, B)
    model.transformer.h[0].mlp.c_fc.weight = torch.nn.Parameter(
        model.transformer.h[0].mlp.c_fc.weight.to_global(sbp=S1)
    )
    state = sbp.checkpoint.full_state_dict(model, rank=0)
    if sbp.env.get_rank() == 0:
        model.save_pretrained(directory, state_dict=state)


def test_hugging_face_save_pretrained_of_a_global_model(pool2, tmp_path):
    pytest.importorskip("transformers")
    from transformers import GPT2LMHeadModel

    pool2.run(_save_pretrained_from_rank_0, str(tmp_path), timeout=300)
    back = GPT2LMHeadModel.from_pretrained(str(tmp_path))
    want = _tiny_gpt2().state_dict()
    for key, value in back.state_dict().items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=0)


def _save_pretrained_without_state_dict(directory: str) -> str:
    model = _tiny_gpt2().to_global(sbp.placement.all("cpu"), B)
    try:
        model.save_pretrained(directory)
    except sbp.InputTypeError as e:
        return str(e)
    return "saved"


def test_hugging_face_save_pretrained_without_state_dict_names_the_way(pool2, tmp_path):
    """safetensors reads a tensor's storage, which a global tensor has not (before: a raw
    RuntimeError, "invalid python storage"): a named error on every rank, with the way."""
    pytest.importorskip("transformers")
    for message in pool2.run(_save_pretrained_without_state_dict, str(tmp_path), timeout=300):
        assert "save_pretrained(d, state_dict=sbp.checkpoint.full_state_dict" in message
    assert not list(tmp_path.glob("*.safetensors"))
