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
