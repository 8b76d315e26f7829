"""The raw boxing kernels without a GPU: every kernel compiles with NVRTC for two
architectures, and the same source built for the CPU (g++ and host_shim.h, every thread of
the grid run in turn) gives exactly what the torch implementation gives, over shapes, split
axes, uneven sizes, padding, rank counts, dtypes, alignments and launch shapes. On a GPU the same comparisons run through CuPy (skipped
without one). Then the executor on 2 ranks with the kernels in place of torch, against the
logical tensors."""

from __future__ import annotations

import contextlib
import math
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sbp
from sbp import kernels
from sbp.kernels import raw, reference

DTYPES = list(raw.DTYPES)
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# ---------------------------------------------------------------- NVRTC, for the GPU


def _nvrtc():
    """Skip without cuda-bindings; the compiler itself is loaded in a child process only."""
    import importlib.util

    if (
        importlib.util.find_spec("cuda") is None
        or importlib.util.find_spec("cuda.bindings") is None
    ):
        pytest.skip("cuda-bindings is not installed")


_COMPILE = """
import sys
from cuda.bindings import nvrtc

def ok(result):
    assert result[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS, result[0]
    return result[1:]

source, arch, out, *includes = sys.argv[1:]
(prog,) = ok(nvrtc.nvrtcCreateProgram(open(source).read().encode(), b"boxing.cu", 0, [], []))
opts = [f"--gpu-architecture=compute_{arch}".encode(), b"--std=c++17"]
opts += [f"-I{d}".encode() for d in includes]
(status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
(size,) = ok(nvrtc.nvrtcGetProgramLogSize(prog))
log = b" " * size
ok(nvrtc.nvrtcGetProgramLog(prog, log))
if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
    sys.exit(log.decode(errors="replace"))
(size,) = ok(nvrtc.nvrtcGetPTXSize(prog))
ptx = b" " * size
ok(nvrtc.nvrtcGetPTX(prog, ptx))
open(out, "w").write(ptx.decode())
"""


