"""per_token_cast_e2m1(_colmajor) specs on the CPU: the e2m1 format (`_e2m1`: rounding against a brute-force
nearest-even search, packing, decoding), shapes, constraints, reference semantics, scale layouts, the torch ops
(fake, opcheck), tkjit.ops, TileKernels' per_token_cast(fmt='e2m1') and its round trip through cast_back, sm_90a
cross-compiles. The kernels are CUDA-only: the ops run here as CompiledKernels that write the reference
(tests/helpers/reference_kernels.py)."""

import inspect
import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops
import tkjit.torch_ops
from tkjit.compat import tile_kernels as tk
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit.registry import get_spec
from tkjit.spec import Align, validate
from tkjit_kernels.quant import _e2m1

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from quant_checks import layout_fixtures  # noqa: E402
from reference_kernels import serve_references  # noqa: E402

NAME, COLMAJOR = "per_token_cast_e2m1", "per_token_cast_e2m1_colmajor"
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

spec, colmajor, reference_kernels = layout_fixtures(NAME, COLMAJOR, (NAME, COLMAJOR, "cast_back", "cast_back_colmajor"))



def _shape(**kw):
    return {"num_tokens": 16, "hidden": 256, "group": 32, **kw}


def _codes(values):
    return _e2m1.encode(torch.tensor(values, dtype=torch.float32)).tolist()


# -- the format ---------------------------------------------------------------------------------------------

def test_encode_hand_checked():
    assert _codes(list(GRID)) == list(range(8))
    assert _codes([-g for g in GRID]) == list(range(8, 16))  # -0.0 is code 8
    # Ties go to the even code (mantissa bit 0): 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2, 2.5 -> 2,
    # 3.5 -> 4, 5 -> 4; just past a tie rounds away from it.
    assert _codes([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]) == [0, 2, 2, 4, 4, 6, 6]
    up = [torch.nextafter(torch.tensor(v), torch.tensor(9.0)).item() for v in (0.25, 1.25, 2.5, 5.0)]
    down = [torch.nextafter(torch.tensor(v), torch.tensor(0.0)).item() for v in (0.75, 1.75, 3.5)]
    assert _codes(up) == [1, 3, 5, 7] and _codes(down) == [1, 3, 5]
    # Saturation at 6 (infinity and NaN too, as TileKernels' reference); the sign survives a round to zero.
    assert _codes([6.5, 1e30, float("inf"), float("nan"), -7.0, -float("inf")]) == [7, 7, 7, 7, 15, 15]
    assert _codes([-0.1, -1e-45, 1e-45, -0.25]) == [8, 8, 0, 8]


def _nearest_even(v: torch.Tensor) -> torch.Tensor:
    """Brute force in float64: the nearest of the eight magnitudes, ties to the even code, past 6 saturating."""
    a = v.double().abs()
    grid = torch.tensor(GRID, dtype=torch.float64)
    d = (a[:, None] - grid).abs()
    best = d.min(-1, keepdim=True).values
    idx = torch.arange(8).expand_as(d)
    tie_even = torch.where(d == best, idx + 8 * (idx % 2), 99).min(-1).values % 8  # the even candidate first
    code = torch.where(a > 6, 7, tie_even)
    return code | torch.where(v.view(torch.int32) < 0, 8, 0)


def test_encode_is_nearest_even_on_a_dense_sweep():
    # Every float32 in [0.125, 8) whose low 13 mantissa bits are 0 or all but one edge pattern, both signs.
    e = torch.arange(124, 130, dtype=torch.int64)
    m = torch.cat([torch.arange(0, 1 << 23, 1 << 13), torch.arange(0, 1 << 23, 1 << 13) + 1,
                   torch.arange(0, 1 << 23, 1 << 13) - 1]).clamp(0, (1 << 23) - 1)
    bits = ((e[:, None] << 23) | m[None, :]).reshape(-1)
    g = torch.Generator().manual_seed(0)
    bits = torch.cat([bits, torch.randint(0, 0x7F800000, (200000,), generator=g, dtype=torch.int64)])
    v = bits.to(torch.int32).view(torch.float32)
    v = torch.cat([v, -v])
    assert torch.equal(_e2m1.encode(v), _nearest_even(v))


