"""cast_back_e5m6(_colmajor) on the GPU: the default config at every shape and every config of the space,
bit-exact with the spec reference on poisoned outputs; float32 (row- and column-major) and packed UE8M0 scales,
per-token and block scales, partial blocks; strided x; tkjit.ops / torch.compile / opcheck; and TileKernels'
cast_back(x_special_fmt='e5m6') (its kernel and its torch reference `cast_back_from_e5m6`) on the same inputs,
bit-exact."""

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
NAME, COLMAJOR = "cast_back_e5m6", "cast_back_e5m6_colmajor"
HIDDENS = (576, 2048, 2560, 3072, 4096, 6144, 7168)  # TileKernels' test hidden sizes


STATIC = [(NAME, {"hidden": h, "block_channels": h}) for h in HIDDENS] + [
    (NAME, {"hidden": 7168, "block_channels": 7168, "out_dtype": "float32"}),
    (NAME, {"hidden": 7168}),  # per-128 groups
    (NAME, {"hidden": 4096, "block_channels": 32}),
    (NAME, {"hidden": 7168, "block_tokens": 128, "block_channels": 128}),
    (NAME, {"hidden": 2048, "block_tokens": 32, "block_channels": 32, "out_dtype": "float32"}),
    (NAME, {"hidden": 576, "block_tokens": 128, "block_channels": 128}),  # partial blocks both ways
    (NAME, {"hidden": 256, "block_channels": 4}),  # several scales per chunk
    (NAME, {"hidden": 24, "block_channels": 24}),  # 8-channel chunks only
    (COLMAJOR, {"hidden": 7168, "block_channels": 7168}),
    (COLMAJOR, {"hidden": 576, "block_channels": 576, "sf_dtype": "int32"}),
    (COLMAJOR, {"hidden": 7168, "block_channels": 7168, "sf_dtype": "int32", "out_dtype": "float32"}),
    (COLMAJOR, {"hidden": 7168, "block_tokens": 128, "block_channels": 128}),
    (COLMAJOR, {"hidden": 576, "block_channels": 16, "sf_dtype": "int32"}),  # 36 groups, 9 words
]
EVERY = [
    (NAME, {"hidden": 7168, "block_channels": 7168}),
    (NAME, {"hidden": 576, "block_tokens": 128, "block_channels": 128, "out_dtype": "float32"}),
    (COLMAJOR, {"hidden": 2560, "block_channels": 2560, "sf_dtype": "int32"}),
    (COLMAJOR, {"hidden": 256, "block_channels": 4}),
]


@pytest.mark.parametrize("name,static", STATIC, ids=_id)
def test_default_config_every_size(name, static):
    for t in (1, 7, 129, 4001, 8001):
        kern = tkjit.get(name, _full(static, t))
        for seed in (0, 1):
            assert check(kern, _full(static, t), seed=seed) is None


def test_every_config_in_the_space():
    check_every_config(EVERY, _full)


def test_strided_x_and_scales():
    """x = buf[:, 16:16 + width] of a wider int32 buffer, the scales a row-strided view: read in place."""
    static = {"hidden": 7168, "block_channels": 128}
    kern = tkjit.get(NAME, _full(static, 4001))
    x, sf = kern.spec.make_inputs(kern.spec.canonical_shape(_full(static, 4001)), "cuda", 3)
    buf = torch.zeros(4001, 2688 + 64, device="cuda", dtype=torch.int32)
    buf[:, 16:16 + 2688] = x
    assert sf.stride() == (59, 1)  # odd seeds: a row-strided scale view
    got = kern(buf[:, 16:16 + 2688], sf)
    want = kern.spec.reference(kern.shape | {"num_tokens": 4001, "num_sf_rows": 4001}, x.cpu(), sf.cpu())
    assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))


# -- tkjit.ops, torch.compile, opcheck ---------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["row", "col", "packed"])
def test_ops_round_trip(layout):
    x = torch.randn(4001, 7168, device="cuda", dtype=torch.bfloat16) * 3
    packed = layout == "packed"
    q, sf = tkjit.ops.per_token_cast_e5m6(x, round_scale=packed, col_major_scales=layout != "row",
                                          packed_ue8m0=packed)
    out = tkjit.ops.cast_back_e5m6(q, sf)
    _, sf_row = tkjit.ops.per_token_cast_e5m6(x, round_scale=packed)
    spec = tkjit.get_spec(NAME)
    want = spec.reference(spec.canonical_shape(_full({"hidden": 7168, "block_channels": 7168}, 4001)),
                          q.view(torch.int32), sf_row)
    assert torch.equal(_bits(out), _bits(want))
    assert torch.allclose(out.float(), x.float(), rtol=2**-6, atol=float(sf_row.max()) * 2**-14)


