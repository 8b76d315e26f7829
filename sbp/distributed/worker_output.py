"""Workers' console output, one whole line at a time, and when each worker exited.

Workers that inherit the launcher's terminal write to it directly, and an unbuffered
`print` writes its text and its newline separately, so two ranks' lines can mix
(`RWRW 0 2`). Here each worker's stdout and stderr go into a named pipe instead; one
thread per pipe cuts the bytes into lines and writes each line, with an optional
`[rank<r>]:` prefix like torchrun's, to the launcher's own stream in a single write
under one lock shared by all pipes.

`ExitTimes` records when each worker process ended (without reaping it, so torchrun's
bookkeeping is untouched), which lets the launcher name the first worker to fail even
when several failures reach torchrun in the same poll with the same one-second time.
"""

from __future__ import annotations

import errno
import os
import select
import shutil
import tempfile
import threading
import time
from typing import BinaryIO

__all__ = ["ExitTimes", "LinePump", "PipeSet"]

_CONSOLE_LOCK = threading.Lock()
_LONGEST_LINE = 1 << 16  # a line this long without a newline is written as it is


class LinePump(threading.Thread):
    """Copy one named pipe to `dest` line by line, each line prefixed and written at once."""

    def __init__(self, fifo: str, dest: BinaryIO, prefix: bytes = b"") -> None:
        super().__init__(name=f"sbp-output-{os.path.basename(fifo)}", daemon=True)
        self.fifo, self.dest, self.prefix = fifo, dest, prefix
        self._stopping = threading.Event()
        self._pending = b""

    def run(self) -> None:
        fd = os.open(self.fifo, os.O_RDONLY)  # waits until torchrun opens the writing end
        try:
            while True:
                ready, _, _ = select.select([fd], [], [], 0.05)
                if not ready:
                    if self._stopping.is_set():
                        break  # the workers are gone and the pipe is empty
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                self._feed(chunk)
        finally:
            os.close(fd)
            if self._pending:
                self._write([self._pending + b"\n"])

    def _feed(self, chunk: bytes) -> None:
        data = self._pending + chunk
        end = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
        if end == 0 and len(data) >= _LONGEST_LINE:
            end = len(data)
        self._pending = data[end:]
        if end:
            self._write(data[:end].splitlines(keepends=True))

    def _write(self, lines: list[bytes]) -> None:
        text = b"".join(self.prefix + line for line in lines)
        with _CONSOLE_LOCK:
            try:
                self.dest.write(text)
                self.dest.flush()
            except (OSError, ValueError):
                pass  # the console went away; keep draining so workers never block

    def stop(self, timeout: float = 5.0) -> None:
        """Write what is left in the pipe, then end (the writers have exited)."""
        self._stopping.set()
        if self.is_alive():
            try:  # unblock an open() that no writer ever answered
                os.close(os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError as err:
                if err.errno not in (errno.ENXIO, errno.ENOENT):
                    raise
        self.join(timeout)


class PipeSet:
    """Named pipes for the workers' streams, in a private folder, with their pumps."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="sbp_launch_")
        self.pumps: list[LinePump] = []

    def pipe(self, name: str, dest: BinaryIO, prefix: str = "") -> str:
        """A new named pipe whose lines go to `dest`; returns its path for torchrun to open."""
        path = os.path.join(self.folder, name)
        if os.path.exists(path):
            os.remove(path)
        os.mkfifo(path)
        pump = LinePump(path, dest, prefix.encode())
        pump.start()
        self.pumps.append(pump)
        return path

    def close(self) -> None:
        for pump in self.pumps:
            pump.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


class ExitTimes:
    """When each child process of the launcher exited (monotonic seconds), by pid.

    A watcher looks for new children for a while after `expect()` (torchrun starts them
    right after asking where their output goes); one thread per child waits for its
    exit with `WNOWAIT`, which leaves the child for torchrun to reap.
    """

    def __init__(self) -> None:
        self.times: dict[int, float] = {}
        self._seen: set[int] = set()
        self._lock = threading.Lock()

    def expect(self, count: int, within: float = 60.0) -> None:
        threading.Thread(target=self._watch, args=(count, within), daemon=True).start()

    def _children(self) -> set[int]:
        found: set[int] = set()
        try:
            for task in os.listdir("/proc/self/task"):
                with open(f"/proc/self/task/{task}/children") as f:
                    found.update(int(pid) for pid in f.read().split())
        except OSError:
            pass
        return found

    def _watch(self, count: int, within: float) -> None:
        new = 0
        deadline = time.monotonic() + within
        while new < count and time.monotonic() < deadline:
            for pid in self._children() - self._seen:
                self._seen.add(pid)
                new += 1
                threading.Thread(target=self._wait, args=(pid,), daemon=True).start()
            time.sleep(0.01)

    def _wait(self, pid: int) -> None:
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass  # already reaped by torchrun: it exited no later than now
        with self._lock:
            self.times.setdefault(pid, time.monotonic())
