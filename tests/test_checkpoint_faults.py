"""Checkpoints that never lose the last good one: a save over an existing checkpoint that
fails or loses a rank at any point leaves exactly the old state loadable (or, once the
commit marker is written, exactly the new one), never a mix; damaged files are caught.

Before generations and the commit marker, DCP rewrote the data files in place and wrote
`.metadata` last: a save of B failing on one rank over A loaded as a mix of A and B.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
import torch

import sbp
from sbp import checkpoint_files
from sbp.checkpoint import CheckpointError
from sbp.comm import collectives, shm
from sbp.testing.pool import SpmdError, SpmdPool

S0, B = sbp.split(0), sbp.broadcast


def _logical(version: int) -> dict:
    g = torch.Generator().manual_seed(version)
    return {
        "s0": torch.randn(7, 5, generator=g, dtype=torch.float64),
        "b": torch.randn(6, 4, generator=g, dtype=torch.float64),
        "n": version,
    }


def _state(version: int | None) -> dict:
    """Global tensors of `version`'s values (zeros for None) on every rank of the world."""
    P = sbp.placement.all("cpu")
    ref = _logical(version or 0)
    state = {}
    for name, nd in (("s0", S0), ("b", B)):
        g = sbp.zeros(*ref[name].shape, placement=P, sbp=nd, dtype=torch.float64)
        if version is not None:
            g.copy_(ref[name])
        state[name] = g
    state["n"] = ref["n"] if version is not None else -1
    return state


def _loaded(directory: str) -> int:
    """The version a load of `directory` returns: every value of it, or the test fails."""
    state = _state(None)
    sbp.checkpoint.load(state, directory)
    version = state["n"]
    ref = _logical(version)
    for name in ("s0", "b"):
        torch.testing.assert_close(state[name].full_tensor(), ref[name], rtol=0, atol=0)
    return version


def _fail_at(point: str, rank: int):
    """Patch the save so that `rank` fails (raises, or dies with `kill`) at `point`."""
    from torch.distributed.checkpoint import FileSystemWriter

    patches = []

    def patch(owner, name, replacement):
        patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    if sbp.env.get_rank() != rank:
        return patches
    if point in ("write", "kill in write"):

        def write_data(self, plan, planner):
            if point == "kill in write":
                os._exit(9)
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

        patch(FileSystemWriter, "write_data", write_data)
    elif point == "checksums":

        def files_of_rank(folder, me):
            raise OSError(errno.EIO, "Input/output error (injected)")

        patch(checkpoint_files, "files_of_rank", files_of_rank)
    elif point in ("marker", "kill after commit"):
        commit = checkpoint_files.commit

        def failing_commit(root, generation, files):
            if point == "kill after commit":
                commit(root, generation, files)
                os._exit(9)
            (root / f".{checkpoint_files.MARKER}.partial.tmp").write_text('{"format": 1, "gen')
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

        patch(checkpoint_files, "commit", failing_commit)
    return patches


def _save_over(directory: str, point: str, rank: int) -> tuple[str, float]:
    """Save version 1, then version 2 failing at `point` on `rank`: the error and its time
    (also written to `<directory>.rank<r>`, for a pool whose other rank died)."""
    sbp.checkpoint.save(_state(1), directory)
    patches = _fail_at(point, rank)
    start = time.monotonic()
    try:
        sbp.checkpoint.save(_state(2), directory)
        result = "no error"
    except CheckpointError as e:
        result = str(e)
    finally:
        for owner, name, original in patches:
            setattr(owner, name, original)
    seconds = time.monotonic() - start
    Path(f"{directory}.rank{sbp.env.get_rank()}").write_text(f"{seconds}\n{result}")
    return result, seconds


def _generations(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("generation-"))


@pytest.mark.parametrize(
    "point, rank, why",
    [
        ("write", 1, "No space left on device (injected)"),
        ("write", 0, "No space left on device (injected)"),
        ("checksums", 1, "reading back its files failed on ranks [1]"),
        ("marker", 0, "writing the commit marker failed on ranks [0]"),
    ],
)
def test_a_failed_save_over_a_checkpoint_leaves_the_old_one(point, rank, why, pool2, tmp_path):
    directory = str(tmp_path / "ckpt")
    for message, seconds in pool2.run(_save_over, directory, point, rank, timeout=90):
        assert why in message and "ckpt" in message
        assert seconds < 10
    assert _loaded(directory) == 1  # in this process (a world of 1): exactly the old state
    assert pool2.run(_loaded, directory) == [1, 1]
    assert len(_generations(directory)) == 1  # the failed generation was removed
    pool2.run(sbp.checkpoint.save, _state(3), directory)  # and the folder takes the next save
    assert _loaded(directory) == 3 and len(_generations(directory)) == 1


