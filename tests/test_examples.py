"""Each example runs a few steps on 2 processes through the launcher, on synthetic data.

What they print is checked against what it must be: the linear regressions end at
w = [[2], [3]] on both ranks, the MNIST losses equal one process trained on the
concatenated batches, the CIFAR-10 loss falls and its test accuracy beats chance.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
TIMEOUT = 300


def launch(tmp_path: Path, example: str, *args: str) -> subprocess.CompletedProcess:
    """Run `examples/<example>` on 2 processes with rank-prefixed console lines."""
    cmd = [sys.executable, "-m", "sbp.distributed.launch", "--nproc_per_node", "2"]
    res = subprocess.run(
        [*cmd, "--rank_prefix", str(EXAMPLES / example), *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return res


def lines_of(res: subprocess.CompletedProcess, rank: int) -> list[str]:
    prefix = f"[rank{rank}]:"
    return [line[len(prefix) :] for line in res.stdout.splitlines() if line.startswith(prefix)]


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("example", ["ddp_train.py", "global_train.py"])
def test_linear_regression_ends_at_2_3_on_both_ranks(tmp_path, example):
    res = launch(tmp_path, example)
    for rank in (0, 1):
        lines = lines_of(res, rank)
        losses = [
            float(m.group(2)) for m in map(re.compile(r"(\d+)/500 loss:(.*)").match, lines) if m
        ]
        assert len(losses) == 10 and losses[-1] < 1e-8 < losses[0]
        start = next(i for i, line in enumerate(lines) if line.startswith("w:"))
        text = " ".join(lines[start:])
        w = [float(v) for v in re.findall(r"\[(-?\d+\.\d+)\]", text)]
        assert w == pytest.approx([2.0, 3.0], abs=1e-3)


def test_mnist_losses_equal_one_process_on_the_concatenated_batches(tmp_path):
    steps, batch, lr = 5, 8, 0.5
    launch(
        tmp_path,
        "mnist_data_parallel.py",
        *("--data", "data", "--logdir", "logs", "--lr", str(lr), "--batch-size", str(batch)),
        *("--max-steps", str(steps), "--log-every", "1", "--synthetic-train", "96"),
    )
    logged = {}
    for rank in (0, 1):
        text = (tmp_path / "logs" / f"rank_{rank}.log").read_text()
        logged[rank] = [float(v) for v in re.findall(r"loss is (\S+)", text)]
    assert logged[0] == logged[1] and len(logged[0]) == steps

    # One process, the same files and model, each step's batch = rank 0's part + rank 1's.
    import torchvision
    import torchvision.transforms as T

    example = load_example("mnist_data_parallel")
    transform = T.Compose([T.ToTensor(), T.Normalize((0.1307,), (0.3081,))])
    dataset = torchvision.datasets.MNIST(tmp_path / "data", train=True, transform=transform)
    shards = [list(example.shard(dataset, r, 2)) for r in (0, 1)]
    torch.manual_seed(1)
    net = example.Network()
    optimizer = torch.optim.SGD(net.parameters(), lr)
    expected = []
    for step in range(steps):
        part = slice(step * batch, (step + 1) * batch)
        samples = shards[0][part] + shards[1][part]
        x = torch.stack([s[0] for s in samples])
        y = torch.tensor([s[1] for s in samples])
        loss = F.cross_entropy(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    assert logged[0] == pytest.approx(expected, rel=1e-5)
    assert abs(expected[-1] - expected[0]) > 1e-3  # training moved: equal losses mean something


def test_cifar10_loss_falls_and_accuracy_beats_chance(tmp_path):
    res = launch(
        tmp_path,
        "cifar10_mobilenet.py",
        *("--data", "data", "--synthetic-train", "640", "--synthetic-test", "100"),
        *("--batch-size", "16", "--max-steps", "15", "--log-every", "1", "--bn-batches", "4"),
    )
    lines = lines_of(res, 0)
    assert any(line.startswith("no CIFAR-10 under") for line in lines)
    assert (tmp_path / "data" / "cifar-10-batches-py" / "data_batch_5").exists()
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", "\n".join(lines))]
    assert len(losses) == 15
    assert sum(losses[-3:]) < sum(losses[:3])
    samples = [int(v) for v in re.findall(r"samples +(\d+)", "\n".join(lines))]
    assert samples[-1] == 15 * 16 * 2
    accuracy = re.search(r"test accuracy (\d+\.\d)% \((\d+)/100\)", "\n".join(lines))
    assert accuracy and int(accuracy.group(2)) > 20  # chance is 10
