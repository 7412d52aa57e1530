"""per_block_cast_lossless(_colmajor) on the GPU: the default config at several shapes and every config of the
space at two, bit-exact against the spec references with poisoned outputs (the lossy flag included); lossy inputs
raise TensorError; the compat layer against TileKernels' torch cast_back (values * scales unchanged) and its
kernel (bit-exact, layouts and strides); torch.compile and opcheck."""

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.testing import check, check_configs

pytestmark = pytest.mark.gpu
NAME, COLMAJOR = "per_block_cast_lossless", "per_block_cast_lossless_colmajor"


def _static(bi, bo, hidden):
    return {"hidden": hidden, "in_block_m": bi[0], "in_block_k": bi[1], "out_block_m": bo[0], "out_block_k": bo[1]}


# TileKernels' use: MXFP4 (1, 32) blocks to (128, 128) / (1, 128); and other whole-block ratios, partial tiles.
STATIC = [
    _static((1, 32), (128, 128), 7168),
    _static((1, 32), (1, 128), 7168),
    _static((1, 32), (128, 128), 2048),
    _static((32, 32), (128, 128), 576),  # partial last output block column (64 channels)
    _static((1, 16), (32, 64), 160),
    _static((1, 32), (96, 128), 4096),  # an output block height that is not a power of two
]
TOKENS = (1, 7, 129, 4001)
EVERY = [_static((1, 32), (128, 128), 7168), _static((1, 32), (1, 128), 576)]


