"""Train mobilenet_v2 on CIFAR-10, data parallel, with global tensors (or torch DDP).

    python -m sbp.distributed.launch --nproc_per_node 2 examples/cifar10_mobilenet.py
    python -m sbp.distributed.launch --nproc_per_node 2 examples/cifar10_mobilenet.py --ddp

The OneFlow seed's script in sbp's API. A single-device training loop plus three
lines: the model is broadcast to every rank (`model.to_global(P, broadcast)`), each
rank's part of the batch becomes a slice of one logical batch (`split(0)`), and the
gradients of the broadcast parameters arrive all-reduced after `loss.backward()`.
`--ddp` trains the same model with `sbp.nn.parallel.DistributedDataParallel` instead.

Data: torchvision's CIFAR10 reader on `--data DIR/cifar-10-batches-py` (`--download`
fetches it where there is internet). With no dataset there, a small synthetic set is
written in the same on-disk format (classes differ in colour and stripe pattern, so a
model learns it quickly) and the script says so.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader

import sbp
from sbp.nn.parallel import DistributedDataParallel, local_device
from sbp.utils.data import DistributedSampler

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
MARKER = "synthetic.json"  # written next to a synthetic set: its sizes and md5 sums


# --- data ------------------------------------------------------------------------------


def synthetic_images(n: int, seed: int) -> tuple[np.ndarray, list[int]]:
    """`n` 32x32 RGB images whose class sets the colour and the stripe direction/frequency."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n)
    palette = rng.integers(40, 216, size=(10, 3))
    yy, xx = np.mgrid[0:32, 0:32]
    images = np.empty((n, 3, 32, 32), dtype=np.uint8)
    for i, c in enumerate(labels):
        angle = np.pi * (c % 5) / 5
        freq = 0.35 + 0.25 * (c // 5)
        phase = rng.uniform(0, 2 * np.pi)
        stripes = np.sign(np.sin(freq * (xx * np.cos(angle) + yy * np.sin(angle)) + phase))
        img = palette[c][:, None, None] + 45 * stripes + rng.normal(0, 25, size=(3, 32, 32))
        images[i] = np.clip(img, 0, 255).astype(np.uint8)
    return images.reshape(n, 3 * 32 * 32), labels.tolist()


def md5(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.md5(f.read()).hexdigest()


def write_synthetic_cifar10(root: str, train_size: int, test_size: int) -> None:
    """Write `root/cifar-10-batches-py` as CIFAR-10 does: 5 train pickles, a test pickle, meta."""
    folder = os.path.join(root, torchvision.datasets.CIFAR10.base_folder)
    os.makedirs(folder, exist_ok=True)
    data, labels = synthetic_images(train_size + test_size, seed=0)
    parts = np.array_split(np.arange(train_size), 5)
    files = {f"data_batch_{i + 1}": idx for i, idx in enumerate(parts)}
    files["test_batch"] = np.arange(train_size, train_size + test_size)
    sums = {}
    for name, idx in files.items():
        entry = {
            "batch_label": name,
            "labels": [labels[i] for i in idx],
            "data": data[idx],
            "filenames": [f"synthetic_{i}.png" for i in idx],
        }
        sums[name] = dump(entry, os.path.join(folder, name))
    sums["batches.meta"] = dump(
        {"label_names": CLASSES, "num_cases_per_batch": len(parts[0]), "num_vis": 3072},
        os.path.join(folder, "batches.meta"),
    )
    marker = {"train_size": train_size, "test_size": test_size, "md5": sums}
    with open(os.path.join(folder, MARKER), "w") as f:
        json.dump(marker, f, indent=1)


def dump(obj: object, path: str) -> str:
    with open(path + ".tmp", "wb") as f:
        pickle.dump(obj, f, protocol=2)
    os.replace(path + ".tmp", path)
    return md5(path)


def synthetic_marker(root: str) -> dict | None:
    path = os.path.join(root, torchvision.datasets.CIFAR10.base_folder, MARKER)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def synthetic_cifar10_class(marker: dict) -> type[torchvision.datasets.CIFAR10]:
    """torchvision's CIFAR10 reader, checking the md5 sums of the synthetic files instead."""
    sums = marker["md5"]
    return type(
        "SyntheticCIFAR10",
        (torchvision.datasets.CIFAR10,),
        {
            "train_list": [[f"data_batch_{i}", sums[f"data_batch_{i}"]] for i in range(1, 6)],
            "test_list": [["test_batch", sums["test_batch"]]],
            "meta": {**torchvision.datasets.CIFAR10.meta, "md5": sums["batches.meta"]},
        },
    )


def prepare_data(args: argparse.Namespace) -> None:
    """On each node's first rank: download CIFAR-10, or write the synthetic set if it is missing."""
    real = os.path.join(args.data, torchvision.datasets.CIFAR10.base_folder, "data_batch_1")
    marker = synthetic_marker(args.data)
    if args.download:
        torchvision.datasets.CIFAR10(args.data, download=True)  # replaces synthetic files
        if marker is not None:
            os.remove(os.path.join(args.data, torchvision.datasets.CIFAR10.base_folder, MARKER))
    elif os.path.exists(real) and marker is None:
        pass  # the real dataset
    elif marker is None or (marker["train_size"], marker["test_size"]) != (
        args.synthetic_train,
        args.synthetic_test,
    ):
        write_synthetic_cifar10(args.data, args.synthetic_train, args.synthetic_test)


def load_datasets(args: argparse.Namespace) -> tuple[torch.utils.data.Dataset, ...]:
    if sbp.env.get_local_rank() == 0:
        prepare_data(args)
    if dist.is_initialized():
        dist.barrier()  # the others wait until the files are there
    marker = None if args.download else synthetic_marker(args.data)
    reader = torchvision.datasets.CIFAR10 if marker is None else synthetic_cifar10_class(marker)
    if sbp.env.get_rank() == 0:
        if marker is None:
            print(f"CIFAR-10 from {os.path.abspath(args.data)}")
        else:
            print(
                f"no CIFAR-10 under {os.path.abspath(args.data)}: using a synthetic set in its "
                f"format ({marker['train_size']} train / {marker['test_size']} test images)"
            )
    transform = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
    train = reader(args.data, train=True, transform=transform)
    test = reader(args.data, train=False, transform=transform)
    return train, test


class RankPartOfEachBatch(torch.utils.data.Sampler):
    """Every rank walks the same logical batches in order and takes its balanced part of each.

    For evaluation: no sample is repeated or dropped, and the parts line up with `split(0)`.
    """

    def __init__(self, size: int, batch_size: int, rank: int, world: int) -> None:
        self.size, self.batch_size, self.rank, self.world = size, batch_size, rank, world

    def __iter__(self):
        for start in range(0, self.size, self.batch_size):
            logical = torch.arange(start, min(start + self.batch_size, self.size))
            yield torch.tensor_split(logical, self.world)[self.rank].tolist()

    def __len__(self) -> int:
        return (self.size + self.batch_size - 1) // self.batch_size


# --- training --------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="data", help="folder holding cifar-10-batches-py")
    parser.add_argument("--download", action="store_true", help="download CIFAR-10 into --data")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32, help="images per rank and step")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--ddp", action="store_true", help="torch DDP instead of global tensors")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    parser.add_argument(
        "--bn-batches",
        type=int,
        default=10,
        help="training batches over which BatchNorm statistics are recomputed before testing",
    )
    parser.add_argument("--synthetic-train", type=int, default=2560, help="synthetic set size")
    parser.add_argument("--synthetic-test", type=int, default=512)
    parser.add_argument("--save", help="write a checkpoint (DCP folder) at the end")
    parser.add_argument("--resume", help="continue from a checkpoint, on any number of ranks")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    rank, world = sbp.env.get_rank(), sbp.env.get_world_size()
    device = local_device(args.device)  # cpu, or cuda:LOCAL_RANK
    train_set, test_set = load_datasets(args)

    sampler = DistributedSampler(train_set, shuffle=True, seed=0)  # this rank's part of the data
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    sbp.manual_seed(0)
    model = torchvision.models.mobilenet_v2(num_classes=10).to(device)
    if args.ddp:
        model = DistributedDataParallel(model)
        placement = None
    else:
        placement = sbp.placement.all(args.device)
        model.to_global(placement, sbp.broadcast)  # 1. parameters and buffers on every rank
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if args.resume and not args.ddp:
        sbp.checkpoint.load_training_state(args.resume, model, optimizer)
    if rank == 0:
        how = "torch DDP" if args.ddp else "global tensors"
        print(
            f"mobilenet_v2 on {world} rank(s), {args.device}, {how}: "
            f"{len(train_set)} train images, batch {args.batch_size} per rank"
        )

    steps_per_epoch = len(loader)
    total_steps = args.epochs * steps_per_epoch
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    step, seen, start = 0, 0, time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            if step == total_steps:
                break
            x, y = x.to(device), y.to(device)
            if placement is not None:
                x = x.to_global(placement, sbp.split(0))  # 2. a slice of one logical batch
                y = y.to_global(placement, sbp.split(0))
            loss = F.cross_entropy(model(x), y)  # mean over the logical batch
            optimizer.zero_grad()
            loss.backward()  # 3. gradients arrive all-reduced
            optimizer.step()
            step += 1
            seen += args.batch_size * world
            if step % args.log_every == 0 or step == total_steps:
                value = mean_over_ranks(loss) if args.ddp else loss.item()
                if rank == 0:
                    rate = seen / (time.perf_counter() - start)
                    print(
                        f"epoch {epoch + 1} step {step:4d}/{total_steps}  loss {value:.4f}  "
                        f"samples {seen:6d}  {rate:6.1f} images/s",
                        flush=True,
                    )

    if args.save and not args.ddp:
        sbp.checkpoint.save_training_state(args.save, model, optimizer, step)
    recompute_batchnorm_statistics(model, loader, args.bn_batches, placement, device)
    correct, total = evaluate(model, test_set, args, placement, device)
    if rank == 0:
        print(f"test accuracy {100 * correct / total:.1f}% ({correct}/{total})", flush=True)


