"""Smallest sbp program: each rank prints which slice of a logical tensor it holds.

Run on 2 processes: python -m sbp.distributed.launch --nproc_per_node 2 examples/hello_global.py
"""

import torch

import sbp
from sbp import comm


def main() -> None:
    rank, world = sbp.env.get_rank(), sbp.env.get_world_size()
    P = sbp.placement.all("cpu")
    shape = (5, 3)
    logical = torch.arange(15.0).reshape(shape)
    part = logical[sbp.local_slices(shape, P, sbp.split(0), P.coord(rank))]
    total = comm.all_reduce(part.sum().reshape(1), "sum", tuple(P.flat_ranks))
    print(f"rank {rank}/{world}: split(0) rows {part[:, 0].tolist()} -> total {total.item()}")
    assert total.item() == logical.sum().item()


if __name__ == "__main__":
    main()
