"""per_token_cast_e5m6(_colmajor) on the GPU: the default config at every shape and every config of the space,
bit-exact with the spec reference on poisoned outputs; strided x; tkjit.ops / torch.compile / opcheck; and
TileKernels' per_token_cast(fmt='e5m6') (its kernel and its torch reference `cast_to_e5m6`) on its own inputs
(`generate_e5m6_inputs`: random and the e5m6 special values), bit-exact: bytes, scales, layouts."""

import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as tkc
from tkjit.testing import check
from tkjit.timing import median, time_cuda
from tkjit_kernels.quant import _e5m6

sys.path.insert(0, str(Path(__file__).parents[1] / "helpers"))
from quant_checks import check_every_config
from quant_checks import float_bits as _bits  # noqa: E402
from quant_checks import param_id as _id

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
NAME, COLMAJOR = "per_token_cast_e5m6", "per_token_cast_e5m6_colmajor"
HIDDENS = (576, 2048, 2560, 3072, 4096, 6144, 7168)  # TileKernels' test hidden sizes
STATIC = [(NAME, {"hidden": h}) for h in HIDDENS] + [
    (NAME, {"hidden": 7168, "round_scale": True}),
    (NAME, {"hidden": 7168, "in_dtype": "float32"}),
    (NAME, {"hidden": 576, "in_dtype": "float32", "round_scale": True}),
    (NAME, {"hidden": 8}),
    (NAME, {"hidden": 24, "in_dtype": "float32"}),
    (NAME, {"hidden": 1000}),  # 125 chunks of 8: guarded last slots
    (NAME, {"hidden": 65536}),  # a 512-thread token
    (COLMAJOR, {"hidden": 7168}),
    (COLMAJOR, {"hidden": 576, "round_scale": True}),
    (COLMAJOR, {"hidden": 4096, "in_dtype": "float32"}),
]
EVERY = [
    (NAME, {"hidden": 7168}),
    (NAME, {"hidden": 576, "in_dtype": "float32", "round_scale": True}),
    (COLMAJOR, {"hidden": 2560}),
]


@pytest.mark.parametrize("name,static", STATIC, ids=_id)
def test_default_config_every_size(name, static):
    tokens = (1, 7, 129, 4001, 8001) if static["hidden"] <= 8192 else (1, 7, 129)
    for t in tokens:
        kern = tkjit.get(name, {**static, "num_tokens": t})
        for seed in (0, 1):
            assert check(kern, {**static, "num_tokens": t}, seed=seed) is None


def test_every_config_in_the_space():
    check_every_config(EVERY)


def test_strided_x():
    """x = buf[:, 16:16 + hidden] of a wider buffer: read in place, bit-exact."""
    kern = tkjit.get(NAME, {"hidden": 7168, "num_tokens": 4001})
    (x,) = kern.spec.make_inputs(kern.spec.canonical_shape({"hidden": 7168, "num_tokens": 4001}), "cuda", 1)
    buf = torch.zeros(4001, 7168 + 64, device="cuda", dtype=torch.bfloat16)
    buf[:, 16:16 + 7168] = x
    words, sf = kern(buf[:, 16:16 + 7168])
    want_w, want_sf = kern.spec.reference(kern.shape | {"num_tokens": 4001}, x)
    assert torch.equal(words, want_w) and torch.equal(sf, want_sf)


# -- tkjit.ops, torch.compile, opcheck ---------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["row", "col", "packed"])
def test_ops_layouts_and_round_trip(layout):
    x = torch.randn(4001, 7168, device="cuda", dtype=torch.bfloat16) * 3
    packed = layout == "packed"
    q, sf = tkjit.ops.per_token_cast_e5m6(x, round_scale=packed, col_major_scales=layout != "row",
                                          packed_ue8m0=packed)
    assert q.dtype == torch.uint8 and q.shape == (4001, 10752) and sf.shape == (4001, 1)
    spec = tkjit.get_spec(NAME)
    words, sf_row = spec.reference(spec.canonical_shape({"num_tokens": 4001, "hidden": 7168,
                                                         "round_scale": packed}), x)
    assert torch.equal(q.view(torch.int32), words)
    if layout != "row":
        assert sf.stride() == (1, 4004)
    if not packed:
        assert torch.equal(sf, sf_row)
    back = tkjit.ops.cast_back_e5m6(q, sf, out_dtype=torch.float32)
    assert torch.allclose(back, x.float(), rtol=2**-6, atol=float(sf_row.max()) * 2**-14)


