"""per_token_cast_e5m6(_colmajor) specs on the CPU: the e5m6 format (`_e5m6`: rounding, packing, decoding, hand
checked), shapes, constraints, reference semantics, scale layouts, the torch ops (fake, opcheck), tkjit.ops,
TileKernels' per_token_cast(fmt='e5m6'), sm_90a cross-compiles. The kernels are CUDA-only: the ops run here as
CompiledKernels that write the reference (tests/helpers/reference_kernels.py)."""

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
from tkjit_kernels.quant import _e5m6

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from quant_checks import layout_fixtures  # noqa: E402

NAME, COLMAJOR = "per_token_cast_e5m6", "per_token_cast_e5m6_colmajor"
HIDDENS = (576, 2048, 2560, 3072, 4096, 6144, 7168)  # TileKernels' test hidden sizes

spec, colmajor, reference_kernels = layout_fixtures(NAME, COLMAJOR, (NAME, COLMAJOR))



def _shape(**kw):
    return {"num_tokens": 16, "hidden": 256, **kw}


def _codes(values):
    return _e5m6.encode(torch.tensor(values, dtype=torch.float32)).tolist()


# -- the format ---------------------------------------------------------------------------------------------

def test_encode_hand_checked():
    # The top 12 bits of the float16: 1.0 = 0x3C00, 65024 = 0x7BF0 (the largest finite), -2 = 0xC000; the
    # smallest subnormal 2^-20 = 0x0010, the largest 2^-14 * 63/64 = 0x03F0, the smallest normal 2^-14 = 0x0400.
    assert _codes([1.0, 65024.0, -2.0, 0.0, -0.0]) == [0x3C0, 0x7BF, 0xC00, 0x000, 0x800]
    assert _codes([2.0**-20, 2.0**-14 * 63 / 64, 2.0**-14]) == [0x001, 0x03F, 0x040]
    # Round to nearest even on the dropped bits: ties go to the even code.
    assert _codes([1 + 2**-7, 1 + 3 * 2**-7, 1 + 2**-7 + 2**-20, 1 + 2**-7 - 2**-20]) == [0x3C0, 0x3C2, 0x3C1, 0x3C0]
    assert _codes([-(1 + 3 * 2**-7)]) == [0xBC2]
    # Rounding carries into the exponent: 2 - 2^-7 is a tie above the largest mantissa (odd) -> 2.0.
    assert _codes([2 - 2**-7]) == [0x400]
    # Past 65024: the largest finite rounds up to infinity (0x7C0) from 65024 + 256 on (the tie, odd code).
    assert _codes([65024.0 + 255, 65024.0 + 256, 70000.0, float("inf")]) == [0x7BF, 0x7C0, 0x7C0, 0x7C0]
    # Below the smallest subnormal: truncated to zero, then rounded on the float32's low 17 bits (TileKernels).
    assert _codes([2.0**-21, 2.0**-30, -(2.0**-30)]) == [0x000, 0x000, 0x800]


def test_pack_layout_hand_checked():
    # Eight codes form a big-endian 96-bit stream split into three words, each stored little-endian.
    codes = torch.tensor([[0x123, 0x456, 0x789, 0xABC, 0xDEF, 0x012, 0x345, 0x678]])
    words = _e5m6.pack(codes)
    assert words.dtype == torch.int32 and words.shape == (1, 3)
    assert [w & 0xFFFFFFFF for w in words[0].tolist()] == [0x12345678, 0x9ABCDEF0, 0x12345678]
    assert _e5m6.as_bytes(words)[0, :4].tolist() == [0x78, 0x56, 0x34, 0x12]
    assert torch.equal(_e5m6.unpack(words), codes)