def _save_on_rank_0_only(directory: str) -> tuple[str, float] | None:
    sbp.checkpoint.ARRIVAL_WINDOW_S = 2.0
    state = _state(1)
    if sbp.env.get_rank() != 0:
        return None
    start = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        sbp.checkpoint.save(state, directory)
    return str(info.value), time.monotonic() - start


def _save_on_rank_0_while_rank_1_reduces(directory: str, gloo: bool) -> tuple[str, float, bool]:
    """Rank 0 saves, rank 1 goes on into an all-reduce in shared memory, or through gloo
    (`gloo`: no shared segment, as between hosts): each rank's error and its time, then
    a sum over both."""
    sbp.checkpoint.ARRIVAL_WINDOW_S = 2.0
    state = _state(1)
    saved = shm._ENABLED
    shm._ENABLED = saved and not gloo
    try:
        collectives.all_reduce(torch.ones(3), "sum", (0, 1))  # (the rank set's first frame)
        start = time.monotonic()
        try:
            if sbp.env.get_rank() == 0:
                sbp.checkpoint.save(state, directory)
            else:
                collectives.all_reduce(torch.ones(3), "sum", (0, 1))
            name = "no error"
        except sbp.SbpError as e:
            name = f"{type(e).__name__}: {e}"
        seconds = time.monotonic() - start
        total = collectives.all_reduce(torch.ones(3), "sum", (0, 1))
        return name, seconds, torch.equal(total, torch.full((3,), 2.0))
    finally:
        shm._ENABLED = saved


SAVE_ON_SOME_RANKS = {
    # through gloo, the others wait inside gloo's frame; before: for the full timeout
    # (rank 0 raised after the arrival's window)
    "gloo": (
        "CheckpointError: sbp.checkpoint.save(",
        "RankFailedError: rank 0 raised CheckpointError: ",
    ),
    # in shared memory, rank 0 waits in the save's arrival, marked in the segment: rank 1,
    # waiting for it in the all-reduce there, sees the mark, and both raise at once (not a
    # CheckpointError: before the window), each taking its call back
    "shared memory": (
        "MetaMismatchError: ranks [1] wait inside a collective over ranks",
        "MetaMismatchError: ranks [0] wait for every rank to arrive",
    ),
}


@pytest.mark.parametrize("transport", sorted(SAVE_ON_SOME_RANKS))
def test_a_save_on_some_ranks_is_named_where_the_others_wait(transport, tmp_path):
    """A pool of its own: the absent rank leaves the arrival counts apart."""
    pool = SpmdPool(2, comm_timeout=30)
    try:
        (name0, seconds0, in_step0), (name1, seconds1, in_step1) = pool.run(
            _save_on_rank_0_while_rank_1_reduces, str(tmp_path / "c"), transport == "gloo"
        )
    finally:
        pool.close()
    start0, start1 = SAVE_ON_SOME_RANKS[transport]
    assert name0.startswith(start0) and name1.startswith(start1), (name0, name1)
    assert transport != "gloo" or "not only rank 0" in name0
    assert seconds0 < 5 and seconds1 < 5
    assert in_step0 and in_step1


def _load_killed_on_rank_1(directory: str) -> None:
    """Rank 1 dies while DCP reads; rank 0 writes its error and time to `<directory>.rank0`."""
    from torch.distributed.checkpoint import FileSystemReader

    if sbp.env.get_rank() == 1:
        FileSystemReader.read_data = lambda self, plan, planner: os._exit(9)
    start = time.monotonic()
    try:
        _loaded(directory)
        result = "no error"
    except CheckpointError as e:
        result = str(e)
    Path(f"{directory}.rank0").write_text(f"{time.monotonic() - start}\n{result}")


