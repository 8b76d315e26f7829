"""Two nodes for real: two network namespaces joined by a veth pair, one launcher in each.

The test makes the namespaces itself (private 10.200.x.x addresses on the veth pair
only, nothing else is touched), runs `--nnodes 2 --node_rank i --master_addr <node 0>`
in each, and checks that a short data-parallel training equals one process. Where
namespaces cannot be made (no root, no `ip`, no CAP_NET_ADMIN) it is skipped and says
why. The namespaces are always removed. The Slurm sbatch file runs with stand-in
`srun`/`scontrol` that start its two "nodes" on this machine.
"""

import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 180

TRAIN = """\
import torch

import sbp

torch.set_default_dtype(torch.float64)
rank = sbp.env.get_rank()
P = sbp.placement.all("cpu")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
model.to_global(P, sbp.broadcast)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
for step in range(4):
    x = torch.randn(6, 4, generator=g)  # the logical batch, the same on every rank
    y = torch.randn(6, 2, generator=g)
    mine = slice(3 * rank, 3 * rank + 3)
    xg = x[mine].to_global(P, sbp.split(0))
    yg = y[mine].to_global(P, sbp.split(0))
    loss = ((model(xg) - yg) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"rank {rank} step {step} loss {loss.item()!r}", flush=True)
"""


def reference_losses() -> list[float]:
    """The same training in one process on the whole batches."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # as the workers do, so the inits are the same
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    finally:
        torch.set_default_dtype(default)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        x = torch.randn(6, 4, generator=g, dtype=torch.float64)
        y = torch.randn(6, 2, generator=g, dtype=torch.float64)
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_namespaces():
    """(namespace, interface, address) for node 0 and node 1, joined by one veth pair."""
    if shutil.which("ip") is None:
        pytest.skip("multi-node test needs the `ip` tool (iproute2) to make network namespaces")
    tag = f"{os.getpid() % 100000}"
    names = [f"sbp_node0_{tag}", f"sbp_node1_{tag}"]
    links = [f"sbp{tag}a", f"sbp{tag}b"]
    subnet = f"10.200.{os.getpid() % 250}"
    addresses = [f"{subnet}.1", f"{subnet}.2"]
    made = []
    try:
        for ns in names:
            res = ip("netns", "add", ns)
            if res.returncode != 0:
                pytest.skip(f"cannot make network namespaces here: {res.stderr.strip()}")
            made.append(ns)
        # the pair is made inside the namespaces: the host's own network is never touched
        steps = [("-n", names[0], "link", "add", links[0], "type", "veth")]
        steps[0] += ("peer", "name", links[1], "netns", names[1])
        for ns, link, address in zip(names, links, addresses, strict=True):
            steps += [
                ("-n", ns, "addr", "add", f"{address}/24", "dev", link),
                ("-n", ns, "link", "set", link, "up"),
                ("-n", ns, "link", "set", "lo", "up"),
            ]
        for step in steps:
            res = ip(*step)
            assert res.returncode == 0, f"ip {' '.join(step)}: {res.stderr}"
        yield list(zip(names, links, addresses, strict=True))
    finally:
        for ns in made:  # removing a namespace removes its end of the veth pair, and the pair
            ip("netns", "delete", ns)


def test_two_nodes_train_like_one_process(tmp_path, two_namespaces):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN))
    master = two_namespaces[0][2]
    procs = []
    for node, (ns, link, _) in enumerate(two_namespaces):
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "GLOO_SOCKET_IFNAME": link,  # gloo talks over the veth pair
        }
        cmd = [
            *("ip", "netns", "exec", ns, sys.executable, "-m", "sbp.distributed.launch"),
            *("--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1"),
            *("--master_addr", master, "--master_port", "29561", str(script)),
        ]
        procs.append(
            subprocess.Popen(
                cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        )
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=TIMEOUT)
            outputs.append(out.decode())
            assert proc.returncode == 0, out.decode() + err.decode()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    expected = reference_losses()
    for node, out in enumerate(outputs):  # node i runs global rank i
        losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("rank ")]
        assert all(line.startswith(f"rank {node} ") for line in out.splitlines() if "loss" in line)
        assert losses == pytest.approx(expected, rel=1e-12, abs=1e-14)


FAKE_SRUN = """\
#!/bin/bash
# stand-in srun: one task per node of a 2-node allocation, both on this machine
shift  # --ntasks-per-node=1
for node in 0 1; do SLURM_NODEID=$node SLURM_NNODES=2 "$@" & done
wait
"""


SUM_OF_RANKS = """\
import torch

import sbp

total = torch.tensor([sbp.env.get_rank() + 1.0])
torch.distributed.all_reduce(total)
print(f"rank {sbp.env.get_rank()} of {sbp.env.get_world_size()}: sum {total.item()}")
"""


def test_sbatch_file_with_stand_in_slurm(tmp_path):
    """examples/slurm_cifar10.sbatch starts one launcher per node; their workers form one world."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    script = tmp_path / "sum_of_ranks.py"
    script.write_text(SUM_OF_RANKS)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "SLURM_SUBMIT_DIR": str(REPO),
        "SLURM_JOB_NODELIST": "node[01-02]",
        "NPROC_PER_NODE": "1",
        "MASTER_PORT": str(free_port()),
        "EXAMPLE": str(script),
    }
    res = subprocess.run(
        ["bash", str(REPO / "examples" / "slurm_cifar10.sbatch")],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    lines = sorted(line for line in res.stdout.splitlines() if line.startswith("[rank"))
    assert lines == [f"[rank{r}]:rank {r} of 2: sum 3.0" for r in (0, 1)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
