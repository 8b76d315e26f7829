"""Checkpoints of global tensors: sharded through torch.distributed.checkpoint (DCP), or plain.

Sharded: `GlobalTensor` speaks DCP's checkpointable protocol (as DTensor does). Each rank
offers the chunk of the logical tensor it holds; DCP writes equal chunks (broadcast
replicas) once in all, and on load each rank reads only the saved chunks that overlap
the part it holds. So a checkpoint saved on N ranks loads on M ranks, into any
placement and sbp. `save` / `load` add what DCP leaves to the caller: partial tensors
are reduced before writing, optimizer state is created before loading into it, and a
failure on any rank is one `CheckpointError` on every rank.

Plain: `full_state_dict` gathers a global model's state to plain tensors (for
`torch.save`, `save_pretrained`, one-process inference), and `model.load_state_dict` of
plain tensors distributes each one by its parameter's sbp (see `GlobalTensor.copy_`).
`torch.save` of a GlobalTensor pickles this rank's part; `torch.load(weights_only=True)`
rebuilds it, and refuses where its placement cannot exist.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from sbp import checkpoint_files, env, optim_step, replicas, tensor_parts
from sbp.boxing.executor import empty_local, local_device
from sbp.comm import agreement, arrival
from sbp.comm.collectives import guarded
from sbp.comm.meta import gather_objects
from sbp.errors import (
    CommTimeoutError,
    MetaMismatchError,
    PlacementError,
    SbpError,
)
from sbp.layout import GlobalSpec
from sbp.placement import placement as Placement
from sbp.signature import (
    SBP,
    Partial,
    Split,
    broadcast,
    format_nd_sbp,
    is_all_broadcast,
    partials_to_broadcast,
)
from sbp.tensor import GlobalTensor

__all__ = [
    "CheckpointError",
    "committed_folder",
    "full_state_dict",
    "load",
    "load_training_state",
    "save",
    "save_training_state",
]


class CheckpointError(SbpError, RuntimeError):
    """A checkpoint could not be saved or loaded (missing, truncated, or not matching)."""


ARRIVAL_WINDOW_S = 30.0  # how long save/load wait for every rank to call them (or timeout/2)


# ---------------------------------------------------------------- save / load


def save(state: Mapping[str, Any], checkpoint_dir: str | os.PathLike) -> None:
    """Write `state` to `checkpoint_dir` with DCP; every rank of the world calls it.

    `state` maps names to modules, optimizers, (global) tensors and Python values. Each
    rank writes only its own shards, a broadcast tensor is written once in all, and a
    partial tensor is reduced first. The save writes a new generation of the folder and
    commits it last (see `sbp.checkpoint_files`): one that fails on any rank raises
    `CheckpointError` on every rank and leaves the checkpoint committed before as it was.
    """
    import torch.distributed.checkpoint as dcp

    root = _folder(checkpoint_dir, "save")
    _check_state(state, "save")
    with _guarded("save", root):
        _all_ranks_called("save", root)
        with torch.no_grad():
            sd = {k: _map_tensors(_state_dict_of(v), _reduced) for k, v in state.items()}
        replicas.check(_named_tensors(sd), f"sbp.checkpoint.save({str(root)!r})")
        generation = _agree_on_generation(root)
        try:
            _run(dcp.save, sd, root / generation, "save")
            _commit(root, generation, _gather_checksums(root / generation))
        finally:  # (rank 0 committed it, or nothing points at it)
            if env.get_rank() == 0 and not _is_committed(root, generation):
                checkpoint_files.remove(root / generation)
    if env.get_rank() == 0:
        checkpoint_files.prune(root, keep=generation)


def load(state: Mapping[str, Any], checkpoint_dir: str | os.PathLike) -> None:
    """Load `checkpoint_dir` into `state` in place; every rank of the world calls it.

    The checkpoint may come from another world size, placement or sbp: each rank reads
    only the saved chunks that overlap what it holds. Modules and tensors are filled in
    place, optimizers get `load_state_dict`, Python values are replaced in `state`.
    """
    import torch.distributed.checkpoint as dcp

    partials: list[tuple[GlobalTensor, GlobalTensor]] = []

    def loadable(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, GlobalTensor) or not any(s.is_partial for s in t.sbp):
            return t
        spec = t._spec._replace(nd_sbp=partials_to_broadcast(t.sbp))
        local = t._local.new_empty(spec.local_shape(env.get_rank()))
        tmp = GlobalTensor(local, spec)
        partials.append((t, tmp))
        return tmp

    root = _folder(checkpoint_dir, "load")
    _check_state(state, "load")
    with _guarded("load", root):
        folder, saved = _open(root)
    created = []  # (optimizer, the parameters given state here): taken back if the load fails
    sd = {}
    for k, v in state.items():
        kept = None
        if isinstance(v, torch.optim.Optimizer):
            optim_step.repoint(v)  # (made before to_global: its state is for the global ones)
            kept = _saved_parameter_states(saved, k)
            created.append((v, _init_optimizer_state(v, kept)))
        sd[k] = _map_tensors(_state_dict_of(v, kept), loadable)
    try:
        with _guarded("load", root):
            _run(dcp.load, sd, folder, "load")
    except BaseException:
        for optimizer, params in created:
            for p in params:
                optimizer.state.pop(p, None)
        raise
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and not isinstance(sd[k], torch.Tensor):
            raise CheckpointError(
                f"sbp.checkpoint.load: {k!r} is a tensor here but the checkpoint holds a "
                f"{type(sd[k]).__name__} under that name"
            )
    with torch.no_grad():
        for target, tmp in partials:  # broadcast -> partial is local: no communication
            target._local.copy_(tmp.to_global(sbp=target.sbp)._local)
    targets = {id(tmp): target for target, tmp in partials}
    for k, v in state.items():
        loaded = _map_tensors(sd[k], lambda t: targets.get(id(t), t))
        if isinstance(v, torch.optim.Optimizer):
            v.load_state_dict(_optimizer_keys_back(loaded))
        elif hasattr(v, "load_state_dict") and hasattr(v, "state_dict"):
            v.load_state_dict(loaded)  # as dcp.load does: a module's tensors are loaded in
            # place already, and this brings its non-tensor state and load hooks along
        elif not isinstance(v, torch.Tensor):
            state[k] = loaded  # type: ignore[index]


def committed_folder(checkpoint_dir: str | os.PathLike) -> Path:
    """The folder of the generation `checkpoint_dir` commits, which DCP's own readers
    (`torch.distributed.checkpoint.load`, `FileSystemReader`) take as `checkpoint_id`;
    `checkpoint_dir` itself for a checkpoint without a commit marker. No communication."""
    root = _folder(checkpoint_dir, "committed_folder")
    try:
        committed = checkpoint_files.read_marker(root)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"sbp.checkpoint.committed_folder({str(root)!r}): {e}") from e
    return root if committed is None else committed.folder


def _check_state(state: Any, what: str) -> None:
    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"sbp.checkpoint.{what}: state must be a dict of names to modules, optimizers, "
            f"tensors and Python values, got a {type(state).__name__}"
        )


def _state_dict_of(v: Any, kept: set[int] | None = None) -> Any:
    """What DCP saves or loads of `v`; of an optimizer, only the parameter states in `kept`
    (on load: those the checkpoint holds) where given."""
    if isinstance(v, torch.optim.Optimizer):
        osd = v.state_dict()
        # DCP turns every key into a string; make that explicit, and undo it on load.
        states = {str(k): s for k, s in osd["state"].items() if kept is None or k in kept}
        return {"state": states, **_rest(osd, "state")}
    if hasattr(v, "state_dict") and hasattr(v, "load_state_dict"):
        return v.state_dict()
    return v


def _rest(d: Mapping, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


def _optimizer_keys_back(osd: dict) -> dict:
    return {"state": {int(k): s for k, s in osd["state"].items()}, **_rest(osd, "state")}


def _reduced(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, GlobalTensor) and any(s.is_partial for s in t.sbp):
        return t.to_global(sbp=partials_to_broadcast(t.sbp))
    return t


def _named_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in nested dicts and lists, by its dotted path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = (
        obj.items() if isinstance(obj, Mapping) else enumerate(obj) if isinstance(obj, list) else ()
    )
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(_named_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _map_tensors(obj: Any, fn: Any) -> Any:
    """`obj` with `fn` applied to every tensor in nested dicts and lists (new containers)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_tensors(v, fn) for v in obj]
    return obj