@pytest.mark.parametrize("layout", ["row", "col"])
def test_compile_fullgraph_bit_exact(layout):
    def model(q, sf):
        return tkjit.ops.cast_back_e5m6(q, sf, out_dtype=torch.float32) * 2

    compiled = torch.compile(model, fullgraph=True)
    for t in (4001, 129, 0):
        x = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
        q, sf = tkjit.ops.per_token_cast_e5m6(x, col_major_scales=layout == "col")
        assert torch.equal(compiled(q, sf), model(q, sf)), t


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("case", ["row", "col", "packed"])
def test_opcheck(case):
    x = torch.randn(37, 512, device="cuda", dtype=torch.bfloat16)
    q, sf = tkjit.ops.per_token_cast_e5m6(x, round_scale=True, col_major_scales=case != "row",
                                          packed_ue8m0=case == "packed")
    words = q.view(torch.int32)
    if case == "row":
        op, args = torch.ops.tkjit.cast_back_e5m6.default, (words, sf, 1, 512, "float32")
    else:
        op, args = torch.ops.tkjit.cast_back_e5m6_colmajor.default, (words, sf.T, 1, 512)
    result = torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result


def test_report_time_at_target():
    """Not a gate: the default config's time at 32768 x 7168 e5m6 -> bf16, one scale per token."""
    static = {"hidden": 7168, "block_channels": 7168}
    kern = tkjit.get(NAME, _full(static, 32768))
    x, sf = kern.spec.make_inputs(kern.spec.canonical_shape(_full(static, 32768)), "cuda", 0)
    out = kern(x, sf)
    us = median(time_cuda(lambda: kern(x, sf, out=out)))
    gbs = kern.spec.bytes_moved(kern.shape | {"num_tokens": 32768, "num_sf_rows": 32768}) / us / 1e3
    print(f"\ncast_back_e5m6 32768x7168 ->bf16 {kern.config}: {us:.1f} us/call, {gbs:.0f} GB/s")


# -- TileKernels, where installed: the same inputs through its cast_back, bit-exact --------------------------

def _tk():
    return pytest.importorskip("tile_kernels")


@pytest.mark.parametrize("n", [1, 129, 4001, 8001])
@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("layout", ["row", "col", "packed"])
def test_per_token_round_trip_matches_tile_kernels(n, hidden, layout):
    """tkjit's per_token_cast(fmt='e5m6') output back through tkjit's and TileKernels' cast_back."""
    tk = _tk()
    x = (torch.randn(n, hidden, device="cuda") * torch.exp(torch.randn(n, 1, device="cuda"))).bfloat16()
    packed = layout == "packed"
    q, sf = tkc.quant.per_token_cast(x, "e5m6", hidden, use_tma_aligned_col_major_sf=layout != "row",
                                     round_sf=packed, use_packed_ue8m0=packed)
    for fmt in ("bf16", "fp32"):
        out = tkc.quant.per_token_cast_back((q, sf), fmt, hidden, "e5m6")
        want = tk.quant.per_token_cast_back((q, sf), fmt, hidden, "e5m6")
        assert out.dtype == want.dtype and out.shape == want.shape and torch.equal(_bits(out), _bits(want)), fmt
        ref = tk.torch.cast_back_from_e5m6((q, sf), fmt, (1, hidden))
        assert torch.equal(_bits(out), _bits(ref)), fmt
        assert torch.equal(_bits(tkc.quant.cast_back((q, sf), fmt, (1, hidden), "e5m6")), _bits(want)), fmt


@pytest.mark.parametrize("n", [1, 129, 4001])
@pytest.mark.parametrize("hidden", [7168, 2048])
@pytest.mark.parametrize("block", [(1, None), (128, 128), (32, 32), (1, 128), (1, 32)])
@pytest.mark.parametrize("layout", ["row", "col", "packed"])
def test_random_block_scaled_matches_tile_kernels(n, hidden, block, layout):
    """The spec's random inputs (every finite code, scales of many magnitudes and zeros) in TileKernels' forms."""
    tk = _tk()
    block = (block[0], block[1] or hidden)
    name = NAME if layout == "row" else COLMAJOR
    spec = tkjit.get_spec(name)
    s = spec.canonical_shape({"num_tokens": n, "num_sf_rows": -(-n // block[0]), "hidden": hidden,
                              "block_tokens": block[0], "block_channels": block[1],
                              "sf_dtype": "int32" if layout == "packed" else "float32"})
    x, sf = spec.make_inputs(s, "cuda", n)
    q = x.view(torch.uint8)
    if layout != "row":
        sf = sf.T  # the column-major (num_sf_rows, ...) view TileKernels takes
    for fmt in ("bf16", "fp32"):
        out = tkc.quant.cast_back((q, sf), fmt, block, "e5m6")
        want = tk.quant.cast_back((q, sf), fmt, block, "e5m6")
        assert torch.equal(_bits(out), _bits(want)), fmt
        if layout != "packed":  # (its reference reads packed scales as a contiguous tensor only)
            assert torch.equal(_bits(out), _bits(tk.torch.cast_back_from_e5m6((q, sf), fmt, block))), fmt
