"""The seed's linear regression trained the global-tensor way (no DDP wrapper).

    python -m sbp.distributed.launch --nproc_per_node 2 examples/global_train.py

The parameter `w` is broadcast to every rank; each rank's two samples become its slice
of one logical batch of 2 * world samples (`split(0)`). The loss is the sum over the
logical batch, its gradient reaches `w` all-reduced, and every rank prints the same
logical `w`, close to [[2], [3]].
"""

import argparse

import torch

import sbp
from sbp.nn.parallel import local_device

train_x = [
    torch.tensor([[1, 2], [2, 3]], dtype=torch.float32),
    torch.tensor([[4, 6], [3, 1]], dtype=torch.float32),
]
train_y = [
    torch.tensor([[8], [13]], dtype=torch.float32),
    torch.tensor([[26], [9]], dtype=torch.float32),
]


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lr = 0.01
        self.iter_count = 500
        self.w = torch.nn.Parameter(torch.tensor([[0], [0]], dtype=torch.float32))

    def forward(self, x):
        return torch.matmul(x, self.w)


def main() -> None:
    parser = argparse.ArgumentParser(description="the seed's linear regression, global tensors")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    device = local_device(args.device)
    placement = sbp.placement.all(args.device)

    m = Model().to(device)
    m.to_global(placement, sbp.broadcast)  # w on every rank
    optimizer = torch.optim.SGD(m.parameters(), m.lr)

    rank = sbp.env.get_rank()
    x = train_x[rank % 2].to(device).to_global(placement, sbp.split(0))  # this rank's rows
    y = train_y[rank % 2].to(device).to_global(placement, sbp.split(0))
    for i in range(0, m.iter_count):
        y_pred = m(x)
        l = ((y_pred - y) ** 2).sum()  # noqa: E741 - MSELoss(reduction="sum"), op by op
        if (i + 1) % 50 == 0:
            print(f"{i + 1}/{m.iter_count} loss:{l.item()}")  # every rank joins .item()

        optimizer.zero_grad()
        l.backward()
        optimizer.step()

    print(f"\nw:{m.w.full_tensor().detach()}")


if __name__ == "__main__":
    main()
