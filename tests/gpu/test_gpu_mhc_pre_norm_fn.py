"""mhc_pre_norm_fn / mhc_pre_norm_fn_bwd (and mhc_pre_norm_fn_split) on the GPU: every config of their spaces
against the float64 references, the default configs at TileKernels' shapes (mhc_mult 4, hidden 1280 to 7168, 1K
to 8K tokens) and odd ones,
the compat op (forward and autograd) against float64 autograd of TileKernels' torch reference at TF32
tolerance and against the TileKernels package (same TF32 rounding of fn: float32 rounding apart), fuse_grad_acc,
and the ops under opcheck and torch.compile."""

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as compat
from tkjit.testing import check, check_configs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
FWD, BWD, SPLIT = "mhc_pre_norm_fn", "mhc_pre_norm_fn_bwd", "mhc_pre_norm_fn_split"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
TF32_RTOL = 2e-3  # fn and the backward's GEMM operand rounded to TF32, as TileKernels' kernels do
TK_SHAPES = [(1, 1024, 4, 1280), (2, 4096, 4, 4096), (1, 8192, 4, 7168)]
ODD = [(1, 1, 4, 64), (1, 4001, 2, 96), (3, 33, 8, 128)]


def tk_ref(residual, mhc_fn, mhc_norm_weight, mhc_norm_eps):
    """TileKernels' mhc_pre_norm_fn_ref, in mhc_fn's float dtype."""
    if mhc_norm_weight is not None:
        mhc_fn = mhc_fn * mhc_norm_weight
    x = residual.flatten(-2, -1).to(mhc_fn.dtype)
    return (x @ mhc_fn.T) * (x.square().sum(-1, keepdim=True) / mhc_fn.shape[-1] + mhc_norm_eps).rsqrt()


def data(n0, n1, m, h, seed=0, weight=False):
    g = torch.Generator().manual_seed(seed)
    m3, k = m * (m + 2), m * h
    residual = torch.randn(n0, n1, m, h, generator=g).to(torch.bfloat16)
    fn = torch.randn(m3, k, generator=g) / k ** 0.5
    w = (1 + 0.1 * torch.randn(k, generator=g)) if weight else None
    og = torch.randn(n0, n1, m3, generator=g)
    return tuple(t.cuda() if t is not None else None for t in (residual, fn, w, og))


def run(impl, residual, fn, w, og, **kw):
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (residual, fn, w)]
    out = impl(*leaves, 1e-6, **kw)
    out.backward(og)
    return [out] + [t.grad for t in leaves if t is not None]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("name", [FWD, BWD])
def test_every_config_in_the_space(name):
    sizes = [{"num_tokens": 4001}, {"num_tokens": 1}, {"num_tokens": 8192}]
    shapes = [{"num_tokens": 8192, "mhc_mult3": 24, "mhc_hidden": 4096}]
    failures = check_configs(name, shapes, sizes, seeds=(0, 1))
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_split_every_config_and_its_sums_are_the_forwards():
    """mhc_pre_norm_fn_split: every config against its float64 reference (token counts off the tile, one token),
    then its partial sums, summed, against the forward kernel's out_mul and sqrsum (TF32 sums in other orders)."""
    sizes = [{"num_tokens": 1000}, {"num_tokens": 1}, {"num_tokens": 4096}]
    shapes = [{"num_tokens": 1024, "mhc_mult3": 24, "mhc_hidden": 16384, "k_splits": 8},
              {"num_tokens": 1024, "mhc_mult3": 8, "mhc_hidden": 1536, "k_splits": 3}]
    failures = check_configs(SPLIT, shapes, sizes, seeds=(0, 1))
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])
    shape = {"num_tokens": 1000, "mhc_mult3": 24, "mhc_hidden": 28672}
    x, fn = tkjit.get_spec(FWD).make_inputs({**shape, "norm_eps": 1e-6}, "cuda", 1)
    _, out_mul, sqrsum = tkjit.get(FWD, shape)(x, fn)
    partial = tkjit.get(SPLIT, {**shape, "k_splits": 8})(x, fn).sum(0)
    assert rel(partial[:, :24], out_mul) < 1e-5 and rel(partial[:, 24], sqrsum) < 1e-5


