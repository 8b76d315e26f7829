"""SBP rules, table-driven: each row's forward values and input gradients on global tensors equal
the single-process torch result on the logical tensors, for every input signature listed (the
ones a rule accepts and ones it must box), on 2 and 4 ranks of a world of 4 and on 2x2.

A new rule joins by adding a row: (inputs, function, signatures to try).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

import sbp

S0, S1, S2, B, P = sbp.split(0), sbp.split(1), sbp.split(2), sbp.broadcast, sbp.partial_sum


@dataclass
class Row:
    shapes: list  # logical input shapes; an int-typed input is ("int", shape, high)
    fn: object
    sbps: list  # one tuple of SBPs (one per input) per case
    grad: bool = True
    two_d: list = field(default_factory=list)  # nd_sbp tuples per input, for a 2x2 placement


def _linear(x, w, b):
    return F.linear(x, w, b)


def _bn_train(x, w, b):
    rm, rv = torch.zeros(x.shape[1], dtype=x.dtype), torch.ones(x.shape[1], dtype=x.dtype)
    if isinstance(x, sbp.GlobalTensor):
        rm = sbp.tensor(rm, x.placement, (B,) * x.placement.ndim)
        rv = sbp.tensor(rv, x.placement, (B,) * x.placement.ndim)
    out = F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.3)
    return out, rm, rv


def _bn_eval(x, w, b):
    rm = torch.linspace(-1, 1, x.shape[1], dtype=x.dtype)
    rv = torch.linspace(0.5, 2, x.shape[1], dtype=x.dtype)
    if isinstance(x, sbp.GlobalTensor):
        rm = sbp.tensor(rm, x.placement, (B,) * x.placement.ndim)
        rv = sbp.tensor(rv, x.placement, (B,) * x.placement.ndim)
    return F.batch_norm(x, rm, rv, w, b, training=False)


def _bn_vendor(op, training: bool):
    """cuDNN's or MIOpen's BatchNorm, which torch calls for a tensor on the GPU, called
    directly on global tensors; the reference is torch's BatchNorm on the CPU."""

    def fn(x, w, b):
        rm = torch.linspace(-1, 1, x.shape[1], dtype=x.dtype)
        rv = torch.linspace(0.5, 2, x.shape[1], dtype=x.dtype)
        if not isinstance(x, sbp.GlobalTensor):
            return F.batch_norm(x, rm, rv, w, b, training=training, momentum=0.3), rm, rv
        rm = sbp.tensor(rm, x.placement, (B,) * x.placement.ndim)
        rv = sbp.tensor(rv, x.placement, (B,) * x.placement.ndim)
        return op(x, w, b, rm, rv, training, 0.3, 1e-5)[0], rm, rv

    return fn


def _inplace_add(x, y):
    z = x * 1.0
    z.add_(y)
    z.mul_(2.0)
    return z


