"""per_block_cast(_colmajor, _with_sf) on the GPU, fmt e4m3 and e2m1: the default config at every shape and every
config of the space at a few, bit-exact against the spec references with poisoned outputs; the compat layer against
TileKernels' torch reference (bit-exact) and its kernels (layouts, strides); torch.compile and opcheck."""

import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.testing import check, check_configs
from tkjit.timing import median, time_cuda

sys.path.insert(0, str(Path(__file__).parents[1] / "helpers"))
from quant_checks import tk_kernel_or_none as _tk_kernel  # noqa: E402

pytestmark = pytest.mark.gpu
NAME, COLMAJOR, WITH_SF = "per_block_cast", "per_block_cast_colmajor", "per_block_cast_with_sf"

# TileKernels' block sizes (32 and 128 each way) and DeepSeek's hidden sizes, partial tiles in both directions.
STATIC = [
    {"hidden": 7168, "block_m": 128, "block_k": 128},
    {"hidden": 7168, "block_m": 128, "block_k": 128, "round_scale": True},
    {"hidden": 7168, "block_m": 32, "block_k": 32},
    {"hidden": 7168, "block_m": 32, "block_k": 128, "in_dtype": "float32"},
    {"hidden": 7168, "block_m": 128, "block_k": 32, "round_scale": True},
    {"hidden": 2048, "block_m": 128, "block_k": 128, "in_dtype": "float32", "round_scale": True},
    {"hidden": 4096, "block_m": 32, "block_k": 32, "in_dtype": "float32"},
    {"hidden": 576, "block_m": 128, "block_k": 128},  # partial last block column (64 channels)
    {"hidden": 576, "block_m": 32, "block_k": 32, "round_scale": True},
    {"hidden": 320, "block_m": 32, "block_k": 128, "in_dtype": "float32"},
    {"hidden": 64, "block_m": 128, "block_k": 128},  # one partial block column
    {"hidden": 4096, "block_m": 64, "block_k": 64},
    {"hidden": 1024, "block_m": 1, "block_k": 128},
    {"hidden": 48, "block_m": 32, "block_k": 32},  # hidden a multiple of 16 only
]
TOKENS = (1, 7, 129, 4001)  # partial last block rows for every block_m > 1
EVERY = [
    {"hidden": 7168, "block_m": 128, "block_k": 128},
    {"hidden": 576, "block_m": 32, "block_k": 32, "round_scale": True},
    {"hidden": 576, "block_m": 32, "block_k": 128, "in_dtype": "float32"},
    {"hidden": 4096, "block_m": 128, "block_k": 32},
]


# fmt='e2m1': the same tiles with FP4 stores of 2 (vec 4), 4 and 8 bytes; the partial tiles of STATIC.
E2M1_STATIC = [
    {"hidden": 7168, "block_m": 128, "block_k": 128, "fmt": "e2m1"},
    {"hidden": 7168, "block_m": 32, "block_k": 32, "fmt": "e2m1", "round_scale": True},
    {"hidden": 7168, "block_m": 128, "block_k": 32, "in_dtype": "float32", "fmt": "e2m1"},
    {"hidden": 576, "block_m": 128, "block_k": 128, "fmt": "e2m1"},  # partial last block column
    {"hidden": 320, "block_m": 32, "block_k": 128, "in_dtype": "float32", "fmt": "e2m1", "round_scale": True},
    {"hidden": 4096, "block_m": 64, "block_k": 64, "fmt": "e2m1"},
    {"hidden": 1024, "block_m": 1, "block_k": 128, "fmt": "e2m1"},
    {"hidden": 48, "block_m": 32, "block_k": 32, "fmt": "e2m1"},
]
E2M1_EVERY = [
    (NAME, {"hidden": 7168, "block_m": 128, "block_k": 128, "fmt": "e2m1"}),
    (NAME, {"hidden": 576, "block_m": 32, "block_k": 32, "round_scale": True, "fmt": "e2m1"}),
    (NAME, {"hidden": 576, "block_m": 32, "block_k": 128, "in_dtype": "float32", "fmt": "e2m1"}),
    (COLMAJOR, {"hidden": 576, "block_m": 32, "block_k": 128, "fmt": "e2m1"}),
    (WITH_SF, {"hidden": 576, "block_m": 32, "block_k": 128, "fmt": "e2m1"}),
]


