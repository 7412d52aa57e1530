"""mhc_pre_norm_fn / mhc_pre_norm_fn_bwd on a CPU host: the specs, the references against TileKernels' torch
reference and its float64 autograd (at TF32 tolerance), both kernels cross-compiled for sm_90a and served by
their references for the op tests (autograd, fuse_grad_acc, main_grad, opcheck, fake), and the TileKernels
compat entry point."""

import inspect
import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as tk
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit.torch_ops import tf32_round

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from ptxas import ptxas_usage  # noqa: E402
from reference_kernels import serve_references  # noqa: E402

pytestmark = pytest.mark.usefixtures("module_cache")
FWD, BWD, SPLIT = "mhc_pre_norm_fn", "mhc_pre_norm_fn_bwd", "mhc_pre_norm_fn_split"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# TF32: fn (and the backward's GEMM operand) keep 10 mantissa bits, a relative error up to 2^-11 each;
# summed over K terms of random sign the outputs' relative L2 error against float64 is about 2^-11 / sqrt(3).
TF32_RTOL = 2e-3


def tk_ref(residual, mhc_fn, mhc_norm_weight, mhc_norm_eps):
    """TileKernels' mhc_pre_norm_fn_ref (tile_kernels/torch/mhc.py), in the inputs' float dtype."""
    if mhc_norm_weight is not None:
        mhc_fn = mhc_fn * mhc_norm_weight
    x = residual.flatten(-2, -1).to(mhc_fn.dtype)
    k = mhc_fn.shape[-1]
    sqrsum = x.square().sum(-1, keepdim=True)
    return (x @ mhc_fn.T) * (sqrsum / k + mhc_norm_eps).rsqrt()


def data(n0, n1, m, h, seed=0, weight=False):
    g = torch.Generator().manual_seed(seed)
    m3, k = m * (m + 2), m * h
    residual = torch.randn(n0, n1, m, h, generator=g).to(torch.bfloat16)
    fn = torch.randn(m3, k, generator=g) / k ** 0.5
    w = (1 + 0.1 * torch.randn(k, generator=g)) if weight else None
    out_grad = torch.randn(n0, n1, m3, generator=g)
    return residual, fn, w, out_grad


def float64_grads(residual, fn, w, eps, out_grad):
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (residual, fn, w)]
    tk_ref(*leaves, eps).backward(out_grad.double())
    return [t.grad if t is not None else None for t in leaves]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture
def refs(monkeypatch):
    return serve_references(monkeypatch, (FWD, BWD))


LANES = {"layout": "lanes", "warps": 4, "tokens_per_warp": 2, "vec": 8, "block_tokens": 32, "block_k": 64, "stages": 1,
         "swizzle": False}
MMA = {"layout": "mma", "warps": 4, "tokens_per_warp": 1, "vec": 8, "block_tokens": 64, "block_k": 128, "stages": 2,
       "swizzle": False}
BWD_LANES = {"layout": "lanes", "threads": 128, "vec": 2, "tile": 32, "warps": 4, "block_tokens": 64, "block_k": 64}
BWD_MMA = {"layout": "mma", "threads": 128, "vec": 1, "tile": 32, "warps": 4, "block_tokens": 64, "block_k": 128}