def mean_over_ranks(loss: torch.Tensor) -> float:
    """DDP: each rank's loss is of its own part; the logical batch's loss is their mean."""
    value = loss.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def recompute_batchnorm_statistics(model, loader, batches: int, placement, device) -> None:
    """BatchNorm's running averages lag behind a short training: recompute them for testing.

    `torch.optim.swa_utils.update_bn` averages the batch statistics of `batches` training
    batches with the trained weights. With global tensors they are the statistics of
    the logical batches; with DDP each rank's own.
    """
    if batches <= 0:
        return
    inputs = []
    for x, _ in itertools.islice(loader, batches):
        x = x.to(device)
        inputs.append(x if placement is None else x.to_global(placement, sbp.split(0)))
    torch.optim.swa_utils.update_bn(inputs, model.module if placement is None else model)


@torch.no_grad()
def evaluate(model, test_set, args, placement, device) -> tuple[int, int]:
    rank, world = sbp.env.get_rank(), sbp.env.get_world_size()
    batches = RankPartOfEachBatch(len(test_set), args.batch_size * world, rank, world)
    model.eval()
    correct = 0
    for x, y in DataLoader(test_set, batch_sampler=batches):
        x, y = x.to(device), y.to(device)
        if placement is None:  # DDP: count this rank's part, add up the ranks' counts below
            correct += int((model.module(x).argmax(1) == y).sum())
        else:
            x = x.to_global(placement, sbp.split(0))
            y = y.to_global(placement, sbp.split(0))
            correct += int((model(x).argmax(1) == y).sum().item())  # logical count
    if placement is None and dist.is_initialized():
        counts = torch.tensor([correct], device=device)
        dist.all_reduce(counts)
        correct = int(counts.item())
    return correct, len(test_set)


if __name__ == "__main__":
    main()