def _static_id(s):
    return "-".join(str(v) for v in s.values())


@pytest.mark.parametrize("name", [NAME, COLMAJOR, WITH_SF])
@pytest.mark.parametrize("static", STATIC + E2M1_STATIC, ids=_static_id)
def test_default_config_every_size(shared_cache, name, static):
    if name == WITH_SF:
        static = {k: v for k, v in static.items() if k != "round_scale"}
    failures = []
    for t in TOKENS + ((65536,) if static["hidden"] <= 1024 else ()):
        kern = tkjit.get(name, {**static, "num_tokens": t})
        for seed in (0, 1):
            msg = check(kern, {**static, "num_tokens": t}, seed=seed)
            if msg:
                failures.append(msg)
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_deepseek_size(shared_cache, fmt):
    static = {"hidden": 7168, "block_m": 128, "block_k": 128, "fmt": fmt}
    for name in (NAME, COLMAJOR, WITH_SF):
        kern = tkjit.get(name, {**static, "num_tokens": 32768})
        assert check(kern, {**static, "num_tokens": 32768}, seed=5) is None


@pytest.mark.parametrize("static", EVERY, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_every_config_in_the_space(shared_cache, static):
    sizes = [{"num_tokens": t} for t in (1, 7, 4001)]
    failures = check_configs(NAME, [{**static, "num_tokens": 7}], sizes)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("name", [COLMAJOR, WITH_SF])
def test_every_config_other_specs(shared_cache, name):
    """The column-major and given-scales variants share the builder: a spread of their space."""
    static = {"hidden": 576, "block_m": 32, "block_k": 128}
    sizes = [{"num_tokens": t} for t in (7, 4001)]
    failures = check_configs(name, [{**static, "num_tokens": 7}], sizes, most=12)
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("name, static", E2M1_EVERY, ids=lambda v: v if isinstance(v, str) else _static_id(v))
def test_e2m1_every_config(shared_cache, name, static):
    sizes = [{"num_tokens": t} for t in (1, 7, 4001)]
    failures = check_configs(name, [{**static, "num_tokens": 7}], sizes, most=None if name == NAME else 12)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_bad_tensors_raise(shared_cache):
    kern = tkjit.get(NAME, {"num_tokens": 64, "hidden": 576, "block_m": 32, "block_k": 128})
    x = torch.randn(64, 576, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(tkjit.TensorError, match="dtype"):
        kern(x.float())
    with pytest.raises(tkjit.TensorError, match="axis 1 must be 576"):
        kern(torch.randn(64, 512, device="cuda", dtype=torch.bfloat16))
    out = torch.empty(64, 576, device="cuda", dtype=torch.float8_e4m3fn)
    with pytest.raises(tkjit.TensorError, match=r"ceil\(num_tokens / 32\)"):
        kern(x, out=(out, torch.empty(3, 5, device="cuda")))
    given = tkjit.get(WITH_SF, {"num_tokens": 64, "hidden": 576, "block_m": 32, "block_k": 128})
    with pytest.raises(tkjit.TensorError, match="sf"):
        given(x, torch.ones(3, 5, device="cuda"))
    with pytest.raises(tkjit.TensorError, match="sf"):
        given(x, torch.ones(2, 4, device="cuda"))


def test_ops_layouts_and_views(shared_cache):
    x = torch.randn(4001, 7168, device="cuda", dtype=torch.bfloat16)
    q, s = tkjit.ops.per_block_cast(x, (128, 128))
    qc, sc = tkjit.ops.per_block_cast(x, (128, 128), col_major_scales=True)
    assert s.shape == sc.shape == (32, 56) and s.stride() == (56, 1) and sc.stride() == (1, 32)
    assert torch.equal(q.view(torch.uint8), qc.view(torch.uint8)) and torch.equal(s, sc)
    deq = q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:4001]
    assert torch.allclose(deq, x.float(), rtol=0.07, atol=1e-3)
    again = tkjit.ops.per_block_cast_with_sf(x, s, (128, 128))
    assert (again.view(torch.uint8) != q.view(torch.uint8)).float().mean() < 1e-3  # 1/sf vs 448/amax: ulps
    q0, s0 = tkjit.ops.per_block_cast(x[:0], (128, 128), col_major_scales=True)
    assert q0.shape == (0, 7168) and s0.shape == (0, 56)


def test_torch_compile_and_cuda_graph(shared_cache):
    x = torch.randn(4001, 7168, device="cuda", dtype=torch.bfloat16)

    def run(x):
        q, s = tkjit.ops.per_block_cast(x * 2, (128, 128), round_scale=True, col_major_scales=True)
        return q, s, tkjit.ops.per_block_cast_with_sf(x, s.contiguous(), (128, 128))

    got = torch.compile(run, fullgraph=True)(x)
    want = run(x)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    assert got[1].stride() == want[1].stride() == (1, 32)
    assert torch.equal(got[2].view(torch.uint8), want[2].view(torch.uint8))
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, sf = tkjit.ops.per_block_cast(x, (32, 32))
    out.view(torch.uint8).fill_(0xFF)
    sf.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    q, s = tkjit.ops.per_block_cast(x, (32, 32))
    assert torch.equal(out.view(torch.uint8), q.view(torch.uint8)) and torch.equal(sf, s)


def test_e2m1_ops_compile_and_round_trip(shared_cache):
    from tkjit_kernels.quant import _e2m1

    x = torch.randn(4001, 7168, device="cuda", dtype=torch.bfloat16)
    q, s = tkjit.ops.per_block_cast(x, (128, 128), fmt="e2m1")
    qc, sc = tkjit.ops.per_block_cast(x, (128, 128), col_major_scales=True, fmt="e2m1")
    assert q.dtype == torch.int8 and q.shape == (4001, 3584) and s.shape == sc.shape == (32, 56)
    assert torch.equal(q, qc) and torch.equal(s, sc) and sc.stride() == (1, 32)
    scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:4001]
    deq = _e2m1.decode(_e2m1.unpack(q)) * scale
    assert ((deq - x.float()).abs() <= scale).all()  # half the coarsest step (2) times the scale

    def run(x):
        q, s = tkjit.ops.per_block_cast(x * 2, (128, 128), round_scale=True, col_major_scales=True, fmt="e2m1")
        return q, s, tkjit.ops.per_block_cast_with_sf(x * 2, s.contiguous(), (128, 128), fmt="e2m1")

    got = torch.compile(run, fullgraph=True)(x)
    want = run(x)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and got[1].stride() == want[1].stride()
    assert torch.equal(got[2], got[0])  # round_scale: 1 / sf both ways


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_opcheck(shared_cache, fmt):
    x = torch.randn(130, 576, device="cuda", dtype=torch.bfloat16)
    for op in (torch.ops.tkjit.per_block_cast.default, torch.ops.tkjit.per_block_cast_colmajor.default):
        torch.library.opcheck(op, (x, 32, 128, True, fmt, None))
    sf = torch.rand(5, 5, device="cuda") + 0.01
    torch.library.opcheck(torch.ops.tkjit.per_block_cast_with_sf.default, (x, sf, 32, 128, fmt, None))


