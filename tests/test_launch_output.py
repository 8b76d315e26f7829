"""The launcher's console: whole lines per rank, the rank prefix, the root cause of a failure.

The worker scripts import neither torch nor sbp, so each launch costs only the launcher.
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TIMEOUT = 120
REPO = Path(__file__).resolve().parents[1]

# python -u (torchrun's default) writes a print's text and its newline separately, so
# without the launcher's line pumps two ranks' text can share one line ("RWRW 0 2").
CHATTY = """\
import os
import sys

rank = os.environ["RANK"]
for i in range(300):
    print("RW", rank, i, "x" * (i % 50))
print("to stderr", rank, file=sys.stderr)
sys.stdout.write(f"no newline at the end {rank}")
"""


def launch(tmp_path: Path, script: str, *options: str) -> subprocess.CompletedProcess:
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(script))
    cmd = [sys.executable, "-m", "sbp.distributed.launch", "--nproc_per_node", "2"]
    return subprocess.run(
        [*cmd, *options, str(path)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def test_lines_of_two_ranks_never_mix(tmp_path):
    res = launch(tmp_path, CHATTY)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    whole = re.compile(r"RW ([01]) (\d+) (x*)")
    for rank in "01":
        mine = [m for m in map(whole.fullmatch, lines) if m and m.group(1) == rank]
        assert [(int(m.group(2)), len(m.group(3))) for m in mine] == [
            (i, i % 50) for i in range(300)
        ]
        # a last line without its newline still arrives, as a line of its own
        assert f"no newline at the end {rank}" in lines
    assert len(lines) == 602  # nothing else, nothing glued together
    assert sorted(line for line in res.stderr.splitlines() if line.startswith("to stderr")) == [
        "to stderr 0",
        "to stderr 1",
    ]


def test_rank_prefix_names_the_rank_of_every_line(tmp_path):
    res = launch(tmp_path, CHATTY, "--rank_prefix")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 602
    for line in lines:
        m = re.fullmatch(r"\[rank([01])\]:(RW ([01]) \d+ x*|no newline at the end ([01]))", line)
        assert m, line
        assert m.group(1) == (m.group(3) or m.group(4))
    assert "[rank1]:to stderr 1" in res.stderr.splitlines()


# The first rank fails at once; the other, stopped by the launcher's SIGTERM, exits with
# an error code of its own, so both count as failed in the same second.
FAILS_FIRST = """\
import os
import signal
import sys
import time

first = int(os.environ["FIRST"])
if int(os.environ["RANK"]) == first:
    while not os.path.exists("other_ready"):  # the other rank handles SIGTERM by now
        time.sleep(0.01)
    print(f"rank {first} fails", file=sys.stderr, flush=True)
    sys.exit(3)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
open("other_ready", "w").close()
time.sleep(60)
"""


@pytest.mark.parametrize("first", [0, 1])
def test_failure_summary_names_the_first_failing_rank(tmp_path, first):
    os.environ["FIRST"] = str(first)
    try:
        res = launch(tmp_path, FAILS_FIRST)
    finally:
        del os.environ["FIRST"]
    other = 1 - first
    assert res.returncode == 1
    summary = res.stderr[res.stderr.index("sbp.distributed.launch:") :].splitlines()
    assert summary[0] == (
        f"sbp.distributed.launch: 2 worker(s) failed; root cause: rank {first} (the first to fail):"
    )
    assert summary[1].startswith(f"  rank {first} ") and "exit code 3" in summary[1]
    assert summary[1].endswith("<- root cause")
    assert summary[2].startswith(f"  rank {other} ") and "exit code 7" in summary[2]
    assert f"rank {first} fails" in res.stderr