@pytest.mark.parametrize("name", [FWD, BWD])
@pytest.mark.parametrize("n0, n1, m, h", TK_SHAPES + ODD, ids=str)
def test_default_config(name, n0, n1, m, h):
    shape = {"num_tokens": n0 * n1, "mhc_mult3": m * (m + 2), "mhc_hidden": m * h}
    kern = tkjit.get(name, shape)
    for seed in (0, 1):  # odd seeds: rows of many magnitudes, a zero row
        assert check(kern, shape, seed=seed) is None


MMA = {"layout": "mma", "warps": 4, "tokens_per_warp": 1, "vec": 8, "block_tokens": 64, "block_k": 128, "stages": 2,
       "swizzle": False}


@pytest.mark.parametrize("config", [MMA, {**MMA, "block_tokens": 32, "block_k": 64, "stages": 3},
                                    {**MMA, "warps": 8, "block_k": 256, "stages": 1},
                                    {**MMA, "block_tokens": 32, "block_k": 256, "swizzle": True}], ids=str)
@pytest.mark.parametrize("n0, n1, m, h", TK_SHAPES + [(1, 1, 4, 64), (1, 4001, 2, 128), (3, 33, 4, 256)], ids=str)
def test_mma_layout(config, n0, n1, m, h):
    """The TF32 tensor-core layout (never measured before this test ran): tail blocks, partial tiles of tokens."""
    shape = {"num_tokens": n0 * n1, "mhc_mult3": m * (m + 2), "mhc_hidden": m * h}
    spec = tkjit.get_spec(FWD)
    if spec.constraint(spec.canonical_shape(shape), config):
        pytest.skip(spec.constraint(spec.canonical_shape(shape), config))
    kern = tkjit.get(FWD, shape, config=config)
    for seed in (0, 1):
        assert check(kern, shape, seed=seed) is None


BWD_MMA = {"layout": "mma", "threads": 128, "vec": 1, "tile": 32, "warps": 4, "block_tokens": 64, "block_k": 128}


def run_bwd(kern, shape, inputs):
    """(x_grad, fn_grad_partial) of the backward kernel on copies of inputs (x_grad is updated in place)."""
    from tkjit.testing import poisoned_outputs

    args = [t.clone() for t in inputs]
    outs = poisoned_outputs(kern, {"num_tokens": shape["num_tokens"]}, args[0].device)
    kern(*args, out=outs)
    torch.cuda.synchronize()
    return args[4], outs[0]


@pytest.mark.parametrize("config", [BWD_MMA, {**BWD_MMA, "block_tokens": 32, "block_k": 64},
                                    {**BWD_MMA, "warps": 8, "block_tokens": 128, "block_k": 128},
                                    {**BWD_MMA, "block_tokens": 128, "block_k": 128}], ids=str)
@pytest.mark.parametrize("n0, n1, m, h", TK_SHAPES + [(1, 1, 4, 64), (1, 4001, 2, 128), (3, 33, 4, 256)], ids=str)
def test_backward_mma_layout(config, n0, n1, m, h):
    """The backward's TF32 tensor-core layout (never measured before this test ran): against the float64
    reference at the spec's tolerance, and against the lanes layout (the same TF32 products: float32 sum
    order apart). Token ranges that end mid-tile, tokens past num_tokens, partials with no tokens (1 token)."""
    shape = {"num_tokens": n0 * n1, "mhc_mult3": m * (m + 2), "mhc_hidden": m * h}
    spec = tkjit.get_spec(BWD)
    full = spec.canonical_shape(shape)
    if spec.constraint(full, config):
        pytest.skip(spec.constraint(full, config))
    kern = tkjit.get(BWD, shape, config=config)
    for seed in (0, 1):
        assert check(kern, shape, seed=seed) is None
    inputs = spec.make_inputs(full, device="cuda", seed=2)
    got_x, got_p = run_bwd(kern, full, inputs)
    want_x, want_p = run_bwd(tkjit.get(BWD, shape), full, inputs)
    assert rel(got_p, want_p) < 1e-5
    assert spec.tolerance.check("x_grad", got_x.cpu(), want_x.cpu()) is None