def test_pack_layout_and_decode():
    codes = torch.tensor([[1, 2, 15, 8, 7, 0]])
    q = _e2m1.pack(codes)
    assert q.dtype == torch.int8 and q.shape == (1, 3)
    assert q.view(torch.uint8).tolist() == [[0x21, 0x8F, 0x07]]  # the even channel in the low nibble
    assert torch.equal(_e2m1.unpack(q), codes)
    every = torch.arange(16).view(1, 16)
    vals = _e2m1.decode(every)
    assert torch.equal(_e2m1.encode(vals), every)
    assert torch.equal(vals, tk.quant.unpack_from_e2m1fn_x2(_e2m1.pack(every)))  # TileKernels' decoding


def test_cast_back_shares_the_table():
    from tkjit_kernels.quant import cast_back

    assert cast_back.E2M1 is _e2m1.E2M1


# -- the spec -----------------------------------------------------------------------------------------------

def test_specs_validate(spec, colmajor):
    e4m3 = get_spec("per_token_cast")
    for s in (spec, colmajor):
        validate(s)
        assert s.family == "quant" and s.tolerance.exact
        assert s.space == e4m3.space and s.params == e4m3.params
        for ex in s.examples:
            full = s.canonical_shape(ex)
            assert s.default_config(full, "sm_90a") in s.configs(full, "sm_90a")
            assert s.default_config(full, "sm_90a") == e4m3.default_config(full, "sm_90a")
    assert colmajor.outputs[1].dims[1] == Align("num_tokens", 4)
    import tkjit_kernels

    assert tkjit_kernels.INDEX[COLMAJOR] == tkjit_kernels.INDEX[NAME] == "tkjit_kernels.quant.per_token_cast_e2m1"


def test_bad_shapes_and_configs(spec):
    with pytest.raises(ShapeError, match="group=48 must be one of"):
        spec.canonical_shape(_shape(group=48))
    with pytest.raises(ShapeError, match="multiple of 16"):
        spec.canonical_shape(_shape(hidden=200, group=200))
    with pytest.raises(ShapeError, match="in_dtype.*not allowed"):
        spec.canonical_shape(_shape(in_dtype="float16"))
    full = spec.canonical_shape(_shape())
    with pytest.raises(ConfigError, match="not a multiple of vec"):
        spec.check_config(full, {"vec": 16, "group_threads": 4, "threads": 256, "iters": 1})
    with pytest.raises(ConfigError, match="CUDA targets only"):
        spec.check_config(full, spec.default_config(full, "sm_90a"), "cpu")


def test_dims_and_bytes(spec, colmajor):
    full = spec.canonical_shape(_shape(num_tokens=5, hidden=576, group=128))
    (o, odt, odims), (s, sdt, sdims) = spec.output_decls(full)
    assert (o, odt, odims) == ("out", "int8", (5, 288)) and (s, sdt, sdims) == ("scales", "float32", (5, 5))
    assert spec.bytes_moved(full) == 5 * 576 * 2 + 5 * 288 + 5 * 5 * 4
    (_, _, cdims) = colmajor.output_decls(full)[1]
    assert cdims == (5, 8) and colmajor.bytes_moved(full) == 5 * 576 * 2 + 5 * 288 + 5 * 8 * 4


def _ref(spec, x, **kw):
    return spec.reference(spec.canonical_shape({"num_tokens": x.shape[0], "hidden": x.shape[1], **kw}), x)