def test_registered_defaults_and_constraints():
    s = tkjit.get_spec(FWD)
    full = s.canonical_shape({"num_tokens": 4096, "mhc_mult3": 24, "mhc_hidden": 16384})
    # TileKernels' tensor-core tile where it applies (mhc_mult3 <= 32, 64 | mhc_hidden), else the lanes layout
    assert s.default_config(full, "sm_90a") == {**MMA, "block_tokens": 32, "block_k": 256, "swizzle": True}
    assert s.default_config(s.canonical_shape({"num_tokens": 1, "mhc_mult3": 24, "mhc_hidden": 2 * 96}),
                            "sm_90a")["block_k"] == 64
    assert s.default_config(s.canonical_shape({"num_tokens": 1, "mhc_mult3": 80, "mhc_hidden": 32768}),
                            "sm_90a") == {**LANES, "tokens_per_warp": 1}
    assert s.constraint(full, {**LANES, "tokens_per_warp": 8, "vec": 8}) is not None  # registers
    odd = s.canonical_shape({"num_tokens": 1, "mhc_mult3": 24, "mhc_hidden": 96})
    assert s.default_config(odd, "sm_90a")["vec"] == 1
    assert "multiple of 32 * vec" in s.constraint(odd, {**LANES, "warps": 1, "tokens_per_warp": 1, "vec": 2})
    # The tensor-core layout: fn's rows padded to the GEMM's 32, whole block_k steps, its own tunables only.
    assert s.constraint(full, MMA) is None
    assert "GEMM's width" in s.constraint(s.canonical_shape({"num_tokens": 1, "mhc_mult3": 80, "mhc_hidden": 1024}),
                                           MMA)
    assert "multiple of block_k" in s.constraint(odd, MMA)
    assert "does not use them" in s.constraint(full, {**MMA, "tokens_per_warp": 2})
    assert "does not use them" in s.constraint(full, {**LANES, "block_k": 128})
    assert "does not use them" in s.constraint(full, {**LANES, "swizzle": True})
    assert s.constraint(full, {**MMA, "swizzle": True}) is None
    with pytest.raises(ShapeError, match="multiple of 32"):
        tkjit.get(FWD, {"num_tokens": 8, "mhc_mult3": 24, "mhc_hidden": 100}, arch="sm_90a")
    with pytest.raises(ConfigError):
        tkjit.get(FWD, {"num_tokens": 8, "mhc_mult3": 24, "mhc_hidden": 96}, arch="sm_90a", config={**LANES, "vec": 8})
    b = tkjit.get_spec(BWD)
    bfull = b.canonical_shape({"num_tokens": 4096, "mhc_mult3": 24, "mhc_hidden": 16384})
    # The tensor-core layout where it applies (mhc_mult3 <= 32, 64 | mhc_hidden), else the lanes layout
    assert b.default_config(bfull, "sm_90a") == BWD_MMA
    assert b.default_config(b.canonical_shape({"num_tokens": 64, "mhc_mult3": 24, "mhc_hidden": 1280 + 64}),
                            "sm_90a") == {**BWD_MMA, "block_k": 64}
    assert b.default_config(b.canonical_shape({"num_tokens": 64, "mhc_mult3": 80, "mhc_hidden": 32768}),
                            "sm_90a")["layout"] == "lanes"
    assert b.default_config(b.canonical_shape({"num_tokens": 64, "mhc_mult3": 24, "mhc_hidden": 1056}),
                            "sm_90a") == {**BWD_LANES, "threads": 32, "vec": 1}
    assert b.constraint(b.canonical_shape({"num_tokens": 1, "mhc_mult3": 80, "mhc_hidden": 1024}),
                        {**BWD_LANES, "threads": 32, "vec": 2, "tile": 8}) is not None
    for spec in (s, b):
        assert spec.arch_constraint("cpu", spec.default_config(full, "sm_90a"), full) is not None


@pytest.mark.parametrize("name", [FWD, BWD])
def test_compiles_for_sm90a(name):
    for shape in ({"num_tokens": 4096, "mhc_mult3": 24, "mhc_hidden": 16384},
                  {"num_tokens": 64, "mhc_mult3": 8, "mhc_hidden": 96}):
        k = tkjit.get(name, shape, arch="sm_90a")
        assert (k.path / "kernel.cu").read_text().count("__global__") >= 1


def test_mma_layout_compiles_to_tf32_tensor_core_gemm_for_sm90a():
    k = tkjit.get(FWD, {"num_tokens": 4096, "mhc_mult3": 24, "mhc_hidden": 16384}, arch="sm_90a", config=MMA)
    src = (k.path / "kernel.cu").read_text()
    assert "mma_sync<tl::DataType::kTensorFloat32" in src and "cp_async" in src


