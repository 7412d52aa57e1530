"""per_token_cast_e2m1(_colmajor) on the GPU: the default config at a handful of shapes and every config of the
space at two, bit-exact with the spec reference on poisoned outputs (its make_inputs holds the rounding ties);
strided x; tkjit.ops / torch.compile / opcheck; and TileKernels' per_token_cast(fmt='e2m1'): its torch reference
`cast` first (bit-exact: bytes, scales, layouts), then its kernel where it builds here, then the round trip through
cast_back (tkjit's against TileKernels' and its torch reference); x_block_size (a quantised input re-cast) against
TileKernels' torch reference."""

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
from quant_checks import check_every_config
from quant_checks import float_bits as _bits  # noqa: E402
from quant_checks import param_id as _id
from quant_checks import tk_kernel_or_none as _tk_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
NAME, COLMAJOR = "per_token_cast_e2m1", "per_token_cast_e2m1_colmajor"
HIDDENS = (576, 2048, 2560, 3072, 4096, 6144, 7168)  # TileKernels' test hidden sizes
STATIC = [
    (NAME, {"hidden": 7168, "group": 32}),
    (NAME, {"hidden": 7168, "group": 16, "round_scale": True}),
    (NAME, {"hidden": 4096, "group": 128, "in_dtype": "float32"}),
    (NAME, {"hidden": 576, "group": 128}),  # a partial last group (64 channels)
    (NAME, {"hidden": 576, "group": 64, "in_dtype": "float32", "round_scale": True}),
    (NAME, {"hidden": 7168, "group": 7168}),  # one scale per token, a cross-warp amax
    (NAME, {"hidden": 16, "group": 16}),
    (COLMAJOR, {"hidden": 7168, "group": 32, "round_scale": True}),
    (COLMAJOR, {"hidden": 2560, "group": 16, "in_dtype": "float32"}),
]
EVERY = [
    (NAME, {"hidden": 7168, "group": 32}),
    (COLMAJOR, {"hidden": 576, "group": 128, "in_dtype": "float32", "round_scale": True}),
]


@pytest.mark.parametrize("name,static", STATIC, ids=_id)
def test_default_config_every_size(name, static):
    for t in (1, 7, 129, 4001, 8001):
        kern = tkjit.get(name, {**static, "num_tokens": t})
        for seed in (0, 1):
            assert check(kern, {**static, "num_tokens": t}, seed=seed) is None


def test_every_config_in_the_space():
    check_every_config(EVERY)


def test_strided_x():
    """x = buf[:, 16:16 + hidden] of a wider buffer: read in place, bit-exact."""
    shape = {"hidden": 7168, "group": 32, "num_tokens": 4001}
    kern = tkjit.get(NAME, shape)
    (x,) = kern.spec.make_inputs(kern.spec.canonical_shape(shape), "cuda", 1)
    buf = torch.zeros(4001, 7168 + 64, device="cuda", dtype=torch.bfloat16)
    buf[:, 16:16 + 7168] = x
    q, sf = kern(buf[:, 16:16 + 7168])
    want_q, want_sf = kern.spec.reference(kern.shape | {"num_tokens": 4001}, x)
    assert torch.equal(q, want_q) and torch.equal(sf, want_sf)


# -- tkjit.ops, torch.compile, opcheck ---------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["row", "col", "packed"])
def test_ops_layouts_and_round_trip(layout):
    x = torch.randn(4001, 7168, device="cuda", dtype=torch.bfloat16) * 3
    packed = layout == "packed"
    q, sf = tkjit.ops.per_token_cast_e2m1(x, 32, round_scale=packed, col_major_scales=layout != "row",
                                          packed_ue8m0=packed)
    assert q.dtype == torch.int8 and q.shape == (4001, 3584)
    spec = tkjit.get_spec(NAME)
    want_q, sf_row = spec.reference(spec.canonical_shape({"num_tokens": 4001, "hidden": 7168, "group": 32,
                                                          "round_scale": packed}), x)
    assert torch.equal(q, want_q)
    if layout != "row":
        assert sf.stride() == (1, 4004)
    if not packed:
        assert torch.equal(sf, sf_row)
    back = tkjit.ops.cast_back(q, sf, (1, 32), out_dtype=torch.float32)
    assert ((back - x.float()).abs() <= sf_row.repeat_interleave(32, 1)).all()  # half the widest step (2)


