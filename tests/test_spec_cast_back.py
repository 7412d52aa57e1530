"""cast_back(_colmajor) specs on the CPU: shapes, constraints, reference semantics (e4m3 / e2m1 values, float32 /
packed UE8M0 scales, partial blocks), the torch ops (fake, opcheck), tkjit.ops, the TileKernels entry points,
sm_90a cross-compiles. The kernels are CUDA-only: the ops run here as CompiledKernels that write the reference."""

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
from tkjit.spec import validate
from tkjit_kernels.quant.cast_back import E2M1, unpack_ue8m0

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from quant_checks import float_equal as _equal  # noqa: E402
from quant_checks import layout_fixtures

NAME, COLMAJOR = "cast_back", "cast_back_colmajor"
CUDA_ONLY = (NAME, COLMAJOR, "per_token_cast", "per_token_cast_colmajor")

spec, colmajor, reference_kernels = layout_fixtures(NAME, COLMAJOR, CUDA_ONLY)



def _shape(n=16, **kw):
    bt = kw.get("block_tokens", 1)
    return {"num_tokens": n, "num_sf_rows": -(-n // bt), "hidden": 256, **kw}


# -- the spec -----------------------------------------------------------------------------------------

def test_specs_validate(spec, colmajor):
    import tkjit_kernels

    for s in (spec, colmajor):
        validate(s)
        assert s.family == "quant" and s.tolerance.exact
        for ex in s.examples:
            full = s.canonical_shape(ex)
            assert s.default_config(full, "sm_90a") in s.configs(full, "sm_90a")
        assert tkjit_kernels.INDEX[s.name] == "tkjit_kernels.quant.cast_back"
    assert spec.space == colmajor.space
    # num_sf_rows follows num_tokens: it adds no tuning bucket
    assert spec.bucket(spec.canonical_shape(_shape(5000, block_tokens=128))) == {"num_tokens": 8192, "num_sf_rows": 1}


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("hidden,bt,bc", [(7168, 1, 128), (7168, 128, 128), (7168, 32, 32), (4096, 1, 32),
                                          (576, 1, 128), (576, 1, 576), (7168, 1, 7168), (64, 1, 16), (256, 1, 8),
                                          (256, 1, 4), (256, 1, 1), (4096, 1, 16), (64, 1, 64), (16, 1, 16)])
def test_defaults_valid(spec, fmt, hidden, bt, bc):
    full = spec.canonical_shape(_shape(4001, hidden=hidden, block_tokens=bt, block_channels=bc, in_fmt=fmt))
    cfg = spec.default_config(full, "sm_90a")
    assert spec.check_config(full, cfg, "sm_90a") == cfg
    if bc % 16 == 0 and hidden % 32 == 0:  # 16-byte input loads where the groups allow
        assert cfg["vec"] == (16 if fmt == "e4m3" else 32)


def test_default_iters_follow_size(spec):
    small = spec.default(spec.canonical_shape(_shape(16, hidden=7168)))
    large = spec.default(spec.canonical_shape(_shape(32768, hidden=7168)))
    assert small["iters"] == 1 and large["iters"] == 4


def test_bad_shapes(spec, colmajor):
    with pytest.raises(ShapeError, match="multiple of 16"):
        spec.canonical_shape(_shape(hidden=200))
    with pytest.raises(ShapeError, match="block_channels=12 must be a multiple of 8 or divide 8"):
        spec.canonical_shape(_shape(block_channels=12))
    with pytest.raises(ShapeError, match=r"num_sf_rows=5 must be ceil\(num_tokens / block_tokens\)"):
        spec.canonical_shape({**_shape(300, block_tokens=128), "num_sf_rows": 5})
    with pytest.raises(ShapeError, match="row-major scales are float32"):
        spec.canonical_shape(_shape(sf_dtype="int32"))
    colmajor.canonical_shape(_shape(sf_dtype="int32"))  # packed UE8M0: column-major only
    with pytest.raises(ShapeError, match="in_fmt.*not allowed"):
        spec.canonical_shape(_shape(in_fmt="e5m6"))
    with pytest.raises(ShapeError, match="out_dtype.*not allowed"):
        spec.canonical_shape(_shape(out_dtype="float16"))
    with pytest.raises(ShapeError, match="'block_tokens'=0 below its minimum 1"):
        spec.canonical_shape({**_shape(), "block_tokens": 0})


def test_bad_configs(spec):
    full = spec.canonical_shape(_shape())
    with pytest.raises(ConfigError, match="16-byte load"):
        spec.check_config(full, {"vec": 32, "threads": 256, "iters": 1})
    with pytest.raises(ConfigError, match="one group or hold whole groups"):
        spec.check_config(spec.canonical_shape(_shape(block_channels=24, hidden=48 * 4)),
                          {"vec": 16, "threads": 256, "iters": 1})
    with pytest.raises(ConfigError, match="not a multiple of vec"):
        spec.check_config(spec.canonical_shape(_shape(hidden=48, block_channels=16)),
                          {"vec": 32, "threads": 256, "iters": 1})
    with pytest.raises(ConfigError, match="CUDA targets only"):
        spec.check_config(full, spec.default_config(full), "cpu")


def test_dims_and_bytes(spec, colmajor):
    full = spec.canonical_shape(_shape(300, hidden=576, block_tokens=128, block_channels=128, in_fmt="e2m1",
                                       out_dtype="float32"))
    x, sf = spec.inputs
    assert x.resolve(full) == ("int8", (300, 288)) and sf.resolve(full) == ("float32", (3, 5))
    assert spec.output_decls(full) == [("out", "float32", (300, 576))]
    assert spec.bytes_moved(full) == 300 * 576 * 4 + 300 * 288 + 3 * 5 * 4
    packed = colmajor.canonical_shape(_shape(7, hidden=576, block_channels=32, sf_dtype="int32"))
    assert colmajor.inputs[1].resolve(packed) == ("int32", (5, 7))  # 18 groups -> 5 words
    assert colmajor.bytes_moved(packed) == 7 * 576 * 3 + 5 * 7 * 4


# -- the reference --------------------------------------------------------------------------------------

def test_reference_e4m3_hand_checked(spec):
    s = spec.canonical_shape(_shape(2, hidden=32, block_channels=16, out_dtype="float32"))
    x = torch.zeros(2, 32)
    x[0, :4] = torch.tensor([1.0, -2.5, 448.0, 2.0**-9])  # all exact e4m3 values (2^-9: the smallest subnormal)
    x[1, 16] = 3.0
    sf = torch.tensor([[0.5, 4.0], [3.0, 2.0**-3]])
    out = spec.reference(s, x.to(torch.float8_e4m3fn), sf)
    assert out.dtype == torch.float32 and out.shape == (2, 32)
    assert out[0, :4].tolist() == [0.5, -1.25, 224.0, 2.0**-10] and out[1, 16].item() == 3.0 * 2.0**-3
    assert (out[0, 4:] == 0).all() and not out[0, 4:].signbit().any()


def test_reference_bf16_rounds_once_to_nearest_even(spec):
    s = spec.canonical_shape(_shape(1, hidden=16, block_channels=16))
    x = torch.full((1, 16), 1.0).to(torch.float8_e4m3fn)
    x[0, 1] = 1.125  # e4m3 1.125
    sf = torch.tensor([[1.0 + 2.0**-8]])  # 1 + 2^-8 is halfway between two bf16 values: ties to even (1.0)
    out = spec.reference(s, x, sf)
    assert out.dtype == torch.bfloat16 and out[0, 0].item() == 1.0
    # 1.125 * (1 + 2^-8) = 1.125 + 1.125 * 2^-8: rounded once from the float32 product
    assert out[0, 1].item() == (torch.tensor(1.125) * torch.tensor(1.0 + 2.0**-8)).bfloat16().item()


def test_reference_e2m1_every_code(spec):
    """Every byte: low nibble first, code 8 is -0.0 (TileKernels' unpack_from_e2m1fn_x2)."""
    s = spec.canonical_shape(_shape(16, hidden=32, block_channels=32, in_fmt="e2m1", out_dtype="float32"))
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8).view(16, 16)
    out = spec.reference(s, x, torch.ones(16, 1))
    want = torch.tensor([[E2M1[b & 15], E2M1[b >> 4]] for b in range(256)]).view(16, 32)
    assert torch.equal(out, want) and torch.equal(out.signbit(), want.signbit())
    assert torch.equal(out, tk.quant.unpack_from_e2m1fn_x2(x))
    assert E2M1[8] == 0.0 and str(E2M1[8]) == "-0.0"


def test_reference_partial_blocks(spec):
    """130 tokens in blocks of 128 and 576 channels in groups of 128: the last block row and column are partial."""
    s = spec.canonical_shape(_shape(130, hidden=576, block_tokens=128, block_channels=128, out_dtype="float32"))
    x = torch.ones(130, 576).to(torch.float8_e4m3fn)
    sf = torch.arange(10, dtype=torch.float32).view(2, 5) + 1
    out = spec.reference(s, x, sf)
    assert out[0, 0] == 1 and out[127, 127] == 1 and out[127, 128] == 2 and out[0, 575] == 5
    assert out[128, 0] == 6 and out[129, 575] == 10


@pytest.mark.parametrize("kw", [{}, {"in_fmt": "e2m1", "block_channels": 32},
                                {"block_tokens": 32, "block_channels": 32},
                                {"block_channels": 4, "out_dtype": "float32"}, {"hidden": 576, "block_channels": 128}])
def test_reference_is_the_elementwise_product(spec, kw):
    """An independent loop: out[t, c] = value * sf[t // bt, c // bc], rounded once."""
    s = spec.canonical_shape(_shape(37, **kw))
    x, sf = spec.make_inputs(s, "cpu", 1)
    out = spec.reference(s, x, sf)
    vals = tk.quant.unpack_from_e2m1fn_x2(x) if s["in_fmt"] == "e2m1" else x.float()
    t = torch.arange(37)[:, None] // s["block_tokens"]
    c = torch.arange(s["hidden"])[None, :] // s["block_channels"]
    assert _equal(out, (vals * sf[t, c]).to(getattr(torch, s["out_dtype"])))


def test_unpack_ue8m0_bytes():
    words = torch.tensor([[0x0180FF7F, 0x00000081]], dtype=torch.int64).to(torch.int32)
    assert unpack_ue8m0(words, 5).tolist() == [[1.0, float("inf"), 2.0, 2.0**-126, 4.0]]  # little-endian bytes
    assert unpack_ue8m0(torch.zeros(1, 1, dtype=torch.int32), 1).item() == 0.0  # exponent byte 0: +0.0


@pytest.mark.parametrize("groups, cols", [(5, 8), (8, 4), (3, 0)])
def test_pack_ue8m0_bytes_round_trip_and_compile(groups, cols):
    """pack_ue8m0 puts group 4w + i's exponent in word w's byte i (exponents >= 128 set the word's sign bit),
    unpack_ue8m0 reads them back, and torch.compile(fullgraph=True) gives the same words (the packing once
    went through a uint8 -> int32 view that inductor's strided layout broke on the GPU)."""
    from tkjit.scales import pack_ue8m0

    exps = torch.randint(-126, 128, (groups, cols), generator=torch.Generator().manual_seed(groups))
    storage = torch.exp2(exps.float())
    words = pack_ue8m0(storage)
    assert words.dtype == torch.int32 and words.shape == (-(-groups // 4), cols)
    assert torch.equal(unpack_ue8m0(words.T, groups).T, storage)
    if groups >= 4 and cols:
        byte3 = (words[0].to(torch.int64) >> 24) & 0xFF
        assert torch.equal(byte3, exps[3] + 127)
    assert torch.equal(torch.compile(pack_ue8m0, fullgraph=True)(storage), words)


@pytest.mark.parametrize("kw", [{}, {"in_fmt": "e2m1", "block_channels": 32}, {"block_tokens": 128},
                                {"hidden": 576, "block_channels": 128, "out_dtype": "float32"}])
def test_colmajor_reference_matches_row_major(spec, colmajor, kw):
    for sdt in ("float32", "int32"):
        s = colmajor.canonical_shape(_shape(37, sf_dtype=sdt, **kw))
        x, storage = colmajor.make_inputs(s, "cpu", 3)
        rows = -(-37 // s["block_tokens"])
        assert storage.shape[1] == rows and storage.stride() == (-(-rows // 4) * 4, 1)  # TMA-aligned buffer's view
        scales = storage.T if sdt == "float32" else unpack_ue8m0(storage.T, -(-s["hidden"] // s["block_channels"]))
        assert _equal(colmajor.reference(s, x, storage), spec.reference({**s, "sf_dtype": "float32"}, x, scales))


def test_make_inputs(spec):
    s = spec.canonical_shape(_shape(200))
    x, sf = spec.make_inputs(s, "cpu", 0)
    assert x.dtype == torch.float8_e4m3fn and not x.float().isnan().any() and sf.is_contiguous()
    assert len(torch.unique(x.view(torch.uint8))) == 254  # every finite code
    x, sf = spec.make_inputs(s, "cpu", 1)  # odd seeds: a row-strided scale view
    assert sf.stride() == (5, 1) and (sf == 0).any() and sf.isfinite().all()


# -- the torch ops and tkjit.ops ------------------------------------------------------------------------

def _quantise(n, hidden, group, *, col_major=False, packed=False, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(n + hidden)
    x = (torch.randn(n, hidden, generator=g) * torch.exp(torch.randn(n, 1, generator=g))).to(dtype)
    return x, tkjit.ops.per_token_cast(x, group, round_scale=packed, col_major_scales=col_major, packed_ue8m0=packed)


@pytest.mark.parametrize("n", [0, 1, 37])
@pytest.mark.parametrize("layout", ["row", "col", "packed"])
def test_ops_round_trip_per_token_cast(reference_kernels, n, layout):
    """tkjit.ops.cast_back reads per_token_cast's three scale layouts off their strides."""
    x, (q, sf) = _quantise(n, 512, 128, col_major=layout != "row", packed=layout == "packed")
    out = tkjit.ops.cast_back(q, sf, (1, 128))
    assert out.dtype == torch.bfloat16 and out.shape == (n, 512) and out.is_contiguous()
    _, sf_row = tkjit.ops.per_token_cast(x, 128, round_scale=layout == "packed")
    want = (q.float() * sf_row.repeat_interleave(128, 1)).bfloat16()
    assert _equal(out, want)
    if n:
        assert torch.allclose(out.float(), x.float(), rtol=0.07, atol=1e-2)
    out32 = tkjit.ops.cast_back(q, sf, (1, 128), out_dtype=torch.float32)
    assert _equal(out32, q.float() * sf_row.repeat_interleave(128, 1))


def test_ops_block_scales_and_e2m1(reference_kernels):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-128, 128, (130, 128), generator=g).to(torch.int8)  # 256 e2m1 channels
    sf = torch.rand(2, 2, generator=g) + 0.5
    out = tkjit.ops.cast_back(x, sf, (128, 128), out_dtype=torch.float32)
    vals = tk.quant.unpack_from_e2m1fn_x2(x)
    assert _equal(out, vals * sf.repeat_interleave(128, 0).repeat_interleave(128, 1)[:130])
    col = torch.empty(2, 4)[:, :2].T  # column-major: the view of a (2, 4) buffer
    col.copy_(sf)
    assert col.stride(0) == 1 and _equal(tkjit.ops.cast_back(x, col, (128, 128), out_dtype=torch.float32), out)


def test_ops_bad_inputs(reference_kernels):
    q = torch.zeros(5, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(TensorError, match=r"sf has 4 token rows, expected ceil\(num_tokens / block_tokens\)"):
        tkjit.ops.cast_back(q, torch.ones(4, 2), (1, 128))
    with pytest.raises(TensorError, match="axis 1 must be 2"):
        tkjit.ops.cast_back(q, torch.ones(5, 3), (1, 128))
    with pytest.raises(TensorError, match="x must be float8_e4m3fn, or int8"):
        tkjit.ops.cast_back(q.view(torch.uint8), torch.ones(5, 2), (1, 128))
    with pytest.raises(TensorError, match="sf must be float32, or int32"):
        tkjit.ops.cast_back(q, torch.ones(5, 2, dtype=torch.float16), (1, 128))
    with pytest.raises(ShapeError, match="row-major scales are float32"):
        tkjit.ops.cast_back(q, torch.ones(5, 2, dtype=torch.int32), (1, 512))
    with pytest.raises(ShapeError, match="out_dtype must be"):
        tkjit.ops.cast_back(q, torch.ones(5, 2), (1, 128), out_dtype=torch.float16)
    with pytest.raises(ShapeError, match="block_size must be"):
        tkjit.ops.cast_back(q, torch.ones(5, 2), 128)


@pytest.mark.parametrize("n", [0, 5])
def test_fake_impls(n):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        q = mode.from_tensor(torch.zeros(n, 288, dtype=torch.int8))
        sf = mode.from_tensor(torch.ones(n, 5))
        out = torch.ops.tkjit.cast_back(q, sf, 1, 128, "float32")
        packed = mode.from_tensor(torch.zeros(5, -(-n // 4) * 4, dtype=torch.int32))[:, :n]  # 18 groups of 32
        out2 = torch.ops.tkjit.cast_back_colmajor(q, packed, 1, 32)
        out3 = tkjit.ops.cast_back(q, sf, (1, 128))
    assert out.shape == (n, 576) and out.dtype == torch.float32
    assert out2.shape == (n, 576) and out2.dtype == torch.bfloat16 and out3.shape == (n, 576)


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("case", ["row", "col", "packed", "e2m1_block", "empty"])
def test_opcheck(reference_kernels, case):
    g = torch.Generator().manual_seed(1)
    n = 0 if case == "empty" else 37
    q = torch.randint(0, 127, (n, 256), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    if case == "row" or case == "empty":
        op, args = torch.ops.tkjit.cast_back.default, (q, torch.rand(n, 2, generator=g), 1, 128, "float32")
    elif case == "col":
        op, args = torch.ops.tkjit.cast_back_colmajor.default, (q, torch.rand(2, 40, generator=g)[:, :n], 1, 128)
    elif case == "packed":
        words = torch.randint(100, 150, (40, 8), generator=g).to(torch.uint8).view(torch.int32).T.contiguous()
        op, args = torch.ops.tkjit.cast_back_colmajor.default, (q, words[:, :n], 1, 32)
    else:
        x = torch.randint(-128, 128, (n, 64), generator=g).to(torch.int8)
        op, args = torch.ops.tkjit.cast_back.default, (x, torch.rand(2, 4, generator=g), 32, 32)
    # test_schema compares the inputs before and after with allclose, which CPU torch lacks for float8: the
    # float8 cases skip it, the int8 (e2m1) case runs it.
    tests = OPCHECK_TESTS if args[0].dtype == torch.int8 else tuple(t for t in OPCHECK_TESTS if t != "test_schema")
    result = torch.library.opcheck(op, args, test_utils=tests)
    assert result == dict.fromkeys(tests, "SUCCESS"), result


# -- the TileKernels entry points -------------------------------------------------------------------------

def test_compat_signatures():
    """TileKernels 1.0.0's quant/cast_back_kernel.py, hard-coded."""
    assert str(inspect.signature(tk.quant.cast_back)) == (
        "(x: 'QuantTensor', fmt: 'str', x_block_size: 'tuple[int, int]', x_special_fmt: 'str | None' = None)"
        " -> 'torch.Tensor'")
    assert str(inspect.signature(tk.quant.per_token_cast_back)) == (
        "(x: 'QuantTensor', fmt: 'str', num_per_channels: 'int', x_special_fmt: 'str | None' = None)"
        " -> 'torch.Tensor'")


@pytest.mark.parametrize("n", [0, 37])
@pytest.mark.parametrize("col_major,packed", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("fmt", ["bf16", "fp32"])
def test_compat_round_trip(reference_kernels, n, col_major, packed, fmt):
    x = (torch.randn(n, 576) * 3).bfloat16()
    q, sf = tk.quant.per_token_cast(x, "e4m3", 64, use_tma_aligned_col_major_sf=col_major, round_sf=packed,
                                    use_packed_ue8m0=packed)
    out = tk.quant.per_token_cast_back((q, sf), fmt, 64)
    assert _equal(out, tk.quant.cast_back((q, sf), fmt, (1, 64)))
    _, sf_row = tk.quant.per_token_cast(x, "e4m3", 64, round_sf=packed)
    dt = torch.bfloat16 if fmt == "bf16" else torch.float32
    assert _equal(out, (q.float() * sf_row.repeat_interleave(64, 1)).to(dt))


@pytest.mark.parametrize("call, option", [
    (lambda: tk.quant.per_token_cast_back((torch.zeros(4, 256, dtype=torch.uint8), torch.ones(4, 2)), "bf16", 128),
     "x[0].dtype=torch.uint8"),
    (lambda: tk.quant.cast_back((torch.zeros(4, 192, dtype=torch.float8_e4m3fn), torch.ones(4, 16)), "bf16", (1, 12)),
     "num_per_channels=12"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_compat_missing(call, option):
    with pytest.raises(NotImplementedError) as err:
        call()
    assert option in str(err.value) and "'quant' kernel family" in str(err.value)


Q = torch.zeros(4, 256, dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("call, error, match", [
    (lambda: tk.quant.cast_back((Q, torch.ones(4, 2)), "e4m3", (1, 128)), ShapeError, "fmt must be one of"),
    (lambda: tk.quant.cast_back((Q, torch.ones(4, 2)), "bf16", (1, 128), "e3m4"), ShapeError, "x_special_fmt"),
    (lambda: tk.quant.cast_back(Q, "bf16", (1, 128)), TensorError, "tuple"),
    (lambda: tk.quant.cast_back((Q.float(), torch.ones(4, 2)), "bf16", (1, 128)), TensorError, r"x\[0\]"),
    (lambda: tk.quant.cast_back((Q, torch.ones(4, 2).double()), "bf16", (1, 128)), TensorError, r"x\[1\]"),
    (lambda: tk.quant.cast_back((Q, torch.ones(4, 2, 1)), "bf16", (1, 128)), TensorError, r"x\[1\].*2-D"),
    (lambda: tk.quant.cast_back((Q, torch.ones(4, 2, dtype=torch.int32)), "bf16", (1, 128)), TensorError,
     "float32 with a contiguous last axis"),
    (lambda: tk.quant.cast_back((Q, torch.ones(4, 2)), "bf16", [1, 128]), ShapeError, "x_block_size must be a"),
    (lambda: tk.quant.cast_back((Q, torch.ones(4, 2)), "bf16", (0, 128)), ShapeError, "positive"),
    (lambda: tk.quant.cast_back((Q[:, :96], torch.ones(4, 1)), "bf16", (1, 128)), ShapeError, "multiple of 64"),
    (lambda: tk.quant.cast_back((Q, torch.ones(4, 3)), "bf16", (1, 128)), TensorError, r"expected \(4, 2\)"),
    (lambda: tk.quant.per_token_cast_back((Q, torch.ones(4, 2)), "bf16", "128"), ShapeError, "must be an int"),
])
def test_compat_refuses_what_tile_kernels_refuses(call, error, match):
    with pytest.raises(error, match=match):
        call()


# -- sm_90a cross-compiles ------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name,shape,config", [
    (NAME, {"hidden": 7168}, None),
    (NAME, {"hidden": 576, "block_tokens": 128, "block_channels": 128, "out_dtype": "float32"}, None),
    (NAME, {"hidden": 256, "block_channels": 4, "in_fmt": "e2m1"}, {"vec": 16, "threads": 128, "iters": 2}),
    (COLMAJOR, {"hidden": 7168, "block_channels": 32, "in_fmt": "e2m1", "sf_dtype": "int32"}, None),
    (COLMAJOR, {"hidden": 576, "block_channels": 16, "sf_dtype": "int32", "out_dtype": "float32"},
     {"vec": 8, "threads": 512, "iters": 4}),
])
def test_compiles_for_sm90a(cache_dir, name, shape, config):
    n = 4001
    bt = shape.get("block_tokens", 1)
    k = tkjit.get(name, {"num_tokens": n, "num_sf_rows": -(-n // bt), **shape}, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    store = "*(float4*)(out + " if shape.get("out_dtype") == "float32" else "*(uint4*)(out + "
    assert src.count(store) == 1 and src.count("(out + ") == 1  # 16-byte stores only
    assert ("int* __restrict__ sf" in src) == (shape.get("sf_dtype") == "int32")
    if shape.get("in_fmt") == "e2m1":
        assert "1056964608" in src  # 126 << 23: the e2m1 decode's exponent bias


@pytest.mark.parametrize("name, maker", [("cast_back", "make_inputs_rowmajor"),
                                         ("cast_back_colmajor", "make_inputs_colmajor")])
def test_make_inputs_keep_their_strided_scales_on_another_device(name, maker):
    """Odd seeds' scales are a row-strided view; moving a view to another device copies it contiguous, so the
    inputs are built there (meta stands in for CUDA here). The strided GPU test found the layout lost."""
    from tkjit_kernels.quant import cast_back as cb

    full = tkjit.get_spec(name).canonical_shape({"num_tokens": 5, "num_sf_rows": 5, "hidden": 576})
    _, sf = getattr(cb, maker)(full, "meta", 1)
    assert sf.device.type == "meta" and sf.stride(1) == 1 and sf.stride(0) > sf.shape[1]