# -- the compat layer against TileKernels ------------------------------------------------------------
def _x(n, hidden, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g) * torch.exp(2 * torch.randn(n, 1, generator=g))
    return x.to(dtype).cuda()


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _strides(t):
    return [s for s, n in zip(t.stride(), t.shape) if n > 1]


CASES = [(n, h, b, d) for n in (1, 129, 4001) for h in (576, 7168) for b in ((32, 32), (128, 128), (32, 128), (128, 32))
         for d in (torch.bfloat16, torch.float32) if h == 576 or d == torch.bfloat16]
OPTIONS = [(False, False, False), (False, True, False), (True, False, False), (True, True, False), (True, True, True)]


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("col, round_sf, packed", OPTIONS)
@pytest.mark.parametrize("n, hidden, block, dtype", CASES)
def test_compat_matches_tile_kernels_reference(shared_cache, n, hidden, block, dtype, col, round_sf, packed, fmt):
    """Bit-exact against TileKernels' torch reference `cast` (values, scales, layout and strides)."""
    pytest.importorskip("tile_kernels")
    from tile_kernels.torch import cast as tk_ref

    import tkjit.compat.tile_kernels as tkc

    x = _x(n, hidden, dtype, seed=n + hidden)
    q, sf = tkc.quant.per_block_cast(x, fmt, block, col, round_sf, packed)
    q_ref, sf_ref = tk_ref(x, fmt, block, round_sf=round_sf, use_tma_aligned_col_major_sf=col,
                           use_packed_ue8m0=packed)
    assert _same(q, q_ref)
    assert sf.dtype == sf_ref.dtype and sf.shape == sf_ref.shape and _strides(sf) == _strides(sf_ref)
    assert torch.equal(sf, sf_ref)
    only = tkc.quant.per_block_cast_with_sf_only(x, fmt, block, col, round_sf, packed)
    assert torch.equal(only, sf) and _strides(only) == _strides(sf)
    if not col:
        given = sf_ref * 1.5
        got = tkc.quant.per_block_cast_with_precomputed_sf(x, fmt, block, given)
        assert _same(got, tk_ref(x, fmt, block, sf=given))


