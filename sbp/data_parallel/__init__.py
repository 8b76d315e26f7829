"""The data-parallel fast path: run a whole module on the local shards when that is exact.

`model.to_global(P, broadcast)` makes every parameter and buffer broadcast; a
batch made global with `split(0)` then flows through per-op dispatch, where
every aten op finds that nothing has to move. For such a module the per-op
work is pure overhead, so the module's forward runs once per input layout op
by op under a watcher (`sbp.ops.registry.observers`) that checks every op is
batch-separable: no input moved, no partial result, no op with its own
cross-sample semantics other than BatchNorm, dropout and a cross-entropy (nll)
loss, which this package reproduces on local tensors. If the check passes, every
later call with that layout runs the module's own forward on local tensors:
- parameters are replaced for the call by local leaves sharing their storage,
  buffers by their local tensors (BatchNorm updates them in place);
- `F.batch_norm` in train mode computes the logical batch's statistics
  (`sbp.ops.batch_norm`: one all-reduce forward, one backward) or, with
  `batch_norm="local"`, per-shard statistics as torch DDP does (running
  statistics are then broadcast from the first rank, as DDP broadcasts buffers);
  `F.dropout` draws the same masks as the per-op rule; `F.cross_entropy` and
  `F.nll_loss` take the mean over the logical batch (one small all-reduce);
- outputs are wrapped back into global tensors; the gradient arriving at a
  broadcast output becomes a partial sum, and at a partial sum (a loss) whole,
  so every local gradient is this rank's share of the logical one;
- the leaves' gradients are summed by `reducer.Reducer`, bucket by
  bucket during backward, and land in each parameter's `.grad` in its sbp
  (kept plain until `.grad` is read: `waiting`).
Anything else (another layout, parameters that are not broadcast, a module
whose check failed, ranks outside the placement) runs op by op as before.

The modules, each importing only those listed after it (docs/design.md):
- `api`: attach and detach, `state`, `data_parallel`'s options, `no_sync`;
- `call`: the call pipeline (`DataParallel`): layouts, the checking pass's run, the
  first local run's verdict across ranks, the local run's set-up;
- `torch_compile`: torch.compile glue (a compiled model's call leaving its graph) and the
  local forward compiled;
- `check`: the checking pass's judge of every op (`_Check`, `_WholeCalls`);
- `local_run`: the local run's counters and mode (`_Run`, `_LocalOps`);
- `compiled_batch_norm`: logical BatchNorm inside a compiled local forward;
- `families`: one module per op family with global semantics (attention, BatchNorm,
  dropout, embedding bags, losses, recurrent layers, sdpa), each with its judge for the
  check and its local run;
- `batch_rows`, `outputs`: a whole call's results laid out as the batch; the outputs that
  remember their local tensors (and the losses run on them);
- `shard_batch_norm`: `batch_norm="local"` where the fast path does not run;
- `row_wise_calls`, `recomputation`, `output_leaves`: library functions let through
  unjudged; checkpointed forwards; a module output's leaves;
- `reducer`: the gradient reducer; `buffers`: the per-shard running statistics' broadcast;
- `slots`: parameter and buffer slots swapped for local tensors, undo of a trial run;
- `inputs`, `layout`: a call's arguments walked once; what a check found per layout;
- `by_name`, `names_replaced`: names of `torch.nn.functional` and module forwards
  replaced for a call, and the per-thread replacement under them;
- `optim_step`: optimizer steps on the locals of broadcast parameters;
- `waiting`: a summed gradient waiting, plain, for its parameter (`GlobalTensor._pending`).

This package imports nothing itself, and nothing of `sbp.nn`: `sbp.nn.fast_path`
re-exports the public names.
"""
