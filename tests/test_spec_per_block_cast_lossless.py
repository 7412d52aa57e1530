"""per_block_cast_lossless(_colmajor) specs on the CPU: shapes, constraints, the reference against an independent
block-by-block re-blocking (values * scales unchanged), the lossless limits and their diagnosis, the ops, torch
ops and compat layer over reference-writing kernels (scale layouts in and out, lossy inputs refused), sm_90a
cross-compiles."""

import inspect
import sys
from pathlib import Path

import pytest
import torch

import tkjit
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit.registry import get_spec
from tkjit.spec import validate

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from quant_checks import word_same as _same
from reference_kernels import serve_references  # noqa: E402

NAME, COLMAJOR = "per_block_cast_lossless", "per_block_cast_lossless_colmajor"
NAMES = (NAME, COLMAJOR)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _shape(**kw):
    return {"num_tokens": 70, "hidden": 256, "in_block_m": 1, "in_block_k": 32, "out_block_m": 32,
            "out_block_k": 128, **kw}


def _decode(x):
    b = x.view(torch.uint8).long()
    t = torch.tensor(E2M1)
    return torch.stack([t[b & 15], t[b >> 4]], -1).reshape(x.shape[0], -1)


def _expand(s, bm, bk, n, h):
    return s.repeat_interleave(bm, 0).repeat_interleave(bk, 1)[:n, :h]


