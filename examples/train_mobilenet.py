"""Data-parallel training with global tensors: a single-device script plus three lines.

    python -m sbp.distributed.launch --nproc_per_node 2 examples/train_mobilenet.py

The model is broadcast to every rank, each batch is split along dim 0, and
gradients of the broadcast parameters are all-reduced by sbp during backward.
FakeData keeps the example offline; swap in torchvision.datasets.CIFAR10.
"""

import argparse
import time

import torch
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader, DistributedSampler

import sbp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--save", help="write a checkpoint (DCP directory) at the end")
    parser.add_argument("--resume", help="continue from a checkpoint, on any number of ranks")
    args = parser.parse_args()

    sbp.manual_seed(0)
    rank, world = sbp.env.get_rank(), sbp.env.get_world_size()
    placement = sbp.placement.all("cpu")

    data = torchvision.datasets.FakeData(
        size=args.steps * args.batch_size * world,
        image_size=(3, 32, 32),
        num_classes=10,
        transform=T.ToTensor(),
    )
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)

    model = torchvision.models.mobilenet_v2(num_classes=10)
    model.to_global(placement, sbp.broadcast)  # 1. parameters and buffers on every rank
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    done = sbp.checkpoint.load_training_state(args.resume, model, optimizer)  # 0 if None

    start = time.perf_counter()
    for step, (x, y) in enumerate(loader):
        x = x.to_global(placement, sbp.split(0))  # 2. each rank holds its part of the batch
        y = y.to_global(placement, sbp.split(0))
        loss = F.cross_entropy(model(x), y)  # mean over the whole logical batch
        optimizer.zero_grad()
        loss.backward()  # 3. gradients arrive broadcast: all-reduced
        optimizer.step()
        value = loss.item()  # every rank joins: the loss is a partial sum until reduced
        if rank == 0 and step % 2 == 0:
            print(f"step {step:3d}  loss {value:.4f}  global batch {tuple(x.shape)}")
    if args.save:
        sbp.checkpoint.save_training_state(args.save, model, optimizer, done + len(loader))
    if rank == 0:
        images = args.steps * args.batch_size * world
        print(f"{images / (time.perf_counter() - start):.0f} images/s on {world} ranks")


if __name__ == "__main__":
    main()