@pytest.mark.parametrize("col, round_sf, packed", OPTIONS)
@pytest.mark.parametrize("n, hidden, block", [(4001, 7168, (128, 128)), (129, 576, (32, 32)), (7, 7168, (32, 128))])
def test_compat_matches_tile_kernels_kernel(shared_cache, n, hidden, block, col, round_sf, packed):
    """TileKernels' own kernels: same shapes, strides and scales (its kernel may divide with fast math, so
    values may differ in the last ulp of rare elements; the packed bytes of unrounded scales are its kernel's
    own conversion, not the reference's)."""
    tk = pytest.importorskip("tile_kernels")
    import tkjit.compat.tile_kernels as tkc

    x = _x(n, hidden, torch.bfloat16, seed=n)
    q, sf = tkc.quant.per_block_cast(x, "e4m3", block, col, round_sf, packed)
    q_tk, sf_tk = tk.quant.per_block_cast(x, "e4m3", block, col, round_sf, packed)
    assert q.shape == q_tk.shape and q.stride() == q_tk.stride()
    assert sf.dtype == sf_tk.dtype and sf.shape == sf_tk.shape and _strides(sf) == _strides(sf_tk)
    if packed and not round_sf:
        return
    if packed:  # bytes past the last block column are unwritten there
        cols = -(-hidden // block[1])
        mine = sf.contiguous().view(torch.uint8).view(sf.shape[0], -1)[:, :cols]
        theirs = sf_tk.contiguous().view(torch.uint8).view(sf.shape[0], -1)[:, :cols]
        assert torch.equal(mine, theirs)
    else:
        assert torch.allclose(sf, sf_tk, rtol=1e-6, atol=0)
    assert (q.view(torch.uint8) != q_tk.view(torch.uint8)).float().mean().item() < 1e-3
    if not col:
        given = tk.quant.per_block_cast_with_precomputed_sf(x, "e4m3", block, sf_tk)
        mine = tkc.quant.per_block_cast_with_precomputed_sf(x, "e4m3", block, sf_tk)
        assert (mine.view(torch.uint8) != given.view(torch.uint8)).float().mean().item() < 1e-3


@pytest.mark.parametrize("col, round_sf, packed", OPTIONS)
@pytest.mark.parametrize("n, hidden, block", [(4001, 7168, (128, 128)), (129, 576, (32, 32)), (7, 7168, (32, 128))])
def test_compat_e2m1_matches_tile_kernels_kernel(shared_cache, n, hidden, block, col, round_sf, packed):
    """TileKernels' own e2m1 kernel: same shapes, strides and scales; where its values equal its torch reference's,
    tkjit's equal them too (tkjit follows the reference where the two differ)."""
    tk = pytest.importorskip("tile_kernels")
    from tile_kernels.torch import cast as tk_ref

    import tkjit.compat.tile_kernels as tkc

    x = _x(n, hidden, torch.bfloat16, seed=n)
    q, sf = tkc.quant.per_block_cast(x, "e2m1", block, col, round_sf, packed)
    got = _tk_kernel(tk.quant.per_block_cast, x, "e2m1", block, col, round_sf, packed)
    if got is None:
        return
    q_tk, sf_tk = got
    assert q.shape == q_tk.shape and q.dtype == q_tk.dtype and q.stride() == q_tk.stride()
    assert sf.dtype == sf_tk.dtype and sf.shape == sf_tk.shape and _strides(sf) == _strides(sf_tk)
    q_ref, _ = tk_ref(x, "e2m1", block, round_sf=round_sf, use_tma_aligned_col_major_sf=col, use_packed_ue8m0=packed)
    if torch.equal(q_tk, q_ref):
        assert torch.equal(q, q_tk)
    else:
        print(f"TileKernels' e2m1 kernel differs from its torch reference at {n} x {hidden} {block} "
              f"{(col, round_sf, packed)}: {(q_tk != q_ref).float().mean().item():.2e} of the bytes")
    if not packed:
        assert torch.allclose(sf, sf_tk, rtol=1e-6, atol=0)
    if not col:
        given = tk.quant.per_block_cast_with_precomputed_sf(x, "e2m1", block, sf_tk)
        mine = tkc.quant.per_block_cast_with_precomputed_sf(x, "e2m1", block, sf_tk)
        assert mine.shape == given.shape and (mine != given).float().mean().item() < 1e-3


@pytest.mark.parametrize("fmt, width", [("e4m3", 7168), ("e2m1", 3584)])
def test_compat_no_tokens(shared_cache, fmt, width):
    import tkjit.compat.tile_kernels as tkc

    x = torch.empty(0, 7168, device="cuda", dtype=torch.bfloat16)
    for col, packed, cols in ((False, False, 56), (True, False, 56), (True, True, 14)):
        q, sf = tkc.quant.per_block_cast(x, fmt, (128, 128), col, packed, packed)
        assert q.shape == (0, width) and sf.shape == (0, cols)


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_report_time_at_target(shared_cache, fmt):
    """Not a gate: the default config's time at 32768 x 7168 bf16, 128 x 128 blocks (GB/s vs the copy ceiling)."""
    for block in ((128, 128), (32, 32)):
        kern = tkjit.get(NAME, {"num_tokens": 32768, "hidden": 7168, "block_m": block[0], "block_k": block[1],
                                "fmt": fmt})
        x = torch.randn(32768, 7168, device="cuda", dtype=torch.bfloat16)
        out = kern(x)
        us = median(time_cuda(lambda kern=kern, x=x, out=out: kern(x, out=out)))
        gbs = kern.spec.bytes_moved(kern.shape | {"num_tokens": 32768}) / us / 1e3
        print(f"\nper_block_cast {fmt} 32768x7168 bf16 {block} {kern.config}: {us:.1f} us/call, {gbs:.0f} GB/s")
