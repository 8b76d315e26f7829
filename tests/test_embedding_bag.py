"""`nn.EmbeddingBag` of a 2-d batch on the data-parallel fast path
(sbp.data_parallel.families.embedding_bag): each row is one bag, so the check takes
`F.embedding_bag` as a whole and the model runs on local shards. Trained against one
process, float64."""

import functools

import pytest
import torch
from fast_path_training import assert_trains_as_one_process

WORDS, DIM, L, CLASSES = 11, 4, 3, 3


class Bags(torch.nn.Module):
    """An embedding bag of each row of ids (weighted per id where `weighted`), then a head."""

    def __init__(self, weighted=False, **options):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(WORDS, DIM, **options)
        self.head = torch.nn.Linear(DIM, CLASSES)
        self.weighted = weighted

    def forward(self, ids, weights):
        return self.head(self.bag(ids, per_sample_weights=weights if self.weighted else None))


def _data(n, steps=2):
    g = torch.Generator().manual_seed(n)
    return [
        (
            torch.randint(0, WORDS, (n, L), generator=g),
            torch.rand(n, L, generator=g, dtype=torch.float64),
            torch.randint(0, CLASSES, (n,), generator=g),
        )
        for _ in range(steps)
    ]


MODELS = {
    "mean": Bags,
    "max-padding": functools.partial(Bags, mode="max", padding_idx=0),
    "sum-weighted": functools.partial(Bags, weighted=True, mode="sum"),
}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("n", [6, 7])
def test_embedding_bags_train_on_the_fast_path(pool2, name, n):
    """Before: op by op ("aten._embedding_bag.default has no SBP rule"), gathering the
    batch."""
    assert_trains_as_one_process(pool2, MODELS[name], _data(n))


def test_frequency_scaled_bags_run_op_by_op(pool2):
    """scale_grad_by_freq counts each id over the whole batch: not row-wise."""
    make = functools.partial(Bags, scale_grad_by_freq=True)
    assert_trains_as_one_process(pool2, make, _data(6), path="per-op")