def test_split_spec_space_shapes_and_reference():
    """mhc_pre_norm_fn_split: whole 64-column steps a K range, mhc_mult3 <= 32, the forward's tensor-core default
    with the widest step dividing a range; its partial sums add up to the forward's reference out_mul and
    sqrsum."""
    spec = tkjit.get_spec(SPLIT)
    full = spec.canonical_shape({"num_tokens": 1024, "mhc_mult3": 24, "mhc_hidden": 28672, "k_splits": 8})
    assert spec.default_config(full, "sm_90a") == {"warps": 4, "block_tokens": 32, "block_k": 256, "stages": 2,
                                                   "swizzle": True}
    odd = spec.canonical_shape({"num_tokens": 5, "mhc_mult3": 8, "mhc_hidden": 1536, "k_splits": 3})  # 512 a range
    assert spec.default_config(odd, "sm_90a")["block_k"] == 256
    assert spec.default_config({**odd, "k_splits": 4}, "sm_90a")["block_k"] == 128  # 384 a range
    with pytest.raises(ShapeError, match="multiple of 64 \\* k_splits"):
        tkjit.get(SPLIT, {"num_tokens": 5, "mhc_mult3": 8, "mhc_hidden": 1536, "k_splits": 5}, arch="sm_90a")
    with pytest.raises(ShapeError, match="mhc_mult3"):
        tkjit.get(SPLIT, {"num_tokens": 5, "mhc_mult3": 80, "mhc_hidden": 1536, "k_splits": 2}, arch="sm_90a")
    shape = {"num_tokens": 7, "mhc_mult3": 8, "mhc_hidden": 768, "k_splits": 3}
    x, fn = spec.make_inputs(shape, "cpu", 1)
    partial = spec.reference(shape, x, fn)
    assert partial.shape == (3, 7, 9)
    _, out_mul, sqrsum = tkjit.get_spec(FWD).reference({**shape, "norm_eps": 1e-6}, x, fn)
    assert torch.allclose(partial.double().sum(0)[:, :8], out_mul.double(), rtol=1e-6, atol=1e-6)
    assert torch.allclose(partial.double().sum(0)[:, 8], sqrsum.double(), rtol=1e-6)


def test_the_op_splits_k_where_told_and_returns_the_forwards_outputs(monkeypatch):
    """Up to PRE_NORM_FN_SPLIT_TOKENS tokens (0, never, until the paths are timed on a GPU) the op runs the split
    kernel and adds its ranges' sums in torch: the forward's three outputs (contiguous, as the fake's), and
    through tkjit.ops TileKernels' reference output in float64."""
    from tkjit import torch_ops
    from tkjit.torch_ops import pre_norm_fn_splits

    assert torch_ops.PRE_NORM_FN_SPLIT_TOKENS == 0 and pre_norm_fn_splits(1024, 24, 16384) == 1
    monkeypatch.setattr(torch_ops.mhc, "PRE_NORM_FN_SPLIT_TOKENS", 2048)
    # 32-token tiles of the bucket times the ranges <= 264 blocks; whole 64-column ranges; mhc_mult3 <= 32
    assert [pre_norm_fn_splits(n, 24, 16384) for n in (0, 1, 1000, 1024, 1025, 2048, 2049)] == [1, 8, 8, 8, 4, 4, 1]
    assert pre_norm_fn_splits(100, 24, 384) == 2 and pre_norm_fn_splits(100, 24, 96) == 1
    assert pre_norm_fn_splits(100, 80, 16384) == 1
    serve_references(monkeypatch, (FWD, BWD, SPLIT))
    got, served = [], torch_ops.serve.get
    monkeypatch.setattr(torch_ops.serve, "get", lambda name, shape, **kw: (
        got.append((name, shape.get("k_splits"))), served(name, shape, **kw))[1])
    residual, fn, _, og = data(1, 300, 4, 256, seed=5)  # K = 1024: 8 ranges of 128 columns
    x = residual.view(300, 1024)
    out, out_mul, sqrsum = torch.ops.tkjit.mhc_pre_norm_fn.default(x, fn, 1e-6)
    assert got == [(SPLIT, 8)]
    want = tkjit.get_spec(FWD).reference({"mhc_hidden": 1024, "norm_eps": 1e-6}, x, tf32_round(fn))
    for a, b in zip((out, out_mul, sqrsum), want):
        assert a.shape == b.shape and a.is_contiguous() and rel(a, b) < 1e-6
    ref = tk_ref(residual.double(), fn.double(), None, 1e-6)
    assert rel(tkjit.ops.mhc_pre_norm_fn(residual, fn, None, 1e-6, fuse_grad_acc=False), ref) < TF32_RTOL


def test_split_compiles_to_the_forwards_tensor_core_sums_for_sm90a():
    """The split kernel's blocks run the forward's tensor-core sums over their K range (a grid dimension per
    range), without spilling registers at its default."""
    k = tkjit.get(SPLIT, {"num_tokens": 1024, "mhc_mult3": 24, "mhc_hidden": 28672, "k_splits": 8}, arch="sm_90a")
    src = (k.path / "kernel.cu").read_text()
    assert "mma_sync<tl::DataType::kTensorFloat32" in src and "cp_async" in src and "blockIdx.y" in src
    assert ptxas_usage(k.path / "kernel.cu")["spill"] == 0


