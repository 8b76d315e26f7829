"""Sharded data parallelism (ZeRO-3 / ZeRO-2, FSDP2's `fully_shard`) as a layout:
parameters `split(0)`, gathered per unit around its forward and backward by the
data-parallel call pipeline (docs/sharded_data_parallel.md).

- `units`: which submodules are gathered as one (the policy, or the user's names);
- `flat`: one unit's parameters as one flat shard per rank (copy-in, copy-out);
- `state`: the runtime (`Sharding`): gathers, prefetch, freeing, gradient reductions.
"""