@torch.no_grad()
def _init_optimizer_state(optimizer: torch.optim.Optimizer, wanted: set[int]) -> list:
    """Create the state (momentum, moments, step) of each parameter in `wanted` (indices
    of the optimizer's state dict) that has none, so that a load can fill it; return
    those parameters.

    As torch.distributed.checkpoint.state_dict does: one step with a learning rate of 0,
    zero gradients for those parameters and none for the others (torch skips them), which
    leaves every parameter as it is. Gradients the parameters hold (a load after a
    backward) are put back after it.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = {id(p) for i, p in enumerate(params) if i in wanted and p not in optimizer.state}
    if not missing:
        return []
    held = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p) if id(p) in missing else None
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        for p, grad in zip(params, held, strict=True):
            p.grad = grad
    return [p for p in params if id(p) in missing]


def _saved_parameter_states(saved: set[str], key: str) -> set[int]:
    """The indices of the parameter states that optimizer `key` has in the checkpoint
    (DCP names them `key.state.<index>.<name>`)."""
    prefix = f"{key}.state."
    return {
        int(index)
        for name in saved
        if name.startswith(prefix)
        for index in [name[len(prefix) :].split(".", 1)[0]]
        if index.isdigit()
    }


def _folder(checkpoint_dir: Any, what: str) -> Path:
    if not isinstance(checkpoint_dir, (str, os.PathLike)) or not os.fspath(checkpoint_dir):
        raise CheckpointError(
            f"sbp.checkpoint.{what}: checkpoint_dir must be a folder's path (a str or "
            f"os.PathLike), got {checkpoint_dir!r}"
        )
    root = Path(os.fspath(checkpoint_dir))
    if root.exists() and not root.is_dir():
        raise CheckpointError(
            f"sbp.checkpoint.{what}: checkpoint_dir {str(root)!r} is a file, not a folder"
        )
    return root


@contextlib.contextmanager
def _guarded(what: str, root: Path) -> Iterator[None]:
    """A rank lost or stuck inside the block: `CheckpointError` on the ranks left."""
    world = tuple(range(env.get_world_size()))
    try:
        with guarded(f"sbp.checkpoint.{what}", world):
            yield
    except CommTimeoutError as e:
        kept = "; the checkpoint committed before in that folder is unchanged" * (what == "save")
        raise CheckpointError(f"sbp.checkpoint.{what}({str(root)!r}): {e}{kept}") from e


def _gather(obj: Any) -> list:
    """Every rank's `obj` (small, picklable), in rank order."""
    return gather_objects(obj, tuple(range(env.get_world_size())))