def test_forward_inputs_hold_tf32_fn_as_the_op_passes_it():
    """The mma layout's tensor cores drop fn's low 13 mantissa bits: make_inputs gives fn as the op does (TF32),
    so the kernel's GEMM is the float32 sums the reference rounds once, for both layouts."""
    spec = tkjit.get_spec(FWD)
    shape = spec.canonical_shape({"num_tokens": 5, "mhc_mult3": 24, "mhc_hidden": 256})
    for seed in (0, 1):
        x, fn = spec.make_inputs(shape, seed=seed)
        assert x.dtype == torch.bfloat16 and fn.dtype == torch.float32
        assert torch.equal(fn, tf32_round(fn)) and (fn.view(torch.int32) & 0x1FFF).eq(0).all()
        assert fn.abs().gt(0).all()


def test_backward_mma_layout_space_and_constraints():
    """The backward's tensor-core layout: its configs exist only where mhc_mult3 <= 32 and block_k divides K,
    each layout's unused keys take one value (no duplicate kernels), shared memory and registers bounded."""
    from tkjit_kernels.mhc import pre_norm_fn_bwd as mod

    b = tkjit.get_spec(BWD)
    full = b.canonical_shape({"num_tokens": 4096, "mhc_mult3": 24, "mhc_hidden": 16384})
    assert b.constraint(full, BWD_MMA) is None and b.constraint(full, BWD_LANES) is None
    assert "padded width" in b.constraint(b.canonical_shape({"num_tokens": 1, "mhc_mult3": 80, "mhc_hidden": 1024}),
                                          BWD_MMA)
    assert "multiple of block_k" in b.constraint(b.canonical_shape({"num_tokens": 1, "mhc_mult3": 24,
                                                                    "mhc_hidden": 96}), BWD_MMA)
    assert "does not use them" in b.constraint(full, {**BWD_MMA, "vec": 2})
    assert "does not use them" in b.constraint(full, {**BWD_LANES, "block_k": 128})
    assert "8 * warps" in b.constraint(full, {**BWD_MMA, "warps": 8, "block_tokens": 32})
    assert "spill" in b.constraint(full, {**BWD_MMA, "block_k": 256})  # 192 accumulators a thread
    for shape, want in ((full, True), (b.canonical_shape({"num_tokens": 1, "mhc_mult3": 80, "mhc_hidden": 32768}),
                                        False)):
        configs = list(b.configs(shape))
        keyed = [tuple(sorted(c.items())) for c in configs]
        assert len(keyed) == len(set(keyed))
        mma = [c for c in configs if c["layout"] == "mma"]
        assert bool(mma) == want
        lanes = [{k: c[k] for k in ("threads", "vec", "tile")} for c in configs if c["layout"] == "lanes"]
        assert len(lanes) == len({tuple(c.items()) for c in lanes})  # one lanes kernel per old config
        for c in mma:
            assert mod._smem_bytes(c) <= 160 * 1024
            assert (c["block_tokens"] + mod.MMA_N) * c["block_k"] // (32 * c["warps"]) <= mod.REG_BOUND