def _blockwise(x, sf, bi, bo):
    """Independent: per output block, scale = its largest input scale / 64, values = x's values / scale (float64,
    checked exact), each block on its own."""
    n, h = x.shape[0], x.shape[1] * 2
    vals = _decode(x).double() * _expand(sf.double(), *bi, n, h)
    rows, cols = -(-n // bo[0]), -(-h // bo[1])
    q = torch.empty(n, h, dtype=torch.float8_e4m3fn)
    scales = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            r0, c0 = i * bo[0] // bi[0], j * bo[1] // bi[1]
            block = sf[r0:r0 + bo[0] // bi[0], c0:c0 + bo[1] // bi[1]]
            s = block.max().double() / 64
            scales[i, j] = s
            v = vals[i * bo[0]:(i + 1) * bo[0], j * bo[1]:(j + 1) * bo[1]] / s
            f = v.to(torch.float8_e4m3fn)
            assert torch.equal(f.double(), v), "not exact"
            q[i * bo[0]:(i + 1) * bo[0], j * bo[1]:(j + 1) * bo[1]] = f
    return q, scales


@pytest.mark.parametrize("name", NAMES)
def test_specs_validate(name):
    spec = get_spec(name)
    validate(spec)
    assert spec.family == "quant" and spec.tolerance.exact
    for ex in spec.examples:
        full = spec.canonical_shape(ex)
        assert spec.default_config(full, "sm_90a") in spec.configs(full, "sm_90a")
    import tkjit_kernels

    assert tkjit_kernels.INDEX[name] == "tkjit_kernels.quant.per_block_cast_lossless"
    assert [o.name for o in spec.outputs] == ["out", "scales", "lossy"] and spec.outputs[2].zeroed


@pytest.mark.parametrize("bi, bo", [((1, 32), (128, 128)), ((1, 32), (1, 128)), ((32, 32), (128, 128)),
                                    ((1, 16), (32, 64)), ((1, 8), (64, 1024)), ((4, 128), (128, 128)),
                                    ((1, 32), (96, 128)), ((128, 128), (128, 128))])
@pytest.mark.parametrize("hidden", [7168, 2048, 4096, 576, 160, 32, 65536])
def test_defaults_valid(bi, bo, hidden):
    spec = get_spec(NAME)
    full = spec.canonical_shape(_shape(hidden=hidden, in_block_m=bi[0], in_block_k=bi[1], out_block_m=bo[0],
                                       out_block_k=bo[1]))
    cfg = spec.default_config(full, "sm_90a")
    assert spec.check_config(full, cfg, "sm_90a") == cfg


def test_bad_shapes():
    spec = get_spec(NAME)
    with pytest.raises(ShapeError, match="multiple of 32"):
        spec.canonical_shape(_shape(hidden=272))
    with pytest.raises(ShapeError, match="out_block_m=32 must be a multiple of in_block_m=3"):
        spec.canonical_shape(_shape(in_block_m=3))
    with pytest.raises(ShapeError, match="out_block_k=128 must be a multiple of in_block_k=256"):
        spec.canonical_shape(_shape(in_block_k=256))
    with pytest.raises(ShapeError, match="in_block_k.*not allowed"):
        spec.canonical_shape(_shape(in_block_k=4))
    with pytest.raises(ShapeError, match="out_block_k.*not allowed"):
        spec.canonical_shape(_shape(out_block_k=96))


def test_bad_configs():
    spec = get_spec(NAME)
    full = spec.canonical_shape(_shape(hidden=7168, in_block_k=16))
    with pytest.raises(ConfigError, match="must divide in_block_k"):
        spec.check_config(full, {"vec": 32, "tile_k": 128, "row_blocks": 1, "threads": 128})
    with pytest.raises(ConfigError, match="not a multiple of out_block_k"):
        spec.check_config(full, {"vec": 16, "tile_k": 64, "row_blocks": 1, "threads": 128})
    with pytest.raises(ConfigError, match="chunks per thread hold"):
        spec.check_config(full, {"vec": 16, "tile_k": 2048, "row_blocks": 4, "threads": 128})
    with pytest.raises(ConfigError, match="rows per tile exceed"):
        spec.check_config(full, {"vec": 16, "tile_k": 128, "row_blocks": 16, "threads": 512})
    with pytest.raises(ConfigError, match="CUDA targets only"):
        spec.check_config(full, spec.default_config(full), "cpu")


def test_output_dims():
    full = get_spec(NAME).canonical_shape(_shape(num_tokens=70, hidden=576))
    assert get_spec(NAME).inputs[0].resolve(full) == ("int8", (70, 288))
    assert get_spec(NAME).inputs[1].resolve(full) == ("float32", (70, 18))
    assert get_spec(NAME).output_decls(full) == [("out", "float8_e4m3fn", (70, 576)), ("scales", "float32", (3, 5)),
                                                 ("lossy", "int32", (1,))]
    assert get_spec(COLMAJOR).output_decls(full)[1] == ("scales", "float32", (5, 4))
    assert get_spec(NAME).bytes_moved(full) == 70 * 576 * 3 // 2 + 70 * 18 * 4 + 3 * 5 * 4


@pytest.mark.parametrize("n, hidden, bi, bo", [
    (70, 256, (1, 32), (32, 128)), (130, 576, (1, 32), (128, 128)), (5, 160, (1, 32), (1, 128)),
    (67, 96, (2, 16), (8, 32)), (33, 1024, (32, 32), (128, 128)), (9, 64, (1, 8), (4, 64)),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_matches_block_by_block(n, hidden, bi, bo, seed):
    spec = get_spec(NAME)
    s = spec.canonical_shape({"num_tokens": n, "hidden": hidden, "in_block_m": bi[0], "in_block_k": bi[1],
                              "out_block_m": bo[0], "out_block_k": bo[1]})
    x, sf = spec.make_inputs(s, "cpu", seed)
    assert sf.stride(1) == 1 and (sf.stride(0) != sf.shape[1]) == bool(seed % 2)
    q, scales, lossy = spec.reference(s, x, sf)
    q2, scales2 = _blockwise(x, sf, bi, bo)
    assert lossy.tolist() == [0] and _same(q, q2) and _same(scales, scales2)
    # Lossless: the values times their scales are x's values times its scales.
    before = _decode(x) * _expand(sf, *bi, n, hidden)
    assert torch.equal(q.float() * _expand(scales, *bo, n, hidden), before)
    # make_inputs reaches both limits: a block at the max and one 2^11 below it.
    from tkjit_kernels.quant.per_block_cast_lossless import exponents
    e = exponents(sf)
    eo = (torch.log2(scales).long() + 127).repeat_interleave(bo[0] // bi[0], 0)
    eo = eo.repeat_interleave(bo[1] // bi[1], 1)[: e.shape[0], : e.shape[1]]
    assert (e - eo).max() == 6 and (e - eo).min() >= -5
    if n * hidden >= 8192:
        assert (e - eo).min() == -5
    _, storage, lossy2 = get_spec(COLMAJOR).reference(s, x, sf)
    assert lossy2.tolist() == [0] and torch.equal(storage[:, : scales.shape[0]].T, scales)
    assert (storage[:, scales.shape[0]:] == 0).all() and storage.shape[1] % 4 == 0


def test_reference_hand_checked():
    """hidden 64, input blocks (1, 32), output blocks (2, 64): 3 tokens, output rows (0, 1) and (2)."""
    spec = get_spec(NAME)
    s = spec.canonical_shape({"num_tokens": 3, "hidden": 64, "in_block_m": 1, "in_block_k": 32, "out_block_m": 2,
                              "out_block_k": 64})
    x = torch.zeros(3, 32, dtype=torch.int8)
    x[0, 0] = 0x7F  # codes 15 (low nibble: -6), 7 (+6)
    x[1, 16] = 0x01  # 0.5 at channel 32
    x[2, 0] = 0x08  # -0.0, then +0
    sf = torch.tensor([[2.0**10, 2.0**3], [2.0**-1, 2.0**10], [2.0**-20, 2.0**-22]])
    q, scales, lossy = spec.reference(s, x, sf)
    assert lossy.tolist() == [0]
    assert scales.tolist() == [[2.0**4], [2.0**-26]]  # the largest input scale / 64
    assert q[0, 0].float().item() == -384.0 and q[0, 1].float().item() == 384.0  # 6 * 2^(10 - 4)
    assert q[1, 32].float().item() == 0.5 * 2.0**6
    assert q[2, 0].view(torch.uint8).item() == 0x80 and q[2, 1].view(torch.uint8).item() == 0  # -0.0 stays
    from tkjit_kernels.quant.per_block_cast_lossless import problem

    assert problem(s, sf) is None  # 2^-1 is 2^11 below 2^10: the limit, still exact


@pytest.mark.parametrize("edit, match", [
    (lambda sf: sf.__setitem__((1, 0), 2.0**-2), r"input scale block \(1, 0\) \(tokens 1..1, channels 0..31\) of "
     r"output block \(0, 0\) has scale 2\^-2, 2\^12 below the block's largest input scale 2\^10"),
    (lambda sf: sf.__setitem__((2, 1), 3.0), r"block \(2, 1\).*scale 3.0, not a positive normal power of two"),
    (lambda sf: sf.__setitem__((0, 1), 0.0), r"block \(0, 1\).*scale 0.0, not a positive"),
    (lambda sf: sf.__setitem__((0, 1), -8.0), r"block \(0, 1\).*scale -8.0, not a positive"),
    (lambda sf: sf.__setitem__((0, 1), float("inf")), r"block \(0, 1\).*scale inf, not a positive"),
    (lambda sf: sf.__setitem__((0, 1), 2.0**-130), r"block \(0, 1\).*not a positive normal"),
    (lambda sf: sf[2].fill_(2.0**-121), r"output block \(1, 0\)'s largest input scale is 2\^-121: its output scale "
     r"2\^-127 would be below float32's normal range"),
])
def test_lossy_inputs_are_diagnosed(edit, match):
    from tkjit_kernels.quant.per_block_cast_lossless import problem

    spec = get_spec(NAME)
    s = spec.canonical_shape({"num_tokens": 3, "hidden": 64, "in_block_m": 1, "in_block_k": 32, "out_block_m": 2,
                              "out_block_k": 64})
    x = torch.zeros(3, 32, dtype=torch.int8)
    sf = torch.tensor([[2.0**10, 2.0**3], [2.0**-1, 2.0**10], [2.0**-20, 2.0**-22]])
    edit(sf)
    assert spec.reference(s, x, sf)[2].tolist() == [1]
    msg = problem(s, sf)
    assert msg is not None
    import re

    assert re.search(match, msg), msg


# -- ops, torch ops, compat over reference-writing kernels ------------------------------------------
@pytest.fixture
def reference_kernels(monkeypatch):
    return serve_references(monkeypatch, NAMES)


def _inputs(n, hidden=576, bi=(1, 32), bo=(32, 128), seed=0):
    spec = get_spec(NAME)
    s = spec.canonical_shape({"num_tokens": max(n, 1), "hidden": hidden, "in_block_m": bi[0], "in_block_k": bi[1],
                              "out_block_m": bo[0], "out_block_k": bo[1]})
    x, sf = spec.make_inputs(s, "cpu", seed)
    return x[:n], sf[: -(-n // bi[0])], s


def _packed(sf):
    """(rows, cols) power-of-two float32 -> the column-major packed UE8M0 int32 (rows, ceil(cols / 4)) view."""
    from tkjit.scales import pack_ue8m0

    rows = sf.shape[0]
    storage = torch.zeros(sf.shape[1], -(-rows // 4) * 4)
    storage[:, :rows] = sf.T
    return pack_ue8m0(storage)[:, :rows].T


@pytest.mark.parametrize("n", [0, 1, 5, 70])
def test_ops_layouts(reference_kernels, n):
    import tkjit.ops

    x, sf, s = _inputs(n)
    q, sc = tkjit.ops.per_block_cast_lossless(x, sf, (1, 32), (32, 128))
    rows = -(-n // 32)
    assert q.shape == (n, 576) and q.dtype == torch.float8_e4m3fn and sc.shape == (rows, 5)
    if n:
        q_ref, sc_ref, _ = get_spec(NAME).reference({**s, "num_tokens": n}, x, sf)
        assert _same(q, q_ref) and _same(sc, sc_ref)
    qc, scc = tkjit.ops.per_block_cast_lossless(x, sf, (1, 32), (32, 128), col_major_scales=True)
    assert _same(qc, q) and torch.equal(scc, sc)
    if n:
        assert scc.stride() == (1, -(-rows // 4) * 4)
    qp, scp = tkjit.ops.per_block_cast_lossless(x, sf, (1, 32), (32, 128), col_major_scales=True, packed_ue8m0=True)
    assert _same(qp, q) and scp.dtype == torch.int32 and scp.shape == (rows, 2)
    if n:
        assert torch.equal(scp, _packed(sc))
        # The input scales column-major, or packed: the same cast.
        cm = torch.zeros(sf.shape[1], -(-sf.shape[0] // 4) * 4)
        cm[:, : sf.shape[0]] = sf.T
        assert _same(tkjit.ops.per_block_cast_lossless(x, cm[:, : sf.shape[0]].T, (1, 32), (32, 128))[0], q)
        assert _same(tkjit.ops.per_block_cast_lossless(x, _packed(sf), (1, 32), (32, 128))[0], q)
    with pytest.raises(ShapeError, match="packed_ue8m0 needs col_major_scales"):
        tkjit.ops.per_block_cast_lossless(x, sf, (1, 32), (32, 128), packed_ue8m0=True)


def test_ops_lossy_raises(reference_kernels):
    import tkjit.ops

    x, sf, _ = _inputs(70)
    sf = sf.clone()
    sf[40, 3] = sf[32:64, :4].max() * 2.0**-12
    with pytest.raises(TensorError, match=r"would lose values: input scale block \(40, 3\) \(tokens 40..40, channels "
                                          r"96..127\) of output block \(1, 0\) has scale 2\^-?\d+, 2\^12 below"):
        tkjit.ops.per_block_cast_lossless(x, sf, (1, 32), (32, 128))
    sf[40, 3] = 1.0 / 3.0
    with pytest.raises(TensorError, match="not a positive normal power of two"):
        tkjit.ops.per_block_cast_lossless(x, sf, (1, 32), (32, 128), col_major_scales=True)


@pytest.mark.parametrize("n", [0, 5, 70])
def test_fake_impls(n):
    from torch._subclasses.fake_tensor import FakeTensorMode

    import tkjit.ops

    x, sf, _ = _inputs(n)
    xu, sfd = x.view(torch.uint8), sf.double()
    with FakeTensorMode() as mode:
        fx, fsf = mode.from_tensor(x), mode.from_tensor(sf.contiguous())
        q, s = torch.ops.tkjit.per_block_cast_lossless(fx, fsf, 1, 32, 32, 128)
        _, storage = torch.ops.tkjit.per_block_cast_lossless_colmajor(fx, fsf, 1, 32, 32, 128)
        q2, s2 = tkjit.ops.per_block_cast_lossless(fx, fsf, (1, 32), (32, 128), col_major_scales=True)
        with pytest.raises(TensorError, match="sf must be float32"):
            torch.ops.tkjit.per_block_cast_lossless(fx, mode.from_tensor(sfd), 1, 32, 32, 128)
        with pytest.raises(TensorError, match="x must be int8"):
            torch.ops.tkjit.per_block_cast_lossless(mode.from_tensor(xu), fsf, 1, 32, 32, 128)
    rows = -(-n // 32)
    assert q.shape == (n, 576) and q.dtype == torch.float8_e4m3fn and s.shape == (rows, 5)
    assert storage.shape == (5, -(-rows // 4) * 4) and q2.shape == (n, 576) and s2.shape == (rows, 5)


def test_opcheck(reference_kernels):
    import tkjit.ops  # noqa: F401

    x, sf, _ = _inputs(70)
    ops = torch.ops.tkjit
    for op in (ops.per_block_cast_lossless.default, ops.per_block_cast_lossless_colmajor.default):
        torch.library.opcheck(op, (x, sf.contiguous(), 1, 32, 32, 128, None))


def test_compat_signature_is_tile_kernels():
    """TileKernels 1.0.0's signature (quant/per_block_cast_lossless_kernel.py), hard-coded."""
    import tkjit.compat.tile_kernels as tk

    sig = str(inspect.signature(tk.quant.per_block_cast_lossless)).replace("'", "")
    assert sig == ("(x: QuantTensor, fmt: str, x_block_size: tuple[int, int], out_block_size: tuple[int, int], "
                   "use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False, use_packed_ue8m0: bool = "
                   "False) -> QuantTensor")


def _tk_layout(sc, col, packed):
    """TileKernels' output scale layouts from the row-major float32 scales (its alloc_scaling_factors and
    cast_epilogue): the column-major TMA-aligned view, packed four column blocks per int32."""
    if not col:
        return sc
    if packed:
        return _packed(sc)
    storage = torch.zeros(sc.shape[1], -(-sc.shape[0] // 4) * 4)
    storage[:, : sc.shape[0]] = sc.T
    return storage[:, : sc.shape[0]].T


def _strides(t):
    return [s for s, n in zip(t.stride(), t.shape) if n > 1]


@pytest.mark.parametrize("n, hidden, bi, bo", [
    (70, 256, (1, 32), (32, 128)), (130, 7168, (1, 32), (128, 128)), (5, 160, (1, 32), (1, 128)),
    (33, 1024, (32, 32), (128, 128)),
])
@pytest.mark.parametrize("in_layout", ["row", "col", "packed"])
@pytest.mark.parametrize("col, packed", [(False, False), (True, False), (True, True)])
def test_compat_layouts(reference_kernels, n, hidden, bi, bo, in_layout, col, packed):
    import tkjit.compat.tile_kernels as tk

    x, sf, s = _inputs(n, hidden, bi, bo, seed=n)
    q_ref, sc_ref, _ = get_spec(NAME).reference(s, x, sf)
    if in_layout == "col":
        cm = torch.zeros(sf.shape[1], -(-sf.shape[0] // 4) * 4)
        cm[:, : sf.shape[0]] = sf.T
        sf = cm[:, : sf.shape[0]].T
    elif in_layout == "packed":
        sf = _packed(sf)
    q, sc = tk.quant.per_block_cast_lossless((x, sf), "e4m3", bi, bo, col, True, packed)
    want = _tk_layout(sc_ref, col, packed)
    assert _same(q, q_ref) and q.is_contiguous()
    assert sc.dtype == want.dtype and sc.shape == want.shape and _strides(sc) == _strides(want)
    assert torch.equal(sc, want)


def test_compat_lossy_raises(reference_kernels):
    import tkjit.compat.tile_kernels as tk

    x, sf, _ = _inputs(70)
    sf = sf.clone()
    sf[3, 0] = 1.5
    with pytest.raises(TensorError, match=r"input scale block \(3, 0\).*not a positive normal power of two"):
        tk.quant.per_block_cast_lossless((x, sf), "e4m3", (1, 32), (32, 128))


def _call(x=None, fmt="e4m3", bi=(1, 32), bo=(32, 128), *rest):
    import tkjit.compat.tile_kernels as tk

    if x is None:
        x = (torch.zeros(4, 128, dtype=torch.int8), torch.ones(4, 8))
    return tk.quant.per_block_cast_lossless(x, fmt, bi, bo, *rest)


@pytest.mark.parametrize("call, error, match", [
    (lambda: _call(fmt="e5m6"), ShapeError, "e2m1 -> 'e4m3' only"),
    (lambda: _call(fmt="e3m4"), ShapeError, "fmt must be one of"),
    (lambda: _call(torch.zeros(4, 128, dtype=torch.int8)), TensorError, "x must be a \\(values, scales\\) tuple"),
    (lambda: _call((torch.zeros(4, 128, dtype=torch.uint8), torch.ones(4, 8))), TensorError, "x\\[0\\].*int8"),
    (lambda: _call((torch.zeros(4, 128, dtype=torch.int8), torch.ones(4, 8).double())), TensorError, "x\\[1\\]"),
    (lambda: _call((torch.zeros(128, 4, dtype=torch.int8).T, torch.ones(4, 8))), TensorError, "contiguous"),
    (lambda: _call((torch.zeros(4, 128, dtype=torch.int8), torch.ones(4, 9))), TensorError, "expected \\(4, 8\\)"),
    (lambda: _call((torch.zeros(4, 128, dtype=torch.int8), torch.ones(3, 8))), TensorError, "expected \\(4, 8\\)"),
    (lambda: _call((torch.zeros(4, 128, dtype=torch.int8), torch.ones(4, 16, dtype=torch.int32))), TensorError,
     "float32 with a contiguous last axis"),
    (lambda: _call((torch.zeros(4, 40, dtype=torch.int8), torch.ones(4, 3))), ShapeError, "multiple of 32"),
    (lambda: _call(bi=(1, 48)), ShapeError, "power-of-two num_per_channels"),
    (lambda: _call(bi=(0, 32)), ShapeError, "must be positive"),
    (lambda: _call(bo=(32, 16)), ShapeError, "must be a multiple of x_block_size"),
    (lambda: _call(bi=(2, 32), bo=(33, 128)), ShapeError, "must be a multiple of x_block_size"),
    (lambda: _call(bo=128), ShapeError, "out_block_size must be a"),
    (lambda: _call(bi=("1", 32)), ShapeError, "x_block_size\\[0\\] must be an int"),
    (lambda: _call(None, "e4m3", (1, 32), (32, 128), False, False, True), ShapeError,
     "use_packed_ue8m0=True needs use_tma_aligned_col_major_sf=True"),
    (lambda: _call((torch.zeros(4, 128, dtype=torch.int8), torch.ones(4, 64)), "e4m3", (1, 4), (32, 128)),
     NotImplementedError, "x_block_size\\[1\\]=4"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_compat_refusals(call, error, match):
    with pytest.raises(error, match=match):
        call()


# -- sm_90a cross-compiles ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name, shape, config", [
    (NAME, {"hidden": 7168}, None),  # MXFP4 (1, 32) -> DeepGEMM's (128, 128)
    (NAME, {"hidden": 7168, "out_block_m": 1}, None),  # -> (1, 128): 32 output block rows per tile
    (NAME, {"hidden": 160, "in_block_m": 2, "in_block_k": 16, "out_block_m": 8, "out_block_k": 32}, None),
    (NAME, {"hidden": 576, "out_block_m": 96}, {"vec": 8, "tile_k": 128, "row_blocks": 1, "threads": 512}),
    (COLMAJOR, {"hidden": 7168}, None),
    (COLMAJOR, {"hidden": 576, "in_block_m": 32, "out_block_m": 32, "out_block_k": 64}, None),
])
def test_compiles_for_sm90a(cache_dir, name, shape, config):
    k = tkjit.get(name, {"num_tokens": 4001, **shape}, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    assert "__shfl_xor_sync" in src and "fp8_e4" in src
    body = src[src.index("buf_dyn_shmem[]"):]
    assert body.count("__syncthreads") == 2  # none inside a divergent branch
    assert src.count("scales[") == (2 if name == COLMAJOR else 1)
