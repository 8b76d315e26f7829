"""Tests for `python -m sbp.distributed.launch` (real launches, 2 workers on gloo)."""

import os
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from torch.distributed.run import config_from_args, get_args_parser

from sbp.distributed import launch

TIMEOUT = 120

# Prints what each worker sees, both from torchrun's variables and through sbp.env
# (which reads them and joins a gloo process group). Workers share the console and run
# unbuffered (python -u), where print() writes the text and the newline separately, so
# lines of two ranks could interleave: every script writes a whole line in one call.
REPORT_SCRIPT = """\
import os
import sys

import sbp

sys.stdout.write(
    f"rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']}"
    f" sbp_rank={sbp.env.get_rank()} sbp_world={sbp.env.get_world_size()}"
    f" omp={os.environ.get('OMP_NUM_THREADS')} args={sys.argv[1:]}\\n"
)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_launcher(*args: str, cwd: Path, extra_env: dict | None = None, timeout: float = TIMEOUT):
    """Run the launcher in a subprocess with a free static port; return CompletedProcess.

    A later ``--master_port`` in ``args`` wins over the free one.
    """
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(extra_env or {})
    cmd = [sys.executable, "-m", "sbp.distributed.launch", "--master_port", str(free_port())]
    return subprocess.run(
        [*cmd, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


# A launch that fails before any worker starts takes the launcher's start-up (a few
# seconds, more on a loaded machine) plus the 1 s join timeout the tests give; without
# the bound it took torchrun's 900 s rendezvous timeout.
QUICK = 30


def one_line(res: subprocess.CompletedProcess) -> str:
    """The launcher's whole stderr, which must be one line of its own (no traceback)."""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("sbp.distributed.launch: "), res.stderr
    return lines[0]