def test_compile_fullgraph_bit_exact():
    def model(x):
        q, sf = tkjit.ops.per_token_cast_e5m6(x, col_major_scales=True)
        return q, sf * 2

    compiled = torch.compile(model, fullgraph=True)
    for t in (4001, 129, 0):
        x = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
        (q1, s1), (q2, s2) = compiled(x), model(x)
        assert torch.equal(q1, q2) and torch.equal(s1, s2), t


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("name", [NAME, COLMAJOR])
def test_opcheck(name):
    x = torch.randn(37, 512, device="cuda", dtype=torch.bfloat16)
    op = getattr(torch.ops.tkjit, name).default
    result = torch.library.opcheck(op, (x, True), test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result


def test_report_time_at_target():
    """Not a gate: the default config's time at 32768 x 7168 bf16."""
    kern = tkjit.get(NAME, {"hidden": 7168, "num_tokens": 32768})
    (x,) = kern.spec.make_inputs(kern.spec.canonical_shape({"hidden": 7168, "num_tokens": 32768}), "cuda", 0)
    outs = kern(x)
    us = median(time_cuda(lambda: kern(x, out=outs)))
    gbs = kern.spec.bytes_moved(kern.shape | {"num_tokens": 32768}) / us / 1e3
    print(f"\nper_token_cast_e5m6 32768x7168 bf16 {kern.config}: {us:.1f} us/call, {gbs:.0f} GB/s")


# -- TileKernels, where installed: bit-exact with its kernel and its torch reference ------------------------

def _tk():
    return pytest.importorskip("tile_kernels")


def _inputs(n, hidden, dtype):
    """TileKernels' generate_e5m6_inputs: a random tensor, then the special values (the smallest and largest
    subnormal, the smallest normal) with a last channel of 65024; plus rows of many magnitudes and a zero row."""
    yield torch.randn(n, hidden, device="cuda").to(dtype)
    for value in (_e5m6.SUBNORMAL_MIN, _e5m6.SUBNORMAL_MAX, _e5m6.NORMAL_MIN):
        x = torch.full((n, hidden), value, device="cuda", dtype=dtype)
        x[:, -1] = _e5m6.E5M6_MAX
        yield x
    x = torch.randn(n, hidden, device="cuda") * torch.exp(3 * torch.randn(n, 1, device="cuda"))
    x[::7] = 0
    yield x.to(dtype)


def _same(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a, b)


LAYOUTS = [  # (use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    (False, False, False), (False, True, False), (True, False, False), (True, True, False), (True, True, True),
]


@pytest.mark.parametrize("n", [1, 129, 4001, 8001])
@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: "-".join("TF"[not b] for b in v))
def test_matches_tile_kernels(n, hidden, dtype, layout):
    tk = _tk()
    col, round_sf, packed = layout
    for x in _inputs(n, hidden, dtype):
        q, sf = tkc.quant.per_token_cast(x, "e5m6", hidden, use_tma_aligned_col_major_sf=col, round_sf=round_sf,
                                         use_packed_ue8m0=packed)
        tq, tsf = tk.quant.per_token_cast(x, "e5m6", hidden, use_tma_aligned_col_major_sf=col, round_sf=round_sf,
                                          use_packed_ue8m0=packed)
        rq, rsf = tk.torch.cast_to_e5m6(x, hidden, col, round_sf, packed)
        assert _same(q, rq) and _same(sf, rsf), "torch reference"
        assert q.stride() == rq.stride() and sf.stride() == rsf.stride()
        assert _same(q, tq) and _same(sf, tsf), "TileKernels kernel"
        assert sf.stride() == tsf.stride()


@pytest.mark.parametrize("hidden", [576, 7168])
@pytest.mark.parametrize("fmt", ["bf16", "fp32"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: "-".join("TF"[not b] for b in v))
def test_round_trip_matches_tile_kernels(hidden, fmt, layout):
    """tkjit's cast, then tkjit's and TileKernels' cast_back (and its torch reference) of it."""
    tk = _tk()
    col, round_sf, packed = layout
    x = (torch.randn(4001, hidden, device="cuda") * 3).bfloat16()
    q, sf = tkc.quant.per_token_cast(x, "e5m6", hidden, use_tma_aligned_col_major_sf=col, round_sf=round_sf,
                                     use_packed_ue8m0=packed)
    out = tkc.quant.per_token_cast_back((q, sf), fmt, hidden, "e5m6")
    assert torch.equal(_bits(out), _bits(tk.quant.per_token_cast_back((q, sf), fmt, hidden, "e5m6")))
    assert torch.equal(_bits(out), _bits(tk.torch.cast_back_from_e5m6((q, sf), fmt, (1, hidden))))