def test_reference_hand_checked(spec):
    # Group 16: amax 6 -> scale 1, the values' own codes; a zero group -> the clamped amax 6 * 2^-126, scale
    # 2^-126, codes 0 (and 8 for -0.0).
    x = torch.zeros(1, 32)
    x[0, :16] = torch.tensor([6.0, 0.25, -0.75, 1.25, 5.0, 3.5, -2.5, 0.5, 0, 0, 0, 0, 0, 0, 0, 0])
    x[0, 17] = -0.0
    q, sf = _ref(spec, x, group=16, in_dtype="float32")
    assert q.shape == (1, 16) and sf.tolist() == [[1.0, 2.0**-126]]
    assert _e2m1.unpack(q)[0, :8].tolist() == [7, 0, 10, 2, 6, 6, 12, 1]
    assert _e2m1.unpack(q)[0, 16:18].tolist() == [0, 8]
    # Not round: inv = 6 / amax, one IEEE division; values * inv, then encoded.
    y = torch.tensor([[3.0, -1.5, 0.25, 1e-3] * 4])
    q, sf = _ref(spec, y, group=16, in_dtype="float32")
    assert sf.item() == (torch.tensor(3.0) / torch.tensor(6.0)).item()
    assert torch.equal(_e2m1.unpack(q), _e2m1.encode(y * (torch.tensor(6.0) / torch.tensor(3.0))))


def test_reference_round_scale_and_partial_group(spec):
    # amax 3: 3 / 6 = 0.5 (a power of two: kept); amax 5: 5/6 -> 1. hidden 48, group 32: a partial last group.
    y = torch.zeros(1, 48)
    y[0, :32] = 3.0
    y[0, 32:] = torch.tensor([5.0, -2.0] * 8)
    q, sf = _ref(spec, y.bfloat16(), group=32, round_scale=True)
    assert sf.tolist() == [[0.5, 1.0]]
    codes = _e2m1.unpack(q)[0]
    assert (codes[:32] == 7).all() and codes[32:].tolist() == [6, 12] * 8  # 3 * 2 = 6; 5 -> 4 (tie to even)


def test_make_inputs(spec):
    full = spec.canonical_shape(_shape(num_tokens=40, hidden=64, group=16, in_dtype="float32"))
    (x,) = spec.make_inputs(full, "cpu", 3)
    assert x.dtype == torch.float32 and x.shape == (40, 64) and (x[5] == 0).all()
    q, sf = spec.reference(full, x)
    codes = _e2m1.unpack(q)
    for row in (7, 9):  # the ties at scale 1 and 2^-100: the same codes
        assert codes[row, :16].tolist() == [0, 10, 2, 12, 4, 14, 6, 15, 0, 8, 0, 9, 7, 6, 5, 1]
    assert (sf[7] == 1).all() and (sf[9] == 2.0**-100).all() and (sf[13] == 2.0**-126).all()


@pytest.mark.parametrize("n,padded", [(1, 4), (5, 8), (8, 8)])
def test_colmajor_reference(spec, colmajor, n, padded):
    full = spec.canonical_shape(_shape(num_tokens=n))
    (x,) = spec.make_inputs(full, "cpu", 0)
    q, sf = spec.reference(full, x)
    cq, storage = colmajor.reference(full, x)
    assert torch.equal(q, cq) and storage.shape == (8, padded) and storage.is_contiguous()
    assert torch.equal(storage[:, :n], sf.T) and (storage[:, n:] == 0).all()


