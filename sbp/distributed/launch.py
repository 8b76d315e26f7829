"""Launch one worker process per rank: ``python -m sbp.distributed.launch``.

A thin front end over torchrun (``torch.distributed.run``): our options are translated into
a torchrun argument list, torchrun builds its ``LaunchConfig`` from it and its elastic agent
starts and watches the workers, so rendezvous, environment variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ...) and failure handling are exactly
torchrun's. What we change:

* ``--logdir DIR`` gives one flat folder per global rank, ``DIR/rank_<r>/``, instead of
  torchrun's ``<run id>_<random>/attempt_<n>/<local rank>/`` nesting (see `RankLogsSpecs`);
* ``OMP_NUM_THREADS`` defaults to 1 for every job, so N workers do not oversubscribe the cores;
* a failed worker gives a short summary on stderr, naming the first worker to fail as the
  root cause, and exit status 1 instead of a traceback;
* the wait for the other nodes is bounded (``--join_timeout``, torchrun's rendezvous
  timeout), and a rendezvous that fails (nodes missing at the end of it, a busy
  ``--master_port``, node 0 not answering) or an unusable ``--logdir`` is one line on
  stderr and a non-zero exit status, not a traceback;
* workers' console output reaches the terminal one whole line at a time (never two ranks'
  text in one line), with a ``[rank<r>]:`` prefix under ``--rank_prefix``.

Example::

    python -m sbp.distributed.launch --nproc_per_node 2 train.py --epochs 3
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import ipaddress
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence

import torch.distributed
from torch.distributed.elastic.multiprocessing.api import (
    LogsDest,
    LogsSpecs,
    SignalException,
    Std,
)
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, get_args_parser

from sbp.distributed.worker_output import ExitTimes, PipeSet

__all__ = [
    "DEFAULT_JOIN_TIMEOUT",
    "DEFAULT_LOGDIR",
    "DEFAULT_MASTER_PORT",
    "RankLogsSpecs",
    "get_parser",
    "main",
]

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
DEFAULT_LOGDIR = "logs"
# Seconds the launchers of a job wait for each other (torchrun's LaunchConfig default is 900).
DEFAULT_JOIN_TIMEOUT = 300
_PROG = "sbp.distributed.launch"
_TORCHRUN_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")


class RankLogsSpecs(LogsSpecs):
    """torchrun log layout with one flat folder per global rank: ``<log_dir>/rank_<r>/``.

    torchrun asks its ``LogsSpecs`` (through `reify`) where each local rank's stdout,
    stderr and error file go, just before it starts the workers. Its default puts them under
    a fresh ``<run id>_<random>/attempt_<n>/<local rank>/`` directory, which is hard to find
    and clashes between nodes (every node has a local rank 0). Here the folder is named by
    the worker's global ``RANK`` (taken from the environment torchrun prepared for it), so
    a job on any number of nodes writing to a shared ``log_dir`` gets one folder per rank.

    Args:
        log_dir: the folder holding the per-rank folders; created when missing. An
            `OSError` is raised at once where it is a file or cannot be written to.
        redirect: redirect each worker's stdout and stderr to ``stdout.log`` /
            ``stderr.log`` in its folder (not shown on the console) instead of the
            launcher's. Either way the folder holds ``error.json`` when a worker that
            uses torch's ``@record`` fails.
        rank_prefix: start each console line with ``[rank<r>]:`` (global rank).

    Console output goes through named pipes (see `sbp.distributed.worker_output`), so
    lines of different ranks never mix; call `close` after the run to write out the rest.
    """

    def __init__(
        self, log_dir: str | os.PathLike[str], redirect: bool = False, rank_prefix: bool = False
    ) -> None:
        log_dir = os.path.abspath(os.fspath(log_dir))
        if os.path.exists(log_dir) and not os.path.isdir(log_dir):
            raise NotADirectoryError(errno.ENOTDIR, "it is a file, not a folder", log_dir)
        os.makedirs(log_dir, exist_ok=True)
        # The rank folders are made only when the workers start: make sure they can be.
        os.rmdir(tempfile.mkdtemp(prefix=".sbp_write_check_", dir=log_dir))
        self.redirect = redirect
        self.rank_prefix = rank_prefix
        self.exit_times = ExitTimes()
        self._pipes: PipeSet | None = None
        super().__init__(log_dir=log_dir, redirects=Std.ALL if redirect else Std.NONE)

    @property
    def root_log_dir(self) -> str:
        """The folder that holds the ``rank_<r>`` folders (torchrun reports it in its events)."""
        return str(self._root_log_dir)

    def rank_dir(self, rank: int) -> str:
        """The folder of global rank ``rank``, so callers can point users at its logs."""
        return os.path.join(self.root_log_dir, f"rank_{rank}")

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Make the rank folders and say where each local rank's streams go.

        ``envs`` maps local rank to the environment torchrun will start that worker with;
        we read ``RANK`` from it and set ``TORCHELASTIC_ERROR_FILE`` in it, like torchrun.
        """
        redirect_out = bool(self._redirects & Std.OUT)  # type: ignore[operator]
        redirect_err = bool(self._redirects & Std.ERR)  # type: ignore[operator]
        stdouts: dict[int, str] = {}
        stderrs: dict[int, str] = {}
        error_files: dict[int, str] = {}
        for local_rank in range(len(envs)):
            env = envs[local_rank]
            folder = self.rank_dir(int(env.get("RANK", local_rank)))
            os.makedirs(folder, exist_ok=True)
            error_file = os.path.join(folder, "error.json")
            # torchrun reads this file to describe a failure: one left by an earlier run
            # into the same folder would be reported as this run's error.
            if os.path.exists(error_file):
                os.remove(error_file)
            stdouts[local_rank] = self._stream(folder, "stdout", redirect_out, env, local_rank)
            stderrs[local_rank] = self._stream(folder, "stderr", redirect_err, env, local_rank)
            error_files[local_rank] = error_file
            env["TORCHELASTIC_ERROR_FILE"] = error_file
        self.exit_times.expect(len(envs))  # torchrun starts the workers right after this
        dest: dict[str, object] = {
            "stdouts": stdouts,
            "stderrs": stderrs,
            "tee_stdouts": {},
            "tee_stderrs": {},
            "error_files": error_files,
        }
        # Only opened when torchrun's --duplicate_*_filters (or PET_ variables) ask for it;
        # the fields are missing from older torch versions.
        names = {f.name for f in dataclasses.fields(LogsDest)}
        for stream in ("stdout", "stderr"):
            if f"filtered_{stream}" in names:
                dest[f"filtered_{stream}"] = os.path.join(
                    self.root_log_dir, f"filtered_{stream}.log"
                )
        return LogsDest(**dest)  # type: ignore[arg-type]

    def _stream(self, folder: str, name: str, redirect: bool, env: dict, local_rank: int) -> str:
        """Where one worker stream goes: its log file, or a pipe to the launcher's console."""
        if redirect:
            return os.path.join(folder, f"{name}.log")
        if self._pipes is None:
            self._pipes = PipeSet()
        rank = int(env.get("RANK", local_rank))
        stream = sys.stdout if name == "stdout" else sys.stderr
        dest = getattr(stream, "buffer", None) or getattr(sys, f"__{name}__").buffer
        prefix = f"[rank{rank}]:" if self.rank_prefix else ""
        return self._pipes.pipe(f"rank_{rank}.{name}", dest, prefix)

    def close(self) -> None:
        """Write out the workers' last console output and remove the pipes."""
        if self._pipes is not None:
            self._pipes.close()
            self._pipes = None

    def __repr__(self) -> str:
        return f"RankLogsSpecs(log_dir={self.root_log_dir!r}, redirects={self._redirects})"