@pytest.mark.parametrize("weight", [False, True])
@pytest.mark.parametrize("n0, n1, m, h", TK_SHAPES + ODD[1:], ids=str)
def test_against_float64_and_tile_kernels(n0, n1, m, h, weight):
    residual, fn, w, og = data(n0, n1, m, h, seed=n1 + h, weight=weight)
    got = run(compat.modeling.mhc.ops.mhc_pre_norm_fn, residual, fn, w, og, fuse_grad_acc=False)
    want = run(tk_ref, residual.double(), fn.double(), None if w is None else w.double(), og.double())
    names = ("out", "residual grad", "mhc_fn grad", "mhc_norm_weight grad")
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape, name
        assert rel(a, b) < TF32_RTOL, name
    if m != 4:
        return  # TileKernels' forward kernel stores 24 mixes a token: mhc_mult 4 only
    tk = pytest.importorskip("tile_kernels")
    try:
        oracle = run(tk.modeling.mhc.ops.mhc_pre_norm_fn, residual, fn, w, og, fuse_grad_acc=False)
    except Exception as e:  # a TileKernels compile failure skips only this comparison
        pytest.skip(f"TileKernels' mhc_pre_norm_fn failed: {type(e).__name__}: {e}")
    tols = (1e-5, 2e-3, 1e-4, 1e-4)  # the residual gradient is bf16: a few last-bit flips
    for name, a, b, tol in zip(names, got, oracle, tols):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel(a, b) < tol, name


def test_fuse_grad_acc_against_tile_kernels():
    residual, fn, _, og = data(1, 1024, 4, 1280, seed=3)
    acc = torch.randn(residual.shape, device="cuda").to(torch.bfloat16)

    def fused(impl):
        res = residual.clone().requires_grad_()
        res.untyped_storage().grad_from_mhc_post = acc.clone()
        stored = res.untyped_storage().grad_from_mhc_post
        impl(res, fn, None, 1e-6).backward(og)
        assert res.grad is None and not hasattr(res.untyped_storage(), "grad_from_mhc_post")
        return stored

    got = fused(compat.modeling.mhc.ops.mhc_pre_norm_fn)
    fresh = run(compat.modeling.mhc.ops.mhc_pre_norm_fn, residual, fn, None, og, fuse_grad_acc=False)[1]
    assert rel(got.float() - acc.float(), fresh) < 2e-2  # bf16 rounding at acc's scale
    tk = pytest.importorskip("tile_kernels")
    try:
        oracle = fused(tk.modeling.mhc.ops.mhc_pre_norm_fn)
    except Exception as e:
        pytest.skip(f"TileKernels' mhc_pre_norm_fn failed: {type(e).__name__}: {e}")
    assert rel(got, oracle) < 1e-3


def test_ops_opcheck_and_compile():
    residual, fn, w, og = data(1, 256, 4, 256, seed=5, weight=True)
    x = residual.view(256, 1024)
    fwd, bwd = torch.ops.tkjit.mhc_pre_norm_fn.default, torch.ops.tkjit.mhc_pre_norm_fn_bwd.default
    args = (x.clone().requires_grad_(), fn.clone().requires_grad_(), 1e-6)
    assert torch.library.opcheck(fwd, args, test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    _, out_mul, sqrsum = fwd(x, fn, 1e-6)
    bargs = (og.view(256, 24), out_mul, sqrsum, x, fn, 1e-6)
    assert torch.library.opcheck(bwd, bargs, test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")

    def f(a, b, c, eps):
        return tkjit.ops.mhc_pre_norm_fn(a, b, c, eps, fuse_grad_acc=False)

    got = run(torch.compile(f, fullgraph=True), residual, fn, w, og)
    want = run(f, residual, fn, w, og)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