def _raise_problems(root: Path, what: str, problems: list) -> None:
    """One `CheckpointError` on every rank naming the ranks of each (what, why) problem."""
    if not any(problems):
        return
    ranks: dict[tuple, list[int]] = {}
    for rank, p in enumerate(problems):
        if p:
            ranks.setdefault(tuple(p), []).append(rank)
    text = "; ".join(f"{failed} on ranks {r}{why}" for (failed, why), r in ranks.items())
    raise CheckpointError(f"sbp.checkpoint.{what}({str(root)!r}): {text}")


def _all_ranks_called(what: str, root: Path) -> None:
    """Every rank of the world is in this call (asked through the store, which enters no
    process group: a rank busy in a collective elsewhere is not met with a wrong one)."""
    if not env.is_distributed():
        return
    window = min(ARRIVAL_WINDOW_S, env.get_timeout().total_seconds() / 2)
    verdict = arrival.arrived_together(
        tuple(range(env.get_world_size())),
        window,
        f"not every rank called it within {window:g} s (rank {env.get_rank()} waited)",
    )
    if verdict not in (arrival.ALL, None):
        error = CheckpointError(
            f"sbp.checkpoint.{what}({str(root)!r}): {verdict}; every rank of the world calls "
            "it (each writes or reads its own shards), not only rank 0"
        )
        agreement.announce(error)  # (a rank that went on into a collective raises there)
        raise error


def _agree_on_generation(root: Path) -> str:
    """Rank 0 makes the folder of the new generation; every rank learns its name, and
    that all ranks name the same checkpoint folder."""
    name, problem = None, None
    if env.get_rank() == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            name = checkpoint_files.next_generation(root)
            (root / name).mkdir()
        except OSError as e:
            problem = ("making its folder failed", f": {e}")
    views = _gather((os.path.abspath(root), name, problem))
    _raise_problems(root, "save", [p for _, _, p in views])
    paths = sorted({path for path, _, _ in views})
    if len(paths) > 1:
        raise CheckpointError(
            f"sbp.checkpoint.save: the ranks name different folders as checkpoint_dir: "
            f"{paths}; pass the same path on every rank"
        )
    return views[0][1]