# -- the torch ops and tkjit.ops ------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 37])
@pytest.mark.parametrize("layout", ["row", "col", "packed"])
def test_ops_layouts(reference_kernels, n, layout):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, 576, generator=g) * 3).bfloat16()
    packed = layout == "packed"
    q, sf = tkjit.ops.per_token_cast_e2m1(x, 32, round_scale=packed, col_major_scales=layout != "row",
                                          packed_ue8m0=packed)
    assert q.dtype == torch.int8 and q.shape == (n, 288) and q.is_contiguous()
    want_q, sf_row = get_spec(NAME).reference(get_spec(NAME).canonical_shape(
        _shape(num_tokens=max(n, 1), hidden=576, round_scale=packed)), x)
    assert torch.equal(q, want_q)
    padded = -(-n // 4) * 4
    if layout != "packed":
        assert sf.dtype == torch.float32 and sf.shape == (n, 18) and torch.equal(sf, sf_row)
        if n and layout == "col":
            assert sf.stride() == (1, padded)
    else:
        assert sf.dtype == torch.int32 and sf.shape == (n, 5)
        if n:
            assert sf.stride() == (1, padded)
            exps = torch.nn.functional.pad(sf_row.view(torch.int32) >> 23, (0, 2)).view(n, 5, 4)
            want = exps[..., 0] | exps[..., 1] << 8 | exps[..., 2] << 16 | exps[..., 3] << 24
            assert torch.equal(sf, want.to(torch.int32))


def test_ops_bad_inputs(reference_kernels):
    with pytest.raises(ShapeError, match="packed_ue8m0 needs col_major_scales"):
        tkjit.ops.per_token_cast_e2m1(torch.zeros(4, 64), 32, packed_ue8m0=True)
    with pytest.raises(ShapeError, match="multiple of 16"):
        tkjit.ops.per_token_cast_e2m1(torch.zeros(4, 72), 72)
    with pytest.raises(ShapeError, match="in_dtype"):
        tkjit.ops.per_token_cast_e2m1(torch.zeros(4, 64, dtype=torch.float16), 32)
    with pytest.raises(TensorError, match="2-D"):
        tkjit.ops.per_token_cast_e2m1(torch.zeros(4, 4, 64), 32)


@pytest.mark.parametrize("n", [0, 5])
def test_fake_impls(n):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(n, 576, dtype=torch.bfloat16))
        q, s = torch.ops.tkjit.per_token_cast_e2m1(x, 128)
        _, storage = torch.ops.tkjit.per_token_cast_e2m1_colmajor(x, 32, True)
        q2, s2 = tkjit.ops.per_token_cast_e2m1(x, 32, col_major_scales=True, packed_ue8m0=True, round_scale=True)
    assert q.shape == (n, 288) and q.dtype == torch.int8 and s.shape == (n, 5) and s.dtype == torch.float32
    assert storage.shape == (18, -(-n // 4) * 4) and storage.dtype == torch.float32
    assert q2.shape == (n, 288) and s2.shape == (n, 5) and s2.dtype == torch.int32


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("name,n,dtype", [(NAME, 37, torch.bfloat16), (COLMAJOR, 5, torch.float32),
                                          (NAME, 0, torch.float32)])
def test_opcheck(reference_kernels, name, n, dtype):
    x = (torch.randn(n, 64, generator=torch.Generator().manual_seed(0)) * 5).to(dtype)
    op = getattr(torch.ops.tkjit, name).default
    result = torch.library.opcheck(op, (x, 32, True), test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result


def test_torch_compile_traces(reference_kernels):
    x = torch.randn(9, 64) * 2

    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        return tkjit.ops.per_token_cast_e2m1(x, 16, col_major_scales=True)

    q, sf = f(x)
    q2, sf2 = tkjit.ops.per_token_cast_e2m1(x, 16, col_major_scales=True)
    assert torch.equal(q, q2) and torch.equal(sf, sf2)


# -- TileKernels' per_token_cast(fmt='e2m1') --------------------------------------------------------------------

def test_compat_signatures_match_tile_kernels():
    params = ["x", "fmt", "num_per_channels", "x_block_size", "use_tma_aligned_col_major_sf", "round_sf",
              "use_packed_ue8m0"]
    defaults = [None, False, False, False]
    for f in (tk.quant.per_token_cast, tk.quant.per_token_cast_with_sf_only):
        sig = inspect.signature(f)
        assert list(sig.parameters) == params
        assert [p.default for p in sig.parameters.values()][3:] == defaults


@pytest.mark.parametrize("n", [0, 37])
@pytest.mark.parametrize("col_major,round_sf,packed", [(False, False, False), (False, True, False),
                                                       (True, False, False), (True, True, True)])
@pytest.mark.parametrize("group", [16, 32, 128, 576])
def test_compat_layouts(reference_kernels, n, col_major, round_sf, packed, group):
    """The dtypes, shapes and strides TileKernels' per_token_cast(fmt='e2m1') returns."""
    x = (torch.randn(n, 576) * 3).bfloat16()
    q, sf = tk.quant.per_token_cast(x, "e2m1", group, use_tma_aligned_col_major_sf=col_major, round_sf=round_sf,
                                    use_packed_ue8m0=packed)
    ng = -(-576 // group)
    assert q.dtype == torch.int8 and q.shape == (n, 288) and q.stride() == (288, 1)
    assert sf.dtype == (torch.int32 if packed else torch.float32)
    assert sf.shape == (n, -(-ng // 4) if packed else ng)
    if n and col_major:
        assert sf.stride() == (1, 40)
    elif n:
        assert sf.stride() == (ng, 1)
    q2, sf2 = tkjit.ops.per_token_cast_e2m1(x, group, round_scale=round_sf)
    assert torch.equal(q, q2)
    if not packed:
        assert torch.equal(sf, sf2)
    sf_only = tk.quant.per_token_cast_with_sf_only(x, "e2m1", group, use_tma_aligned_col_major_sf=col_major,
                                                   round_sf=round_sf, use_packed_ue8m0=packed)
    assert torch.equal(sf_only, sf) and sf_only.stride() == sf.stride()


@pytest.mark.parametrize("col_major,round_sf,packed", [(False, False, False), (True, False, False),
                                                       (True, True, True)])
def test_compat_round_trip_through_cast_back(reference_kernels, col_major, round_sf, packed):
    """per_token_cast(e2m1) -> per_token_cast_back: the codes' values times their scales, close to x."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 256, generator=g) * torch.exp(torch.randn(37, 1, generator=g))
    q, sf = tk.quant.per_token_cast(x, "e2m1", 32, use_tma_aligned_col_major_sf=col_major, round_sf=round_sf,
                                    use_packed_ue8m0=packed)
    back = tk.quant.per_token_cast_back((q, sf), "fp32", 32)
    _, sf_row = tkjit.ops.per_token_cast_e2m1(x, 32, round_scale=round_sf)
    want = _e2m1.decode(_e2m1.unpack(q)) * sf_row.repeat_interleave(32, 1)
    assert torch.equal(back, want)
    # Half a step of the coarsest e2m1 spacing (2, between 4 and 6) times the scale bounds the error.
    assert ((back - x).abs() <= sf_row.repeat_interleave(32, 1) * 1.0 + 1e-30).all()


@pytest.mark.parametrize("call, error, match", [
    (lambda: tk.quant.per_token_cast(torch.zeros(4, 256), "e2m1", 48), ShapeError, "num_per_channels=48"),
    (lambda: tk.quant.per_token_cast(torch.zeros(4, 96), "e2m1", 96), ShapeError, "multiple of 64"),
    (lambda: tk.quant.per_token_cast(torch.zeros(4, 256), "e2m1", 32, None, False, True, True), ShapeError,
     "use_packed_ue8m0=True needs use_tma_aligned_col_major_sf=True"),
    (lambda: tk.quant.per_token_cast(torch.zeros(4, 256, dtype=torch.float16), "e2m1", 32), TensorError,
     "x must be"),
    (lambda: tk.quant.per_token_cast(torch.zeros(4, 256), "e2m1", "32"), ShapeError, "must be an int"),
])
def test_compat_refuses_what_tile_kernels_refuses(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_compat_hidden_tkjit_does_not_take():
    # hidden 200 is not a multiple of 16: tkjit's kernel does not take it (NotImplementedError, naming it).
    with pytest.raises(NotImplementedError, match=r"hidden \(x.shape\[1\]\)=200"):
        tk.quant.per_token_cast(torch.zeros(4, 200), "e2m1", 16)


# -- x_block_size: re-casting a quantised (values, scales) input ---------------------------------------------------

@pytest.fixture
def all_reference_kernels(monkeypatch):
    serve_references(monkeypatch, (NAME, COLMAJOR, "per_token_cast", "per_token_cast_colmajor", "cast_back",
                                   "cast_back_colmajor"))


def _dequant(values, sf_row, block):
    """TileKernels' reference dequantisation: float32 values times their block's float32 scale, one rounding."""
    v = _e2m1.decode(_e2m1.unpack(values)) if values.dtype == torch.int8 else values.float()
    s = sf_row.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: v.shape[0], : v.shape[1]]
    return v * s


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
@pytest.mark.parametrize("in_fmt,in_layout", [("e4m3", "row"), ("e4m3", "packed"), ("e2m1", "col"),
                                              ("e4m3", "block")])
def test_x_block_size_recasts_the_dequantised_input(all_reference_kernels, fmt, in_fmt, in_layout):
    g = torch.Generator().manual_seed(3)
    n, h = 37, 512
    x = (torch.randn(n, h, generator=g) * torch.exp(torch.randn(n, 1, generator=g))).bfloat16()
    if in_layout == "block":  # (128, 128) blocks, scales not powers of two, built by hand
        block = (128, 128)
        values = (torch.randn(n, h, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        sf_row = torch.rand(1, 4, generator=g) + 0.5
        sf = sf_row
    else:
        block = (1, 128 if in_fmt == "e4m3" else 32)
        col, packed = in_layout != "row", in_layout == "packed"
        values, sf = tk.quant.per_token_cast(x, in_fmt, block[1], use_tma_aligned_col_major_sf=col, round_sf=packed,
                                             use_packed_ue8m0=packed)
        _, sf_row = tk.quant.per_token_cast(x, in_fmt, block[1], round_sf=packed)
    want_x = _dequant(values, sf_row, block)
    for col, round_sf, packed in ((False, False, False), (True, True, True)):
        q, out_sf = tk.quant.per_token_cast((values, sf), fmt, 32, block, col, round_sf, packed)
        want_q, want_sf = tk.quant.per_token_cast(want_x, fmt, 32, None, col, round_sf, packed)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(out_sf, want_sf)
        assert out_sf.stride() == want_sf.stride()
        sf_only = tk.quant.per_token_cast_with_sf_only((values, sf), fmt, 32, block, col, round_sf, packed)
        assert torch.equal(sf_only, want_sf)


@pytest.mark.parametrize("call, error, match", [
    (lambda: tk.quant.per_token_cast((torch.zeros(4, 256, dtype=torch.float8_e4m3fn), torch.ones(4, 2)), "e2m1",
                                     32), ShapeError, "needs x_block_size"),
    (lambda: tk.quant.per_token_cast(torch.zeros(4, 256), "e2m1", 32, (1, 128)), ShapeError,
     r"for a \(values, scales\) x only"),
    (lambda: tk.quant.per_token_cast((torch.zeros(4, 256, dtype=torch.float8_e4m3fn), torch.ones(4, 3)), "e2m1",
                                     32, (1, 128)), TensorError, r"x\[1\] \(scales\) has shape \(4, 3\)"),
    (lambda: tk.quant.per_token_cast((torch.zeros(4, 256), torch.ones(4, 2)), "e2m1", 32, (1, 128)), TensorError,
     r"x\[0\] \(values\) must be"),
    (lambda: tk.quant.per_token_cast((torch.zeros(4, 256, dtype=torch.uint8), torch.ones(4, 2)), "e4m3", 32,
                                     (1, 128)), NotImplementedError, "x\\[0\\].dtype=torch.uint8"),
])
def test_x_block_size_refusals(call, error, match):
    with pytest.raises(error, match=match):
        call()


# -- sm_90a cross-compiles ------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name,shape,config", [
    (NAME, {"hidden": 7168, "group": 32}, None),
    (NAME, {"hidden": 576, "group": 128, "in_dtype": "float32", "round_scale": True}, None),  # partial group
    (NAME, {"hidden": 7168, "group": 7168}, None),  # cross-warp amax
    (COLMAJOR, {"hidden": 4096, "group": 16}, {"vec": 16, "group_threads": 1, "threads": 128, "iters": 4}),
])
def test_compiles_for_sm90a(cache_dir, name, shape, config):
    k = tkjit.get(name, {"num_tokens": 4001, **shape}, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    assert "__fdiv_rn" in src  # IEEE divisions whatever the fast-math setting
    assert "2097151" in src  # the rounding add of the encoding
    store = {2: "*(char2*)(out + ", 4: "*(int*)(out + ", 8: "*(int2*)(out + "}[k.config["vec"] // 2]
    assert store in src
    assert src.count("scales[") == (2 if name == COLMAJOR else 1)