def _nproc(value: str) -> str:
    """argparse type for --nproc_per_node: a positive int, or one of torchrun's words."""
    if value in _TORCHRUN_NPROC_WORDS:
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer or one of {', '.join(_TORCHRUN_NPROC_WORDS)}, got {value!r}"
        )
    return str(n)


def _at_least_one(what: str):
    """argparse type: an integer >= 1, named `what` in its error."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}")
        return n

    return parse


_positive_int = _at_least_one("a positive integer")  # --nnodes
_seconds = _at_least_one("a whole number of seconds >= 1")  # --join_timeout (torchrun's unit)


def _port(value: str) -> int:
    """argparse type for --master_port."""
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"expected a port number in 1..65535, got {value!r}")
    return port


def get_parser() -> argparse.ArgumentParser:
    """The launcher's command-line parser (separate from `main` so docs and tests can use it)."""
    parser = argparse.ArgumentParser(
        prog="python -m sbp.distributed.launch",
        description="Start one process per rank for an sbp program (built on torchrun). "
        "Workers get torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
        "MASTER_PORT, ...), which sbp.env reads, and OMP_NUM_THREADS=1 unless it is set. "
        "The launcher exits non-zero if any worker fails.",
    )
    parser.add_argument(
        "--nproc_per_node",
        "--nproc-per-node",
        type=_nproc,
        default="1",
        metavar="N",
        help="worker processes on this node (default 1); torchrun's auto/cpu/gpu also work",
    )
    parser.add_argument(
        "--nnodes",
        type=_positive_int,
        default=1,
        metavar="K",
        help="number of nodes (default 1); world size is K * N",
    )
    parser.add_argument(
        "--node_rank",
        "--node-rank",
        type=int,
        default=0,
        metavar="R",
        help="rank of this node, 0..K-1 (default 0); its workers get global ranks R*N .. R*N+N-1",
    )
    parser.add_argument(
        "--master_addr",
        "--master-addr",
        default=DEFAULT_MASTER_ADDR,
        metavar="A",
        help=f"address of node 0, which hosts the rendezvous store (default {DEFAULT_MASTER_ADDR})",
    )
    parser.add_argument(
        "--master_port",
        "--master-port",
        type=_port,
        default=None,
        metavar="P",
        help="free port on node 0 for the rendezvous store (default: a free port chosen by "
        f"the OS when --nnodes is 1, else {DEFAULT_MASTER_PORT})",
    )
    parser.add_argument(
        "--join_timeout",
        "--join-timeout",
        type=_seconds,
        default=DEFAULT_JOIN_TIMEOUT,
        metavar="SECONDS",
        help="how long the launchers wait for each other at --master_addr:--master_port "
        f"(default {DEFAULT_JOIN_TIMEOUT}); when not all --nnodes nodes joined by then, the "
        "launcher says how many did and exits with status 1",
    )
    parser.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="run the target as a module, like 'python -m' (it is then a module name)",
    )
    parser.add_argument(
        "--no_python",
        "--no-python",
        action="store_true",
        help="run the target as an executable, not through the Python interpreter",
    )
    parser.add_argument(
        "--logdir",
        "--log_dir",
        default=None,
        metavar="DIR",
        help="write each rank's logs into its own folder DIR/rank_<global rank>/ "
        "(error.json when a worker fails, plus stdout.log/stderr.log with "
        "--redirect_stdout_and_stderr)",
    )
    parser.add_argument(
        "--redirect_stdout_and_stderr",
        "--redirect-stdout-and-stderr",
        action="store_true",
        help="send each worker's stdout and stderr to DIR/rank_<r>/stdout.log and stderr.log "
        f"instead of the console (DIR defaults to ./{DEFAULT_LOGDIR} when --logdir is not given)",
    )
    parser.add_argument(
        "--rank_prefix",
        "--rank-prefix",
        action="store_true",
        help="start every line a worker prints on the console with [rank<r>]: (global rank)",
    )
    parser.add_argument(
        "training_script",
        metavar="script.py",
        help="the program each worker runs (a module name with -m, an executable with --no_python)",
    )
    parser.add_argument(
        "training_script_args",
        nargs=argparse.REMAINDER,
        metavar="...",
        help="arguments passed on to the program",
    )
    return parser


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse and cross-check the options (errors exit with status 2, like argparse)."""
    parser = get_parser()
    args = parser.parse_args(argv)
    if args.module and args.no_python:
        parser.error("-m/--module and --no_python cannot be used together")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node_rank must be in 0..{args.nnodes - 1}, got {args.node_rank}")
    if args.redirect_stdout_and_stderr and args.logdir is None:
        args.logdir = DEFAULT_LOGDIR
    return args


def _torchrun_argv(args: argparse.Namespace) -> list[str]:
    """Our options as a torchrun command line, so torchrun's own parser fills every default."""
    argv = [
        f"--nproc_per_node={args.nproc_per_node}",
        f"--nnodes={args.nnodes}",
        f"--node_rank={args.node_rank}",
        f"--master_addr={args.master_addr}",
    ]
    if _is_loopback(args.master_addr):
        argv.append(f"--local_addr={args.master_addr}")  # workers' MASTER_ADDR, not the fqdn
    if args.master_port is None and args.nnodes == 1:
        # Like plain torchrun on one node: a c10d store on a port the OS picks, so that
        # two jobs on one machine do not fight over port 29500.
        argv += ["--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", f"--rdzv_id={uuid.uuid4()}"]
        argv.append(f"--rdzv_conf=join_timeout={args.join_timeout}")
    else:
        argv += ["--rdzv_backend=static", f"--master_port={_master_port(args)}"]
        # The static rendezvous's TCPStore timeout: node 0 waits that long for the other
        # nodes' launchers, the others that long for node 0's store to answer.
        argv.append(f"--rdzv_conf=timeout={args.join_timeout}")
    # torchrun builds a DefaultLogsSpecs that we replace; devnull keeps it from making a
    # temporary folder first.
    argv.append(f"--log_dir={os.devnull}")
    if args.module:
        argv.append("--module")
    if args.no_python:
        argv.append("--no_python")
    return [*argv, args.training_script, *args.training_script_args]