def test_a_rank_lost_or_absent_during_a_save(tmp_path):
    """A rank dies while writing (the survivor raises within seconds, the old state loads)
    or right after rank 0 committed (the survivor raises, the new state loads), or while
    a load reads (the survivor raises within seconds); a save
    called on rank 0 only (`if rank == 0: save(...)`; before: rank 0 waited out the
    timeout in DCP's first collective) fails fast. A pool of its own: the kills restart
    it, and the absent rank leaves the ranks' arrival counts apart, so that case is last."""
    pool = SpmdPool(2, comm_timeout=30)
    try:
        for point, rank, version in (("kill in write", 1, 1), ("kill after commit", 0, 2)):
            directory = str(tmp_path / point.replace(" ", "-"))
            with pytest.raises(SpmdError, match=f"rank {rank} died"):
                pool.run(_save_over, directory, point, rank, timeout=90)
            seconds, message = Path(f"{directory}.rank{1 - rank}").read_text().split("\n", 1)
            assert float(seconds) < 10, point
            assert "sbp.checkpoint.save" in message and "ranks [" in message, message
            assert _loaded(directory) == version, point
        directory = str(tmp_path / "kill-in-read")
        pool.run(sbp.checkpoint.save, _state(1), directory)
        with pytest.raises(SpmdError, match="rank 1 died"):
            pool.run(_load_killed_on_rank_1, directory, timeout=90)
        seconds, message = Path(f"{directory}.rank0").read_text().split("\n", 1)
        assert float(seconds) < 10 and "sbp.checkpoint.load" in message, message
        result, none = pool.run(_save_on_rank_0_only, str(tmp_path / "c"))
    finally:
        pool.close()
    assert none is None
    message, seconds = result
    assert "not every rank called it within 2 s" in message
    assert "not only rank 0" in message and seconds < 5
    assert not (tmp_path / "c" / checkpoint_files.MARKER).exists()


def test_damaged_bytes_in_a_saved_tensor_are_caught_on_every_rank(pool2, tmp_path):
    """(Before: a byte changed inside a tensor's data loaded without a word.)"""
    directory = tmp_path / "ckpt"
    pool2.run(sbp.checkpoint.save, _state(1), str(directory))
    folder = sbp.checkpoint.committed_folder(directory)
    victim = folder / "__1_0.distcp"
    data = bytearray(victim.read_bytes())
    data[-20] ^= 0x01  # one bit inside the last tensor's bytes: the size stays
    victim.write_bytes(bytes(data))
    for message in pool2.run(_load_error, str(directory)):
        assert "damaged files on ranks" in message and "__1_0.distcp" in message
        assert "CRC-32" in message
    with pytest.raises(CheckpointError, match="__1_0.distcp"):
        _loaded(str(directory))


def _load_error(directory: str) -> str:
    with pytest.raises(CheckpointError) as info:
        _loaded(directory)
    return str(info.value)


@pytest.mark.parametrize("bad", [None, 3, ""])
def test_a_checkpoint_dir_that_is_not_a_path_is_named(bad):
    """(Before: `save(state, None)` raised DCP's raw error.)"""
    for fn in (sbp.checkpoint.save, sbp.checkpoint.load):
        with pytest.raises(CheckpointError, match="checkpoint_dir must be a folder's path"):
            fn({"n": 1}, bad)


def test_a_checkpoint_dir_that_is_a_file_is_named(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(CheckpointError, match="is a file, not a folder"):
        sbp.checkpoint.save({"n": 1}, path)


def test_a_checkpoint_written_before_generations_still_loads_and_is_superseded(tmp_path):
    """A folder with DCP's files at its top (sbp before generations, or DCP itself) loads;
    the next save commits a generation and removes the superseded files."""
    import torch.distributed.checkpoint as dcp

    directory = tmp_path / "old"
    ref = _logical(1)
    dcp.save({"s0": ref["s0"], "b": ref["b"], "n": 1}, checkpoint_id=str(directory))
    assert sbp.checkpoint.committed_folder(directory) == directory
    assert _loaded(str(directory)) == 1
    sbp.checkpoint.save(_state(2), directory)
    assert _loaded(str(directory)) == 2
    names = set(os.listdir(directory))
    assert ".metadata" not in names and not any(n.endswith(".distcp") for n in names)
    assert names == {checkpoint_files.MARKER, *_generations(str(directory))}
    assert Path(sbp.checkpoint.committed_folder(directory)).parent == directory
