"""reduce_fused on the CPU: spec, variants, the exact-FMA reference against rational arithmetic, the torch
ops' plumbing (the kernel replaced by one writing the reference: it is CUDA-only), compat argument errors,
an sm_90a cross-compile."""

import random
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops
import tkjit.torch_ops
from tkjit.compat.tile_kernels import moe as tk_moe
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit.registry import get_spec
from tkjit.spec import validate
from tkjit_kernels.moe import reduce_fused as mod

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from reference_kernels import serve_references  # noqa: E402

NAME = "reduce_fused"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
VARIANTS = [  # (in_dtype, e4m3_out, has_weights, has_x_sf, has_sf)
    ("bfloat16", False, True, False, False),
    ("bfloat16", False, False, False, False),
    ("float32", False, True, True, False),
    ("bfloat16", True, True, True, True),
    ("float32", True, False, False, True),
    ("bfloat16", True, True, False, False),
    ("float16", False, True, False, False),
    ("float8_e4m3fn", False, True, True, False),  # an e4m3 QuantTensor: e4m3 out (saturating) without fp8_format
    ("float8_e4m3fn", True, False, True, True),
]


@pytest.fixture(scope="module")
def spec():
    return get_spec(NAME)


def _shape(n=37, p=300, h=512, k=6, v=VARIANTS[0]):
    return {"num_tokens": n, "num_expanded_tokens": p, "hidden": h, "num_topk": k, "in_dtype": v[0],
            "e4m3_out": v[1], "has_weights": v[2], "has_x_sf": v[3], "has_sf": v[4]}


def test_spec_validates(spec):
    validate(spec)
    assert spec.family == "moe" and spec.tolerance.exact
    for ex in spec.examples:
        full = spec.canonical_shape(ex)
        assert spec.default_config(full, "sm_90a") in spec.configs(full, "sm_90a")
    d = spec.default_config(spec.canonical_shape(spec.examples[0]), "sm_90a")
    assert d == {"threads": 128, "rows": 1, "vec_bytes": 16, "unroll": 7}


def test_variants_take_their_inputs(spec):
    for v in VARIANTS:
        full = spec.canonical_shape(_shape(v=v))
        names = [t.name for t in spec.abi_tensors(full)]
        want = ["x"] + ["topk_weights"] * v[2] + ["token_topk_to_pos"] + ["sf"] * v[4] + ["x_sf"] * v[3] + ["out"]
        assert names == want
        assert len(spec.make_inputs(full)) == len(want) - 1
        assert spec.output_decls(full)[0][1] == ("float8_e4m3fn" if v[1] else v[0])


def test_bad_shapes_and_configs(spec):
    with pytest.raises(ShapeError, match="has_sf needs e4m3_out"):
        spec.canonical_shape(_shape(v=("bfloat16", False, True, False, True)))
    with pytest.raises(ShapeError, match="'in_dtype'='float64' not allowed"):
        spec.canonical_shape(_shape(v=("float64", False, True, False, False)))
    full = spec.canonical_shape(_shape())
    with pytest.raises(ConfigError, match="CUDA targets only"):
        spec.check_config(full, spec.default_config(full), "cpu")
    with pytest.raises(ConfigError, match="not a whole number of 16-byte vectors"):
        spec.check_config(spec.canonical_shape(_shape(h=516)), {**spec.default_config(full), "vec_bytes": 16})


# -- the exact fma ----------------------------------------------------------------------------------

def _fma_exact(a: float, b: float, c: float) -> float:
    """Round-to-nearest-even of a * b + c to float32, in rationals."""
    v = Fraction(a) * Fraction(b) + Fraction(c)
    lo = torch.tensor(float(v), dtype=torch.float64).float()  # a neighbour; search both sides exactly
    cands = [lo, torch.nextafter(lo, torch.tensor(float("inf"))), torch.nextafter(lo, torch.tensor(float("-inf")))]
    best = min(cands, key=lambda f: (abs(Fraction(float(f)) - v), int(f.view(torch.int32)) & 1))
    return float(best)