def timed_launch(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    res = run_launcher(*args, cwd=cwd, timeout=2 * QUICK)
    return res, time.monotonic() - start


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def test_two_workers_see_rank_world_and_omp(tmp_path):
    script = write(tmp_path / "report.py", REPORT_SCRIPT)
    res = run_launcher("--nproc_per_node", "2", str(script), "--lr", "0.1", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = sorted(line for line in res.stdout.splitlines() if line.startswith("rank="))
    assert lines == [
        f"rank={r} world=2 sbp_rank={r} sbp_world=2 omp=1 args=['--lr', '0.1']" for r in (0, 1)
    ]


def test_logdir_one_folder_per_rank_with_redirected_output(tmp_path):
    script = write(tmp_path / "report.py", REPORT_SCRIPT)
    logdir = tmp_path / "logs_here"
    res = run_launcher(
        "--nproc_per_node",
        "2",
        "--logdir",
        str(logdir),
        "--redirect_stdout_and_stderr",
        str(script),
        cwd=tmp_path,
        extra_env={"OMP_NUM_THREADS": "2"},  # a user's setting is kept
    )
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in logdir.iterdir()) == ["rank_0", "rank_1"]
    for r in (0, 1):
        folder = logdir / f"rank_{r}"
        assert folder.is_dir()
        out = (folder / "stdout.log").read_text()
        assert f"rank={r} world=2 sbp_rank={r} sbp_world=2 omp=2" in out
        assert (folder / "stderr.log").exists()
    assert "rank=" not in res.stdout  # redirected, not on the console


def test_failing_worker_makes_launcher_fail(tmp_path):
    script = write(
        tmp_path / "fail.py",
        """\
        import os
        import sys

        if os.environ["RANK"] == "1":
            print("rank 1 gives up", file=sys.stderr, flush=True)
            sys.exit(3)
        """,
    )
    # --redirect_stdout_and_stderr without --logdir writes to ./logs
    res = run_launcher(
        "--nproc_per_node", "2", "--redirect_stdout_and_stderr", str(script), cwd=tmp_path
    )
    assert res.returncode != 0
    assert "rank 1" in res.stderr and "exit code 3" in res.stderr
    logs = tmp_path / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["rank_0", "rank_1"]
    assert "rank 1 gives up" in (logs / "rank_1" / "stderr.log").read_text()


def test_module_mode_and_logdir_without_redirect(tmp_path):
    pkg = tmp_path / "mods"
    pkg.mkdir()
    write(
        pkg / "hello_mod.py",
        """\
        import os
        import sys

        sys.stdout.write(f"module rank {os.environ['RANK']}\\n")
        """,
    )
    logdir = tmp_path / "L"
    res = run_launcher(
        "--nproc_per_node",
        "2",
        "--logdir",
        str(logdir),
        "-m",
        "hello_mod",
        cwd=tmp_path,
        extra_env={"PYTHONPATH": str(pkg)},
    )
    assert res.returncode == 0, res.stderr
    assert sorted(line for line in res.stdout.splitlines() if line.startswith("module")) == [
        "module rank 0",
        "module rank 1",
    ]
    # the folders exist even though output went to the console
    assert sorted(p.name for p in logdir.iterdir()) == ["rank_0", "rank_1"]
    assert not (logdir / "rank_0" / "stdout.log").exists()


def test_help_lists_options(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "sbp.distributed.launch", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert res.returncode == 0
    for option in ("--nproc_per_node", "--nnodes", "--node_rank", "--master_port", "--logdir"):
        assert option in res.stdout
    assert "--join_timeout SECONDS" in res.stdout and "(default 300)" in res.stdout
    assert "--redirect_stdout_and_stderr" in res.stdout and "./logs" in res.stdout


# --- launches that cannot start: one line, quickly, no worker started --------------------

NO_WORKER = "open('worker_ran', 'w').close()\n"


def test_missing_node_ends_at_the_join_timeout(tmp_path):
    script = write(tmp_path / "w.py", NO_WORKER)
    port = free_port()
    res, took = timed_launch(
        "--nnodes",
        "2",
        "--master_port",
        str(port),
        "--join_timeout",
        "1",
        str(script),
        cwd=tmp_path,
    )
    line = one_line(res)
    assert res.returncode == 1
    assert f"only 1 of 2 nodes joined within --join_timeout 1 s at 127.0.0.1:{port}" in line
    assert took < QUICK
    assert not (tmp_path / "worker_ran").exists()


def test_node_without_node0_ends_at_the_join_timeout(tmp_path):
    # node 1 of 2, and nobody listens at node 0's address: no C++ retry logs either
    script = write(tmp_path / "w.py", NO_WORKER)
    port = free_port()
    args = ("--nnodes", "2", "--node_rank", "1", "--master_port", str(port), "--join_timeout", "1")
    res, took = timed_launch(*args, str(script), cwd=tmp_path)
    line = one_line(res)
    assert res.returncode == 1
    assert f"node 0's rendezvous store at 127.0.0.1:{port} did not answer" in line
    assert "--node_rank 1 of --nnodes 2" in line
    assert took < QUICK
    assert not (tmp_path / "worker_ran").exists()


def test_node_finding_something_else_at_node0s_port(tmp_path):
    # A program that is not a rendezvous store answers there: TCPStore's client retries
    # and logs a C++ stack trace for each try, all held back for the one line.
    script = write(tmp_path / "w.py", NO_WORKER)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]

        def answer():
            while True:
                try:
                    conn, _ = other.accept()
                except OSError:
                    return
                with conn:
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        threading.Thread(target=answer, daemon=True).start()
        args = ("--nnodes", "2", "--node_rank", "1", "--master_port", str(port))
        res, took = timed_launch(*args, "--join_timeout", "1", str(script), cwd=tmp_path)
    line = one_line(res)
    assert res.returncode == 1
    assert f"something answers at 127.0.0.1:{port}, but it is not node 0's rendezvous" in line
    assert took < QUICK
    assert not (tmp_path / "worker_ran").exists()


def test_busy_master_port(tmp_path):
    script = write(tmp_path / "w.py", NO_WORKER)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res, took = timed_launch("--master_port", str(port), str(script), cwd=tmp_path)
    line = one_line(res)
    assert res.returncode == 1
    assert f"--master_port {port} is already in use on 127.0.0.1" in line
    assert "choose a free port" in line
    assert took < QUICK
    assert not (tmp_path / "worker_ran").exists()


@pytest.mark.parametrize("where", ["a_file", "a_file/sub"])
def test_logdir_that_cannot_be_a_folder(tmp_path, where):
    script = write(tmp_path / "w.py", NO_WORKER)
    (tmp_path / "a_file").write_text("not a folder")
    res, took = timed_launch("--logdir", where, str(script), cwd=tmp_path)
    line = one_line(res)
    assert res.returncode == 2
    assert line.startswith(f"sbp.distributed.launch: cannot write logs to --logdir {where}: ")
    assert ("a file, not a folder" if where == "a_file" else "Not a directory") in line
    assert took < QUICK
    assert not (tmp_path / "worker_ran").exists()
    assert (tmp_path / "a_file").read_text() == "not a folder"


# --- in-process checks (no workers started) -------------------------------------------


def test_rank_logs_specs_refuses_a_folder_it_cannot_write(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr(launch.tempfile, "mkdtemp", refuse)
    with pytest.raises(PermissionError):
        launch.RankLogsSpecs(tmp_path)


def test_rank_logs_specs_names_folders_by_global_rank(tmp_path):
    # local ranks 0, 1 of node 1 with 2 procs per node are global ranks 2, 3
    (tmp_path / "rank_3").mkdir()
    (tmp_path / "rank_3" / "error.json").write_text("{}")  # stale, from an earlier run
    specs = launch.RankLogsSpecs(tmp_path, redirect=True)
    envs = {0: {"RANK": "2", "LOCAL_RANK": "0"}, 1: {"RANK": "3", "LOCAL_RANK": "1"}}
    dest = specs.reify(envs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_2", "rank_3"]
    assert dest.stdouts == {
        0: str(tmp_path / "rank_2" / "stdout.log"),
        1: str(tmp_path / "rank_3" / "stdout.log"),
    }
    assert dest.stderrs[1] == str(tmp_path / "rank_3" / "stderr.log")
    assert (
        dest.error_files[1]
        == envs[1]["TORCHELASTIC_ERROR_FILE"]
        == str(tmp_path / "rank_3" / "error.json")
    )
    assert not (tmp_path / "rank_3" / "error.json").exists()

    console_specs = launch.RankLogsSpecs(tmp_path / "c")
    console = console_specs.reify({0: {"RANK": "0"}})
    try:  # console output goes through named pipes outside the log folder
        for path in (console.stdouts[0], console.stderrs[0]):
            assert stat.S_ISFIFO(os.stat(path).st_mode)
            assert not path.startswith(str(tmp_path))
    finally:
        console_specs.close()
    assert not os.path.exists(console.stdouts[0])


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "--no_python", "x"],
        ["--nnodes", "2", "--node_rank", "2", "x.py"],
        ["--nproc_per_node", "0", "x.py"],
        ["--join_timeout", "0", "x.py"],
        [],
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        launch._parse(argv)
    assert exc.value.code == 2


def test_translation_to_torchrun_arguments():
    args = launch._parse(["--nproc_per_node", "4", "train.py", "--epochs", "3"])
    argv = launch._torchrun_argv(args)
    assert "--rdzv_backend=c10d" in argv  # one node, no port: torchrun picks a free one
    assert "--rdzv_conf=join_timeout=300" in argv
    assert argv[-3:] == ["train.py", "--epochs", "3"]

    args = launch._parse(
        [
            "--nnodes",
            "2",
            "--node_rank",
            "1",
            "--master_addr",
            "10.0.0.1",
            "--join-timeout",
            "7",
            "t.py",
        ]
    )
    argv = launch._torchrun_argv(args)
    assert "--rdzv_backend=static" in argv and "--master_port=29500" in argv
    assert "--rdzv_conf=timeout=7" in argv  # the static rendezvous's TCPStore timeout
    targs = get_args_parser().parse_args(argv)
    assert (targs.nnodes, targs.node_rank, targs.master_addr) == ("2", 1, "10.0.0.1")
    config, _, _ = config_from_args(targs)
    assert config.rdzv_configs["timeout"] == "7"
