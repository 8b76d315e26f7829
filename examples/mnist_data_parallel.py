"""The MindSpore seed's data-parallel MNIST MLP (784-512-512-10), with global tensors.

    python -m sbp.distributed.launch --nproc_per_node 2 examples/mnist_data_parallel.py

Each rank reads its own shard of the data (every world-th sample, like MindSpore's
`num_shards`/`shard_id`); the shards of one step form one logical batch (`split(0)`),
and the gradients of the broadcast parameters arrive averaged over it, as MindSpore's
`gradients_mean=True` gives. Every rank logs its loss lines to `--logdir/rank_<r>.log`.

Data: torchvision's MNIST reader on `--data DIR/MNIST/raw` (`--download` where there is
internet). With no files there, a small synthetic set is written in MNIST's idx format.
"""

from __future__ import annotations

import argparse
import os
import struct

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader, Subset

import sbp
from sbp.nn.parallel import local_device

FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def write_idx(path: str, array: np.ndarray) -> None:
    """An idx file: magic (0, 0, type 0x08 = ubyte, ndim), big-endian int32 sizes, bytes."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    with open(path + ".tmp", "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())
    os.replace(path + ".tmp", path)


def synthetic_digits(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """28x28 images: a bright bar whose place and direction depend on the class, plus noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n)
    images = rng.integers(0, 60, size=(n, 28, 28))
    for i, c in enumerate(labels):
        offset = 4 + 4 * (c % 5) + rng.integers(-1, 2)
        if c < 5:
            images[i, 4:24, offset : offset + 3] = 255
        else:
            images[i, offset : offset + 3, 4:24] = 255
    return images.astype(np.uint8), labels.astype(np.uint8)


def prepare_data(root: str, train_size: int, test_size: int, download: bool) -> None:
    raw = os.path.join(root, "MNIST", "raw")
    if download:
        torchvision.datasets.MNIST(root, download=True)
    elif not all(os.path.exists(os.path.join(raw, f)) for f in FILES[True] + FILES[False]):
        os.makedirs(raw, exist_ok=True)
        for train, size, seed in ((True, train_size, 0), (False, test_size, 1)):
            images, labels = synthetic_digits(size, seed)
            write_idx(os.path.join(raw, FILES[train][0]), images)
            write_idx(os.path.join(raw, FILES[train][1]), labels)
        print(f"no MNIST under {os.path.abspath(raw)}: wrote a synthetic set in its idx format")


class Network(torch.nn.Module):
    """784-512-512-10 with weights ~ N(0, 0.01) and zero biases (MindSpore's 'normal'/'zeros')."""

    def __init__(self) -> None:
        super().__init__()
        self.flatten = torch.nn.Flatten()
        self.dense_relu_sequential = torch.nn.Sequential(
            torch.nn.Linear(28 * 28, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 10),
        )
        for layer in self.dense_relu_sequential:
            if isinstance(layer, torch.nn.Linear):
                torch.nn.init.normal_(layer.weight, std=0.01)
                torch.nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_relu_sequential(self.flatten(x))


def shard(dataset, rank: int, world: int) -> Subset:
    """Every world-th sample from `rank` on, the same count on every rank."""
    per_rank = len(dataset) // world
    return Subset(dataset, range(rank, per_rank * world, world))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="data", help="folder holding MNIST/raw")
    parser.add_argument("--download", action="store_true")
    parser.add_argument("--logdir", default="log_output", help="per-rank logs: DIR/rank_<r>.log")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--synthetic-train", type=int, default=6400)
    parser.add_argument("--synthetic-test", type=int, default=1000)
    args = parser.parse_args()

    rank, world = sbp.env.get_rank(), sbp.env.get_world_size()
    device = local_device(args.device)
    placement = sbp.placement.all(args.device)
    if sbp.env.get_local_rank() == 0:
        prepare_data(args.data, args.synthetic_train, args.synthetic_test, args.download)
    if sbp.env.is_distributed():
        torch.distributed.barrier()

    transform = T.Compose([T.ToTensor(), T.Normalize((0.1307,), (0.3081,))])
    dataset = torchvision.datasets.MNIST(args.data, train=True, transform=transform)
    loader = DataLoader(shard(dataset, rank, world), batch_size=args.batch_size, drop_last=True)

    sbp.manual_seed(1)
    net = Network().to(device)
    net.to_global(placement, sbp.broadcast)
    optimizer = torch.optim.SGD(net.parameters(), args.lr)

    os.makedirs(args.logdir, exist_ok=True)
    log_path = os.path.join(args.logdir, f"rank_{rank}.log")
    steps = 0
    with open(log_path, "w") as log:
        for epoch in range(args.epochs):
            for i, (data, label) in enumerate(loader):
                if steps == args.max_steps:
                    break
                data = data.to(device).to_global(placement, sbp.split(0))
                label = label.to(device).to_global(placement, sbp.split(0))
                loss = F.cross_entropy(net(data), label)  # mean over the logical batch
                optimizer.zero_grad()
                loss.backward()  # gradients averaged over all ranks' samples
                optimizer.step()
                steps += 1
                if i % args.log_every == 0:
                    line = f"epoch: {epoch}, step: {i}, loss is {loss.item()!r}"
                    log.write(line + "\n")
                    log.flush()
                    if rank == 0:
                        print(line, flush=True)
    if rank == 0:
        print(f"per-rank logs in {os.path.abspath(args.logdir)}/rank_<r>.log")


if __name__ == "__main__":
    main()