def _gather_checksums(folder: Path) -> dict[str, tuple[int, int]]:
    """The size and CRC-32 of every file of the save, each rank summing the files it wrote."""
    sums, problem = {}, None
    try:
        for name in checkpoint_files.files_of_rank(folder, env.get_rank()):
            sums[name] = checkpoint_files.checksum(folder / name)
    except OSError as e:
        problem = ("reading back its files failed", f": {e}")
    gathered = _gather((sums, problem))
    _raise_problems(folder.parent, "save", [p for _, p in gathered])
    return {name: s for rank_sums, _ in gathered for name, s in rank_sums.items()}


def _commit(root: Path, generation: str, files: dict[str, tuple[int, int]]) -> None:
    """Rank 0 commits the generation (replaces the marker); every rank learns it did."""
    problem = None
    if env.get_rank() == 0:
        try:
            checkpoint_files.commit(root, generation, files)
        except OSError as e:
            problem = ("writing the commit marker failed", f": {e}")
    _raise_problems(root, "save", _gather(problem))


def _is_committed(root: Path, generation: str) -> bool:
    try:
        committed = checkpoint_files.read_marker(root)
    except (OSError, ValueError):
        return False
    return committed is not None and committed.folder.name == generation


def _open(root: Path) -> tuple[Path, set[str]]:
    """The folder of the committed generation (or `root`, for a checkpoint without a
    marker) and the names it holds, its files verified (each rank a share of them);
    every rank learns which ranks found a problem, and all raise alike."""
    folder, keys, problem = root, set(), None
    try:
        committed = checkpoint_files.read_marker(root)
    except (OSError, ValueError) as e:
        committed, problem = None, ("reading its commit marker failed", f": {e}"[:400])
    if committed is not None:
        folder = committed.folder
        damaged = checkpoint_files.verify(committed, env.get_rank(), env.get_world_size())
        if damaged:
            problem = ("damaged files", ": " + "; ".join(damaged)[:800])
    if problem is None:
        problem, keys = _saved_names(folder)
    _raise_problems(root, "load", _gather(problem))
    return folder, keys