def _master_port(args: argparse.Namespace) -> int:
    return DEFAULT_MASTER_PORT if args.master_port is None else args.master_port


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


class _LaunchError(Exception):
    """A problem the launcher reports as one line on stderr, then exits with ``status``."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def _rendezvous_error(
    err: BaseException, args: argparse.Namespace, is_master: bool
) -> _LaunchError | None:
    """Our one line for a rendezvous store that could not be made, or None if unknown."""
    port = _master_port(args)
    where = f"{args.master_addr}:{port}"
    text = str(err)
    if is_master and ("EADDRINUSE" in text or getattr(err, "errno", None) == errno.EADDRINUSE):
        return _LaunchError(
            f"--master_port {port} is already in use on {args.master_addr} (another program or "
            "job listens there); choose a free port with --master_port"
            + (", the same on every node" if args.nnodes > 1 else " or leave it out")
        )
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if is_master and joined:
        others = "1" if args.nnodes == 2 else f"1..{args.nnodes - 1}"
        return _LaunchError(
            f"only {joined[1]} of {joined[2]} nodes joined within --join_timeout "
            f"{args.join_timeout} s at {where}; start the missing nodes' launchers "
            f"(--node_rank {others}) with --nnodes {args.nnodes} "
            f"--master_addr {args.master_addr} --master_port {port}, or raise --join_timeout"
        )
    # Something listened (`_wait_for_node0` saw it) but did not act as a store: its
    # "Ping failed", or, on a loaded machine, the client's own timeout first.
    if not is_master and ("Ping failed" in text or isinstance(err, torch.distributed.DistError)):
        return _LaunchError(
            f"something answers at {where}, but it is not node 0's rendezvous store (another "
            "program listens there?); check --master_addr and --master_port"
        )
    return None


def _node0_silent(args: argparse.Namespace) -> _LaunchError:
    return _LaunchError(
        f"node 0's rendezvous store at {args.master_addr}:{_master_port(args)} did not answer "
        f"within --join_timeout {args.join_timeout} s (this is --node_rank {args.node_rank} of "
        f"--nnodes {args.nnodes}); start node 0's launcher with the same --master_addr and "
        "--master_port, check that this node can reach it, or raise --join_timeout"
    )


def _wait_for_node0(host: str, port: int, args: argparse.Namespace) -> None:
    """Wait until something listens at node 0's store address, at most --join_timeout.

    TCPStore's client would wait too, but up to about twice its timeout, and it logs a
    C++ stack trace for every failed try; a plain connection attempt every half second
    is quiet (the store's server ignores a connection closed before any request).
    """
    deadline = time.monotonic() + args.join_timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _node0_silent(args)
        try:
            with socket.create_connection((host, port), timeout=min(left, 5.0)):
                return
        except OSError:
            time.sleep(min(0.5, max(deadline - time.monotonic(), 0)))


@contextlib.contextmanager
def _stderr_held() -> Iterator[None]:
    """Hold back what this process writes to stderr (fd 2, C++ logs included) meanwhile.

    It is written out afterwards, unless a `_LaunchError` ends the block: that one line
    says what went wrong instead.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    keep = True
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except _LaunchError:
            keep = False
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if keep:
                held.seek(0)
                data = memoryview(held.read())
                while data:
                    data = data[os.write(2, data) :]


@contextlib.contextmanager
def _rendezvous_stores(args: argparse.Namespace) -> Iterator[None]:
    """Watch the rendezvous stores torchrun makes in this process.

    A store that cannot be made (its port busy, the other nodes missing when the join
    timeout is up, node 0 not answering) raises `_LaunchError` with one line for the user.
    Another node's launcher first waits quietly for node 0's store (`_wait_for_node0`).

    And a store this process hosts for a loopback host listens on that address only:
    torch's TCPStore server listens on every interface whatever host it is given, so a
    single-node job would take connections from the network. Here its socket is bound
    first (to 127.0.0.1, say) and handed over (`master_listen_fd`).
    """
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    real = torch.distributed.TCPStore

    def store(host_name, port, *rest, **kwargs):
        is_master = kwargs.get("is_master", rest[1] if len(rest) > 1 else False)
        if is_master:
            return make(host_name, port, rest, kwargs, is_master=True)
        with _stderr_held():  # TCPStore's C++ log of each failed try to reach node 0
            _wait_for_node0(host_name, port, args)
            return make(host_name, port, rest, kwargs, is_master=False)

    def make(host_name, port, rest, kwargs, is_master):
        try:
            if is_master and kwargs.get("master_listen_fd") is None and _is_loopback(host_name):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind((socket.gethostbyname(host_name), port))
                    sock.listen(socket.SOMAXCONN)
                except OSError:
                    sock.close()
                    raise
                port = sock.getsockname()[1]
                kwargs["master_listen_fd"] = sock.detach()
            return real(host_name, port, *rest, **kwargs)
        except (OSError, torch.distributed.DistError) as err:
            mine = _rendezvous_error(err, args, is_master)
            if mine is None:
                raise
            raise mine from None

    modules = (torch.distributed, c10d_rendezvous_backend, static_tcp_rendezvous)
    saved = [m.TCPStore for m in modules]
    for m in modules:
        m.TCPStore = store
    try:
        yield
    finally:
        for m, old in zip(modules, saved, strict=True):
            m.TCPStore = old


def _root_cause_order(failures: dict, logs: RankLogsSpecs) -> list:
    """Failed ranks, first to fail first.

    torchrun stamps failures with whole seconds when the worker left no error file, and
    after the first failure it stops the others (SIGTERM), which then count as failed too.
    The exit times we watched come first, then not-stopped-by-us, then torchrun's stamp.
    """

    def key(rank: int) -> tuple:
        failure = failures[rank]
        exited = logs.exit_times.times.get(failure.pid, float("inf"))
        stopped = failure.exitcode == -signal.SIGTERM
        return (exited, stopped, failure.timestamp, rank)

    return sorted(failures, key=key)


def _report_failure(err: BaseException, logs: RankLogsSpecs) -> None:
    """Print one short line per failed worker, the root cause (first to fail) first."""
    failures = getattr(err, "failures", {})
    order = _root_cause_order(failures, logs)
    head = f"sbp.distributed.launch: {len(failures)} worker(s) failed"
    if order:
        head += f"; root cause: rank {order[0]} (the first to fail)"
    print(head + ":", file=sys.stderr)
    for i, rank in enumerate(order):
        failure = failures[rank]
        if failure.exitcode < 0:
            how = f"killed by signal {failure.signal_name()}"
        else:
            how = f"exit code {failure.exitcode}"
        line = f"  rank {rank} (local_rank {failure.local_rank}, pid {failure.pid}): {how}"
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", "")
        if message and not str(message).startswith(("To enable traceback", "Signal ")):
            line += f": {message}"
        if logs.redirect:
            line += f" (see {os.path.join(logs.rank_dir(rank), 'stderr.log')})"
        if i == 0 and len(order) > 1:
            line += "  <- root cause"
        print(line, file=sys.stderr)


def _exit(message: str, status: int = 1) -> None:
    print(f"{_PROG}: {message}", file=sys.stderr)
    sys.exit(status)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the launcher: start the workers, wait for them, exit 1 if any of them failed.

    ``argv`` defaults to ``sys.argv[1:]``; it is a parameter so the launcher can be driven
    from Python (tests, wrappers) without a subprocess of its own.
    """
    args = _parse(argv)

    # Set before torchrun reads the environment: workers inherit it, and torchrun then
    # skips its own (nproc > 1 only) default and its warning banner.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Workers that import sbp die with this process, even if it is SIGKILLed
    # (sbp.env.die_with_launcher).
    os.environ["SBP_LAUNCHER_PID"] = str(os.getpid())

    torchrun_args = get_args_parser().parse_args(_torchrun_argv(args))
    config, entrypoint, entry_args = config_from_args(torchrun_args)
    # Without --logdir the rank folders (error files only) live in a temporary folder.
    scratch = None if args.logdir is not None else tempfile.mkdtemp(prefix="sbp_logs_")
    try:
        logs = RankLogsSpecs(
            args.logdir if scratch is None else scratch,
            redirect=args.redirect_stdout_and_stderr,
            rank_prefix=args.rank_prefix,
        )
    except OSError as err:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        why = err.strerror or str(err)
        if err.filename and os.path.abspath(err.filename) != os.path.abspath(args.logdir):
            why += f" ({err.filename})"
        advice = "give a folder it can create and write to"
        _exit(f"cannot write logs to --logdir {args.logdir}: {why}; {advice}", 2)
    config.logs_specs = logs

    try:
        with _rendezvous_stores(args):
            elastic_launch(config=config, entrypoint=entrypoint)(*entry_args)
    except _LaunchError as err:
        logs.close()
        _exit(str(err), err.status)
    except torch.distributed.DistError as err:
        # A rendezvous store failing after it was made: once joined, the other nodes wait
        # (--join_timeout again) for node 0 to hand out the ranks, which it does when all
        # nodes joined; or node 0 went away.
        logs.close()
        where = f"{args.master_addr}:{_master_port(args)}"
        text = str(err).strip()
        if args.node_rank and "assigned_ranks" in text:
            _exit(
                f"this node joined the rendezvous at {where}, but node 0 did not hand out the "
                f"ranks within --join_timeout {args.join_timeout} s: not all {args.nnodes} nodes "
                "joined (node 0's launcher says how many)"
            )
        first = text.splitlines()[0] if text else type(err).__name__
        hint = " (node 0's launcher says why)" if args.node_rank else ""
        _exit(f"rendezvous at {where} failed: {first}{hint}")
    except ChildFailedError as err:
        logs.close()  # the workers' last lines before the summary
        _report_failure(err, logs)
        sys.exit(1)
    except SignalException as err:
        logs.close()
        print(f"sbp.distributed.launch: stopped by {err.sigval.name}", file=sys.stderr)
        sys.exit(128 + int(err.sigval))
    finally:
        logs.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
