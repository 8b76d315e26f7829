"""Where a checkpoint's files live on disk: generations, a commit marker, checksums.

DCP writes a checkpoint's data files first and its `.metadata` last, rewriting files in
place, so a save that fails over an existing checkpoint leaves old metadata beside new
data (a load then mixes the two). Here each save writes a new *generation*, a folder
`generation-NNNNNN/` inside the checkpoint folder, and commits it last by replacing the
marker file `sbp_checkpoint.json` (write to a temporary file, fsync, rename: atomic on
POSIX file systems). The marker names the committed generation and the size and CRC-32
of each of its files. A load reads the marker and verifies the files; a save that never
reached its commit leaves the marker, and so the previous generation, as they were.

A folder without a marker that holds a `.metadata` file (an sbp checkpoint of before
generations, or one written by `torch.distributed.checkpoint` itself) loads as it is,
unverified. This module touches files only; the ranks agree in `sbp.checkpoint`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from pathlib import Path

MARKER = "sbp_checkpoint.json"
FORMAT = 1
_GENERATION = re.compile(r"generation-(\d{6,})")
_CHUNK = 8 << 20


class Committed:
    """A committed generation: its folder and each file's (size, CRC-32)."""

    def __init__(self, folder: Path, files: dict[str, tuple[int, int]]):
        self.folder, self.files = folder, files


def read_marker(root: Path) -> Committed | None:
    """The generation the marker commits, None when there is no marker.

    Raises `ValueError` (for the caller to report) when the marker cannot be parsed,
    `OSError` when it cannot be read.
    """
    path = root / MARKER
    if not path.exists():
        return None
    with open(path) as f:
        marker = json.load(f)  # (JSONDecodeError is a ValueError)
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise ValueError(f"{path} is not an sbp checkpoint marker of format {FORMAT}")
    try:
        name = marker["generation"]
        files = {str(k): (int(v[0]), int(v[1])) for k, v in marker["files"].items()}
    except (KeyError, TypeError, IndexError, AttributeError) as e:
        raise ValueError(f"{path} lacks or garbles {e}") from e
    if not isinstance(name, str) or not _GENERATION.fullmatch(name):
        raise ValueError(f"{path} names {name!r}, not a generation folder")
    return Committed(root / name, files)


def next_generation(root: Path) -> str:
    """A generation name above every one in `root` (committed, failed or pruned late)."""
    numbers = [0]
    if root.is_dir():
        for entry in os.listdir(root):
            m = _GENERATION.fullmatch(entry)
            if m:
                numbers.append(int(m.group(1)))
    return f"generation-{max(numbers) + 1:06d}"


def checksum(path: Path) -> tuple[int, int]:
    """(size in bytes, CRC-32) of a file: catches damaged bytes, not tampering."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def files_of_rank(folder: Path, rank: int) -> list[str]:
    """The files of a finished DCP save that `rank` records: the data files it wrote
    (DCP names them `__<rank>_<n>.distcp`), and on rank 0 `.metadata` too."""
    prefix = f"__{rank}_"
    names = [n for n in os.listdir(folder) if n.startswith(prefix) and n.endswith(".distcp")]
    if rank == 0:
        names.append(".metadata")
    return sorted(names)


def verify(committed: Committed, rank: int, world: int) -> list[str]:
    """Check this rank's share of the committed files (every `world`-th one): the
    problems found, each naming its file."""
    problems = []
    for i, name in enumerate(sorted(committed.files)):
        if i % world != rank:
            continue
        path = committed.folder / name
        want_size, want_crc = committed.files[name]
        try:
            size, crc = checksum(path)
        except OSError as e:
            problems.append(f"{path}: cannot be read ({e.strerror or e})")
            continue
        if size != want_size:
            problems.append(f"{path}: {size} bytes where {want_size} were written")
        elif crc != want_crc:
            problems.append(f"{path}: its bytes changed since the save (CRC-32 differs)")
    return problems


def commit(root: Path, generation: str, files: dict[str, tuple[int, int]]) -> None:
    """Make `generation` the checkpoint of `root`: the marker is replaced atomically."""
    folder = root / generation
    _fsync_folder(folder)
    marker = {"format": FORMAT, "generation": generation, "files": files}
    tmp = root / f".{MARKER}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(marker, f, indent=0, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MARKER)
    _fsync_folder(root)


def prune(root: Path, keep: str) -> None:
    """Remove generations other than `keep` and the files of a checkpoint written before
    generations (a `.metadata` and DCP data files in `root` itself): all superseded."""
    for entry in os.listdir(root):
        path = root / entry
        if _GENERATION.fullmatch(entry) and entry != keep:
            shutil.rmtree(path, ignore_errors=True)
        elif entry == ".metadata" or (entry.startswith("__") and entry.endswith(".distcp")):
            path.unlink(missing_ok=True)
        elif entry.startswith(f".{MARKER}.") and entry.endswith(".tmp"):  # a failed commit's
            path.unlink(missing_ok=True)


def remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _fsync_folder(folder: Path) -> None:
    """Make the folder's entries (new files, a rename) durable; a no-op where folders
    cannot be opened for it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