def _saved_names(folder: Path) -> tuple[tuple[str, str] | None, set[str]]:
    """(a problem, or None; the names DCP's metadata in `folder` holds)."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (folder.is_dir() and any(n.endswith(".metadata") for n in os.listdir(folder))):
        return ("no checkpoint there (no commit marker, no .metadata file)", ""), set()
    try:
        return None, set(FileSystemReader(folder).read_metadata().state_dict_metadata)
    except Exception as e:  # (a truncated or foreign .metadata file)
        return ("reading its .metadata failed", f": {type(e).__name__}: {e}"[:400]), set()


def _run(fn: Any, sd: dict, checkpoint_dir: str | os.PathLike, what: str) -> None:
    """Run dcp.save/load; a failure on any rank becomes one clear error on every rank.

    DCP gathers each rank's exception of every phase (plan, read, write) to all ranks,
    so no rank is left waiting in a collective.
    """
    import warnings

    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            if not env.is_distributed():  # a world of 1 needs no process group; DCP knows
                warnings.filterwarnings("ignore", "torch.distributed is disabled")
            fn(sd, checkpoint_id=os.fspath(checkpoint_dir))
    except CheckpointException as e:
        lines = []
        for rank, (exc, _trace) in sorted(e.failures.items()):
            text = str(exc).strip().splitlines()
            text = text[0][:400] if text else "a file ends early: a truncated checkpoint?"
            lines.append(f"  rank {rank}: {type(exc).__name__}: {text}")
        raise CheckpointError(
            f"sbp.checkpoint.{what}({os.fspath(checkpoint_dir)!r}) failed on ranks "
            f"{sorted(e.failures)}:\n" + "\n".join(lines)
        ) from None


# ---------------------------------------------------------------- resuming training


def save_training_state(
    checkpoint_dir: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
) -> None:
    """Save what resuming needs: model, optimizer and the number of steps done."""
    save({"model": model, "optimizer": optimizer, "step": int(step)}, checkpoint_dir)


def load_training_state(
    checkpoint_dir: str | os.PathLike | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> int:
    """Load a `save_training_state` checkpoint into `model` and `optimizer`; return its step.

    With no directory (`--resume` not given) nothing is loaded and training starts at 0.
    """
    if checkpoint_dir is None:
        return 0
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    load(state, checkpoint_dir)
    return int(state["step"])


# ---------------------------------------------------------------- plain tensors


@torch.no_grad()
def full_state_dict(obj: Any, *, rank: int | None = None) -> Any:
    """Plain tensors of the logical values of a module's (or any nested) state dict.

    `rank=None`: every rank of the world gets them (an all-gather; ranks outside a
    tensor's placement too). `rank=r`: only rank `r` does and the others get an empty
    dict, so only one rank holds the whole model (a gather to `r`).
    """
    sd = obj.state_dict() if hasattr(obj, "state_dict") else obj
    me = env.get_rank()
    world = list(range(env.get_world_size()))
    replicas.check(_named_tensors(sd), "sbp.checkpoint.full_state_dict")

    def plain(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, GlobalTensor):
            return t.detach()
        if rank is None and sorted(t.placement.flat_ranks) == world:
            return t.full_tensor()
        to = world if rank is None else [rank]
        return t.to_global(Placement(t.placement.type, to), broadcast).to_local()

    out = _map_tensors(sd, plain)
    return out if rank is None or me == rank else {}


# ---------------------------------------------------------------- torch.save / torch.load


def reduce_global_tensor(g: GlobalTensor) -> tuple:
    """`GlobalTensor.__reduce_ex__`: this rank's part plus plain metadata, so that
    `torch.load(weights_only=True)` needs no class but `rebuild_global_tensor`."""
    P = g.placement
    return (
        rebuild_global_tensor,
        (
            g._local.detach(),
            P.type,
            P.ranks,
            tuple(_encode(s) for s in g.sbp),
            tuple(g.shape),
            g.requires_grad,
            env.get_rank(),
        ),
    )


def rebuild_global_tensor(
    local: torch.Tensor,
    device_type: str,
    ranks: list,
    nd_sbp: tuple,
    shape: tuple,
    requires_grad: bool,
    saved_rank: int,
) -> GlobalTensor:
    """Unpickle a GlobalTensor in this process; `SbpError` where it cannot be the same one."""
    P = Placement(device_type, ranks)
    world, me = env.get_world_size(), env.get_rank()
    missing = [r for r in P.flat_ranks if r >= world]
    if missing:
        raise PlacementError(
            f"torch.load: a GlobalTensor saved on {P} needs ranks {missing}, which this world "
            f"of {world} ranks does not have; to load on another number of ranks save with "
            "sbp.checkpoint.save (DCP) or save plain tensors (sbp.checkpoint.full_state_dict)"
        )
    nd = tuple(_decode(c) for c in nd_sbp)
    spec = GlobalSpec(P, nd, tuple(shape), local.dtype)
    if me in P:
        if saved_rank != me and not is_all_broadcast(nd):
            raise MetaMismatchError(
                f"torch.load on rank {me}: this GlobalTensor ({format_nd_sbp(nd)} on {P}) holds "
                f"rank {saved_rank}'s part; load each rank's own file, or use sbp.checkpoint"
            )
        if tuple(local.shape) != spec.local_shape(me):
            raise MetaMismatchError(
                f"torch.load on rank {me}: local shape {tuple(local.shape)} does not match "
                f"{spec.local_shape(me)} of logical shape {spec.shape} by {format_nd_sbp(nd)}"
            )
        local = local.to(local_device(P.type))
    else:
        local = empty_local(spec)
    g = GlobalTensor(local, spec)
    return g.requires_grad_(True) if requires_grad else g


def _encode(s: SBP) -> tuple:
    if isinstance(s, Split):
        return ("S", s.dim)
    if isinstance(s, Partial):
        return ("P", s.op)
    return ("B",)


def _decode(code: tuple) -> SBP:
    if code[0] == "S":
        return Split(code[1])
    if code[0] == "P":
        return Partial(code[1])
    return broadcast


torch.serialization.add_safe_globals([rebuild_global_tensor])
tensor_parts.pickle_with(reduce_global_tensor)
