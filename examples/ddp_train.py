"""Linear regression with torch DDP through sbp: the OneFlow seed's `ddp_train.py`.

    python -m sbp.distributed.launch --nproc_per_node 2 examples/ddp_train.py

Two lines differ from a one-device script: the model is wrapped in
`sbp.nn.parallel.DistributedDataParallel` (torch DDP; the process group and the device
come from the launcher), and each rank takes its own part of the data by
`sbp.env.get_rank()`. DDP averages the gradients, so every rank ends with the same `w`,
close to [[2], [3]] (y = 2 * x0 + 3 * x1 holds on every rank's data).
"""

import argparse

import torch

import sbp
from sbp.nn.parallel import DistributedDataParallel as ddp
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
    parser = argparse.ArgumentParser(description="OneFlow's ddp_train.py seed on sbp")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    device = local_device(args.device)  # cpu, or cuda:LOCAL_RANK

    m = Model().to(device)
    m = ddp(m)
    loss = torch.nn.MSELoss(reduction="sum")
    optimizer = torch.optim.SGD(m.parameters(), m.lr)

    for i in range(0, m.iter_count):
        rank = sbp.env.get_rank()
        x = train_x[rank % 2].to(device)
        y = train_y[rank % 2].to(device)

        y_pred = m(x)
        l = loss(y_pred, y)  # noqa: E741 - the seed's name
        if (i + 1) % 50 == 0:
            print(f"{i + 1}/{m.iter_count} loss:{l.item()}")

        optimizer.zero_grad()
        l.backward()
        optimizer.step()

    print(f"\nw:{m.w.detach()}")


if __name__ == "__main__":
    main()