def test_compile_fullgraph_bit_exact():
    def model(x):
        q, sf = tkjit.ops.per_token_cast_e2m1(x, 32, col_major_scales=True)
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
    result = torch.library.opcheck(op, (x, 32, True), test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result


def test_report_time_at_target():
    """Not a gate: the default config's time at 32768 x 7168 bf16, group 32."""
    shape = {"hidden": 7168, "group": 32, "num_tokens": 32768}
    kern = tkjit.get(NAME, shape)
    (x,) = kern.spec.make_inputs(kern.spec.canonical_shape(shape), "cuda", 0)
    outs = kern(x)
    us = median(time_cuda(lambda: kern(x, out=outs)))
    gbs = kern.spec.bytes_moved(kern.shape | {"num_tokens": 32768}) / us / 1e3
    print(f"\nper_token_cast_e2m1 32768x7168 bf16 group 32 {kern.config}: {us:.1f} us/call, {gbs:.0f} GB/s")


# -- TileKernels, where installed: bit-exact with its torch reference, then its kernel ------------------------

def _tk():
    return pytest.importorskip("tile_kernels")


def _inputs(n, hidden, dtype):
    """A random tensor (TileKernels' tests), rows of many magnitudes with zero rows, and the spec's tie rows."""
    yield torch.randn(n, hidden, device="cuda").to(dtype)
    x = torch.randn(n, hidden, device="cuda") * torch.exp(3 * torch.randn(n, 1, device="cuda"))
    x[::7] = 0
    yield x.to(dtype)
    spec = tkjit.get_spec(NAME)
    (x,) = spec.make_inputs(spec.canonical_shape({"num_tokens": n, "hidden": hidden, "group": 16}), "cuda", 0)
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
MATCH = [(h, 32, torch.bfloat16, LAYOUTS[0]) for h in HIDDENS] + [
    (h, g, dt, layout)
    for h in (576, 7168)
    for g, dt in ((16, torch.bfloat16), (32, torch.float32), (64, torch.bfloat16), (128, torch.bfloat16),
                  (h, torch.bfloat16))
    for layout in LAYOUTS[1:]
]


@pytest.mark.parametrize("hidden,group,dtype,layout", MATCH, ids=lambda v: str(v).replace("torch.", ""))
def test_matches_tile_kernels(hidden, group, dtype, layout):
    tk = _tk()
    col, round_sf, packed = layout
    for n in (4001, 8001):
        for x in _inputs(n, hidden, dtype):
            q, sf = tkc.quant.per_token_cast(x, "e2m1", group, use_tma_aligned_col_major_sf=col, round_sf=round_sf,
                                             use_packed_ue8m0=packed)
            rq, rsf = tk.torch.cast(x, "e2m1", (1, group), round_sf=round_sf, use_tma_aligned_col_major_sf=col,
                                    use_packed_ue8m0=packed)
            assert _same(q, rq) and _same(sf, rsf), "torch reference"
            assert q.stride() == rq.stride() and sf.stride() == rsf.stride()
            sf_only = tkc.quant.per_token_cast_with_sf_only(x, "e2m1", group, use_tma_aligned_col_major_sf=col,
                                                            round_sf=round_sf, use_packed_ue8m0=packed)
            assert _same(sf_only, sf) and sf_only.stride() == sf.stride()
            got = _tk_kernel(tk.quant.per_token_cast, x, "e2m1", group, use_tma_aligned_col_major_sf=col,
                             round_sf=round_sf, use_packed_ue8m0=packed)
            if got is not None:
                tq, tsf = got
                if _same(tq, rq) and _same(tsf, rsf):  # (then ours is the same as the kernel's, by the asserts)
                    assert _same(q, tq) and _same(sf, tsf), "TileKernels kernel"
                else:  # TileKernels' kernel and its reference disagree: tkjit follows the reference
                    print(f"TileKernels' kernel differs from its torch reference at n={n} hidden={hidden} "
                          f"group={group} {dtype} {layout}")


@pytest.mark.parametrize("hidden,group", [(576, 32), (7168, 16), (7168, 128)])
@pytest.mark.parametrize("fmt", ["bf16", "fp32"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: "-".join("TF"[not b] for b in v))
def test_round_trip_matches_tile_kernels(hidden, group, fmt, layout):
    """tkjit's cast, then tkjit's and TileKernels' cast_back (and its torch reference) of it."""
    tk = _tk()
    col, round_sf, packed = layout
    x = (torch.randn(4001, hidden, device="cuda") * 3).bfloat16()
    q, sf = tkc.quant.per_token_cast(x, "e2m1", group, use_tma_aligned_col_major_sf=col, round_sf=round_sf,
                                     use_packed_ue8m0=packed)
    out = tkc.quant.per_token_cast_back((q, sf), fmt, group)
    assert torch.equal(_bits(out), _bits(tk.torch.cast_back((q, sf), fmt, (1, group))))
    got = _tk_kernel(tk.quant.per_token_cast_back, (q, sf), fmt, group)
    if got is not None:
        assert torch.equal(_bits(out), _bits(got))


# -- x_block_size: a quantised (values, scales) input, dequantised by cast_back then cast (two kernels) ----------

X_INPUTS = [  # (input format, its x_block_size, (use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0) of it)
    ("e4m3", (1, 128), (False, False, False)),
    ("e4m3", (1, 128), (True, True, True)),
    ("e2m1", (1, 32), (True, False, False)),
    ("e4m3", (128, 128), (False, False, False)),
    ("e2m1", (128, 128), (False, False, False)),  # per_block_cast's FP4 blocks
]


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
@pytest.mark.parametrize("in_fmt,block,in_layout", X_INPUTS, ids=str)
@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[-1]], ids=lambda v: "-".join("TF"[not b] for b in v))
def test_x_block_size_matches_tile_kernels(fmt, in_fmt, block, in_layout, layout):
    tk = _tk()
    col, round_sf, packed = layout
    x = torch.randn(4001, 7168, device="cuda").bfloat16()
    if block[0] == 1:
        values, sf = tkc.quant.per_token_cast(x, in_fmt, block[1], None, *in_layout)
    else:
        values, sf = tkc.quant.per_block_cast(x, in_fmt, block)
    q, out_sf = tkc.quant.per_token_cast((values, sf), fmt, 32, block, col, round_sf, packed)
    rq, rsf = tk.torch.cast((values, sf), fmt, (1, 32), x_block_size=block, round_sf=round_sf,
                            use_tma_aligned_col_major_sf=col, use_packed_ue8m0=packed)
    assert _same(q, rq) and _same(out_sf, rsf), "torch reference"
    assert q.stride() == rq.stride() and out_sf.stride() == rsf.stride()
    got = _tk_kernel(tk.quant.per_token_cast, (values, sf), fmt, 32, block, col, round_sf, packed)
    if got is not None:
        tq, tsf = got
        if _same(tq, rq) and _same(tsf, rsf):
            assert _same(q, tq) and _same(out_sf, tsf), "TileKernels kernel"
        else:  # its kernel folds the input scale into the factor (another rounding): tkjit follows the reference
            print(f"TileKernels' kernel differs from its torch reference: {fmt} {in_fmt} {block} {in_layout} {layout}")
