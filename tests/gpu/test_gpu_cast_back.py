"""cast_back(_colmajor) on the GPU: the default config at every shape and every config of the space, bit-exact with
the spec reference on poisoned outputs; e4m3 and packed e2m1 values, float32 (row- and column-major) and packed
UE8M0 scales, per-token groups and blocks, partial blocks; tkjit.ops / torch.compile / opcheck; and TileKernels'
`cast_back` on the same inputs (per_token_cast round trips and random block-scaled data), bit-exact."""

import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as tkc
from tkjit.testing import check
from tkjit.timing import median, time_cuda

sys.path.insert(0, str(Path(__file__).parents[1] / "helpers"))
from quant_checks import cast_back_full as _full  # noqa: E402
from quant_checks import check_every_config
from quant_checks import float_bits as _bits
from quant_checks import param_id as _id

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
NAME, COLMAJOR = "cast_back", "cast_back_colmajor"


STATIC = [  # (spec, static shape)
    (NAME, {"hidden": 7168}),
    (NAME, {"hidden": 7168, "out_dtype": "float32"}),
    (NAME, {"hidden": 4096, "block_channels": 32}),
    (NAME, {"hidden": 7168, "block_tokens": 128, "block_channels": 128}),
    (NAME, {"hidden": 2048, "block_tokens": 32, "block_channels": 32, "out_dtype": "float32"}),
    (NAME, {"hidden": 576, "block_channels": 128}),  # partial last group
    (NAME, {"hidden": 576, "block_tokens": 128, "block_channels": 128}),  # partial blocks both ways
    (NAME, {"hidden": 576, "block_channels": 576}),  # one scale per token
    (NAME, {"hidden": 256, "block_channels": 4}),  # several scales per chunk
    (NAME, {"hidden": 7168, "block_channels": 32, "in_fmt": "e2m1"}),
    (NAME, {"hidden": 7168, "block_channels": 16, "in_fmt": "e2m1", "out_dtype": "float32"}),
    (NAME, {"hidden": 4096, "block_tokens": 32, "block_channels": 32, "in_fmt": "e2m1"}),
    (COLMAJOR, {"hidden": 7168}),
    (COLMAJOR, {"hidden": 576, "block_channels": 128, "out_dtype": "float32"}),
    (COLMAJOR, {"hidden": 7168, "block_tokens": 128, "block_channels": 128}),
    (COLMAJOR, {"hidden": 7168, "block_channels": 128, "sf_dtype": "int32"}),
    (COLMAJOR, {"hidden": 7168, "block_channels": 32, "in_fmt": "e2m1", "sf_dtype": "int32"}),
    (COLMAJOR, {"hidden": 576, "block_channels": 16, "sf_dtype": "int32", "out_dtype": "float32"}),  # 36 groups
    (COLMAJOR, {"hidden": 2048, "block_tokens": 32, "block_channels": 32, "in_fmt": "e2m1", "sf_dtype": "int32"}),
]
EVERY = [
    (NAME, {"hidden": 7168}),
    (NAME, {"hidden": 576, "block_tokens": 128, "block_channels": 128, "out_dtype": "float32"}),
    (NAME, {"hidden": 256, "block_channels": 4, "in_fmt": "e2m1"}),
    (COLMAJOR, {"hidden": 2048, "block_channels": 32, "in_fmt": "e2m1", "sf_dtype": "int32"}),
    (COLMAJOR, {"hidden": 576, "block_channels": 16}),
]


@pytest.mark.parametrize("name,static", STATIC, ids=_id)
def test_default_config_every_size(name, static):
    tokens = (1, 7, 129, 4001, 65536) if static["hidden"] <= 2048 else (1, 7, 129, 4001)
    for t in tokens:
        kern = tkjit.get(name, _full(static, t))
        for seed in (0, 1):
            assert check(kern, _full(static, t), seed=seed) is None


def test_every_config_in_the_space():
    check_every_config(EVERY, _full)