def test_decode_every_code():
    codes = torch.arange(4096).view(512, 8)
    assert torch.equal(_e5m6.unpack(_e5m6.pack(codes)), codes)
    vals = _e5m6.decode(codes.reshape(-1))
    want = ((codes.reshape(-1) << 4).to(torch.int32) & 0xFFFF).to(torch.uint16).view(torch.float16).float()
    assert torch.equal(vals.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(vals[finite].view(torch.int32), want[finite].view(torch.int32))
    # Every finite code encodes back to itself.
    assert torch.equal(_e5m6.encode(vals[finite]), codes.reshape(-1)[finite])


def test_encode_is_the_nearest_value():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-12, 15, (4096,), generator=g).float())
    back = _e5m6.decode(_e5m6.encode(v))
    # |v| in the normal range: relative error at most half a unit in the 6-bit mantissa.
    normal = v.abs() >= 2.0**-14
    assert ((back - v).abs()[normal] <= v.abs()[normal] * 2.0**-7).all()


# -- the spec -----------------------------------------------------------------------------------------------

def test_specs_validate(spec, colmajor):
    for s in (spec, colmajor):
        validate(s)
        assert s.family == "quant" and s.tolerance.exact
        for ex in s.examples:
            full = s.canonical_shape(ex)
            assert s.default_config(full, "sm_90a") in s.configs(full, "sm_90a")
    assert colmajor.space == spec.space
    assert colmajor.outputs[1].dims == (1, Align("num_tokens", 4))
    import tkjit_kernels

    assert tkjit_kernels.INDEX[COLMAJOR] == tkjit_kernels.INDEX[NAME] == "tkjit_kernels.quant.per_token_cast_e5m6"


