"""cast_back_e5m6(_colmajor) specs on the CPU: shapes, constraints, reference semantics (e5m6 codes, float32 /
packed UE8M0 scales, block sizes), the torch ops (fake, opcheck), tkjit.ops, TileKernels' cast_back /
per_token_cast_back with x_special_fmt='e5m6', sm_90a cross-compiles. The kernels are CUDA-only: the ops run
here as CompiledKernels that write the reference."""

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
from tkjit_kernels.quant import _e5m6

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from quant_checks import float_equal as _equal  # noqa: E402
from quant_checks import layout_fixtures

NAME, COLMAJOR = "cast_back_e5m6", "cast_back_e5m6_colmajor"
CUDA_ONLY = (NAME, COLMAJOR, "per_token_cast_e5m6", "per_token_cast_e5m6_colmajor")
HIDDENS = (576, 2048, 2560, 3072, 4096, 6144, 7168)  # TileKernels' test hidden sizes

spec, colmajor, reference_kernels = layout_fixtures(NAME, COLMAJOR, CUDA_ONLY)



def _shape(n=16, **kw):
    bt = kw.get("block_tokens", 1)
    return {"num_tokens": n, "num_sf_rows": -(-n // bt), "hidden": 256, **kw}


def _values(q):
    """uint8 (n, hidden * 3 / 2) -> float32 (n, hidden), independently of the spec: the torch format helpers."""
    return _e5m6.decode(_e5m6.unpack(q.contiguous().view(torch.int32)))


# -- the spec -----------------------------------------------------------------------------------------------

def test_specs_validate(spec, colmajor):
    for s in (spec, colmajor):
        validate(s)
        assert s.family == "quant" and s.tolerance.exact
        for ex in s.examples:
            full = s.canonical_shape(ex)
            assert s.default_config(full, "sm_90a") in s.configs(full, "sm_90a")
    assert [p.name for p in spec.params] == ["num_tokens", "num_sf_rows", "hidden", "block_tokens", "block_channels",
                                             "out_dtype", "sf_dtype"]
    import tkjit_kernels

    assert tkjit_kernels.INDEX[COLMAJOR] == tkjit_kernels.INDEX[NAME] == "tkjit_kernels.quant.cast_back_e5m6"


@pytest.mark.parametrize("hidden", HIDDENS + (8, 24))
@pytest.mark.parametrize("bt,bc", [(1, None), (1, 128), (128, 128), (32, 32), (1, 8)])
def test_defaults_valid(spec, hidden, bt, bc):
    full = spec.canonical_shape(_shape(4001, hidden=hidden, block_tokens=bt, block_channels=bc or hidden))
    cfg = spec.default_config(full, "sm_90a")
    assert spec.check_config(full, cfg, "sm_90a") == cfg


def test_default_iters_follow_size(spec):
    small = spec.canonical_shape(_shape(64, hidden=7168, block_channels=7168))
    big = spec.canonical_shape(_shape(32768, hidden=7168, block_channels=7168))
    # 8-channel chunks (a warp's stores one contiguous span), four a thread once they fill the GPU many times
    assert spec.default_config(small, "sm_90a") == {"vec": 8, "threads": 256, "iters": 1}
    assert spec.default_config(big, "sm_90a") == {"vec": 8, "threads": 256, "iters": 4}


def test_bad_shapes(spec, colmajor):
    with pytest.raises(ShapeError, match="multiple of 8"):
        spec.canonical_shape(_shape(hidden=20))
    with pytest.raises(ShapeError, match="multiple of 8 or divide 8"):
        spec.canonical_shape(_shape(block_channels=12))
    with pytest.raises(ShapeError, match="row-major scales are float32"):
        spec.canonical_shape(_shape(sf_dtype="int32"))
    colmajor.canonical_shape(_shape(sf_dtype="int32"))
    with pytest.raises(ShapeError, match=r"num_sf_rows=3 must be ceil\(num_tokens / block_tokens\)"):
        spec.canonical_shape({**_shape(16), "num_sf_rows": 3})
    with pytest.raises(ShapeError, match="in_fmt"):
        spec.canonical_shape(_shape(in_fmt="e5m6"))


def test_bad_configs(spec):
    full = spec.canonical_shape(_shape(hidden=24, block_channels=24))
    with pytest.raises(ConfigError, match="not a multiple of vec=16"):
        spec.check_config(full, {"vec": 16, "threads": 256, "iters": 1})
    full = spec.canonical_shape(_shape(block_channels=4))
    with pytest.raises(ConfigError, match="a chunk must lie in one group"):
        spec.check_config(spec.canonical_shape(_shape(hidden=240, block_channels=24)),
                          {"vec": 16, "threads": 256, "iters": 1})
    with pytest.raises(ConfigError, match="CUDA targets only"):
        spec.check_config(full, spec.default_config(full, "sm_90a"), "cpu")


def test_dims_and_bytes(spec, colmajor):
    full = spec.canonical_shape(_shape(5, hidden=576, block_channels=32))
    x, sf = spec.inputs
    assert x.resolve(full) == ("int32", (5, 216)) and sf.resolve(full) == ("float32", (5, 18))
    assert spec.output_decls(full) == [("out", "bfloat16", (5, 576))]
    assert spec.bytes_moved(full) == 5 * 864 + 5 * 576 * 2 + 5 * 18 * 4
    packed = colmajor.canonical_shape(_shape(5, hidden=576, block_channels=32, sf_dtype="int32"))
    assert colmajor.inputs[1].resolve(packed) == ("int32", (5, 5))  # 18 groups -> 5 words
    assert colmajor.bytes_moved(packed) == 5 * 864 + 5 * 576 * 2 + 5 * 5 * 4


def test_reference_hand_checked(spec):
    # Codes 1.0, -2.0, 65024, the smallest subnormal, 0, -0, 1 + 2^-6, 2^-14 times scale 0.5, to float32.
    codes = torch.tensor([[0x3C0, 0xC00, 0x7BF, 0x001, 0x000, 0x800, 0x3C1, 0x040]])
    x = _e5m6.pack(codes)
    s = spec.canonical_shape(_shape(1, hidden=8, block_channels=8, out_dtype="float32"))
    out = spec.reference(s, x, torch.tensor([[0.5]]))
    assert out.dtype == torch.float32 and out.shape == (1, 8)
    want = torch.tensor([[0.5, -1.0, 32512.0, 2.0**-21, 0.0, -0.0, 0.5 + 2**-7, 2.0**-15]])
    assert _equal(out, want)


def test_reference_bf16_rounds_once(spec):
    # (1 + 63/64) * (1 + 2^-7): 9 significant bits, rounded once to bf16 (8 bits) to nearest even.
    x = _e5m6.pack(torch.tensor([[0x3FF] * 8]))
    s = spec.canonical_shape(_shape(1, hidden=8, block_channels=8))
    sf = torch.tensor([[1 + 2**-7]])
    out = spec.reference(s, x, sf)
    assert _equal(out, ((1 + 63 / 64) * sf.expand(1, 8)).bfloat16())


@pytest.mark.parametrize("kw", [{"block_channels": 32}, {"block_tokens": 128, "block_channels": 128},
                                {"block_tokens": 3, "block_channels": 8, "out_dtype": "float32"}])
def test_reference_is_the_elementwise_product(spec, kw):
    s = spec.canonical_shape(_shape(37, **kw))
    x, sf = spec.make_inputs(s, "cpu", 0)
    out = spec.reference(s, x, sf)
    vals = _e5m6.decode(_e5m6.unpack(x))
    for t, c in [(0, 0), (5, 17), (36, 255), (20, 100)]:
        want = vals[t, c] * sf[t // s["block_tokens"], c // s["block_channels"]]
        assert _equal(out[t, c], want.to(out.dtype))


@pytest.mark.parametrize("kw", [{}, {"block_tokens": 128, "block_channels": 128, "out_dtype": "float32"}])
def test_colmajor_reference_matches_row_major(spec, colmajor, kw):
    s = spec.canonical_shape(_shape(37, **kw))
    x, sf = spec.make_inputs(s, "cpu", 0)
    xc, storage = colmajor.make_inputs(s, "cpu", 0)
    assert torch.equal(x, xc) and storage.stride(1) == 1 and torch.equal(storage.T, sf)
    assert _equal(colmajor.reference(s, xc, storage), spec.reference(s, x, sf))


def test_colmajor_reference_packed(colmajor):
    s = colmajor.canonical_shape(_shape(37, hidden=512, block_channels=32, sf_dtype="int32"))
    x, words = colmajor.make_inputs(s, "cpu", 2)
    assert words.dtype == torch.int32 and words.shape == (4, 37)
    exps = words.T.contiguous().view(torch.uint8).view(37, 16).to(torch.int32)
    scales = (exps << 23).view(torch.float32)
    want = (_e5m6.decode(_e5m6.unpack(x)) * scales.repeat_interleave(32, 1)).bfloat16()
    assert _equal(colmajor.reference(s, x, words), want)


def test_make_inputs(spec):
    s = spec.canonical_shape(_shape(64, hidden=512))
    x, sf = spec.make_inputs(s, "cpu", 0)
    assert x.dtype == torch.int32 and x.shape == (64, 192)
    codes = _e5m6.unpack(x)
    assert ((codes >> 6) & 31).max() == 30 and ((codes >> 6) & 31).min() == 0  # finite, subnormals included
    assert (codes >> 11).min() == 0 and (codes >> 11).max() == 1
    _, sf1 = spec.make_inputs(s, "cpu", 1)  # odd seeds: a row-strided view of the scales
    assert sf1.stride(0) == sf1.shape[1] + 3 and not sf1.is_contiguous()


# -- the torch ops and tkjit.ops ------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 37])
@pytest.mark.parametrize("layout", ["row", "col", "packed"])
def test_ops_round_trip(reference_kernels, n, layout):
    """tkjit.ops.cast_back_e5m6 reads per_token_cast_e5m6's three scale layouts off their strides."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, 576, generator=g) * torch.exp(torch.randn(n, 1, generator=g))).bfloat16()
    packed = layout == "packed"
    q, sf = tkjit.ops.per_token_cast_e5m6(x, round_scale=packed, col_major_scales=layout != "row",
                                          packed_ue8m0=packed)
    out = tkjit.ops.cast_back_e5m6(q, sf)
    assert out.dtype == torch.bfloat16 and out.shape == (n, 576) and out.is_contiguous()
    _, sf_row = tkjit.ops.per_token_cast_e5m6(x, round_scale=packed)
    assert _equal(out, (_values(q) * sf_row).bfloat16())
    if n:
        assert torch.allclose(out.float(), x.float(), rtol=2**-6, atol=sf_row.max().item() * 2**-14)
    out32 = tkjit.ops.cast_back_e5m6(q, sf, (1, 576), out_dtype=torch.float32)
    assert _equal(out32, _values(q) * sf_row)
    # int32 words are taken as they are; an unaligned uint8 view is copied first.
    assert _equal(tkjit.ops.cast_back_e5m6(q.view(torch.int32), sf), out)
    buf = torch.zeros(n, 864 + 3, dtype=torch.uint8)
    buf[:, 1:865] = q
    assert _equal(tkjit.ops.cast_back_e5m6(buf[:, 1:865], sf), out)


def test_ops_block_scales(reference_kernels):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 0x7C0, (130, 256), generator=g)
    q = _e5m6.as_bytes(_e5m6.pack(codes))
    sf = torch.rand(2, 2, generator=g) + 0.5
    out = tkjit.ops.cast_back_e5m6(q, sf, (128, 128), out_dtype=torch.float32)
    assert _equal(out, _e5m6.decode(codes) * sf.repeat_interleave(128, 0).repeat_interleave(128, 1)[:130])
    col = torch.empty(2, 4)[:, :2].T  # column-major: the view of a (2, 4) buffer
    col.copy_(sf)
    assert col.stride(0) == 1 and _equal(tkjit.ops.cast_back_e5m6(q, col, (128, 128), out_dtype=torch.float32), out)


def test_ops_bad_inputs(reference_kernels):
    q = torch.zeros(5, 384, dtype=torch.uint8)  # hidden 256
    with pytest.raises(TensorError, match=r"sf has 4 token rows, expected ceil\(num_tokens / block_tokens\)"):
        tkjit.ops.cast_back_e5m6(q, torch.ones(4, 2), (1, 128))
    with pytest.raises(TensorError, match="axis 1 must be 2"):
        tkjit.ops.cast_back_e5m6(q, torch.ones(5, 3), (1, 128))
    with pytest.raises(TensorError, match="not 12 per 8 e5m6 values"):
        tkjit.ops.cast_back_e5m6(q[:, :380], torch.ones(5, 2), (1, 128))
    with pytest.raises(TensorError, match="x must be int32 words"):
        tkjit.ops.cast_back_e5m6(q.view(torch.float8_e4m3fn), torch.ones(5, 2), (1, 128))
    with pytest.raises(TensorError, match="sf must be float32, or int32"):
        tkjit.ops.cast_back_e5m6(q, torch.ones(5, 2, dtype=torch.float16), (1, 128))
    with pytest.raises(ShapeError, match="row-major scales are float32"):
        tkjit.ops.cast_back_e5m6(q, torch.ones(5, 2, dtype=torch.int32), (1, 512))
    with pytest.raises(ShapeError, match="out_dtype must be"):
        tkjit.ops.cast_back_e5m6(q, torch.ones(5, 2), (1, 128), out_dtype=torch.float16)
    with pytest.raises(ShapeError, match="block_size must be"):
        tkjit.ops.cast_back_e5m6(q, torch.ones(5, 2), 128)


@pytest.mark.parametrize("n", [0, 5])
def test_fake_impls(n):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.zeros(n, 216, dtype=torch.int32))  # hidden 576
        sf = mode.from_tensor(torch.ones(n, 5))
        out = torch.ops.tkjit.cast_back_e5m6(x, sf, 1, 128, "float32")
        packed = mode.from_tensor(torch.zeros(5, -(-n // 4) * 4, dtype=torch.int32))[:, :n]  # 18 groups of 32
        out2 = torch.ops.tkjit.cast_back_e5m6_colmajor(x, packed, 1, 32)
        out3 = tkjit.ops.cast_back_e5m6(x.view(torch.uint8), sf, (1, 128))
    assert out.shape == (n, 576) and out.dtype == torch.float32
    assert out2.shape == (n, 576) and out2.dtype == torch.bfloat16 and out3.shape == (n, 576)


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("case", ["row", "col", "packed", "block", "empty"])
def test_opcheck(reference_kernels, case):
    g = torch.Generator().manual_seed(1)
    n = 0 if case == "empty" else 37
    x = _e5m6.pack(torch.randint(0, 0x7C0, (n, 256), generator=g))
    if case == "row" or case == "empty":
        op, args = torch.ops.tkjit.cast_back_e5m6.default, (x, torch.rand(n, 2, generator=g), 1, 128, "float32")
    elif case == "col":
        op, args = torch.ops.tkjit.cast_back_e5m6_colmajor.default, (x, torch.rand(2, 40, generator=g)[:, :n], 1, 128)
    elif case == "packed":
        words = torch.randint(100, 150, (40, 8), generator=g).to(torch.uint8).view(torch.int32).T.contiguous()
        op, args = torch.ops.tkjit.cast_back_e5m6_colmajor.default, (x, words[:, :n], 1, 32)
    else:
        op, args = torch.ops.tkjit.cast_back_e5m6.default, (x, torch.rand(2, 8, generator=g), 32, 32)
    result = torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result


def test_torch_compile_traces(reference_kernels):
    x = torch.randn(9, 64) * 2

    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        q, sf = tkjit.ops.per_token_cast_e5m6(x, col_major_scales=True)
        return tkjit.ops.cast_back_e5m6(q, sf, out_dtype=torch.float32)

    q, sf = tkjit.ops.per_token_cast_e5m6(x)
    assert _equal(f(x), _values(q) * sf)


# -- TileKernels' cast_back / per_token_cast_back with x_special_fmt='e5m6' ---------------------------------------

@pytest.mark.parametrize("n", [0, 37])
@pytest.mark.parametrize("col_major,packed", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("fmt", ["bf16", "fp32"])
def test_compat_round_trip(reference_kernels, n, col_major, packed, fmt):
    x = (torch.randn(n, 576) * 3).bfloat16()
    q, sf = tk.quant.per_token_cast(x, "e5m6", 576, use_tma_aligned_col_major_sf=col_major, round_sf=packed,
                                    use_packed_ue8m0=packed)
    out = tk.quant.per_token_cast_back((q, sf), fmt, 576, "e5m6")
    assert _equal(out, tk.quant.cast_back((q, sf), fmt, (1, 576), "e5m6"))
    _, sf_row = tk.quant.per_token_cast(x, "e5m6", 576, round_sf=packed)
    dt = torch.bfloat16 if fmt == "bf16" else torch.float32
    assert _equal(out, (_values(q) * sf_row).to(dt))


def test_compat_block_scales(reference_kernels):
    codes = torch.randint(0, 0x7C0, (130, 256), generator=torch.Generator().manual_seed(3))
    q = _e5m6.as_bytes(_e5m6.pack(codes))
    sf = torch.rand(2, 2) + 0.5
    out = tk.quant.cast_back((q, sf), "fp32", (128, 128), "e5m6")
    assert _equal(out, _e5m6.decode(codes) * sf.repeat_interleave(128, 0).repeat_interleave(128, 1)[:130])


Q = torch.zeros(4, 384, dtype=torch.uint8)  # hidden 256


@pytest.mark.parametrize("call, error, match", [
    (lambda: tk.quant.cast_back((Q, torch.ones(4, 1)), "e5m6", (1, 256), "e5m6"), ShapeError, "fmt must be one of"),
    (lambda: tk.quant.cast_back(Q, "bf16", (1, 256), "e5m6"), TensorError, "tuple"),
    (lambda: tk.quant.cast_back((Q.view(torch.int8), torch.ones(4, 1)), "bf16", (1, 256), "e5m6"), TensorError,
     r"x\[0\].*uint8"),
    (lambda: tk.quant.cast_back((Q, torch.ones(4, 1).double()), "bf16", (1, 256), "e5m6"), TensorError, r"x\[1\]"),
    (lambda: tk.quant.cast_back((Q, torch.ones(4, 2, dtype=torch.int32)), "bf16", (1, 128), "e5m6"), TensorError,
     "float32 with a contiguous last axis"),
    (lambda: tk.quant.cast_back((Q, torch.ones(4, 1)), "bf16", [1, 256], "e5m6"), ShapeError, "x_block_size must be"),
    (lambda: tk.quant.cast_back((Q, torch.ones(4, 1)), "bf16", (1, 0), "e5m6"), ShapeError, "positive"),
    (lambda: tk.quant.cast_back((Q[:, :380], torch.ones(4, 1)), "bf16", (1, 256), "e5m6"), ShapeError,
     "12 bytes"),
    (lambda: tk.quant.cast_back((Q, torch.ones(4, 3)), "bf16", (1, 96), "e5m6"), ShapeError,
     r"multiple of num_per_channels \(96\)"),
    (lambda: tk.quant.cast_back((Q, torch.ones(4, 3)), "bf16", (1, 128), "e5m6"), TensorError, r"expected \(4, 2\)"),
    (lambda: tk.quant.per_token_cast_back((Q, torch.ones(4, 1)), "bf16", "256", "e5m6"), ShapeError, "must be an int"),
])
def test_compat_refuses_what_tile_kernels_refuses(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_compat_missing():
    with pytest.raises(NotImplementedError,
                       match=r"num_per_channels=12, .*must be a multiple of 8 or divide 8.*'quant' kernel family"):
        tk.quant.cast_back((torch.zeros(4, 72, dtype=torch.uint8), torch.ones(4, 4)), "bf16", (1, 12), "e5m6")


# -- sm_90a cross-compiles ------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name,shape,config", [
    (NAME, {"hidden": 7168, "block_channels": 7168}, None),
    (NAME, {"hidden": 576, "block_tokens": 128, "block_channels": 128, "out_dtype": "float32"},
     {"vec": 8, "threads": 128, "iters": 2}),
    (COLMAJOR, {"hidden": 576, "block_channels": 576, "sf_dtype": "int32"}, None),
    (COLMAJOR, {"hidden": 256, "block_channels": 4, "out_dtype": "float32"}, {"vec": 16, "threads": 512, "iters": 4}),
])
def test_compiles_for_sm90a(cache_dir, name, shape, config):
    n = 4001
    bt = shape.get("block_tokens", 1)
    k = tkjit.get(name, {"num_tokens": n, "num_sf_rows": -(-n // bt), **shape}, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    store = "*(float4*)(out + " if shape.get("out_dtype") == "float32" else "*(uint4*)(out + "
    assert src.count(store) == 1 and src.count("(out + ") == 1  # 16-byte stores only
    load = {1: "x[", 2: "*(int2*)(x + ", 4: "*(int4*)(x + "}[k.config["vec"] // 8]
    assert load in src
    assert "65520" in src  # 0xFFF0: a code in the top 12 bits of a float16
    assert ("int* __restrict__ sf" in src) == (shape.get("sf_dtype") == "int32")