ROWS = {
    "add_broadcast": Row([(5, 6), (6,)], torch.add, [(S0, B), (S1, S0), (P, B), (B, B), (S0, S0)]),
    "sub": Row([(5, 6), (5, 6)], torch.sub, [(S0, S0), (P, P), (S1, S0), (P, B)]),
    "mul": Row([(5, 6), (5, 1)], torch.mul, [(S0, S0), (P, B), (B, P), (S1, B), (P, P)]),
    "div": Row([(7, 3), (3,)], lambda x, y: x / (y.abs() + 1), [(S0, B), (P, B), (S1, S0)]),
    "scalar_ops": Row([(7, 3)], lambda x: (x * 3 - 1) / 2 + x**2, [(S0,), (S1,), (P,), (B,)]),
    "inplace": Row([(5, 6), (6,)], _inplace_add, [(S0, B), (P, P), (S1, S0)]),
    "relu_gelu": Row(
        [(7, 5)], lambda x: F.relu(x) + F.gelu(x) + F.relu6(3 * x), [(S0,), (S1,), (P,)]
    ),
    "hardtanh_sigmoid_exp": Row(
        [(7, 5)], lambda x: F.hardtanh(x) * torch.sigmoid(x) + torch.exp(x / 4), [(S0,), (P,)]
    ),
    "where_clamp": Row([(7, 5)], lambda x: torch.where(x > 0, x, -x).clamp(max=1.0), [(S1,), (P,)]),
    "mm": Row(
        [(5, 4), (4, 3)],
        torch.mm,
        [(S0, B), (B, S1), (S1, S0), (P, B), (S0, S0), (S1, S1)],
        two_d=[((S0, S1), (S0, B)), ((S0, B), (B, S1))],
    ),
    "linear": Row(
        [(7, 4), (3, 4), (3,)],
        _linear,
        [(S0, B, B), (B, S0, S0), (S1, S1, B), (P, B, B)],
        two_d=[((S0, B), (B, S1), (B, B)), ((S0, S1), (B, B), (B, B))],
    ),
    "bmm": Row([(3, 4, 5), (3, 5, 2)], torch.bmm, [(S0, S0), (S1, B), (B, S2), (S2, S1), (P, B)]),
    "matmul_batched": Row([(2, 5, 4), (4, 3)], torch.matmul, [(S0, B), (S1, B), (B, S1), (S2, S0)]),
    "einsum": Row(
        [(2, 3, 4), (2, 4, 5)], lambda a, b: torch.einsum("bij,bjk->bik", a, b), [(S0, S0), (S1, B)]
    ),
    "sum_dims": Row(
        [(5, 6, 3)],
        lambda x: (x.sum(0), x.sum(1), x.sum((0, 2), keepdim=True), x.sum()),
        [(S0,), (S1,), (S2,), (P,)],
    ),
    "mean_dims": Row(
        [(5, 6, 3)],
        lambda x: (x.mean(0), x.mean(1, keepdim=True), x.mean()),
        [(S0,), (S1,), (P,)],
        two_d=[((S0, S1),), ((S0, S0),)],
    ),
    "amax_amin": Row([(5, 6)], lambda x: (x.amax(0), x.amin(1), x.amax()), [(S0,), (S1,), (P,)]),
    "max_min_all": Row(
        [(5, 6)], lambda x: (x.max(), x.min() * 2), [(S0,), (S1,), (B,)], two_d=[((S0, S1),)]
    ),
    "max_dim": Row([(5, 6)], lambda x: x.max(1).values + x.min(0).values.sum(), [(S0,), (S1,)]),
    "var_std": Row([(6, 5)], lambda x: (x.var(0), x.std(1), x.var()), [(S0,), (S1,), (P,)]),
    "norm": Row(
        [(6, 5)],
        lambda x: (
            x.norm(),
            torch.linalg.vector_norm(x, 3),
            torch.linalg.vector_norm(x, float("inf"), dim=1),
        ),
        [(S0,), (S1,), (P,)],
        two_d=[((S0, S1),)],
    ),
    "views": Row(
        [(4, 6, 3)],
        lambda x: (x.view(4, 18), x.reshape(24, 3), x.flatten(1), x.flatten()),
        [(S0,), (S1,), (S2,), (P,)],
    ),
    "transpose_permute": Row(
        [(5, 6, 3)],
        lambda x: (x.t() if x.dim() == 2 else x.transpose(0, 2), x.permute(1, 2, 0)),
        [(S0,), (S1,), (S2,), (P,)],
    ),
    "squeeze_expand": Row(
        [(5, 1, 3)],
        lambda x: (x.squeeze(1), x.unsqueeze(0), x.expand(5, 4, 3)),
        [(S0,), (S2,), (P,)],
    ),
    "slice_select_index": Row(
        [(7, 6)], lambda x: (x[:, 1:4], x[2:5], x[1], x[[0, 3, 3]]), [(S0,), (S1,), (P,)]
    ),
    "cat_stack": Row(
        [(5, 3), (5, 3)],
        lambda a, b: (torch.cat([a, b], 0), torch.cat([a, b], 1), torch.stack([a, b], 1)),
        [(S0, S0), (S1, S1), (S0, B), (P, P)],
    ),
    "split_chunk": Row(
        [(7, 6)], lambda x: (*x.split(2, dim=1), *x.chunk(3, dim=0)), [(S0,), (S1,)]
    ),
    "softmax": Row(
        [(7, 5)],
        lambda x: (
            F.softmax(x, 1),
            F.log_softmax(x, 1),
            F.softmax(x, 0),
            torch.ops.aten._safe_softmax(x, 1),  # (scaled_dot_product_attention's math path)
        ),
        [(S0,), (S1,), (P,)],
    ),
    "cross_entropy": Row(
        [(7, 5), ("int", (7,), 5)],
        lambda x, t: F.cross_entropy(x, t),
        [(S0, S0), (S0, B), (B, S0), (S1, S0), (P, S0)],
        two_d=[((S0, S0), (S0, S0)), ((S0, B), (S0, B))],
    ),
    "cross_entropy_options": Row(
        [(9, 4), ("int", (9,), 4)],
        lambda x, t: (
            F.cross_entropy(x, t, reduction="sum"),
            F.cross_entropy(x, t, ignore_index=1),
            F.cross_entropy(x, t, label_smoothing=0.1),
        ),
        [(S0, S0), (B, B)],
    ),
    "cross_entropy_kdim": Row(  # (N, C, d1, d2) and (N, C, d): torch's nll_loss2d
        [(5, 3, 2, 3), ("int", (5, 2, 3), 3)],
        lambda x, t: (
            F.cross_entropy(x, t),
            F.cross_entropy(x, t, reduction="none"),
            F.cross_entropy(x.flatten(2), t.flatten(1), ignore_index=1, label_smoothing=0.1),
        ),
        [(S0, S0), (S0, B), (B, S0), (S2, S1), (P, S0)],
        two_d=[((S0, S0), (S0, S0)), ((S0, S2), (S0, S1))],
    ),
    "elementwise_losses": Row(  # torch's decompositions, through the rules
        [(7, 5), (7, 5)],
        lambda x, t: (
            F.mse_loss(x, t),
            F.smooth_l1_loss(x, t, reduction="sum"),
            F.huber_loss(x, t, reduction="none", delta=0.5),
            F.binary_cross_entropy_with_logits(x, t.sigmoid()),
            F.binary_cross_entropy(x.sigmoid(), t.sigmoid(), reduction="sum"),
            F.soft_margin_loss(x, t.detach()),  # (no gradient for its target)
            F.l1_loss(x, t),
        ),
        [(S0, S0), (S1, S1), (S0, B), (B, S1), (P, S0)],
        two_d=[((S0, S1), (S0, S1))],
    ),
    "activations_backward": Row(  # torch's pointwise tag, and untagged backward ops
        [(7, 5)],
        lambda x: (
            F.elu(x),
            F.softplus(x, beta=2.0),
            F.hardsigmoid(x),
            F.softshrink(x, 0.3),
            F.hardshrink(x, 0.3),
            F.logsigmoid(x),
            torch.xlogy(x.abs(), x.abs() + 1),
            x.expm1(),
        ),
        [(S0,), (S1,), (P,)],
    ),
    "group_norm": Row(
        [(5, 4, 3), (4,), (4,)],
        lambda x, w, b: F.group_norm(x, 2, w, b),
        [(S0, B, B), (B, B, B), (S1, B, B), (S2, B, B)],
        two_d=[((S0, S0), (B, B), (B, B))],
    ),
    "gather": Row(  # (its backward: scatter_add)
        [(5, 4), ("int", (5, 3), 4), ("int", (2, 4), 5)],
        lambda x, i, j: (torch.gather(x, 1, i), torch.gather(x, 0, j)),
        [(S0, S0, B), (B, S1, S1), (P, B, B), (S1, S0, S0)],
    ),
    "scatter_add": Row(
        [(5, 4), ("int", (5, 3), 4), (5, 3)],
        lambda x, i, src: x.scatter_add(1, i, src),
        [(S0, S0, S0), (B, S1, S1), (P, B, P), (S1, S0, B), (B, B, B)],
    ),
    "scatter_add_longer_src": Row(  # src rows beyond index's are not added
        [(3, 2), ("int", (4, 2), 3), (6, 2)],
        lambda x, i, src: x.scatter_add(0, i, src),
        [(B, S0, S0), (P, S0, S0), (S1, B, S1)],
        grad=False,  # (torch's own backward refuses a src longer than index)
    ),
    "slice_select_backward": Row(
        [(5, 6, 3)], lambda x: (x[:, 1:5:2], x[:, 2], x[..., 0]), [(S0,), (S1,), (S2,), (P,)]
    ),
    "roll_flip": Row(
        [(5, 4, 3)],
        lambda x: (torch.roll(x, (1, -1), (1, 2)), torch.roll(x, 2), x.flip(2), x.flip(0, 1)),
        [(S0,), (S1,), (S2,), (P,)],
        two_d=[((S0, S2),)],
    ),
    "permute_reshape": Row(  # a permuted local cannot be viewed: reshape copies, as torch does
        [(4, 3, 2, 6)],
        lambda x: x.permute(0, 2, 1, 3).reshape(4, 6, 6),
        [(S0,), (sbp.split(3),), (S1,), (P,)],
    ),
    "glu": Row([(6, 4)], lambda x: (F.glu(x), F.glu(x, 0)), [(S0,), (S1,), (B,)]),
    "scans": Row(  # along a dim: a split of any other stays (transformers' packed masks)
        [(5, 4, 3)],
        lambda x: (x.cumsum(1), x.logcumsumexp(0)),
        [(S0,), (S1,), (S2,), (B,)],
        two_d=[((S0, S2),)],
    ),
    "cumprod_cummax_cummin": Row(
        [(5, 4, 3)],
        lambda x: (x.cumprod(2), x.cummax(1).values, x.cummin(-1).values, x.cummax(0).indices),
        [(S0,), (S1,), (S2,), (B,)],
        # (torch 2.11's backward ops are composites making tensors in C++, plain: not global)
        grad=torch.__version__ >= "2.12",
    ),
    "index_unindexed_split": Row(  # a split of a dim the indices skip stays
        [(6, 5, 4), ("int", (3,), 4)],
        lambda x, i: (x[:, i], x[..., i], x[:, [-1, 0]], x[:, i, i.flip(0)], x[i, :, i]),
        [(S0, B), (S2, B), (S1, B), (P, B), (S0, S0)],
        two_d=[((S0, S2), (B, B))],
    ),
    "cumsum_partial": Row([(5, 4)], lambda x: x.cumsum(0), [(P,), (S1,)]),
    "cat_empty_1d": Row(  # torch's cat skips an empty 1-D tensor (a KV cache's first cat;
        # integer here: torch's backward makes its gradient a plain tensor, as for any subclass)
        [("int", (0,), 1), (4, 3, 2)],
        lambda e, x: (torch.cat([e, x], dim=-2), torch.cat([x, e, x], dim=0)),
        [(B, S0), (B, S2), (B, P), (S0, S1)],
    ),
    "prelu": Row([(5, 3, 4), (3,)], lambda x, w: F.prelu(x, w), [(S0, B), (S1, S0), (S2, B)]),
    "pairwise_distance": Row(
        [(7, 5), (7, 5)], lambda x, t: F.pairwise_distance(x, t), [(S0, S0), (S1, S1)]
    ),
    "nll_none": Row(
        [(7, 5), ("int", (7,), 5)],
        lambda x, t: F.nll_loss(F.log_softmax(x, 1), t, reduction="none"),
        [(S0, S0), (B, S0)],
    ),
    "conv2d": Row(
        [(5, 3, 6, 6), (4, 3, 3, 3), (4,)],
        lambda x, w, b: F.conv2d(x, w, b, padding=1),
        [(S0, B, B), (B, S0, S0), (P, B, B), (S1, B, B)],
        two_d=[((S0, S0), (B, B), (B, B))],
    ),
    "conv2d_depthwise": Row(
        [(5, 4, 6, 6), (4, 1, 3, 3)],
        lambda x, w: F.conv2d(x, w, stride=2, groups=4),
        [(S0, B), (B, B), (S1, B)],
    ),
    "batch_norm_train": Row(
        [(7, 3, 4, 4), (3,), (3,)],
        _bn_train,
        [(S0, B, B), (B, B, B), (S2, B, B), (P, B, B), (S1, B, B)],
        two_d=[((S0, S0), (B, B), (B, B)), ((S0, S2), (B, B), (B, B))],
    ),
    # 3 samples on 4 ranks: one rank's part of the batch is empty; 1x1 and 2x2 planes
    "batch_norm_train_small": Row(
        [(3, 5, 2, 2), (5,), (5,)],
        _bn_train,
        [(S0, B, B), (S1, B, B)],
        two_d=[((S0, S0), (B, B), (B, B)), ((S0, sbp.split(3)), (B, B), (B, B))],
    ),
    "batch_norm_train_1d": Row([(3, 5), (5,), (5,)], _bn_train, [(S0, B, B)]),
    "batch_norm_train_cudnn": Row(
        [(7, 3, 4, 4), (3,), (3,)],
        _bn_vendor(torch.ops.aten.cudnn_batch_norm, True),
        [(S0, B, B), (P, B, B), (S1, B, B)],
        two_d=[((S0, S0), (B, B), (B, B))],
    ),
    "batch_norm_eval_cudnn": Row(
        [(7, 3, 4, 4), (3,), (3,)], _bn_vendor(torch.ops.aten.cudnn_batch_norm, False), [(S0, B, B)]
    ),
    "batch_norm_train_miopen": Row(
        [(3, 5, 2, 2), (5,), (5,)], _bn_vendor(torch.ops.aten.miopen_batch_norm, True), [(S0, B, B)]
    ),
    "batch_norm_eval": Row([(7, 3, 4, 4), (3,), (3,)], _bn_eval, [(S0, B, B), (B, B, B)]),
    "pooling": Row(
        [(5, 3, 6, 6)],
        lambda x: (
            F.adaptive_avg_pool2d(x, 1),
            F.adaptive_avg_pool2d(x, 2),
            F.max_pool2d(x, 2),
            F.avg_pool2d(x, 3),
        ),
        [(S0,), (S1,), (B,), (S2,)],
    ),
    "layer_norm": Row(
        [(5, 3, 4), (4,), (4,)],
        lambda x, w, b: F.layer_norm(x, (4,), w, b),
        [(S0, B, B), (S1, B, B), (S2, B, B)],
    ),
    "embedding": Row(
        [(6, 4), ("int", (5, 3), 6)],
        lambda w, i: F.embedding(i, w),
        [(B, S0), (B, S1), (B, B), (S0, S0)],
    ),
    # rotary embeddings as LLaMA applies them: pairs as complex numbers, times unit phases
    # (their gradient conjugates: it was read unconjugated, and view_as_* gathered)
    "rotary_complex": Row(
        [(5, 3, 8), (3, 4)],
        lambda x, f: torch.view_as_real(
            torch.view_as_complex(x.reshape(5, 3, 4, 2)) * torch.polar(torch.ones_like(f), f)
        ).flatten(-2),
        [(S0, B), (S1, S0), (S2, B), (B, B), (P, B)],
    ),
    "conjugates": Row(
        [(5, 4), (5, 4)],
        lambda a, b: (
            torch.view_as_real(torch.complex(a, b).conj() * torch.complex(b, a)),
            torch.view_as_real(torch.complex(a, b).conj().exp()),
            (torch.complex(a, b).conj() + 1).abs(),
        ),
        [(S0, S0), (S1, B), (B, B)],
    ),
    # torch.where with a number, which torch's C++ makes a 0-dim tensor (a PlacementError)
    "where_number": Row(
        [(5, 4)],
        lambda x: (torch.where(x > 0, x, 0.5), torch.where(x > 0, 2.0, x), x.where(x < 1, -1)),
        [(S0,), (S1,), (B,)],
    ),
    # backward formulas joining local constants to gradients (a PlacementError)
    "prod_trace": Row(
        [(5, 4)],
        lambda x: (x.prod(), x.prod(1), x.prod(0), torch.trace(x)),
        [(S0,), (S1,), (B,)],
    ),
    "mv_dot_vdot": Row(
        [(5, 4), (4,), (4,)],
        lambda a, v, w: (torch.mv(a, v), torch.dot(v, w), torch.vdot(v, w)),
        [(S0, B, B), (S1, S0, S0), (P, B, B), (B, P, B), (B, S0, P)],
    ),
    "triangles_matrix_exp": Row(
        [(3, 4, 4)],
        lambda x: (x.tril(), x.triu(1), x.clone().tril_(-1), torch.linalg.matrix_exp(x / 4)),
        [(S0,), (S1,), (S2,), (P,), (B,)],
        two_d=[((S0, S0),), ((S0, P),)],
    ),
    "weight_norm": Row(  # (dim 0 runs torch's fused kernel; dim 1 of three its composite)
        [(4, 3, 2), (4, 1, 1), (1, 3, 1)],
        lambda v, g0, g1: (torch._weight_norm(v, g0, 0), torch._weight_norm(v, g1, 1)),
        [(S0, S0, B), (S1, B, S1), (B, B, B), (P, B, B)],
    ),
    # found by review: split indices counted their frequencies per shard; unbind's backward
    # stacks zeros torch makes for the unused parts; one unbatched sample has no batch dim
    "embedding_scaled_by_frequency": Row(
        [("int", (3, 2), 5), (5, 3)],
        lambda i, w: F.embedding(i, w, scale_grad_by_freq=True),
        [(S0, B), (S1, B), (B, B)],
        two_d=[((S0, S1), (B, B))],
    ),
    "unbind_some_unused": Row([(4, 3)], lambda x: x.unbind(0)[1] * 2, [(S0,), (S1,), (B,)]),
    "nll_of_one_sample": Row(
        [(3,), ("int", (), 3)],
        lambda x, t: (F.nll_loss(x, t), F.cross_entropy(x, t)),
        [(S0, B), (B, B)],
        two_d=[((B, B), (B, B))],
    ),
    "unsafe_split_chunk": Row(  # (the gates of torch's LSTM and GRU cells)
        [(6, 5)],
        lambda x: (
            *x.unsafe_chunk(3, 0),
            *torch.unsafe_split(x, 2, 1),
            *x.unsafe_split_with_sizes([1, 4], 1),
        ),
        [(S0,), (S1,), (P,), (B,)],
        two_d=[((S0, S1),)],
    ),
    # factorizations check their error codes in an op that returns nothing (a ValueError)
    "factorizations": Row(
        [(4, 4)],
        lambda x: (
            torch.linalg.inv(x @ x.mT + 4 * torch.ones_like(x).tril().triu()),
            torch.linalg.cholesky(x @ x.mT + 4 * torch.ones_like(x).tril().triu()),
            torch.linalg.solve(x @ x.mT + 4 * torch.ones_like(x).tril().triu(), x),
        ),
        [(S0,), (S1,), (B,)],
    ),
    # list-taking ops whose one result mixes the entries took the foreach rule (ValueError)
    "block_diag": Row(
        [(2, 3), (1, 2)], lambda a, b: torch.block_diag(a, b), [(S0, B), (S1, S0), (B, B)]
    ),
    "chunk_cat": Row(
        [(4, 6), (4, 2)], lambda a, b: torch._chunk_cat([a, b], 1, 2), [(S1, S0), (B, B)], False
    ),
    # dim 0 (or -1) of a 0-dim tensor is the tensor itself (an IndexError in the rules)
    "reductions_of_a_0dim_tensor": Row(
        [()],
        lambda x: (x.mean(0, keepdim=True), x.sum(-1), torch.cummax(x, 0)[0]),
        [(B,), (P,)],
    ),
    # the gradient of a sum is an expanded tensor: as_strided read past its one element
    "as_strided_scatter_summed": Row(
        [(3, 3), (2, 2)],
        lambda a, b: torch.as_strided_scatter(a, b, (2, 2), (1, 2), 0).sum(),
        [(S1, S1), (S0, B), (B, B)],
    ),
    # their backward formulas make the zeros they scatter as local tensors
    "scatter_into_parts": Row(
        [(4, 6), (4, 2), (4,), (4,)],
        lambda a, b, c, d: (
            torch.slice_scatter(a, b, 1, 2, 4),
            torch.select_scatter(a, c, 1, 3),
            torch.diagonal_scatter(a, d),
        ),
        [(S0, B, S0, B), (S1, S0, B, S0), (B, B, B, B), (P, B, P, B)],
    ),
    "scatter_add_of_0dim_tensors": Row(
        [(), ("int", (), 1), ()],
        lambda x, i, s: torch.scatter_add(x, 0, i, s),
        [(B, B, B), (P, B, P)],
    ),
}