def test_backward_inputs_are_tf32_and_the_tolerance_holds_for_float32_sums():
    """make_inputs draws mul_grad and fn as the op passes them (TF32), so a TF32 tensor-core product loses
    nothing; a float32 evaluation in another order (torch's CPU GEMM) is within the spec's tolerance of the
    float64 reference, while leaving out the 2 * x * sqrsum_grad term or truncating non-TF32 operands is not."""
    b = tkjit.get_spec(BWD)
    for n, seed in ((4001, 0), (8192, 1)):
        shape = b.canonical_shape({"num_tokens": n, "mhc_mult3": 24, "mhc_hidden": 4096})
        g, sg, x, fn, xg = b.make_inputs(shape, seed=seed)
        assert torch.equal(tf32_round(g), g) and torch.equal(tf32_round(fn), fn)
        want_x, want_p = b.reference(shape, g, sg, x, fn, xg)
        per, xf = -(-n // shape["num_partials"]), x.float()
        parts = torch.stack([g[p * per:(p + 1) * per].T @ xf[p * per:(p + 1) * per]
                             for p in range(shape["num_partials"])])
        got_x = (xg.float() + g @ fn + 2 * xf * sg[:, None]).to(torch.bfloat16)
        assert b.tolerance.check("x_grad", got_x, want_x) is None
        assert b.tolerance.check("fn_grad_partial", parts, want_p) is None
        assert rel(parts, want_p) < 1e-6
        assert b.tolerance.check("x_grad", (xg.float() + g @ fn).to(torch.bfloat16), want_x) is not None
        rough = torch.randn(g.shape)  # not TF32: the tensor core would drop 13 bits of each operand
        cut = (rough.view(torch.int32) & -0x2000).view(torch.float32)
        assert b.tolerance.check("x_grad", (xg.float() + cut @ fn + 2 * xf * sg[:, None]).to(torch.bfloat16),
                                 b.reference(shape, rough, sg, x, fn, xg)[0]) is not None


@pytest.mark.parametrize("config", [BWD_MMA, {**BWD_MMA, "block_tokens": 32, "block_k": 64},
                                    {**BWD_MMA, "warps": 8, "block_tokens": 64, "block_k": 64}], ids=str)
def test_backward_mma_layout_compiles_to_tf32_tensor_core_gemms_for_sm90a(config):
    k = tkjit.get(BWD, {"num_tokens": 4096, "mhc_mult3": 24, "mhc_hidden": 16384}, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    assert src.count("mma_sync<tl::DataType::kTensorFloat32") >= 2 and "cp_async" in src
    usage = ptxas_usage(k.path / "kernel.cu")
    assert usage["registers"] <= 255 and usage["spill"] == 0, usage


def test_tf32_round_is_tile_kernels_rounding_then_truncation():
    x = torch.tensor([1.0, 1 + 2 ** -11, 1 + 2 ** -12, -(1 + 2 ** -11), 1 + 3 * 2 ** -12, 0.0, -0.0, 3e-39])
    tk = (x.view(torch.int32) + 0x1000).view(torch.float32)  # TileKernels' round_to_tf32
    trunc = (tk.view(torch.int32) & ~0x1FFF).view(torch.float32)  # the tensor core drops 13 bits
    assert torch.equal(tf32_round(x).view(torch.int32), trunc.view(torch.int32))
    assert tf32_round(x)[1] == 1 + 2 ** -10 and tf32_round(x)[2] == 1.0 and tf32_round(x)[3] == -(1 + 2 ** -10)


@pytest.mark.parametrize("seed", [0, 1])
def test_forward_reference(seed):
    shape = {"num_tokens": 37, "mhc_mult3": 24, "mhc_hidden": 256, "norm_eps": 1e-6}
    x, fn = tkjit.get_spec(FWD).make_inputs(shape, seed=seed)
    out, out_mul, sqrsum = tkjit.get_spec(FWD).reference(shape, x, fn)
    want = tk_ref(x.double().view(37, 4, 64), fn.double(), None, 1e-6)
    assert rel(out, want) < 1e-6
    torch.testing.assert_close(sqrsum.double(), x.double().square().sum(-1), rtol=1e-6, atol=0)
    if seed:  # the zero row: out 0, sqrsum 0
        assert sqrsum[18] == 0 and (out[18] == 0).all()


def test_backward_pieces_are_float64_autograd():
    """pre_norm_fn_grads (the norm's backward) then the bwd kernel's reference reproduce float64 autograd of
    TileKernels' reference, to TF32 (the GEMM operand is rounded as TileKernels rounds it)."""
    from tkjit.torch_ops import pre_norm_fn_grads

    residual, fn, _, og = data(2, 9, 4, 64, seed=3)
    n, k, eps = 18, 256, 1e-6
    x = residual.view(n, k)
    out, out_mul, sqrsum = tkjit.get_spec(FWD).reference({"mhc_hidden": k, "norm_eps": eps}, x, fn)
    mg, sg = pre_norm_fn_grads(og.view(n, 24), out_mul, sqrsum, k, eps)
    shape = {"num_partials": 4}
    x_grad, parts = tkjit.get_spec(BWD).reference(shape, mg, sg, x, fn, torch.zeros_like(x))
    gx, gfn, _ = float64_grads(residual, fn, None, eps, og)
    assert rel(x_grad.float(), gx.view(n, k)) < TF32_RTOL
    assert rel(parts.sum(0), gfn) < TF32_RTOL


def test_backward_token_ranges_follow_the_token_count_bucket(refs, monkeypatch):
    """The op's fn-gradient token ranges: 16 from 4096 tokens, fewer below so a range of the count's power-of-two
    bucket keeps >= 256 tokens (1024 tokens: 4 ranges of 256, not 16 of 64); the summed gradient is the same."""
    from tkjit.torch_ops import pre_norm_fn_partials

    assert [pre_norm_fn_partials(n) for n in (0, 1, 256, 257, 512, 1000, 1024, 1025, 2048, 4096, 1 << 20)] == \
        [1, 1, 1, 2, 2, 4, 4, 8, 8, 16, 16]
    ranges, served = [], tkjit.torch_ops.serve.get
    monkeypatch.setattr(tkjit.torch_ops.serve, "get", lambda name, shape, **kw: (
        ranges.append(shape.get("num_partials")), served(name, shape, **kw))[1])
    for n in (6, 1000, 4096):
        residual, fn, _, og = data(1, n, 2, 64, seed=n)
        x = residual.view(n, 128)
        _, out_mul, sqrsum = torch.ops.tkjit.mhc_pre_norm_fn.default(x, fn, 1e-6)
        _, fn_grad = torch.ops.tkjit.mhc_pre_norm_fn_bwd.default(og.view(n, 8), out_mul, sqrsum, x, fn, 1e-6)
        assert rel(fn_grad, float64_grads(residual, fn, None, 1e-6, og)[1]) < TF32_RTOL
    assert ranges == [None, 1, None, 4, None, 16]  # (the forward's shape has no ranges)


def test_ops_opcheck_and_fake(refs):
    from torch._subclasses.fake_tensor import FakeTensorMode

    fwd, bwd = torch.ops.tkjit.mhc_pre_norm_fn.default, torch.ops.tkjit.mhc_pre_norm_fn_bwd.default
    residual, fn, _, og = data(1, 6, 2, 64)
    x = residual.view(6, 128)
    args = (x.clone(), fn.clone().requires_grad_(), 1e-6)
    assert torch.library.opcheck(fwd, args, test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    out, out_mul, sqrsum = fwd(x, fn, 1e-6)
    bargs = (og.view(6, 8), out_mul, sqrsum, x, fn, 1e-6)
    assert torch.library.opcheck(bwd, bargs, test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        outs = fwd(mode.from_tensor(x), mode.from_tensor(fn), 1e-6)
        assert [tuple(o.shape) for o in outs] == [(6, 8), (6, 8), (6,)]
        grads = bwd(*(mode.from_tensor(t) for t in bargs[:5]), 1e-6)
        assert [tuple(g.shape) for g in grads] == [(6, 128), (8, 128)]
    with pytest.raises(TensorError, match="columns"):
        fwd(x.to("meta"), fn[:, :64].to("meta"), 1e-6)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("weight", [False, True])
def test_autograd_matches_float64(refs, compiled, weight):
    residual, fn, w, og = data(2, 5, 4, 64, seed=int(compiled), weight=weight)

    def f(a, b, c):
        return tkjit.ops.mhc_pre_norm_fn(a, b, c, 1e-6, fuse_grad_acc=False)

    if compiled:
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (residual, fn, w)]
    out = f(*leaves)
    want = tk_ref(residual.double(), fn.double(), None if w is None else w.double(), 1e-6)
    assert out.shape == (2, 5, 24) and out.dtype == torch.float32
    if not compiled:  # one autograd node from the residual: no views around the Function
        assert out.grad_fn.next_functions[0][0].variable is leaves[0]
    assert rel(out, want) < TF32_RTOL
    out.backward(og)
    for got, w64 in zip([t.grad for t in leaves if t is not None], [g for g in float64_grads(residual, fn, w, 1e-6, og)
                                                                  if g is not None]):
        assert rel(got, w64) < TF32_RTOL


def test_fuse_grad_acc_adds_into_mhc_posts_gradient(refs):
    residual, fn, _, og = data(1, 7, 4, 64, seed=5)
    res = residual.clone().requires_grad_()
    acc = torch.randn(residual.shape).to(torch.bfloat16)
    res.untyped_storage().grad_from_mhc_post = acc.clone()
    stored = res.untyped_storage().grad_from_mhc_post
    out = tk.modeling.mhc.ops.mhc_pre_norm_fn(res, fn, None, 1e-6)
    out.backward(og)
    assert res.grad is None and not hasattr(res.untyped_storage(), "grad_from_mhc_post")
    gx = float64_grads(residual, fn, None, 1e-6, og)[0]
    assert rel(stored.float() - acc.float(), gx) < 1e-2  # stored's bf16 rounding at the scale of acc
    # no such gradient: a fresh one (TileKernels fails there)
    res2 = residual.clone().requires_grad_()
    tk.modeling.mhc.ops.mhc_pre_norm_fn(res2, fn, None, 1e-6).backward(og)
    assert rel(res2.grad, gx) < TF32_RTOL
    res3 = residual.clone().requires_grad_()
    res3.untyped_storage().grad_from_mhc_post = torch.zeros(3)
    out = tk.modeling.mhc.ops.mhc_pre_norm_fn(res3, fn, None, 1e-6)
    with pytest.raises(TensorError, match="grad_from_mhc_post"):
        out.backward(og)


def test_main_grad_takes_the_weight_gradients(refs):
    residual, fn, w, og = data(1, 4, 4, 64, seed=7, weight=True)
    fn_p, w_p = fn.clone().requires_grad_(), w.clone().requires_grad_()
    fn_p.main_grad, w_p.main_grad = torch.ones_like(fn), torch.full_like(w, 2.0)
    out = tk.modeling.mhc.ops.mhc_pre_norm_fn(residual, fn_p, w_p, 1e-6, fuse_grad_acc=False)
    out.backward(og)
    assert fn_p.grad is None and w_p.grad is None
    _, gfn, gw = float64_grads(residual, fn, w, 1e-6, og)
    assert rel(fn_p.main_grad - 1, gfn) < TF32_RTOL and rel(w_p.main_grad - 2, gw) < TF32_RTOL


def test_differentiable_once(refs):
    residual, fn, _, og = data(1, 3, 2, 64)
    fn_p = fn.clone().requires_grad_()
    out = tkjit.ops.mhc_pre_norm_fn(residual, fn_p, None, 1e-6, fuse_grad_acc=False)
    (g,) = torch.autograd.grad((out * og).sum(), [fn_p], create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        g.sum().backward()


def test_compat_signature_is_tile_kernels():
    P = inspect.Parameter
    params = inspect.signature(tk.modeling.mhc.ops.mhc_pre_norm_fn).parameters.values()
    assert [(p.name, p.kind, p.default) for p in params] == [
        ("residual", P.POSITIONAL_OR_KEYWORD, P.empty), ("mhc_fn", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("mhc_norm_weight", P.POSITIONAL_OR_KEYWORD, P.empty), ("mhc_norm_eps", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("fuse_grad_acc", P.POSITIONAL_OR_KEYWORD, True), ("n_splits", P.POSITIONAL_OR_KEYWORD, 16)]


@pytest.mark.parametrize("n_splits", [1, 16])
def test_compat_matches_tile_kernels_reference(refs, n_splits):
    residual, fn, w, og = data(2, 3, 4, 128, seed=11, weight=True)
    out = tk.modeling.mhc.ops.mhc_pre_norm_fn(residual, fn, w, 1e-6, n_splits=n_splits)
    assert out.shape == (2, 3, 24)
    assert rel(out, tk_ref(residual.float(), fn, w, 1e-6)) < TF32_RTOL


def _bad(kind):
    residual, fn, w, _ = data(1, 2, 4, 64, weight=True)
    return {
        "residual dtype": ((residual.float(), fn, w, 1e-6), TensorError, "residual"),
        "fn dtype": ((residual, fn.double(), w, 1e-6), TensorError, "mhc_fn"),
        "fn cols": ((residual, fn[:, :128], w, 1e-6), TensorError, "mhc_fn"),
        "weight shape": ((residual, fn, w[:10], 1e-6), TensorError, "mhc_norm_weight"),
        "rows": ((residual, torch.zeros(81, 256), None, 1e-6), ShapeError, "80 rows"),
        "eps": ((residual, fn, w, "x"), Exception, "mhc_norm_eps"),
        "splits": ((residual, fn, w, 1e-6, True, 0), TensorError, "n_splits"),
    }[kind]


@pytest.mark.parametrize("kind", ["residual dtype", "fn dtype", "fn cols", "weight shape", "rows", "eps", "splits"])
def test_compat_argument_errors(kind):
    args, err, match = _bad(kind)
    with pytest.raises(err, match=match):
        tk.modeling.mhc.ops.mhc_pre_norm_fn(*args)