def test_strided_x_and_scales():
    """x = buf[:, 16:16 + hidden] of a wider buffer, the scales a row-strided view: read in place."""
    static = {"hidden": 7168, "block_channels": 128}
    kern = tkjit.get(NAME, _full(static, 4001))
    x, sf = kern.spec.make_inputs(kern.spec.canonical_shape(_full(static, 4001)), "cuda", 3)
    buf = torch.zeros(4001, 7168 + 64, device="cuda", dtype=torch.uint8).view(torch.float8_e4m3fn)
    buf[:, 16:16 + 7168] = x
    xs = buf[:, 16:16 + 7168]
    assert sf.stride(1) == 1 and sf.stride(0) > sf.shape[1]  # odd seeds: a row-strided scale view
    got = kern(xs, sf)
    want = kern.spec.reference(kern.shape | {"num_tokens": 4001, "num_sf_rows": 4001}, x.cpu(), sf.cpu())
    assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))


def test_bad_tensors_raise():
    kern = tkjit.get(NAME, _full({"hidden": 576}, 64))
    q = torch.zeros(64, 576, device="cuda", dtype=torch.float8_e4m3fn)
    sf = torch.ones(64, 5, device="cuda")
    with pytest.raises(tkjit.TensorError, match="dtype"):
        kern(q.view(torch.int8), sf)
    with pytest.raises(tkjit.TensorError, match="axis 1 must be 5"):
        kern(q, torch.ones(64, 4, device="cuda"))
    with pytest.raises(tkjit.TensorError, match=r"sf has 63 token rows"):
        tkjit.ops.cast_back(q, sf[:63], (1, 128))


# -- tkjit.ops, torch.compile, opcheck ---------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["row", "col", "packed"])
def test_ops_round_trip(layout):
    x = torch.randn(4001, 7168, device="cuda", dtype=torch.bfloat16) * 3
    packed = layout == "packed"
    q, sf = tkjit.ops.per_token_cast(x, 128, round_scale=packed, col_major_scales=layout != "row",
                                     packed_ue8m0=packed)
    out = tkjit.ops.cast_back(q, sf, (1, 128))
    _, sf_row = tkjit.ops.per_token_cast(x, 128, round_scale=packed)
    want = (q.float() * sf_row.repeat_interleave(128, 1)).bfloat16()
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert torch.allclose(out.float(), x.float(), rtol=0.07, atol=1e-2)


@pytest.mark.parametrize("layout", ["row", "col"])
def test_compile_fullgraph_bit_exact(layout):
    def model(q, sf):
        return tkjit.ops.cast_back(q, sf, (1, 128), out_dtype=torch.float32) * 2

    compiled = torch.compile(model, fullgraph=True)
    for t in (4001, 129, 0):
        x = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
        q, sf = tkjit.ops.per_token_cast(x, 128, col_major_scales=layout == "col")
        assert torch.equal(compiled(q, sf), model(q, sf)), t


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("case", ["row", "col", "packed_e2m1"])
def test_opcheck(case):
    x = torch.randn(37, 512, device="cuda", dtype=torch.bfloat16)
    if case == "packed_e2m1":
        q = torch.randint(-128, 128, (37, 256), device="cuda", dtype=torch.int8)
        words = torch.randint(100, 150, (40, 16), device="cuda").to(torch.uint8).view(torch.int32)  # 16 groups
        op, args = torch.ops.tkjit.cast_back_colmajor.default, (q, words.T.contiguous()[:, :37], 1, 32)
    else:
        q, sf = tkjit.ops.per_token_cast(x, 128, col_major_scales=case == "col")
        op = torch.ops.tkjit.cast_back.default if case == "row" else torch.ops.tkjit.cast_back_colmajor.default
        args = (q, sf if case == "row" else sf.T, 1, 128, "float32")
    # opcheck's test_schema compares the inputs before and after with a multiply, which torch has no
    # float8 kernel for ("mul_cuda" not implemented for 'Float8_e4m3fn'): for float8 values the schema's
    # "mutates nothing" is checked here on the bytes instead.
    tests = OPCHECK_TESTS if q.dtype != torch.float8_e4m3fn else OPCHECK_TESTS[1:]
    before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    result = torch.library.opcheck(op, args, test_utils=tests)
    assert result == dict.fromkeys(tests, "SUCCESS"), result
    op(*args)
    after = [a for a in args if isinstance(a, torch.Tensor)]
    assert all(torch.equal(b.view(torch.uint8), a.view(torch.uint8)) for b, a in zip(before, after))


