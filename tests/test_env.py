"""`sbp.env`: world of one without launcher variables, torchrun and Slurm start-up."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest

import sbp
from sbp.env import first_slurm_host


@pytest.mark.parametrize(
    "nodelist, host",
    [("node7", "node7"), ("gpu[03-05,07]", "gpu03"), ("a[1,2],b3", "a1"), ("c-1,c-2", "c-1")],
)
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_world_of_one_without_launcher_variables():
    assert "RANK" not in os.environ and "SLURM_PROCID" not in os.environ
    assert (sbp.env.get_rank(), sbp.env.get_world_size(), sbp.env.get_local_rank()) == (0, 1, 0)
    assert not sbp.env.is_distributed()
    assert sbp.placement.all("cpu").ranks == [0]


def test_bad_timeout_is_named():
    with pytest.raises(sbp.SbpError, match="timeout"):
        sbp.env.init(timeout=-1)


SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist, sbp
    t = torch.tensor([float(sbp.env.get_rank() + 1)])
    dist.all_reduce(t)
    print(sbp.env.get_rank(), sbp.env.get_world_size(), sbp.env.get_local_rank(), t.item())
    """
)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_slurm_variables_start_a_gloo_world():
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD", "MASTER"))}
        env.update(
            SLURM_PROCID=str(rank),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(rank),
            SLURM_NODELIST="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE, text=True
            )
        )
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == [["0", "2", "0", "3.0"], ["1", "2", "1", "3.0"]]


USERS_GROUP = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")  # the user's group, adopted by sbp
    import sbp
    P = sbp.placement("cpu", [0, 1])
    w = sbp.tensor(torch.arange(6.0).reshape(2, 3), placement=P, sbp=sbp.split(1))
    x = sbp.tensor(torch.ones(4, 2), placement=P, sbp=sbp.split(0))
    loss = (x @ w.requires_grad_()).square().sum()
    loss.backward()
    values = [loss.item(), w.grad.full_tensor().sum().item()]
    if dist.get_rank() == 0:  # (one writer: the ranks share the launcher's stdout)
        print(*values)
    dist.destroy_process_group()
    """
)


def test_a_users_group_destroyed_exits_cleanly(tmp_path):
    """After the user's own `destroy_process_group`, sbp's cached subgroups still held gloo's
    threads into the interpreter's teardown, which aborted ("terminate called without an
    active exception", SIGABRT: a failed worker for the launcher) in nearly every exit
    (so one run catches it); sbp drops them at exit."""
    script = tmp_path / "users_group.py"
    script.write_text(USERS_GROUP)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD", "MASTER"))}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        + ["--master_port", str(_free_port()), str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-800:]
    assert out.stdout.split() == ["332.0", "240.0"]
    assert "terminate called" not in out.stderr