@pytest.mark.parametrize("name", [NAME, COLMAJOR])
@pytest.mark.parametrize("static", STATIC, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_default_config_every_size(shared_cache, name, static):
    failures = []
    for t in TOKENS:
        kern = tkjit.get(name, {**static, "num_tokens": t})
        for seed in (0, 1):
            msg = check(kern, {**static, "num_tokens": t}, seed=seed)
            if msg:
                failures.append(msg)
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("static", EVERY, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_every_config_in_the_space(shared_cache, static):
    sizes = [{"num_tokens": t} for t in (7, 4001)]
    failures = check_configs(NAME, [{**static, "num_tokens": 7}], sizes)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_every_config_colmajor(shared_cache):
    sizes = [{"num_tokens": t} for t in (7, 4001)]
    failures = check_configs(COLMAJOR, [{**EVERY[0], "num_tokens": 7}], sizes, most=8)
    assert not failures, "\n".join(failures[:20])


def _inputs(n, static, seed=0):
    spec = tkjit.get_spec(NAME)
    return spec.make_inputs(spec.canonical_shape({**static, "num_tokens": n}), "cuda", seed)


def test_lossy_inputs_raise(shared_cache):
    static = STATIC[0]
    x, sf = _inputs(4001, static)
    for r, c, value, match in ((300, 7, None, r"input scale block \(300, 7\).*2\^12 below"),
                               (4000, 223, 1.0 / 3.0, r"input scale block \(4000, 223\).*not a positive normal"),
                               (0, 0, 0.0, r"input scale block \(0, 0\).*not a positive normal"),
                               (5, 5, -1.0, r"not a positive normal")):
        bad = sf.clone()
        block = bad[r // 128 * 128:(r // 128 + 1) * 128, c // 4 * 4:(c // 4 + 1) * 4]  # its output block's
        bad[r, c] = value if value is not None else block.max() * 2**-12
        for col in (False, True):
            with pytest.raises(tkjit.TensorError, match=match):
                tkjit.ops.per_block_cast_lossless(x, bad, (1, 32), (128, 128), col_major_scales=col)
    tiny = torch.full_like(sf, 2.0**-121)
    with pytest.raises(tkjit.TensorError, match="below float32's normal range"):
        tkjit.ops.per_block_cast_lossless(x, tiny, (1, 32), (128, 128))
    q, s = tkjit.ops.per_block_cast_lossless(x, sf, (1, 32), (128, 128))  # the same call, lossless: no error
    assert q.shape == (4001, 7168) and s.shape == (32, 56)


def test_torch_compile(shared_cache):
    static = STATIC[0]
    x, sf = _inputs(4001, static, seed=1)

    def run(x, sf):
        return tkjit.ops.per_block_cast_lossless(x, sf, (1, 32), (128, 128), col_major_scales=True, packed_ue8m0=True)

    got = torch.compile(run, fullgraph=True)(x, sf)
    want = run(x, sf)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    assert got[1].stride() == want[1].stride()


def test_opcheck(shared_cache):
    x, sf = _inputs(130, _static((1, 32), (32, 128), 576))
    for op in (torch.ops.tkjit.per_block_cast_lossless.default,
               torch.ops.tkjit.per_block_cast_lossless_colmajor.default):
        torch.library.opcheck(op, (x, sf.contiguous(), 1, 32, 32, 128, None))


# -- the compat layer against TileKernels ------------------------------------------------------------
def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _strides(t):
    return [s for s, n in zip(t.stride(), t.shape) if n > 1]


OPTIONS = [(False, False), (True, False), (True, True)]
CASES = [(n, h, bi, bo) for n in (1, 129, 4001) for h in (2048, 7168)
         for bi, bo in (((1, 32), (128, 128)), ((1, 32), (1, 128)), ((32, 32), (128, 128)))]


@pytest.mark.parametrize("col, packed", OPTIONS)
@pytest.mark.parametrize("n, hidden, bi, bo", CASES)
def test_compat_matches_tile_kernels_reference(shared_cache, n, hidden, bi, bo, col, packed):
    """TileKernels' torch cast_back of the result equals its cast_back of the input (bit-exact, float32), and
    the values and scales are the spec reference's, in TileKernels' layouts."""
    pytest.importorskip("tile_kernels")
    from tile_kernels.torch import cast_back as tk_back

    import tkjit.compat.tile_kernels as tkc

    static = _static(bi, bo, hidden)
    x, sf = _inputs(n, static, seed=n + hidden)
    q, s = tkc.quant.per_block_cast_lossless((x, sf), "e4m3", bi, bo, col, False, packed)
    q_ref, s_ref, _ = tkjit.get_spec(NAME).reference({**static, "num_tokens": n}, x, sf)
    assert _same(q, q_ref.cuda())
    rows = s_ref.shape[0]
    if packed:
        assert s.dtype == torch.int32 and s.shape == (rows, -(-s_ref.shape[1] // 4)) and s.stride(0) == 1
    elif col:
        assert s.shape == s_ref.shape and s.stride() == (1, -(-rows // 4) * 4)
    else:
        assert s.shape == s_ref.shape and s.stride() == (s_ref.shape[1], 1)
    assert torch.equal(tk_back((q, s), "fp32", bo), tk_back((x, sf.contiguous()), "fp32", bi))


def _tk_kernel(*args):
    """TileKernels' kernel, or a skip of this comparison when it does not build on this host."""
    import tile_kernels

    try:
        return tile_kernels.quant.per_block_cast_lossless(*args)
    except Exception as e:  # a TileLang / nvcc failure of TileKernels' own kernel
        pytest.skip(f"TileKernels' per_block_cast_lossless failed here: {type(e).__name__}: {e}")


@pytest.mark.parametrize("col, packed", OPTIONS)
@pytest.mark.parametrize("n, hidden, bi, bo", [(4001, 7168, (1, 32), (128, 128)), (129, 2048, (1, 32), (1, 128)),
                                               (7, 7168, (32, 32), (128, 128))])
def test_compat_matches_tile_kernels_kernel(shared_cache, n, hidden, bi, bo, col, packed):
    """TileKernels' own kernel on lossless inputs: the same values, scales, shapes and strides (bytes past the
    last packed block column and the TMA padding are unwritten there, so the logical scales are compared)."""
    pytest.importorskip("tile_kernels")
    import tkjit.compat.tile_kernels as tkc

    x, sf = _inputs(n, _static(bi, bo, hidden), seed=n)
    sf = sf.contiguous()
    q, s = tkc.quant.per_block_cast_lossless((x, sf), "e4m3", bi, bo, col, False, packed)
    q_tk, s_tk = _tk_kernel((x, sf), "e4m3", bi, bo, col, False, packed)
    assert _same(q, q_tk) and q.stride() == q_tk.stride()
    assert s.dtype == s_tk.dtype and s.shape == s_tk.shape and _strides(s) == _strides(s_tk)
    if packed:
        cols = -(-hidden // bo[1])
        mine = s.contiguous().view(torch.uint8).view(s.shape[0], -1)[:, :cols]
        theirs = s_tk.contiguous().view(torch.uint8).view(s.shape[0], -1)[:, :cols]
        assert torch.equal(mine, theirs)
    else:
        assert torch.equal(s, s_tk)


def test_compat_no_tokens(shared_cache):
    import tkjit.compat.tile_kernels as tkc

    x = torch.empty(0, 3584, device="cuda", dtype=torch.int8)
    sf = torch.empty(0, 224, device="cuda")
    for col, packed, cols in ((False, False, 56), (True, False, 56), (True, True, 14)):
        q, s = tkc.quant.per_block_cast_lossless((x, sf), "e4m3", (1, 32), (128, 128), col, False, packed)
        assert q.shape == (0, 7168) and s.shape == (0, cols)