def test_fma32_is_correctly_rounded_at_float32_midpoints():
    # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 is a float32 midpoint: + or - 2^-100 decides the rounding, which a
    # float64 sum loses (it lands exactly on the midpoint, then rounds to even).
    a = torch.tensor([1 + 2**-12] * 4)
    c = torch.tensor([2.0**-100, -(2.0**-100), 0.0, 2.0**-60])
    got = mod.fma32(a, a, c)
    want = [_fma_exact(float(a[0]), float(a[0]), float(x)) for x in c]
    assert got.tolist() == want
    assert got[0] != (a[0].double() ** 2 + c[0].double()).float()  # the naive double rounding is wrong here


def test_fma32_random_against_rationals():
    rnd = random.Random(0)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3000, generator=g).bfloat16().float()
    b = torch.rand(3000, generator=g)
    c = torch.randn(3000, generator=g) * torch.exp(torch.randn(3000, generator=g) * 8)
    for i in range(0, 3000, 7):  # midpoints by construction, nudged by tiny addends
        m = 1 + rnd.randrange(1, 4096) * 2.0**-12
        a[i], b[i], c[i] = m, m, rnd.choice([2.0**-90, -(2.0**-90), 0.0])
    got = mod.fma32(a, b, c)
    for i in range(3000):
        assert float(got[i]) == _fma_exact(float(a[i]), float(b[i]), float(c[i])), i


def _naive(shape, x, w, pos, sf, x_sf):
    """Token by token, slot by slot, each step an exactly rounded fma (rationals)."""
    p = x.shape[0]
    out = torch.zeros(pos.shape[0], x.shape[1], dtype=torch.float32)
    for t in range(pos.shape[0]):
        acc = [0.0] * x.shape[1]
        for k in range(pos.shape[1]):
            q = int(pos[t, k])
            if not 0 <= q < p:
                continue
            s = torch.tensor(float(w[t, k]) if w is not None else 1.0, dtype=torch.float32)
            if x_sf is not None:
                s = s * x_sf[q]
            acc = [_fma_exact(float(x[q, i]), float(s), acc[i]) for i in range(x.shape[1])]
        out[t] = torch.tensor(acc, dtype=torch.float32)
    if sf is not None:
        out = out * sf[0]
    if mod.out_dtype(shape) == "float8_e4m3fn":
        out = out.clamp(-448, 448)
    return out.to(getattr(torch, mod.out_dtype(shape)))