def _compile_ptx(nvrtc, code: str, arch: int) -> str:
    """NVRTC in a child process: loaded into the test process, it later breaks torch's
    unpickling of tensor storages there ("storage has wrong byte size")."""
    import subprocess
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        source, out = Path(tmp) / "boxing.cu", Path(tmp) / "boxing.ptx"
        source.write_text(code)
        args = [str(source), str(arch), str(out), *map(str, raw.include_dirs())]
        done = subprocess.run(
            [sys.executable, "-c", _COMPILE, *args], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return out.read_text()


@pytest.mark.parametrize("arch", [80, 90])
def test_every_kernel_compiles_with_nvrtc(arch):
    nvrtc = _nvrtc()
    assert raw.include_dirs(), (
        "cuda_fp16.h / cuda_bf16.h not found (CUDA_PATH or nvidia pip headers)"
    )
    ptx = _compile_ptx(nvrtc, raw.source(raw.all_instances()), arch)
    names = raw.kernel_names()
    assert len(names) == 6 * len(raw.WORDS) + 6 * len(raw.DTYPES)
    missing = [n for n in names if f".entry {n}(" not in ptx]
    assert not missing, f"kernels missing from the PTX: {missing}"
    # The 16-byte paths really move 16 bytes per access.
    assert "ld.global.v4" in ptx or "ld.global.nc.v4" in ptx


def test_each_module_compiles_alone():
    """The CuPy launcher compiles one word width or one dtype per module."""
    nvrtc = _nvrtc()
    for instance in raw.all_instances()[:1] + [raw.reduce_instance(torch.bfloat16)]:
        assert ".entry sbp_" in _compile_ptx(nvrtc, raw.source([instance]), 90)


# ---------------------------------------------------------------- the same source on the CPU


class Backend:
    """Where the kernels run: `host` (g++ build, every CI machine; `host-wide` takes the
    pack and unpack kernels' 64-bit index path, which the GPU takes for tensors past 2^31
    words) or `cuda` (CuPy on a GPU, skipped without one). All are compared with the torch
    implementation."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name.startswith("host"):
            from sbp.kernels import host_launcher

            if host_launcher.compiler() is None:
                pytest.skip("no C++ compiler")
            wide = name == "host-wide"
            host_launcher.library(wide)  # build (or load) once, outside hypothesis' timing
            self.device = torch.device("cpu")
            self._make = lambda threads, blocks: host_launcher.HostLauncher(threads, blocks, wide)
        else:
            if not torch.cuda.is_available():
                pytest.skip("no GPU")
            cupy_launcher = pytest.importorskip("sbp.kernels.cupy_launcher")
            self.device = torch.device("cuda", torch.cuda.current_device())
            self._cuda = cupy_launcher.CupyLauncher()
            self._make = lambda threads, blocks: self._cuda

    def launcher(self, threads: int = 32, blocks: int = 4):
        """A launcher; the host one runs `threads` x `blocks` (the GPU one picks its own)."""
        return self._make(threads, blocks)


@pytest.fixture(scope="module", params=["host", "host-wide", "cuda"])
def backend(request):
    return Backend(request.param)


@pytest.fixture(scope="module")
def host():
    return Backend("host")


SCHEMES = pytest.mark.parametrize("scheme", ["linear", "rows"])


@contextlib.contextmanager
def forced(scheme: str):
    """raw.py's thresholds moved so that chunks of several rows, whatever their size, take
    the linear or the rows kernel (a single contiguous range always takes the flat one)."""
    with pytest.MonkeyPatch.context() as mp:
        if scheme == "rows":
            mp.setattr(raw, "ROWS_MAX_WIDTH", 16)
            mp.setattr(raw, "ROWS_MIN_WORDS", 0)
            mp.setattr(raw, "ROWS_MIN_GRID", 0)
        else:
            mp.setattr(raw, "ROWS_MIN_WORDS", math.inf)
        yield


def _values(shape, dtype, seed, specials=False):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)  # the full range, so sums wrap around
        return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)
    if specials and x.numel():
        flat = x.view(-1)
        picks = torch.randint(0, flat.numel(), (max(1, flat.numel() // 4),), generator=g)
        for j, i in enumerate(picks.tolist()):
            flat[i] = (float("nan"), float("inf"), -float("inf"), -0.0)[j % 4]
    return x


def _at_offset(t: torch.Tensor, offset: int, device=None) -> torch.Tensor:
    """`t`'s values in a contiguous tensor on `device` that starts `offset` elements into its
    storage (so its address is aligned to less than 16 bytes: the kernels use narrower words)."""
    buf = torch.empty(offset + t.numel(), dtype=t.dtype, device=device)
    out = buf[offset:].view(t.shape)
    out.copy_(t)
    return out


@st.composite
def splits(draw, max_ranks=5):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
    dim = draw(st.integers(0, ndim - 1))
    n = draw(st.integers(1, max_ranks))
    cuts = sorted(draw(st.lists(st.integers(0, shape[dim]), min_size=n - 1, max_size=n - 1)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, shape[dim]], strict=True)]
    return shape, dim, sizes


launches = st.tuples(st.sampled_from([1, 3, 32]), st.sampled_from([1, 2, 5]))


@SCHEMES
@settings(max_examples=150)
@given(
    splits(),
    st.sampled_from(DTYPES),
    st.one_of(st.none(), st.integers(0, 2)),
    st.integers(0, 3),
    launches,
    st.integers(0, 2**16),
)
def test_pack_matches_torch(backend, scheme, split, dtype, pad_extra, offset, launch, seed):
    shape, dim, sizes = split
    pad_to = None if pad_extra is None else max(sizes) + pad_extra
    x = _at_offset(_values(shape, dtype, seed), offset, backend.device)
    expected = reference.pack_chunks(x, dim, sizes, pad_to).clone()
    with forced(scheme):
        got = raw.pack_chunks(backend.launcher(*launch), x, dim, sizes, pad_to)
    assert got is not None and got.shape == expected.shape
    rest = reference.elements_per_index(shape, dim)
    rows = [pad_to if pad_to is not None else s for s in sizes]
    for i, s in enumerate(sizes):  # padding is left as it was: compare the chunks
        start = sum(rows[:i]) * rest
        assert torch.equal(got[start : start + s * rest], expected[start : start + s * rest])


@SCHEMES
@settings(max_examples=150)
@given(
    splits(),
    st.sampled_from(DTYPES),
    st.one_of(st.none(), st.integers(0, 2)),
    st.integers(0, 3),
    launches,
    st.integers(0, 2**16),
)
def test_unpack_matches_torch(backend, scheme, split, dtype, pad_extra, offset, launch, seed):
    shape, dim, sizes = split
    chunk_shapes = [shape[:dim] + (s,) + shape[dim + 1 :] for s in sizes]
    rest = reference.elements_per_index(shape, dim)
    stride = None if pad_extra is None else (max(sizes) + pad_extra) * rest
    total = len(sizes) * stride if stride is not None else math.prod(shape)
    buf = _at_offset(_values((total,), dtype, seed), offset, backend.device)
    fill = _values(shape, dtype, seed + 1).to(backend.device)  # where no chunk goes
    expected = reference.unpack_chunks(buf, chunk_shapes, dim, fill.clone(), stride)
    out = _at_offset(fill, offset, backend.device)
    with forced(scheme):
        got = raw.unpack_chunks(backend.launcher(*launch), buf, chunk_shapes, dim, out, stride)
    assert got is out
    assert torch.equal(got, expected)


def _expected_reduce(chunks, op):
    if chunks[0].dtype in (torch.float16, torch.bfloat16):  # the kernels add in float
        return reference.reduce_chunks([c.float() for c in chunks], op).to(chunks[0].dtype)
    return reference.reduce_chunks(chunks, op)


@settings(max_examples=150)
@given(
    st.integers(2, 5),
    st.integers(0, 40),
    st.integers(0, 9),
    st.sampled_from(DTYPES),
    st.sampled_from(raw.OPS),
    st.integers(0, 3),
    launches,
    st.integers(0, 2**16),
)
def test_reduce_matches_torch(backend, k, n, gap, dtype, op, offset, launch, seed):
    chunk = n + gap  # chunks lie `chunk` elements apart in one buffer, as received
    values = _values((k * chunk,), dtype, seed, specials=True)
    buf = _at_offset(values, offset, backend.device)
    chunks = [buf[i * chunk : i * chunk + n] for i in range(k)]
    got = raw.reduce_chunks(backend.launcher(*launch), chunks, op)
    assert got is not None
    torch.testing.assert_close(got, _expected_reduce(chunks, op), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_reduce_propagates_nan_like_torch(backend, op, dtype):
    nan, inf = float("nan"), float("inf")
    a = torch.tensor([nan, 1.0, nan, -inf, 2.0, 0.0, nan, 5.0], dtype=dtype, device=backend.device)
    b = torch.tensor([1.0, nan, nan, inf, -2.0, nan, 3.0, 5.0], dtype=dtype, device=backend.device)
    buf = torch.cat([a, b])  # 8 elements: the 16-byte kernels too for 2-byte types
    got = raw.reduce_chunks(backend.launcher(), [buf[:8], buf[8:]], op)
    want = (torch.maximum if op == "max" else torch.minimum)(a, b)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert got.isnan().tolist() == [True, True, True, False, False, True, True, False]


def test_word_width_follows_alignment_of_every_offset():
    m = raw.plan_move([0, 64, 128], [0, 256], outer=3, row=128, pointers=[1024, 2048])
    assert (m.width, m.cols, m.bases, m.row) == (16, (0, 4, 8), (0, 16), 8)
    m = raw.plan_move([0, 12, 20], [0, 36], outer=3, row=20, pointers=[1024, 2048])
    assert m.width == 4 and m.cols == (0, 3, 5)
    assert raw.plan_move([0, 8], [0], 1, 8, [1024, 1026]).width == 2


def test_scheme_choice_on_an_h100_grid():
    """The scheme raw.py picks with the CuPy launcher's block size and an H100's grid cap
    (132 SMs x 16 blocks): float32 (r, 1027) split over 8 ranks along dim 1 takes the rows
    kernel from 64 MiB (teams of a warp), the linear one at 16 MiB; 16-byte words take the
    linear one; a single contiguous range, or whole rows, the flat one."""

    class H100:
        threads = 256

        def max_blocks(self, device):
            return 132 * 16

    def plan(r, row, sizes, width):
        cols = [0, *raw._prefix(sizes)]
        bases = [b * r for b in raw._prefix([0, *sizes[:-1]])]
        m = raw.Move(width, tuple(cols), tuple(bases), r, row)
        return raw.move_plan(m, H100(), torch.device("cpu"))

    sizes = [129, 129, 129, 128, 128, 128, 128, 128]
    scheme, values, grid, outer, row = plan(16384, 1027, sizes, 4)
    assert (scheme, values[-1], grid, outer, row) == ("_rows", 32, (16384, 1), 16384, 1027)
    assert plan(4096, 1027, sizes, 4)[0] == ""
    assert plan(16384, 256, [32] * 8, 16)[0] == ""
    assert plan(1, 1000, [400, 600], 4)[0] == "_flat"
    scheme, values, grid, outer, row = plan(5, 1000, [1000], 4)
    assert (scheme, values, outer, row) == ("_flat", (0, 5000, 0), 1, 5000)


def test_cases_outside_the_kernels_fall_back(host):
    L = host.launcher()
    x = torch.arange(24.0).view(4, 6)
    assert raw.pack_chunks(L, x.t(), 0, [3, 3]) is None  # strided input
    odd = torch.arange(20.0)
    assert raw.reduce_chunks(L, [odd[0:4], odd[10:14], odd[12:16]], "sum") is None  # uneven gaps
    assert raw.reduce_chunks(L, [odd[:4]], "sum") is None  # nothing to reduce
    out = torch.zeros(4, 6)
    assert raw.unpack_chunks(L, odd, [(2, 3), (3, 3)], 1, out) is None  # other dims differ
    # ... and the public functions then give torch's answer.
    assert torch.equal(
        kernels.pack_chunks(x.t(), 0, [3, 3]), reference.pack_chunks(x.t(), 0, [3, 3])
    )


# ---------------------------------------------------------------- choosing the implementation


def test_cpu_tensors_use_torch_and_bad_choice_is_rejected(monkeypatch):
    assert kernels.launcher_for(torch.device("cpu")) is None
    monkeypatch.setenv("SBP_KERNELS", "torch")
    assert kernels.launcher_for(torch.device("cuda", 0)) is None
    monkeypatch.setenv("SBP_KERNELS", "cupy!")
    with pytest.raises(kernels.KernelChoiceError, match="SBP_KERNELS"):
        kernels.pack_chunks(torch.zeros(4), 0, [2, 2])
    assert issubclass(kernels.KernelChoiceError, sbp.SbpError)


def test_without_cupy_cuda_uses_torch_after_one_notice(monkeypatch):
    monkeypatch.delenv("SBP_KERNELS", raising=False)
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` fail
    monkeypatch.delitem(sys.modules, "sbp.kernels.cupy_launcher", raising=False)
    monkeypatch.setattr(kernels, "_cuda", [])
    with pytest.warns(UserWarning, match="CuPy is unavailable"):
        assert kernels.launcher_for(torch.device("cuda", 0)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the notice comes once
        assert kernels.launcher_for(torch.device("cuda", 0)) is None


# ---------------------------------------------------------------- the executor on the kernels


def _boxing_on_host_kernels(cases):
    """Every conversion with the executor's pack/unpack/reduce running the host-built
    kernels, against the logical tensor."""
    from sbp.kernels import host_launcher

    used = set()

    class CountingLauncher(host_launcher.HostLauncher):
        def launch(self, kernel, *args):
            used.add(kernel.split("_")[1])  # pack, unpack or reduce
            super().launch(kernel, *args)

    launcher = CountingLauncher(threads=32, blocks=3)

    def fake_launcher_for(device):
        return launcher

    original, kernels.launcher_for = kernels.launcher_for, fake_launcher_for
    try:
        me = sbp.env.get_rank()
        P = sbp.placement("cpu", [0, 1])
        results = []
        for shape, src, dst, dtype in cases:
            g = torch.Generator().manual_seed(len(results))
            value = torch.randint(-50, 50, shape, generator=g).to(dtype)
            if src.is_partial:  # rank 0 holds the value, rank 1 the op's identity
                local = (
                    value
                    if me == 0
                    else torch.full(shape, kernels.fill_value(dtype, src.op), dtype=dtype)
                )
            else:
                local = value[sbp.local_slices(shape, P, src, P.coord(me))].contiguous()
            x = sbp.to_global(local, P, src, shape=shape, check_meta=False, sync_data=False)
            y = x.to_global(P, dst)
            results.append(torch.equal(y.full_tensor(), value))
        return results, sorted(used)
    finally:
        kernels.launcher_for = original


def test_executor_boxing_runs_on_the_kernels(pool2, host):  # host: the build is cached
    S, Psum, Pmax = sbp.split, sbp.partial_sum, sbp.partial_max
    cases = [
        ((5, 7), S(0), sbp.broadcast, torch.float32),
        ((5, 7), S(1), sbp.broadcast, torch.float64),
        ((5, 7, 3), S(1), S(2), torch.int64),
        ((5, 7), S(0), S(1), torch.float16),
        ((6, 5), Psum, S(1), torch.float32),
        ((6, 5), Pmax, S(0), torch.int32),
        ((4, 9), Psum, S(1), torch.bfloat16),
    ]
    for results, used in pool2.run(_boxing_on_host_kernels, cases):
        assert results == [True] * len(cases)
        assert used == ["pack", "reduce", "unpack"]  # the kernels really ran