@pytest.mark.parametrize("in_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("hidden", HIDDENS + (8, 24, 64, 1000, 65536))
def test_defaults_valid(spec, in_dtype, hidden):
    full = spec.canonical_shape(_shape(hidden=hidden, in_dtype=in_dtype))
    cfg = spec.default_config(full, "sm_90a")
    assert spec.check_config(full, cfg, "sm_90a") == cfg
    if hidden in HIDDENS:  # about 32 elements per thread, 8-channel chunks (TileKernels' layout)
        assert cfg["vec"] == 8 and 16 <= -(-hidden // 8 // cfg["group_threads"]) * 8 <= 64


def test_bad_shapes(spec):
    with pytest.raises(ShapeError, match="multiple of 8"):
        spec.canonical_shape(_shape(hidden=12))
    with pytest.raises(ShapeError, match="below its minimum 8"):
        spec.canonical_shape(_shape(hidden=0))
    with pytest.raises(ShapeError, match="in_dtype.*not allowed"):
        spec.canonical_shape(_shape(in_dtype="float16"))
    with pytest.raises(ShapeError, match="must be a bool"):
        spec.canonical_shape(_shape(round_scale=1))


def test_bad_configs(spec):
    full = spec.canonical_shape(_shape(in_dtype="float32"))
    with pytest.raises(ConfigError, match="at most 64 bytes"):
        spec.check_config(full, {"vec": 32, "group_threads": 4, "threads": 256, "iters": 1})
    with pytest.raises(ConfigError, match="more than the 16 chunks"):
        spec.check_config(full, {"vec": 16, "group_threads": 32, "threads": 256, "iters": 1})
    with pytest.raises(ConfigError, match="spill"):
        spec.check_config(spec.canonical_shape(_shape(hidden=4096)),
                          {"vec": 16, "group_threads": 16, "threads": 256, "iters": 1})
    with pytest.raises(ConfigError, match="not a multiple of vec=16"):
        spec.check_config(spec.canonical_shape(_shape(hidden=24)),
                          {"vec": 16, "group_threads": 1, "threads": 256, "iters": 1})
    with pytest.raises(ConfigError, match="CUDA targets only"):
        spec.check_config(full, spec.default_config(full, "sm_90a"), "cpu")


def test_dims_and_bytes(spec, colmajor):
    full = spec.canonical_shape(_shape(num_tokens=5, hidden=576))
    (o, odt, odims), (s, sdt, sdims) = spec.output_decls(full)
    assert (o, odt, odims) == ("out", "int32", (5, 216)) and (s, sdt, sdims) == ("scales", "float32", (5, 1))
    assert spec.bytes_moved(full) == 5 * 576 * 2 + 5 * 864 + 5 * 4
    (_, _, cdims) = colmajor.output_decls(full)[1]
    assert cdims == (1, 8) and colmajor.bytes_moved(full) == 5 * 576 * 2 + 5 * 864 + 8 * 4


def _ref(spec, x, **kw):
    return spec.reference(spec.canonical_shape({"num_tokens": x.shape[0], "hidden": x.shape[1], **kw}), x)


def test_reference_hand_checked(spec):
    # amax 65024: scale 1, the values themselves; a zero row: the clamped amax 1e-4, all codes 0.
    x = torch.zeros(2, 8)
    x[0] = torch.tensor([65024.0, 1.0, -2.0, 1 + 3 * 2**-7, 0.0, -0.0, 2.0**-20, -65024.0])
    words, sf = _ref(spec, x, in_dtype="float32")
    assert sf.shape == (2, 1) and sf.dtype == torch.float32
    assert sf[0].item() == 1.0
    assert sf[1].item() == (torch.tensor(1e-4) / torch.tensor(65024.0)).item()
    assert _e5m6.unpack(words)[0].tolist() == [0x7BF, 0x3C0, 0xC00, 0x3C2, 0x000, 0x800, 0x001, 0xFBF]
    assert (words[1] == 0).all()
    # Not round: inv = 65024 / amax, one IEEE division; values * inv, then encoded.
    y = torch.tensor([[3.0, -1.5, 0.25, 0, 0, 0, 0, 1e-3]])
    words, sf = _ref(spec, y, in_dtype="float32")
    assert sf.item() == (torch.tensor(3.0) / torch.tensor(65024.0)).item()
    inv = torch.tensor(65024.0) / torch.tensor(3.0)
    assert torch.equal(_e5m6.unpack(words), _e5m6.encode(y * inv).view(1, 8))


def test_reference_round_scale(spec):
    # amax 3: 3 / 65024 = 4.6e-5 -> 2^-14 (the power of two above); values scaled by exactly 2^14.
    y = torch.tensor([[3.0, -1.5, 0.25, 0, 0, 0, 0, 1e-3]]).bfloat16()
    words, sf = _ref(spec, y, round_scale=True)
    assert sf.item() == 2.0**-14
    assert torch.equal(_e5m6.unpack(words), _e5m6.encode(y.float() * 2.0**14).view(1, 8))
    # A scale that is a power of two stays: amax 65024 * 2^-3.
    assert _ref(spec, torch.full((1, 8), 65024.0 * 2**-3), round_scale=True, in_dtype="float32")[1].item() == 2.0**-3


def test_reference_dequantises_close(spec):
    full = spec.canonical_shape(_shape(num_tokens=40, hidden=576))
    (x,) = spec.make_inputs(full, "cpu", 1)
    words, sf = spec.reference(full, x)
    back = _e5m6.decode(_e5m6.unpack(words)) * sf
    big = x.float().abs() >= sf * 2.0**-14  # values in e5m6's normal range after scaling
    assert ((back - x.float()).abs()[big] <= x.float().abs()[big] * 2.0**-7).all()


def test_make_inputs(spec):
    full = spec.canonical_shape(_shape(num_tokens=40, hidden=576))
    (x,) = spec.make_inputs(full, "cpu", 3)
    assert x.dtype == torch.bfloat16 and x.shape == (40, 576)
    assert (x[5] == 0).all() and x[3].abs().max() < 1e-4
    for row, value in zip((7, 9, 11), (2.0**-20, 2.0**-14 * 63 / 64, 2.0**-14)):
        assert (x[row, :-1] == value).all() and x[row, -1] == 65024.0
    words, sf = spec.reference(full, x)
    assert sf[7].item() == 1.0 and (_e5m6.unpack(words)[7, :-1] == 1).all()  # the smallest subnormal code
    (y,) = spec.make_inputs({**full, "in_dtype": "float32"}, "cpu", 3)
    assert y.dtype == torch.float32


@pytest.mark.parametrize("n,padded", [(1, 4), (5, 8), (8, 8)])
def test_colmajor_reference(spec, colmajor, n, padded):
    full = spec.canonical_shape(_shape(num_tokens=n))
    (x,) = spec.make_inputs(full, "cpu", 0)
    words, sf = spec.reference(full, x)
    cwords, storage = colmajor.reference(full, x)
    assert torch.equal(words, cwords) and storage.shape == (1, padded) and storage.is_contiguous()
    assert torch.equal(storage[0, :n], sf[:, 0]) and (storage[0, n:] == 0).all()


# -- the torch ops and tkjit.ops ------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 37])
@pytest.mark.parametrize("layout", ["row", "col", "packed"])
def test_ops_layouts(reference_kernels, n, layout):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, 576, generator=g) * 3).bfloat16()
    packed = layout == "packed"
    q, sf = tkjit.ops.per_token_cast_e5m6(x, round_scale=packed, col_major_scales=layout != "row",
                                          packed_ue8m0=packed)
    assert q.dtype == torch.uint8 and q.shape == (n, 864) and q.is_contiguous()
    words, sf_row = get_spec(NAME).reference(get_spec(NAME).canonical_shape(_shape(num_tokens=max(n, 1),
                                                                                    hidden=576, round_scale=packed)), x)
    assert torch.equal(q, _e5m6.as_bytes(words))
    padded = -(-n // 4) * 4
    if layout == "row":
        assert sf.dtype == torch.float32 and sf.shape == (n, 1) and torch.equal(sf, sf_row)
    elif layout == "col":
        assert sf.dtype == torch.float32 and sf.shape == (n, 1) and torch.equal(sf, sf_row)
        if n:
            assert sf.stride() == (1, padded)
    else:
        assert sf.dtype == torch.int32 and sf.shape == (n, 1)
        if n:
            assert sf.stride() == (1, padded)
            assert torch.equal(sf[:, 0], (sf_row[:, 0].view(torch.int32) >> 23))  # exponent byte 0, rest 0


def test_ops_bad_inputs(reference_kernels):
    with pytest.raises(ShapeError, match="packed_ue8m0 needs col_major_scales"):
        tkjit.ops.per_token_cast_e5m6(torch.zeros(4, 64), packed_ue8m0=True)
    with pytest.raises(ShapeError, match="multiple of 8"):
        tkjit.ops.per_token_cast_e5m6(torch.zeros(4, 68))
    with pytest.raises(ShapeError, match="in_dtype"):
        tkjit.ops.per_token_cast_e5m6(torch.zeros(4, 64, dtype=torch.float16))
    with pytest.raises(TensorError, match="2-D"):
        tkjit.ops.per_token_cast_e5m6(torch.zeros(4, 4, 64))


@pytest.mark.parametrize("n", [0, 5])
def test_fake_impls(n):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(n, 576, dtype=torch.bfloat16))
        words, s = torch.ops.tkjit.per_token_cast_e5m6(x)
        _, storage = torch.ops.tkjit.per_token_cast_e5m6_colmajor(x, True)
        q, s2 = tkjit.ops.per_token_cast_e5m6(x, col_major_scales=True, packed_ue8m0=True, round_scale=True)
    assert words.shape == (n, 216) and words.dtype == torch.int32 and s.shape == (n, 1)
    assert storage.shape == (1, -(-n // 4) * 4) and storage.dtype == torch.float32
    assert q.shape == (n, 864) and q.dtype == torch.uint8 and s2.shape == (n, 1) and s2.dtype == torch.int32


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("name,n,dtype", [(NAME, 37, torch.bfloat16), (COLMAJOR, 5, torch.float32),
                                          (NAME, 0, torch.float32)])
def test_opcheck(reference_kernels, name, n, dtype):
    x = (torch.randn(n, 64, generator=torch.Generator().manual_seed(0)) * 5).to(dtype)
    op = getattr(torch.ops.tkjit, name).default
    result = torch.library.opcheck(op, (x, True), test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result


def test_torch_compile_traces(reference_kernels):
    x = torch.randn(9, 64) * 2

    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        return tkjit.ops.per_token_cast_e5m6(x, col_major_scales=True)

    q, sf = f(x)
    q2, sf2 = tkjit.ops.per_token_cast_e5m6(x, col_major_scales=True)
    assert torch.equal(q, q2) and torch.equal(sf, sf2)


# -- TileKernels' per_token_cast(fmt='e5m6') --------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 37])
@pytest.mark.parametrize("col_major,round_sf,packed", [(False, False, False), (False, True, False),
                                                       (True, False, False), (True, True, True)])
def test_compat_layouts(reference_kernels, n, col_major, round_sf, packed):
    """The dtypes, shapes and strides TileKernels' per_token_cast_to_e5m6 returns."""
    x = (torch.randn(n, 576) * 3).bfloat16()
    q, sf = tk.quant.per_token_cast(x, "e5m6", 576, use_tma_aligned_col_major_sf=col_major, round_sf=round_sf,
                                    use_packed_ue8m0=packed)
    assert q.dtype == torch.uint8 and q.shape == (n, 864) and q.stride() == (864, 1)
    assert sf.dtype == (torch.int32 if packed else torch.float32) and sf.shape == (n, 1)
    if n:
        assert sf.stride() == ((1, 40) if col_major else (1, 1))
    q2, sf2 = tkjit.ops.per_token_cast_e5m6(x, round_scale=round_sf)
    assert torch.equal(q, q2)
    if not packed:
        assert torch.equal(sf, sf2)


@pytest.mark.parametrize("call, error, match", [
    (lambda: tk.quant.per_token_cast(torch.zeros(4, 256), "e5m6", 128), ShapeError, r"num_per_channels == hidden"),
    (lambda: tk.quant.per_token_cast(torch.zeros(4, 256), "e5m6", 256, (1, 128)), ShapeError, "no x_block_size"),
    (lambda: tk.quant.per_token_cast(torch.zeros(4, 260), "e5m6", 260), ShapeError, "multiple of 8"),
    (lambda: tk.quant.per_token_cast(torch.zeros(4, 256), "e5m6", 256, None, False, True, True), ShapeError,
     "use_packed_ue8m0=True needs use_tma_aligned_col_major_sf=True"),
    (lambda: tk.quant.per_token_cast(torch.zeros(4, 256, dtype=torch.float16), "e5m6", 256), TensorError,
     "x must be"),
    (lambda: tk.quant.per_token_cast(torch.zeros(4, 256), "e5m6", "256"), ShapeError, "must be an int"),
    (lambda: tk.quant.per_token_cast_with_sf_only(torch.zeros(4, 256), "e5m6", 256), ShapeError,
     "no scales-only form"),
])
def test_compat_refuses_what_tile_kernels_refuses(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_compat_precomputed_sf_refuses_e5m6():
    # TileKernels asserts sf is None for e5m6: a ShapeError naming the op, not NotImplementedError
    with pytest.raises(ShapeError, match="per_token_cast_with_precomputed_sf: fmt='e5m6' takes no precomputed sf"):
        tk.quant.per_token_cast_with_precomputed_sf(torch.zeros(4, 256), "e5m6", 256, torch.ones(4, 1))


# -- sm_90a cross-compiles ------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name,shape,config", [
    (NAME, {"hidden": 7168}, None),  # bf16, a guarded last chunk slot, cross-warp reduction
    (NAME, {"hidden": 4096, "in_dtype": "float32", "round_scale": True}, None),
    (NAME, {"hidden": 576}, {"vec": 8, "group_threads": 8, "threads": 128, "iters": 4}),
    (COLMAJOR, {"hidden": 576, "round_scale": True}, {"vec": 32, "group_threads": 8, "threads": 128, "iters": 1}),
])
def test_compiles_for_sm90a(cache_dir, name, shape, config):
    k = tkjit.get(name, {"num_tokens": 4001, **shape}, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    assert "__fdiv_rn" in src  # IEEE divisions whatever the fast-math setting
    assert "131071" in src  # the rounding's 17 low bits
    wv = k.config["vec"] // 8
    store = {1: "out[", 2: "*(int2*)(out + ", 4: "*(int4*)(out + "}[wv]
    assert store in src
    assert src.count("scales[") == (2 if name == COLMAJOR else 1)