@pytest.mark.parametrize("v", VARIANTS, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_against_naive(spec, v, seed):
    s = spec.canonical_shape(_shape(n=9, p=40, h=16, k=6, v=v))
    inputs = spec.make_inputs(s, "cpu", seed)
    x, w, pos, sf, x_sf = mod.split_inputs(s, inputs)
    if seed % 2:
        assert bool(((pos >= 40) | (pos < -1)).any())
    ref = spec.reference(s, *inputs)
    naive = _naive(s, x, w, pos, sf, x_sf)
    assert ref.dtype == naive.dtype and torch.equal(ref.view(torch.uint8), naive.view(torch.uint8))


def test_reference_saturates_e4m3_and_keeps_nan(spec):
    s = spec.canonical_shape(_shape(n=1, p=2, h=4, k=2, v=("float32", True, False, False, False)))
    x = torch.tensor([[1000.0, -1000.0, float("nan"), float("inf")], [1.0, 1.0, 1.0, float("-inf")]])
    pos = torch.tensor([[0, -1]], dtype=torch.int32)
    r = spec.reference(s, x, pos)
    assert r.float()[0, :2].tolist() == [448.0, -448.0] and r.float()[0, 2].isnan() and r.float()[0, 3] == 448


def test_bytes_moved(spec):
    s = spec.canonical_shape(spec.examples[0])
    assert spec.bytes_moved(s) == 8192 * 8 * (7168 * 2 + 8) + 8192 * 7168 * 2


@pytest.mark.slow
def test_compiles_for_sm90a(cache_dir):
    k = tkjit.get(NAME, _shape(n=4001, p=40000, h=7168, k=8, v=VARIANTS[3]), arch="sm_90a")
    src = (k.path / "kernel.cu").read_text()
    assert "__fmaf_rn(" in src and "*(uint4*)(xs" in src  # a real FMA; 16-byte loads
    assert "(int64_t)pos) * (int64_t)7168" in src


@pytest.mark.slow
def test_e4m3_input_compiles_for_sm90a(cache_dir):
    # An e4m3 QuantTensor (x, x_sf): 16 codes a 16-byte load, the e4m3 output in paired SATFINITE conversions.
    k = tkjit.get(NAME, _shape(n=4001, p=40000, h=7168, k=8, v=("float8_e4m3fn", False, True, True, False)),
                  arch="sm_90a")
    src = (k.path / "kernel.cu").read_text()
    assert "*(fp8_e4_16_t*)(xs" in src and "__nv_cvt_float2_to_fp8x2(" in src and "__fmaf_rn(" in src


@pytest.mark.slow
@pytest.mark.parametrize("hidden,vec_bytes,unroll", [(7168, 16, 7), (4098, 4, 2), (4098, 2, 4)])
def test_e4m3_cast_compiles_for_sm90a(cache_dir, hidden, vec_bytes, unroll):
    # The e4m3 output: paired SATFINITE conversions where a lane holds 2+ values (saturate to +-448, NaN
    # stays NaN: the values the clamp gave), the clamp and a scalar cast for one value (vec_bytes=2 bf16).
    cfg = {"threads": 128, "rows": 1, "vec_bytes": vec_bytes, "unroll": unroll}
    k = tkjit.get(NAME, _shape(n=4001, p=40000, h=hidden, k=8, v=("bfloat16", True, True, False, True)),
                  arch="sm_90a", config=cfg)
    src = (k.path / "kernel.cu").read_text()
    paired = "__nv_cvt_float2_to_fp8x2(" in src and "__NV_SATFINITE, __NV_E4M3" in src
    assert paired == (vec_bytes > 2) and ("4.480000e+02" in src) == (vec_bytes == 2)


# -- the torch ops, their fakes, compat --------------------------------------------------------------

@pytest.fixture
def reference_kernels(monkeypatch):
    """reduce_fused as a CPU CompiledKernel that writes its reference (real argument checks)."""
    serve_references(monkeypatch, (NAME,))


def _op_args(v, n=37, p=300, h=256, k=6, seed=0):
    """(x, topk_weights, token_topk_to_pos, fp8_format, sf, x_sf) for the ops."""
    spec = get_spec(NAME)
    s = spec.canonical_shape(_shape(n=n, p=p, h=h, k=k, v=v))
    x, w, pos, sf, x_sf = mod.split_inputs(s, spec.make_inputs(s, "cpu", seed))
    return x, w, pos, "e4m3" if v[1] else "", sf, x_sf


@pytest.mark.parametrize("v", VARIANTS[:4], ids=str)
def test_opcheck(reference_kernels, v):
    args = _op_args(v)
    result = torch.library.opcheck(torch.ops.tkjit.reduce_fused.default, args, test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result
    x, w, pos, fmt, sf, x_sf = args
    if fmt:  # opcheck's mutation check does arithmetic on `out`, which CPU torch lacks for float8
        return
    out = torch.empty(pos.shape[0], x.shape[1], dtype=torch.float8_e4m3fn if fmt else x.dtype)
    result = torch.library.opcheck(torch.ops.tkjit.reduce_fused_out.default, (x, w, pos, out, fmt, sf, x_sf),
                                   test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result


@pytest.mark.parametrize("v", VARIANTS, ids=str)
def test_ops_match_reference_fake_and_out(reference_kernels, v):
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w, pos, fmt, sf, x_sf = _op_args(v, seed=1)
    spec = get_spec(NAME)
    s = spec.canonical_shape(_shape(n=37, p=300, h=256, v=v))
    ref = spec.reference(s, *[t for t in (x, w, pos, sf, x_sf) if t is not None])
    got = tkjit.ops.reduce_fused(x, w, pos, fmt, sf, x_sf)
    assert got.dtype == ref.dtype and torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    out = torch.full_like(ref, 3.0) if ref.dtype != torch.float8_e4m3fn else torch.empty_like(ref)
    assert tkjit.ops.reduce_fused(x, w, pos, fmt, sf, x_sf, out=out) is out
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
    with FakeTensorMode(allow_non_fake_inputs=True) as m:
        fake = torch.ops.tkjit.reduce_fused(*(m.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                              for a in (x, w, pos, fmt, sf, x_sf)))
    assert (fake.shape, fake.dtype, fake.stride()) == (got.shape, got.dtype, got.stride())


def test_zero_tokens_and_zero_rows(reference_kernels):
    v = VARIANTS[0]
    x, w, pos, fmt, sf, x_sf = _op_args(v)
    got = tkjit.ops.reduce_fused(x, w[:0], pos[:0])
    assert got.shape == (0, 256) and got.dtype == torch.bfloat16
    got = tkjit.ops.reduce_fused(x[:0], w, torch.full_like(pos, -1))
    assert got.shape == (37, 256) and not got.any()


def test_torch_compile_fullgraph(reference_kernels):
    x, w, pos, fmt, sf, x_sf = _op_args(VARIANTS[3], seed=2)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x, w, pos, sf, x_sf):
        out = torch.empty(pos.shape[0], x.shape[1], dtype=torch.float8_e4m3fn)
        tkjit.ops.reduce_fused(x * 2, w, pos, "e4m3", sf, x_sf, out=out)
        return tkjit.ops.reduce_fused(x, w, pos, "e4m3", sf, x_sf).float() + out.float()

    want = tkjit.ops.reduce_fused(x, w, pos, "e4m3", sf, x_sf).float() + tkjit.ops.reduce_fused(
        x * 2, w, pos, "e4m3", sf, x_sf).float()
    assert torch.equal(f(x, w, pos, sf, x_sf), want)


def test_fake_refuses_bad_inputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(50, 256).bfloat16()
        pos = torch.zeros(5, 6, dtype=torch.int32)
        w = torch.rand(5, 6)
        with pytest.raises(TensorError, match="topk_weights has dtype torch.bfloat16"):
            torch.ops.tkjit.reduce_fused(x, w.bfloat16(), pos)
        with pytest.raises(ShapeError, match="fp8_format must be '' or 'e4m3'"):
            torch.ops.tkjit.reduce_fused(x, w, pos, "e5m2")
        with pytest.raises(ShapeError, match="has_sf needs e4m3_out"):
            torch.ops.tkjit.reduce_fused(x, w, pos, "", torch.ones(1))


def test_compat_argument_errors(reference_kernels):
    x, w, pos, fmt, sf, x_sf = _op_args(VARIANTS[0])
    with pytest.raises(ShapeError, match="must be a multiple of 256"):
        tk_moe.reduce_fused(x[:, :128].contiguous(), w, pos)
    with pytest.raises(ShapeError, match="fp8_format must be '' or 'e4m3'"):
        tk_moe.reduce_fused(x, w, pos, "e5m2")
    with pytest.raises(ShapeError, match="sf is only taken with an FP8 output"):
        tk_moe.reduce_fused(x, w, pos, "", torch.ones(1))
    with pytest.raises(TensorError, match="token_topk_to_pos must be torch.int32"):
        tk_moe.reduce_fused(x, w, pos.long())
    with pytest.raises(TensorError, match="topk_weights has shape"):
        tk_moe.reduce_fused(x, w[1:], pos)
    with pytest.raises(TensorError, match="x's sf has 299 rows, x has 300"):
        tk_moe.reduce_fused((x, torch.rand(299)), w, pos)
    with pytest.raises(TensorError, match="out must be torch.bfloat16"):
        tk_moe.reduce_fused(x, w, pos, out=torch.empty(37, 256))
    with pytest.raises(TensorError, match="out has shape"):
        tk_moe.reduce_fused(x, w, pos, out=torch.empty(36, 256, dtype=torch.bfloat16))
    with pytest.raises(NotImplementedError, match="x of dtype torch.float64"):
        tk_moe.reduce_fused(x.double(), w, pos)
    spec = get_spec(NAME)
    s = spec.canonical_shape(_shape(h=256, v=VARIANTS[3]))
    x2, w2, pos2, fmt2, sf2, xsf2 = _op_args(VARIANTS[3])
    got = tk_moe.reduce_fused((x2, xsf2), w2, pos2, "e4m3", sf2)
    ref = spec.reference(s, x2, w2, pos2, sf2, xsf2)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    out = torch.empty_like(ref)
    assert tk_moe.reduce_fused((x2, xsf2), w2, pos2, "e4m3", sf2, out=out) is out
    assert tk_moe.reduce_fused(x, w[:0], pos[:0]).shape == (0, 256)
