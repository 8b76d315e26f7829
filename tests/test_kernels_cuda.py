"""The CUDA path end to end (skipped without a GPU).

A world of 1 on `sbp.placement("cuda", [0])`: boxing, op rules and a few training steps of
mobilenet_v2, each against plain torch on the same GPU. Then 2 processes sharing one GPU
over gloo (both ranks use cuda:0, as two one-GPU nodes would), so multi-rank CUDA boxing
runs its collectives and the raw kernels for real; every result is compared with the
logical tensor, with the kernels and with SBP_KERNELS=torch. NCCL needs one GPU per rank,
so its multi-rank path cannot run on one GPU.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import socket
import traceback
import warnings

import pytest
import torch
import torch.nn.functional as F

import sbp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")

S0, S1, B = sbp.split(0), sbp.split(1), sbp.broadcast


def _placement():
    return sbp.placement("cuda", [0])


def test_kernels_are_chosen_for_cuda_tensors():
    pytest.importorskip("cupy")
    from sbp.kernels.cupy_launcher import CupyLauncher

    assert isinstance(sbp.kernels.launcher_for(torch.device("cuda", 0)), CupyLauncher)
    assert sbp.kernels.launcher_for(torch.device("cpu")) is None


def test_kernels_run_on_torchs_current_stream():
    """CuPy gets torch's current stream itself, through the CUDA stream protocol where CuPy
    has it (CuPy 14 deprecates ExternalStream), and a pack lands on that stream."""
    pytest.importorskip("cupy")
    from sbp.kernels import raw
    from sbp.kernels.cupy_launcher import CupyLauncher

    launcher = CupyLauncher()
    side = torch.cuda.Stream()
    x = torch.arange(12.0, device="cuda").view(3, 4)
    side.wait_stream(torch.cuda.current_stream())
    with warnings.catch_warnings(), torch.cuda.stream(side):
        warnings.simplefilter("error", DeprecationWarning)
        assert launcher._stream(x.device).ptr == side.cuda_stream
        out = raw.pack_chunks(launcher, x, 1, [1, 3])
    side.synchronize()
    assert out.tolist() == [0.0, 4.0, 8.0, 1.0, 2.0, 3.0, 5.0, 6.0, 7.0, 9.0, 10.0, 11.0]


@pytest.mark.parametrize("src", [S0, S1, B, sbp.partial_sum])
@pytest.mark.parametrize("dst", [S0, S1, B])
def test_boxing_on_one_gpu(src, dst):
    P = _placement()
    value = torch.randn(6, 5, dtype=torch.float64, device="cuda")
    g = sbp.to_global(value, P, src)
    h = g.to_global(P, dst)
    assert h.to_local().device.type == "cuda"
    assert torch.equal(h.full_tensor(), value)


def test_op_rules_on_one_gpu():
    P = _placement()
    a = torch.randn(6, 4, dtype=torch.float64, device="cuda")
    b = torch.randn(4, 3, dtype=torch.float64, device="cuda")
    ga, gb = sbp.to_global(a, P, S0), sbp.to_global(b, P, B)
    out = torch.softmax(ga @ gb, dim=1).sum(0) + 1
    want = torch.softmax(a @ b, dim=1).sum(0) + 1
    assert out.to_local().device.type == "cuda"
    torch.testing.assert_close(out.full_tensor(), want)


def _train_on_one_gpu(data_parallel: str | None, steps: int = 3):
    """mobilenet_v2 steps on global tensors and on plain torch (float64, same GPU); returns
    the fast path's route per step and the sbp warnings raised."""
    torchvision = pytest.importorskip("torchvision")
    P = _placement()
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v2(num_classes=10, dropout=0.0).double().cuda()
    ref = copy.deepcopy(model)
    gmodel = model.to_global(P, B)
    if data_parallel is not None:
        sbp.nn.data_parallel(gmodel, batch_norm=data_parallel)
    opt = torch.optim.SGD(gmodel.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    paths = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            x = torch.randn(6, 3, 32, 32, generator=g, dtype=torch.float64).cuda()
            y = torch.randint(0, 10, (6,), generator=g).cuda()
            loss = F.cross_entropy(gmodel(sbp.to_global(x, P, S0)), sbp.to_global(y, P, S0))
            if data_parallel is not None:
                paths.append(sbp.nn.fast_path.state(gmodel).last_path)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ref_loss = F.cross_entropy(ref(x), y)
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
            torch.testing.assert_close(loss.full_tensor(), ref_loss)
    for p, q in zip(gmodel.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q)
    for a, b in zip(gmodel.buffers(), ref.buffers(), strict=True):
        torch.testing.assert_close(a.full_tensor(), b)
    return paths, [str(w.message) for w in caught if str(w.message).startswith("sbp:")]


def test_training_steps_on_one_gpu():
    """Op by op: torch picks cuDNN's BatchNorm for a GPU tensor, and it has a rule."""
    _, sbp_warnings = _train_on_one_gpu(None)
    assert sbp_warnings == []


@pytest.mark.parametrize("batch_norm", ["global", "local"])
def test_data_parallel_fast_path_on_one_gpu(batch_norm):
    paths, sbp_warnings = _train_on_one_gpu(batch_norm)
    assert sbp_warnings == []
    assert paths == ["fast"] * 3


def _sgd_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def _steps_without_host_sync(model, image_shape, warm: int, **options) -> None:
    """`warm` steps of the global copy of `model` (data_parallel `options`), then one more
    under torch's sync debug mode, which raises on a host sync; every step equals plain
    torch's on the same batch."""
    P = _placement()
    ref = copy.deepcopy(model)
    model.to_global(P, B)
    sbp.nn.data_parallel(model, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(8, *image_shape, device="cuda", dtype=torch.float64)
    y = torch.randint(0, 10, (8,), device="cuda")

    def step():
        return _sgd_step(model, opt, sbp.to_global(x, P, S0), sbp.to_global(y, P, S0))

    losses = [step() for _ in range(warm)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses.append(step())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sbp.nn.fast_path.state(model).last_path == "fast"
    for loss in losses:
        torch.testing.assert_close(loss.full_tensor(), _sgd_step(ref, ref_opt, x, y))
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q)


def test_data_parallel_step_never_waits_for_the_gpu():
    """After the first (checking) step, to_global of a batch, the local forward, backward and
    the optimizer step (on the locals from the second) queue GPU work without a host sync,
    as a plain torch step does; the steps equal plain torch's."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v2(num_classes=10, dropout=0.0).double().cuda()
    _steps_without_host_sync(model, (3, 32, 32), warm=1)


def test_compiled_local_forward_on_the_gpu():
    """`data_parallel(model, compile=True)` on CUDA: Inductor compiles the local forward
    (plain CUDA tensors); the steps equal plain torch's, and the third queues its GPU work
    without a host sync."""
    torch.manual_seed(0)
    layers = [
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 10),
    ]
    model = torch.nn.Sequential(*layers).double().cuda()
    _steps_without_host_sync(model, (3, 16, 16), warm=2, compile=True)


# ---------------------------------------------------------------- two ranks on one GPU


CASES = [
    ((7, 5), S0, B, torch.float32),
    ((7, 5), S1, B, torch.float64),  # pack and unpack along the inner axis
    ((7, 5, 3), S1, S0, torch.float32),
    ((7, 5, 3), S0, sbp.split(2), torch.int64),
    ((6, 5), sbp.partial_sum, S1, torch.float32),  # all-to-all + reduce kernel
    ((6, 5), sbp.partial_max, S0, torch.int32),
    ((6, 9), sbp.partial_sum, S1, torch.bfloat16),
    ((6, 5), sbp.partial_sum, B, torch.float64),
]


def _boxing_two_ranks(cases, device="cuda"):
    me = sbp.env.get_rank()
    P = sbp.placement(device, [0, 1])
    launcher = type(sbp.kernels.launcher_for(torch.device(device, 0))).__name__
    ok = []
    for i, (shape, src, dst, dtype) in enumerate(cases):
        g = torch.Generator().manual_seed(i)
        value = torch.randint(-50, 50, shape, generator=g).to(dtype).to(device)
        if src.is_partial:  # rank 0 holds the value, rank 1 the op's identity
            fill = sbp.kernels.fill_value(dtype, src.op)
            local = value if me == 0 else torch.full(shape, fill, dtype=dtype, device=device)
        else:
            local = value[sbp.local_slices(shape, P, src, P.coord(me))].contiguous()
        x = sbp.to_global(local, P, src, shape=shape, check_meta=False, sync_data=False)
        ok.append(torch.equal(x.to_global(P, dst).full_tensor(), value))
    return launcher, ok


def _batch_norm_two_ranks(device="cuda") -> float:
    """Logical BatchNorm (train) on a batch split over both ranks, forward and backward:
    the largest difference from torch on the whole batch (its all-reduces are small CUDA
    tensors, which go through host memory)."""
    P = sbp.placement(device, [0, 1])
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 3, 4, 4, generator=g, dtype=torch.float64).to(device)
    w = torch.randn(3, generator=g, dtype=torch.float64).to(device)
    gx = sbp.to_global(x, P, B).to_global(P, S0).detach().requires_grad_()
    gw = sbp.to_global(w, P, B).detach().requires_grad_()
    out = F.batch_norm(gx, None, None, gw, None, training=True)
    (out * out).sum().backward()
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = F.batch_norm(x, None, None, w, None, training=True)
    (want * want).sum().backward()
    pairs = [(out, want), (gx.grad, x.grad), (gw.grad, w.grad)]
    return max((a.full_tensor() - b).abs().max().item() for a, b in pairs)


def _rank_main(rank: int, port: int, kernels: str, queue, device: str = "cuda") -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK="0",  # both ranks on cuda:0
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        SBP_KERNELS=kernels,
    )
    import datetime

    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        sbp.env.init()
        queue.put((rank, "ok", (*_boxing_two_ranks(CASES, device), _batch_norm_two_ranks(device))))
    except BaseException:  # noqa: BLE001 - reported to the test
        queue.put((rank, "err", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_two_ranks_share_one_gpu_over_gloo(kernels):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, kernels, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        replies = {r: (kind, data) for r, kind, data in [queue.get(timeout=300) for _ in procs]}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, (kind, data) in sorted(replies.items()):
        assert kind == "ok", f"rank {rank} failed:\n{data}"
        launcher, ok, batch_norm_error = data
        assert ok == [True] * len(CASES), f"rank {rank}: {ok}"
        assert batch_norm_error < 1e-10
        if kernels == "torch":
            assert launcher == "NoneType"
        elif importlib.util.find_spec("cupy") is not None:
            assert launcher == "CupyLauncher"