def _inputs(row: Row, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in row.shapes:
        if isinstance(s, tuple) and s and s[0] == "int":
            out.append(torch.randint(0, s[2], s[1], generator=g))
        else:
            out.append(torch.randn(s, generator=g, dtype=torch.float64))
    return out


def _flat(out):
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return [out]


def _run_case(name: str, nd_sbps: list, ranks: list):
    """On each rank: the global computation vs the single-process reference."""
    row = ROWS[name]
    P_ = sbp.placement("cpu", ranks)
    logical = _inputs(row, 7)
    ref_in = [t.clone().requires_grad_(row.grad and t.is_floating_point()) for t in logical]
    glob = []
    for t, nd in zip(logical, nd_sbps, strict=True):
        g = sbp.tensor(t, P_, nd)
        if row.grad and t.is_floating_point():
            g.requires_grad_()
        glob.append(g)
    ref_out, out = _flat(row.fn(*ref_in)), _flat(row.fn(*glob))
    inside = sbp.env.get_rank() in P_
    errors = []
    for i, (r, o) in enumerate(zip(ref_out, out, strict=True)):
        if not isinstance(o, sbp.GlobalTensor):
            errors.append(f"output {i} is not global: {type(o)}")
            continue
        if tuple(o.shape) != tuple(r.shape):
            errors.append(f"output {i}: shape {tuple(o.shape)} != {tuple(r.shape)}")
            continue
        full = o.full_tensor()
        if inside and not torch.allclose(full.double(), r.detach().double(), rtol=1e-9, atol=1e-10):
            errors.append(
                f"output {i} ({o.sbp}) differs by {(full.double() - r.detach().double()).abs().max()}"
            )
    if row.grad and not errors:
        weights = _inputs(Row([tuple(r.shape) for r in ref_out], None, []), 11)
        pairs = [
            (r, o, w) for r, o, w in zip(ref_out, out, weights, strict=True) if r.requires_grad
        ]
        if pairs:
            sum((r * w).sum() for r, _, w in pairs).backward()
            sum((o * sbp.tensor(w, P_, (B,) * P_.ndim)).sum() for _, o, w in pairs).backward()
            for i, (r, g) in enumerate(zip(ref_in, glob, strict=True)):
                if r.grad is None:
                    continue
                if g.grad is None:
                    errors.append(f"input {i}: no gradient")
                    continue
                if tuple(g.grad.sbp) != tuple(g.sbp) and not any(s.is_partial for s in g.sbp):
                    errors.append(f"input {i}: grad sbp {g.grad.sbp} != leaf sbp {g.sbp}")
                full = g.grad.full_tensor()
                if inside and not torch.allclose(full, r.grad, rtol=1e-9, atol=1e-10):
                    errors.append(f"input {i} grad differs by {(full - r.grad).abs().max()}")
    return errors


CASES = [
    (name, nd, ranks)
    for name, row in ROWS.items()
    for ranks in ([0, 1], [3, 1, 0, 2])
    for nd in [tuple((s,) for s in combo) for combo in row.sbps]
] + [(name, nd, [[0, 1], [2, 3]]) for name, row in ROWS.items() for nd in row.two_d]


def _id(case):
    name, nd, ranks = case
    sig = "-".join("".join(repr(s).replace("sbp.", "") for s in t) for t in nd)
    return f"{name}[{sig}]{ranks}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_op_matches_single_process(pool4, case):
    name, nd, ranks = case
    results = pool4.run(_run_case, name, list(nd), ranks)
    for rank, errors in enumerate(results):
        assert not errors, f"rank {rank}: {errors}"


def _dropout_stats(p: float):
    P_ = sbp.placement("cpu", [0, 1, 2, 3])
    sbp.manual_seed(5)
    x = sbp.ones(4000, 8, placement=P_, sbp=S0)
    y = F.dropout(x, p, training=True)
    kept = (y.to_local() != 0).double().mean().item()
    values = {round(v, 5) for v in y.to_local().unique().tolist()}
    b = F.dropout(sbp.ones(64, 8, placement=P_, sbp=B), p, training=True)
    return kept, values, b.to_local(), y.to_local()


def test_dropout_masks_scaling_and_sharing(pool4):
    p = 0.3
    results = pool4.run(_dropout_stats, p)
    for kept, values, _, _ in results:
        assert abs(kept - (1 - p)) < 0.03
        assert values <= {0.0, round(1 / (1 - p), 5)}
    masks_b = [r[2] for r in results]
    assert all(torch.equal(m, masks_b[0]) for m in masks_b)  # broadcast: one mask everywhere
    shards = [r[3] for r in results]
    assert not torch.equal(shards[0], shards[1])  # split: every shard draws its own


def _mixing():
    P_ = sbp.placement("cpu", [0, 1])
    g = sbp.ones(4, 2, placement=P_, sbp=B)
    h = sbp.ones(4, 2, placement=sbp.placement("cpu", [1, 0]), sbp=B)
    out = []
    cases = (
        lambda: g + torch.ones(4, 2),
        lambda: g + h,
        lambda: torch._foreach_add_([g], [torch.ones(4, 2)]),  # list ops: their own path
        lambda: torch._foreach_add_([g], [h]),
    )
    for f in cases:
        try:
            f()
            out.append("no error")
        except sbp.PlacementError as e:
            out.append(str(e))
    return out


def test_mixing_local_or_placements_raises_naming_the_op(pool4):
    for local_msg, placement_msg, list_local, list_placement in pool4.run(_mixing):
        assert "aten.add.Tensor" in local_msg and "local torch.Tensor" in local_msg
        assert "aten.add.Tensor" in placement_msg and "different placements" in placement_msg
        assert "aten._foreach_add_" in list_local and "local torch.Tensor" in list_local
        assert "aten._foreach_add_" in list_placement and "different placements" in list_placement


def _factories():
    P_ = sbp.placement("cpu", [[0, 1], [2, 3]])
    sbp.manual_seed(3)
    a = sbp.randn(5, 6, placement=P_, sbp=(S0, S1)).full_tensor()
    b = sbp.rand(5, 6, placement=P_, sbp=(B, P)).full_tensor()
    torch.manual_seed(3)
    ra, rb = torch.randn(5, 6), torch.rand(5, 6)
    c = sbp.arange(7, placement=P_, sbp=(S0, B)).full_tensor()
    d = sbp.full((3, 2), 4.0, placement=P_, sbp=(P, S0)).full_tensor()
    e = sbp.zeros(3, placement=P_, sbp=(B, B)) + sbp.ones(3, placement=P_, sbp=(S0, P))
    return torch.equal(a, ra) and torch.equal(b, rb), c.tolist(), d.tolist(), e.tolist()


def test_factories_give_the_single_process_value(pool4):
    for same, c, d, e in pool4.run(_factories):
        assert same
        assert c == list(range(7)) and d == [[4.0, 4.0]] * 3 and e == [1.0, 1.0, 1.0]


def _fallback():
    import warnings

    P_ = sbp.placement("cpu", [0, 1, 2])
    x = sbp.tensor(torch.arange(12.0).reshape(4, 3), P_, S0)
    with warnings.catch_warnings(record=True) as w, sbp.comm_stats() as st:
        warnings.simplefilter("always")
        y = torch.renorm(x, 2, 0, 5.0)
    return y.full_tensor().tolist(), [str(m.message) for m in w], dict(st.fallbacks)


def test_op_without_rule_falls_back_to_broadcast_and_warns(pool4):
    ref = torch.renorm(torch.arange(12.0).reshape(4, 3), 2, 0, 5.0).tolist()
    for rank, (got, warned, kinds) in enumerate(pool4.run(_fallback)):
        assert got == (ref if rank < 3 else [])  # rank 3 is outside the placement
        if rank < 3:
            assert any("no SBP rule for aten.renorm" in m for m in warned) or kinds
            assert any(k.startswith("aten.renorm") for k in kinds)


def _segmentation_loss():
    """Cross-entropy of (N, C, H, W) scores split along the batch: its value and gradient,
    and what it communicated."""
    P_ = sbp.placement("cpu", [0, 1, 2, 3])
    x, t = _inputs(Row([(6, 4, 3, 3), ("int", (6, 3, 3), 4)], None, []), 3)
    t[1, 0, 0] = -100  # an ignored pixel: the divisor is all-reduced
    gx = sbp.tensor(x, P_, (S0,)).requires_grad_()
    with sbp.comm_stats() as st:
        loss = F.cross_entropy(gx, sbp.tensor(t, P_, (S0,)))
        loss.backward()
    x.requires_grad_()
    want = F.cross_entropy(x, t)
    want.backward()
    value_error = (loss.full_tensor() - want).abs().item()
    grad_error = (gx.grad.full_tensor() - x.grad).abs().max().item()
    return value_error, grad_error, dict(st.fallbacks), dict(st.by_kind), gx.grad.sbp


def test_segmentation_loss_keeps_the_batch_split(pool4):
    """torch's nll_loss2d (K-dim cross-entropy) has the 2-D loss's rule: the scores are
    not gathered, only the divisor is all-reduced, and the gradient stays split."""
    for value_error, grad_error, fallbacks, kinds, grad_sbp in pool4.run(_segmentation_loss):
        assert value_error < 1e-12 and grad_error < 1e-12
        assert fallbacks == {} and kinds == {"all_reduce": 1}
        assert grad_sbp == (S0,)


BATCH_OPS = {  # ops on a batch split along dim 0 that must stay local (no fallback, no gather)
    "mse_loss": lambda x, t: F.mse_loss(x, t),
    "smooth_l1_loss": lambda x, t: F.smooth_l1_loss(x, t),
    "huber_loss": lambda x, t: F.huber_loss(x, t),
    "l1_loss": lambda x, t: F.l1_loss(x, t),
    "bce": lambda x, t: F.binary_cross_entropy(x.sigmoid(), t.sigmoid()),
    "bce_with_logits": lambda x, t: F.binary_cross_entropy_with_logits(x, t.sigmoid()),
    "soft_margin_loss": lambda x, t: F.soft_margin_loss(x, t.sign()),
    "kl_div": lambda x, t: F.kl_div(F.log_softmax(x, 1), F.softmax(t, 1), reduction="batchmean"),
    "elu": lambda x, t: F.elu(x).sum(),
    "softplus": lambda x, t: F.softplus(x).sum(),
    "hardsigmoid": lambda x, t: F.hardsigmoid(x).sum(),
    "logsigmoid": lambda x, t: F.logsigmoid(x).sum(),
    "group_norm": lambda x, t: F.group_norm(x.view(8, 2, 3), 2).sum(),
    "pairwise_distance": lambda x, t: F.pairwise_distance(x, t).sum(),
    "glu": lambda x, t: F.glu(x).sum(),
    "prelu": lambda x, t: F.prelu(x.view(8, 3, 2), x.new_full((3,), 0.25)).sum(),
    "hardswish_": lambda x, t: F.hardswish(x * 1.0, inplace=True).sum(),
    "slice_select": lambda x, t: (x[:, 1:4] * t[:, :3]).sum() + x[:, 0].sum(),
    "roll": lambda x, t: (torch.roll(x, 2, 1) * t).sum(),
    "gather": lambda x, t: torch.gather(x, 1, (t.abs() * 2).long().clamp(max=5)).sum(),
    "safe_softmax": lambda x, t: (torch.ops.aten._safe_softmax(x, 1) * t).sum(),
    "flip": lambda x, t: (x.flip(1) * t).sum(),
    "permute_reshape": lambda x, t: (x.view(8, 2, 3).permute(0, 2, 1).reshape(8, 6) * t).sum(),
}


def _merge_on_2x2(x, nd):
    """Flatten and unflatten the batch dim on a 2x2 placement: the split follows."""
    P_ = sbp.placement("cpu", [[0, 1], [2, 3]])
    gx = sbp.tensor(x, P_, nd).requires_grad_()
    with sbp.comm_stats() as st:
        flat = gx.view(-1, x.shape[-1])
        back = flat.view(x.shape)
        out = (flat * 2).sum() + back.pow(2).sum()
        out.backward()
    return flat.sbp, back.sbp, out.full_tensor(), gx.grad.full_tensor(), st.calls


@pytest.mark.parametrize("nd", [(S0, S0), (S0, B), (B, S0)])
def test_merging_the_batch_dim_keeps_its_split_on_2x2(pool4, nd):
    """(N, L, E) viewed as (N*L, E) and back: where N divides over all four ranks, each
    rank's rows of the merged dim are its rows of N, so the split follows (it was made a
    partial sum on a 2-D placement, and every op after ran on the whole tensor)."""
    x = torch.randn(8, 3, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    xr = x.clone().requires_grad_()
    want = (xr.view(-1, 2) * 2).sum() + xr.pow(2).sum()
    want.backward()
    for flat, back, out, grad, calls in pool4.run(_merge_on_2x2, x, nd):
        assert flat == back == nd
        torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, xr.grad, rtol=1e-12, atol=1e-12)
        assert calls == 0  # (nothing moved: the sum stays a partial sum)


def _batch_op(name):
    P_ = sbp.placement("cpu", [0, 1])
    x, t = _inputs(Row([(8, 6), (8, 6)], None, []), 5)
    gx = sbp.tensor(x, P_, (S0,)).requires_grad_()
    with sbp.comm_stats() as st:
        out = BATCH_OPS[name](gx, sbp.tensor(t, P_, (S0,)))
        out.backward()
    x.requires_grad_()
    want = BATCH_OPS[name](x, t)
    want.backward()
    close = torch.allclose(out.full_tensor(), want, rtol=1e-12, atol=1e-14)
    return close, torch.allclose(gx.grad.full_tensor(), x.grad, rtol=1e-12, atol=1e-14), st


@pytest.mark.parametrize("name", sorted(BATCH_OPS))
def test_losses_and_activations_keep_a_batch_split(pool2, name):
    """Losses and activations with no aten rule of their own (torch's decompositions and
    pointwise tag) compute on the local shards: equal to one process, nothing gathered."""
    for value_close, grad_close, stats in pool2.run(_batch_op, name):
        assert value_close and grad_close
        assert not stats.fallbacks and "all_gather" not in stats.by_kind, stats


def _position_embedding():
    """GPT-2's position embedding: ids broadcast, added to a split batch; the positions'
    gradient is then a partial sum. Reduced there (3 x 4), not as the table's gradient
    (5 x 4, what the embedding backward would carry partial into the buckets): fewer bytes,
    the same count (docs/design.md, "Data flow of one op")."""
    P_ = sbp.placement("cpu", [0, 1])
    x, table = _inputs(Row([(8, 3, 4), (5, 4)], None, []), 9)
    gx = sbp.tensor(x, P_, (S0,)).requires_grad_()
    gt = sbp.tensor(table, P_, (B,)).requires_grad_()
    ids = torch.arange(3)
    with sbp.comm_stats() as st:
        out = (gx + F.embedding(sbp.tensor(ids, P_, (B,)), gt)).pow(2).sum()
        out.backward()
    x.requires_grad_(), table.requires_grad_()
    (x + F.embedding(ids, table)).pow(2).sum().backward()
    close = [
        torch.allclose(a, b, rtol=1e-12, atol=1e-12)
        for a, b in [(gx.grad.full_tensor(), x.grad), (gt.grad.full_tensor(), table.grad)]
    ]
    return close, dict(st.by_kind)


def test_position_embedding_gradient_stays_partial(pool2):
    for close, kinds in pool2.run(_position_embedding):
        assert close == [True, True]
        assert kinds == {"all_reduce": 1}, kinds  # the positions' gradient, before the lookup


WORLD2_CASES = [(name, tuple((s,) for s in row.sbps[0]), [1, 0]) for name, row in ROWS.items()]
WORLD2_CASES += [
    (name, tuple((s,) for s in combo), [0, 1])
    for name, row in ROWS.items()
    for combo in row.sbps[1:]
]


@pytest.mark.parametrize("case", WORLD2_CASES, ids=[_id(c) for c in WORLD2_CASES])
def test_op_matches_single_process_in_a_world_of_2(pool2, case):
    name, nd, ranks = case
    for rank, errors in enumerate(pool2.run(_run_case, name, list(nd), ranks)):
        assert not errors, f"rank {rank}: {errors}"


def _half_batch_norm(dtype, x, want):
    """Train-mode BatchNorm in `dtype` over the batch split on 2 ranks: its errors against
    the float64 result (torch takes float32 statistics for half inputs)."""
    P_ = sbp.placement("cpu", [0, 1])
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(3).to(dtype).to_global(P_, B)
    gx = sbp.tensor(x.to(dtype), P_, S0).requires_grad_()
    out = bn(gx)
    out.float().pow(2).sum().backward()
    got = [out, gx.grad, bn.weight.grad, bn.running_var]
    return [
        (g.full_tensor().double() - w).abs().max().item() for g, w in zip(got, want, strict=True)
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_batch_norm_over_ranks(pool2, dtype):
    """(It used to raise: float32 statistics met the half weight in torch's kernel.) Errors
    against float64 stay within twice single-process torch's own in `dtype`."""
    x = torch.randn(8, 3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def run(dt, module):
        xr = x.to(dt, copy=True).requires_grad_()
        out = module.to(dt)(xr)
        out.to(torch.float64).pow(2).sum().backward()
        return [out, xr.grad, module.weight.grad, module.running_var], module

    want, _ = run(torch.float64, torch.nn.BatchNorm1d(3))
    want = [w.detach() for w in want]
    torch_half, _ = run(dtype, torch.nn.BatchNorm1d(3))
    bound = [
        2 * (t.detach().double() - w).abs().max().item() + 1e-3
        for t, w in zip(torch_half, want, strict=True)
    ]
    for errors in pool2.run(_half_batch_norm, dtype, x, want):
        assert all(e <= b for e, b in zip(errors, bound, strict=True)), (errors, bound)


MASK_LAYOUTS = [(S0, S0), (S0, B), (S1, B), (B, B), (P, B)]


def _masked_indexing(x, layouts):
    P_ = sbp.placement("cpu", [0, 1])
    results = []
    for xs, ms in layouts:
        gx = sbp.tensor(x, P_, xs).requires_grad_()
        mask = sbp.tensor(x > 0, P_, ms if ms != P else B)
        rows = sbp.tensor(x[:, 0] > 0, P_, B)
        out = gx[mask].sum() * 2 + (gx[rows] ** 2).sum() + gx[:, mask[0]].pow(3).sum()
        out.backward()
        results.append((out.full_tensor(), gx.grad.full_tensor(), gx[rows].sbp))
    return results


def _masked_indexing_beside_outsiders(x):
    """On ranks 0 and 1 of four: the logical shapes on every rank, values where held."""
    P_ = sbp.placement("cpu", [0, 1])
    inside = sbp.env.get_rank() in P_
    results = []
    for xs in (S0, S1, B):
        gx = sbp.tensor(x, P_, xs).requires_grad_()
        mask, rows = sbp.tensor(x > 0, P_, B), sbp.tensor(x[:, 0] > 0, P_, B)
        picked, row_picked = gx[mask], gx[rows]
        out = picked.sum() + (row_picked**2).sum()
        out.backward()
        results.append(
            (
                tuple(picked.shape),
                tuple(row_picked.shape),
                out.full_tensor() if inside else None,
                gx.grad.full_tensor() if inside else None,
            )
        )
    return results


def test_boolean_mask_indexing_beside_ranks_outside_the_placement(pool4):
    """Ranks outside the placement hold no mask values: they learn each mask's number of
    positions, so the output's logical shape is the same on every rank (it had no rows
    there)."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    xr = x.clone().requires_grad_()
    want = xr[x > 0].sum() + (xr[x[:, 0] > 0] ** 2).sum()
    want.backward()
    shapes = (tuple(x[x > 0].shape), tuple(x[x[:, 0] > 0].shape))
    for rank, results in enumerate(pool4.run(_masked_indexing_beside_outsiders, x)):
        for picked, row_picked, out, grad in results:
            assert (picked, row_picked) == shapes
            if rank < 2:
                torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(grad, xr.grad, rtol=1e-12, atol=1e-12)


def test_boolean_mask_indexing_equals_one_process(pool2):
    """`x[mask]` (it raised: torch has no meta nonzero): the mask read as its nonzero
    positions; a mask over dims a split does not touch keeps it (`x[rows]` of a split(1) x)."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    xr = x.clone().requires_grad_()
    rows, cols = x[:, 0] > 0, x[0] > 0
    want = xr[x > 0].sum() * 2 + (xr[rows] ** 2).sum() + xr[:, cols].pow(3).sum()
    want.backward()
    for results in pool2.run(_masked_indexing, x, MASK_LAYOUTS):
        for (out, grad, rows_sbp), (xs, _) in zip(results, MASK_LAYOUTS, strict=True):
            torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(grad, xr.grad, rtol=1e-12, atol=1e-12)
            if xs == S1:
                assert rows_sbp == (S1,)


def _calls_alike_when_flattened():
    """Calls whose flat arguments compare equal: `sum(x, [0], True)` and `sum(x, [0, 1])`
    (True == 1), `add(b, True)` and `add(b, 1)` of a bool tensor."""
    P = sbp.placement("cpu", [0, 1])
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(4, 6, generator=g, dtype=torch.float64)
    x = sbp.tensor(x0, placement=P, sbp=S0)
    b = sbp.tensor(x0 > 0, placement=P, sbp=S0)
    outs = [x.sum(0, keepdim=True), x.sum([0, 1]), torch.linalg.vector_norm(x), b + True, b + 1]
    return [(tuple(o.shape), o.dtype, o.full_tensor()) for o in outs]


def test_decisions_of_calls_alike_when_flattened_are_kept_apart(pool2):
    """The decision cache keyed the arguments flattened, booleans equal to integers: the
    vector norm after `x.sum(0, keepdim=True)` took its (1, 6) shape (and clip_grad_norm_
    on split and broadcast gradients failed in torch.stack)."""
    x0 = torch.randn(4, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    b0 = x0 > 0
    want = [
        x0.sum(0, keepdim=True),
        x0.sum([0, 1]),
        torch.linalg.vector_norm(x0),
        b0 + True,
        b0 + 1,
    ]
    for outs in pool2.run(_calls_alike_when_flattened):
        for (shape, dtype, got), w in zip(outs, want, strict=True):
            assert shape == tuple(w.shape) and dtype == w.dtype
            torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-12)


def _norms_and_scalings(z, x, s, t) -> list:
    """Complex and dtype-cast vector norms of `z` and `x`, and sums `s` and `t` scaled by
    numbers that do not scale a partial sum's parts (infinite, NaN, zero to divide by)."""
    return [
        torch.linalg.vector_norm(z, dim=0),
        z.norm(),
        torch.linalg.vector_norm(z, 3),
        torch.linalg.vector_norm(z, float("inf"), dim=1),
        torch.linalg.vector_norm(x, float("inf"), dtype=torch.float64),
        torch.linalg.vector_norm(x, float("-inf"), dim=0, dtype=torch.float64),
        torch.linalg.vector_norm(x, 0, dtype=torch.float64),
        torch.linalg.vector_norm(x, 2, dim=1, dtype=torch.float64),
        *(s / 0.0, s * float("inf"), s * float("nan"), s / 2.0, s * 0.0, t / 0.0, -t / 0),
        *(s.div(0.0), torch.mul(s, float("-inf")), s.clone().div_(0.0)),
    ]


def _logical_norm_inputs() -> tuple:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 3, generator=g, dtype=torch.complex128)
    x = torch.randn(5, 3, generator=g, dtype=torch.float32)
    ones = torch.tensor([2.0, -0.5, 1.0], dtype=torch.float64)
    return z, x, ones, torch.tensor([2.0], dtype=torch.float64)  # (a rank holds none of it)


def _norms_and_scaled_partial_sums(nd):
    P = sbp.placement("cpu", [0, 1])
    z, x, ones, single = (sbp.tensor(t, P, nd) for t in _logical_norm_inputs())
    outs = _norms_and_scalings(z, x, ones.sum(), single.sum())
    return [(o.dtype, o.full_tensor()) for o in outs]


@pytest.mark.parametrize("nd", [S0, B])
def test_norms_of_complex_tensors_and_partial_sums_scaled_by_infinities(pool2, nd):
    """vector_norm squared a complex tensor (z * z, not |z|^2: complex, wrong values) and
    ignored dtype= for inf and 0 orders; a partial sum over zero or times an infinity kept
    partial, its parts' infinities adding up to NaN where torch gives an infinity."""
    z, x, ones, single = _logical_norm_inputs()
    want = _norms_and_scalings(z, x, ones.sum(), single.sum())
    for outs in pool2.run(_norms_and_scaled_partial_sums, nd):
        for (dtype, got), w in zip(outs, want, strict=True):
            assert dtype == w.dtype
            torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-12, equal_nan=True)


def _embedding_bags(world):
    """nn.EmbeddingBag on a 2-D batch (its offsets: a plain arange F.embedding_bag makes
    over the logical size), in each mode, and with per-sample weights."""
    g = torch.Generator().manual_seed(0)
    ids, weights = torch.randint(0, 11, (7, 5), generator=g), torch.rand(7, 5, generator=g)
    P = sbp.placement("cpu", list(range(world))) if world else None
    results = []
    for mode in ("mean", "sum", "max"):
        torch.manual_seed(1)
        bag = torch.nn.EmbeddingBag(11, 6, mode=mode).double()
        x, w = ids, weights.double().requires_grad_()
        if P is not None:
            bag.to_global(P, B)
            x = sbp.tensor(ids, placement=P, sbp=S0)
            w = sbp.tensor(weights.double(), placement=P, sbp=S0).requires_grad_()
        out = bag(x, per_sample_weights=w) if mode == "sum" else bag(x)
        out.square().sum().backward()
        values = [out, bag.weight.grad] + ([w.grad] if mode == "sum" else [])
        results += [v.detach() if P is None else v.full_tensor() for v in values]
    return results


@pytest.mark.filterwarnings("ignore:sbp. no SBP rule")
def test_embedding_bag_of_a_split_batch(pool2):
    """The offsets F.embedding_bag makes were a local tensor mixed with global ones: a
    PlacementError (or, under global_mode, one in backward, where they were saved)."""
    want = _embedding_bags(None)
    for got in pool2.run(_embedding_bags, 2):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _unsafe_splits():
    P_ = sbp.placement("cpu", [0, 1])
    x = sbp.tensor(torch.arange(30.0).view(6, 5), P_, S0)
    with sbp.comm_stats() as st:
        parts = [*x.unsafe_chunk(3, 1), *torch.unsafe_split(x, 2, 1)]
    return [p.sbp for p in parts], dict(st.fallbacks), dict(st.by_kind)


def test_unsafe_splits_keep_the_split_and_move_nothing(pool2):
    """torch's LSTM and GRU cells cut their gates with unsafe_chunk: before, no rule (the
    broadcast fallback gathered the batch at every step)."""
    for layouts, fallbacks, collectives in pool2.run(_unsafe_splits):
        assert layouts == [(S0,)] * 6
        assert fallbacks == {} and collectives == {}


def _zero_gradients(x0):
    P_ = sbp.placement("cpu", [0, 1])
    x = sbp.tensor(x0, P_, S0, requires_grad=True)
    x.sgn().sum().backward()
    a = sbp.tensor(x0, P_, S0, requires_grad=True)
    b = sbp.tensor(-x0, P_, S1, requires_grad=True)
    torch.copysign(a, b).sum().backward()
    c = sbp.tensor(x0, P_, S1, requires_grad=True)
    (c.sgn() * c).sum().backward()  # (torch adds the zero to the other part's gradient)
    return [(type(t.grad).__name__, t.grad.sbp, t.grad.full_tensor()) for t in (x, a, b, c)]


def test_zero_gradients_torch_makes_from_sizes_are_global(pool2):
    """sgn's gradient and copysign's for its sign operand are zeros torch's formulas make
    from sizes alone, plain tensors (before: `x.grad` a plain torch.Tensor); they become
    the leaf's zeros, in its layout. Added to another gradient (`x.sgn() * x`), torch's
    kernel asks the global one for its metadata on the meta device (before:
    DeviceMismatchError)."""
    x0 = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want = []
    for fn in (lambda x: x.sgn(), lambda a: torch.copysign(a, -x0)):
        t = x0.clone().requires_grad_()
        fn(t).sum().backward()
        want.append(t.grad)
    b = (-x0).clone().requires_grad_()
    torch.copysign(x0, b).sum().backward()
    want.append(b.grad)
    c = x0.clone().requires_grad_()
    (c.sgn() * c).sum().backward()
    want.append(c.grad)
    for grads in pool2.run(_zero_gradients, x0):
        for (kind, layout, got), ref, leaf in zip(grads, want, (S0, S0, S1, S1), strict=True):
            assert kind == "GlobalTensor" and layout == (leaf,)
            torch.testing.assert_close(got, ref, rtol=0, atol=0)