def test_report_time_at_target():
    """Not a gate: the default config's time at 32768 x 7168 e4m3 -> bf16, per-128 scales."""
    static = {"hidden": 7168}
    kern = tkjit.get(NAME, _full(static, 32768))
    q, sf = kern.spec.make_inputs(kern.spec.canonical_shape(_full(static, 32768)), "cuda", 0)
    out = kern(q, sf)
    us = median(time_cuda(lambda: kern(q, sf, out=out)))
    gbs = kern.spec.bytes_moved(kern.shape | {"num_tokens": 32768, "num_sf_rows": 32768}) / us / 1e3
    print(f"\ncast_back 32768x7168 e4m3->bf16 g128 {kern.config}: {us:.1f} us/call, {gbs:.0f} GB/s")


# -- TileKernels, where installed: the same inputs through its cast_back, bit-exact --------------------------

def _tk():
    return pytest.importorskip("tile_kernels")


@pytest.mark.parametrize("n", [1, 129, 4001])
@pytest.mark.parametrize("hidden,group", [(7168, 128), (4096, 64), (2048, 32), (7168, 16), (4096, 4096)])
@pytest.mark.parametrize("layout", ["row", "col", "packed"])
@pytest.mark.parametrize("fmt", ["bf16", "fp32"])
def test_per_token_cast_round_trip_matches_tile_kernels(n, hidden, group, layout, fmt):
    """tkjit's per_token_cast output (TileKernels' layouts) back through tkjit's and TileKernels' cast_back."""
    tk = _tk()
    x = (torch.randn(n, hidden, device="cuda") * torch.exp(torch.randn(n, 1, device="cuda"))).bfloat16()
    packed = layout == "packed"
    q, sf = tkc.quant.per_token_cast(x, "e4m3", group, use_tma_aligned_col_major_sf=layout != "row",
                                     round_sf=packed, use_packed_ue8m0=packed)
    out = tkc.quant.per_token_cast_back((q, sf), fmt, group)
    want = tk.quant.per_token_cast_back((q, sf), fmt, group)
    assert out.dtype == want.dtype and out.shape == want.shape and torch.equal(_bits(out), _bits(want))
    assert torch.equal(_bits(tkc.quant.cast_back((q, sf), fmt, (1, group))), _bits(want))


@pytest.mark.parametrize("n", [1, 129, 4001])
@pytest.mark.parametrize("hidden", [7168, 2048])
@pytest.mark.parametrize("block", [(128, 128), (32, 32), (1, 128), (1, 32)])
@pytest.mark.parametrize("in_fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("layout", ["row", "col", "packed"])
def test_random_block_scaled_matches_tile_kernels(n, hidden, block, in_fmt, layout):
    """The spec's random inputs (every finite code, scales of many magnitudes and zeros) in TileKernels' forms."""
    tk = _tk()
    name = NAME if layout == "row" else COLMAJOR
    spec = tkjit.get_spec(name)
    s = spec.canonical_shape({"num_tokens": n, "num_sf_rows": -(-n // block[0]), "hidden": hidden,
                              "block_tokens": block[0], "block_channels": block[1], "in_fmt": in_fmt,
                              "sf_dtype": "int32" if layout == "packed" else "float32"})
    x, sf = spec.make_inputs(s, "cuda", n)
    if layout != "row":
        sf = sf.T  # the column-major (num_sf_rows, ...) view TileKernels takes
    for fmt in ("bf16", "fp32"):
        out = tkc.quant.cast_back((x, sf), fmt, block)
        want = tk.quant.cast_back((x, sf), fmt, block)
        assert torch.equal(_bits(out), _bits(want)), fmt
