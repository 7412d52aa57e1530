"""per_block_cast(_colmajor, _with_sf) specs on the CPU: shapes, constraints, reference semantics (hand-checked
and block by block), scale layouts (CeilDiv rows), the ops, torch ops and compat layer over reference-writing
kernels, sm_90a cross-compiles."""

import inspect
import sys
from pathlib import Path

import pytest
import torch

import tkjit
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit.kernel import CompiledKernel
from tkjit.registry import get_spec
from tkjit.spec import CeilDiv, validate

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from quant_checks import word_same as _same
from reference_kernels import serve_references  # noqa: E402

NAME, COLMAJOR, WITH_SF = "per_block_cast", "per_block_cast_colmajor", "per_block_cast_with_sf"
NAMES = (NAME, COLMAJOR, WITH_SF)


def _shape(**kw):
    return {"num_tokens": 16, "hidden": 256, "block_m": 32, "block_k": 32, **kw}


@pytest.mark.parametrize("name", NAMES)
def test_specs_validate(name):
    spec = get_spec(name)
    validate(spec)
    assert spec.family == "quant" and spec.tolerance.exact
    for ex in spec.examples:
        full = spec.canonical_shape(ex)
        assert spec.default_config(full, "sm_90a") in spec.configs(full, "sm_90a")
    import tkjit_kernels

    assert tkjit_kernels.INDEX[name] == "tkjit_kernels.quant.per_block_cast"
    assert ("round_scale" in [p.name for p in spec.params]) == (name != WITH_SF)


@pytest.mark.parametrize("in_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("block_m", [1, 32, 64, 128])
@pytest.mark.parametrize("block_k", [32, 64, 128])
@pytest.mark.parametrize("hidden", [7168, 4096, 2048, 576, 1536, 64, 16, 48, 65536])
def test_defaults_valid(in_dtype, block_m, block_k, hidden):
    spec = get_spec(NAME)
    full = spec.canonical_shape(_shape(hidden=hidden, block_m=block_m, block_k=block_k, in_dtype=in_dtype))
    cfg = spec.default_config(full, "sm_90a")
    assert spec.check_config(full, cfg, "sm_90a") == cfg


def test_default_heuristic_tiles():
    spec = get_spec(NAME)

    def cfg(**kw):
        return spec.default_config(spec.canonical_shape(_shape(hidden=7168, **kw)), "sm_90a")

    # TileKernels' tiles: 128 x 128 and 32 x 256 for bf16 (8192+ elements per CTA of 256 threads).
    assert cfg(block_m=128, block_k=128) == {"vec": 8, "tile_k": 128, "threads": 256}
    assert cfg(block_m=32, block_k=32) == {"vec": 8, "tile_k": 256, "threads": 256}
    assert cfg(block_m=128, block_k=32) == {"vec": 8, "tile_k": 64, "threads": 256}
    assert cfg(block_m=32, block_k=128, in_dtype="float32") == {"vec": 4, "tile_k": 128, "threads": 256}


def test_bad_shapes():
    spec = get_spec(NAME)
    with pytest.raises(ShapeError, match="multiple of 16"):
        spec.canonical_shape(_shape(hidden=584))
    with pytest.raises(ShapeError, match="block_m.*not allowed"):
        spec.canonical_shape(_shape(block_m=16))
    with pytest.raises(ShapeError, match="block_k.*not allowed"):
        spec.canonical_shape(_shape(block_k=256))
    with pytest.raises(ShapeError, match="in_dtype.*not allowed"):
        spec.canonical_shape(_shape(in_dtype="float16"))
    with pytest.raises(ShapeError, match="must be a bool"):
        spec.canonical_shape(_shape(round_scale=1))
    with pytest.raises(ShapeError, match="round_scale"):
        get_spec(WITH_SF).canonical_shape(_shape(round_scale=True))


def test_bad_configs():
    spec = get_spec(NAME)
    full = spec.canonical_shape(_shape(hidden=7168, block_m=128, block_k=128, in_dtype="float32"))
    with pytest.raises(ConfigError, match="at most 32 bytes"):
        spec.check_config(full, {"vec": 16, "tile_k": 128, "threads": 256})
    with pytest.raises(ConfigError, match="not a multiple of block_k"):
        spec.check_config(full, {"vec": 4, "tile_k": 64, "threads": 256})
    with pytest.raises(ConfigError, match="spill"):
        spec.check_config(full, {"vec": 8, "tile_k": 1024, "threads": 512})
    with pytest.raises(ConfigError, match="exceed threads"):
        spec.check_config(full, {"vec": 4, "tile_k": 1024, "threads": 128})
    with pytest.raises(ConfigError, match="rows per pass exceed block_m"):
        spec.check_config(spec.canonical_shape(_shape(block_m=1, block_k=128)),
                          {"vec": 8, "tile_k": 128, "threads": 256})
    with pytest.raises(ConfigError, match="CUDA targets only"):
        spec.check_config(full, spec.default_config(full), "cpu")


@pytest.mark.parametrize("n, hidden, bm, bk, rows, cols", [
    (3, 7168, 128, 128, 1, 56), (4001, 7168, 128, 128, 32, 56), (4096, 576, 32, 128, 128, 5),
    (33, 48, 32, 32, 2, 2), (1, 16, 1, 32, 1, 1), (65, 1024, 64, 64, 2, 16),
])
def test_output_dims(n, hidden, bm, bk, rows, cols):
    full = get_spec(NAME).canonical_shape({"num_tokens": n, "hidden": hidden, "block_m": bm, "block_k": bk})
    (o, odt, odims), (s, sdt, sdims) = get_spec(NAME).output_decls(full)
    assert (o, odt, odims) == ("out", "float8_e4m3fn", (n, hidden))
    assert (s, sdt, sdims) == ("scales", "float32", (rows, cols))
    assert get_spec(NAME).bytes_moved(full) == n * hidden * 3 + rows * cols * 4
    padded = -(-rows // 4) * 4
    assert get_spec(COLMAJOR).output_decls(full)[1] == ("scales", "float32", (cols, padded))
    assert get_spec(COLMAJOR).bytes_moved(full) == n * hidden * 3 + cols * padded * 4
    sf = get_spec(WITH_SF)
    assert sf.inputs[1].resolve(full) == ("float32", (rows, cols))
    assert sf.output_decls(full) == [("out", "float8_e4m3fn", (n, hidden))]


def _blockwise(x, bm, bk, round_scale):
    """An independent per-block path: each tile's real elements, quantised on their own."""
    n, h = x.shape
    rows, cols = -(-n // bm), -(-h // bk)
    q = torch.empty(n, h, dtype=torch.float8_e4m3fn)
    sf = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            tile = x[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk].float()
            amax = tile.abs().max().clamp(min=1e-4).reshape(1)
            s = amax / torch.tensor([448.0])
            if round_scale:
                s = torch.pow(2.0, torch.ceil(torch.log2(s.double()))).float()  # exact for these magnitudes
                inv = torch.tensor([1.0]) / s
            else:
                inv = torch.tensor([448.0]) / amax
            sf[i, j] = s
            q[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk] = (tile * inv).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, sf


@pytest.mark.parametrize("round_scale", [False, True])
@pytest.mark.parametrize("n, hidden, bm, bk, dtype", [
    (70, 256, 32, 32, "bfloat16"), (130, 576, 128, 128, "float32"), (41, 576, 32, 128, "bfloat16"),
    (5, 48, 32, 32, "float32"), (9, 160, 1, 64, "bfloat16"), (129, 384, 64, 128, "bfloat16"),
])
def test_reference_matches_block_by_block(n, hidden, bm, bk, dtype, round_scale):
    spec = get_spec(NAME)
    s = spec.canonical_shape({"num_tokens": n, "hidden": hidden, "block_m": bm, "block_k": bk, "in_dtype": dtype,
                              "round_scale": round_scale})
    (x,) = spec.make_inputs(s, "cpu", n)
    q, sf = spec.reference(s, x)
    q2, sf2 = _blockwise(x, bm, bk, round_scale)
    assert _same(sf, sf2) and _same(q, q2)
    if round_scale:  # the given-scales cast with these scales gives the same values (1 / sf both ways)
        assert _same(get_spec(WITH_SF).reference(s, x, sf), q)


def test_reference_hand_checked():
    """hidden 48, blocks 32 x 32, 40 tokens: tiles (0, 0) 32 x 32, (0, 1) 32 x 16, (1, 0) 8 x 32, (1, 1) 8 x 16."""
    spec = get_spec(NAME)
    s = spec.canonical_shape({"num_tokens": 40, "hidden": 48, "block_m": 32, "block_k": 32, "in_dtype": "float32"})
    x = torch.zeros(40, 48)
    x[0, 0] = 1000.0  # tile (0, 0): scale 1000 / 448
    x[31, 31] = -3.0
    x[7, 40] = 896.0  # tile (0, 1): scale 2, 896 -> 448
    x[12, 33] = 3.0  # 1.5
    x[35, 10] = 14.0  # tile (1, 0): scale 14 / 448 = 1/32, values * 32
    x[39, 31] = -7.0  # -> -224
    x[32:, 32:] = 1e-6  # tile (1, 1): under the clamp, amax 1e-4
    q, sf = spec.reference(s, x)
    assert q.shape == (40, 48) and q.is_contiguous() and sf.shape == (2, 2) and sf.is_contiguous()
    assert sf[0, 0].item() == (torch.tensor(1000.0) / torch.tensor(448.0)).item() and q[0, 0].float().item() == 448.0
    assert sf[0, 1].item() == 2.0 and q[7, 40].float().item() == 448.0 and q[12, 33].float().item() == 1.5
    assert sf[1, 0].item() == 1 / 32 and q[35, 10].float().item() == 448.0 and q[39, 31].float().item() == -224.0
    assert sf[1, 1].item() == (torch.tensor(1e-4) / torch.tensor(448.0)).item()
    assert q[33, 40].float().item() == 4.5  # 1e-6 * 448 / 1e-4 = 4.48 -> nearest e4m3 4.5
    cm = get_spec(COLMAJOR)
    q_c, storage = cm.reference(s, x)
    assert storage.shape == (2, 4) and torch.equal(storage[:, :2].T, sf) and (storage[:, 2:] == 0).all()
    assert not storage.signbit().any() and _same(q_c, q)
    sr = {**s, "round_scale": True}  # 1000 / 448 = 2.23 -> 4: 1000 / 4 = 250 -> e4m3 256 (step 16 there)
    q_r, sf_r = spec.reference(sr, x)
    assert sf_r[0, 0].item() == 4.0 and q_r[0, 0].float().item() == 256.0 and sf_r[0, 1].item() == 2.0


def test_reference_with_sf_hand_checked():
    spec = get_spec(WITH_SF)
    s = spec.canonical_shape({"num_tokens": 3, "hidden": 64, "block_m": 32, "block_k": 32, "in_dtype": "float32"})
    x = torch.zeros(3, 64)
    x[0, 0], x[1, 1], x[2, 40], x[2, 41] = 3.0, 1000.0, -10.0, 0.3
    sf = torch.tensor([[0.5, 1.0 / 3.0]])
    q = spec.reference(s, x, sf)
    assert q.shape == (3, 64) and q.dtype == torch.float8_e4m3fn
    assert q[0, 0].float().item() == 6.0 and q[1, 1].float().item() == 448.0  # 2000 clamped
    inv = sf[0, 1].reciprocal()  # 1 / (1/3 in float32): 3 rounded
    assert q[2, 40].float().item() == torch.tensor(-10.0 * inv.item()).to(torch.float8_e4m3fn).float().item() == -30
    assert q[2, 41].float().item() == 0.875  # 0.9 -> nearest e4m3 0.875
    strided = torch.zeros(1, 8)[:, :2]
    strided.copy_(sf)
    assert _same(spec.reference(s, x, strided), q)


def test_make_inputs():
    spec = get_spec(NAME)
    full = spec.canonical_shape(_shape(num_tokens=70, hidden=576))
    (x,) = spec.make_inputs(full, "cpu", 3)
    assert x.dtype == torch.bfloat16 and x.shape == (70, 576) and (x[5] == 0).all()
    assert x[32:40, :32].float().abs().max() < 1e-4 and x[0].float().abs().max() > 0
    x2, sf = get_spec(WITH_SF).make_inputs({**full, "in_dtype": "float32"}, "cpu", 3)
    assert x2.dtype == torch.float32 and sf.shape == (3, 18) and sf.dtype == torch.float32 and (sf > 0).all()
    # Some products pass 448 (the clamp is exercised).
    inv = sf.reciprocal().repeat_interleave(32, 0).repeat_interleave(32, 1)[:70, :576]
    assert (x2 * inv).abs().max() > 448


# -- CeilDiv: the launcher's checks and allocation ----------------------------------------------------
def _fake_kernel(name, shape):
    """A CompiledKernel whose 'launch' writes the reference: exercises checks, allocation, ops views."""
    spec = get_spec(name)
    full = spec.canonical_shape(shape)

    def launch(*args):
        n_in = len(spec.inputs)
        ref = spec.reference({**full, "num_tokens": args[0].shape[0]}, *args[:n_in])
        for o, r in zip(args[n_in:], ref if isinstance(ref, tuple) else (ref,)):
            o.copy_(r)

    return CompiledKernel(spec, full, spec.default_config(full, "sm_90a"), "cpu", "0" * 40, "explicit", Path("."),
                          launch)


def test_ceildiv_dims():
    d = CeilDiv("num_tokens", "block_m")
    assert d.of(65, {"block_m": 32}) == 3 and d.of(64, {"block_m": 32}) == 2 and d.of(0, {"block_m": 32}) == 0
    assert CeilDiv("n", 32, 4).of(65) == 4 and CeilDiv("n", 32, 4).of(129) == 8
    assert str(CeilDiv("n", "block_m", 4)) == "align(ceil(n / block_m), 4)"
    assert d.resolved({"block_m": 128}) == CeilDiv("num_tokens", 128)


def test_ceildiv_allocates_and_checks_scales():
    k = _fake_kernel(NAME, {"num_tokens": 65, "hidden": 256, "block_m": 32, "block_k": 32})
    x = torch.randn(65, 256, dtype=torch.bfloat16)
    q, sf = k(x)
    assert q.shape == (65, 256) and sf.shape == (3, 8)
    out = torch.empty(65, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(TensorError, match=r"expected ceil\(num_tokens / 32\) \(3\)"):
        k(x, out=(out, torch.empty(2, 8)))
    with pytest.raises(TensorError, match="must be 8"):
        k(x, out=(out, torch.empty(3, 7)))
    k(x, out=(out, torch.empty(3, 8)))
    q0, sf0 = k(x[:0])
    assert q0.shape == (0, 256) and sf0.shape == (0, 8)
    cm = _fake_kernel(COLMAJOR, {"num_tokens": 65, "hidden": 256, "block_m": 32, "block_k": 32})
    q, storage = cm(x)
    assert storage.shape == (8, 4)
    with pytest.raises(TensorError, match=r"align\(ceil\(num_tokens / 32\), 4\) \(4\)"):
        cm(x, out=(out, torch.empty(8, 3)))


def test_ceildiv_checks_given_scales():
    k = _fake_kernel(WITH_SF, {"num_tokens": 65, "hidden": 256, "block_m": 32, "block_k": 32})
    x, sf = get_spec(WITH_SF).make_inputs(get_spec(WITH_SF).canonical_shape(_shape(num_tokens=65)), "cpu", 1)
    q = k(x, sf)
    assert _same(q, get_spec(WITH_SF).reference(k.shape, x, sf))
    with pytest.raises(TensorError, match=r"input sf axis 0 is 2, expected ceil\(num_tokens / 32\) \(3\)"):
        k(x, sf[:2])
    with pytest.raises(TensorError, match="sf"):
        k(x, sf[:, :7])
    wide = torch.zeros(3, 16)
    wide[:, :8] = sf
    assert _same(k(x, wide[:, :8]), q)  # a row-strided view of the scales is read in place
    with pytest.raises(TensorError, match="contiguous last axis"):
        k(x, sf.T.contiguous().T)


# -- ops, torch ops, compat over reference-writing kernels ------------------------------------------
@pytest.fixture
def reference_kernels(monkeypatch):
    return serve_references(monkeypatch, NAMES)


@pytest.mark.parametrize("n", [0, 1, 5, 65, 130])
def test_ops_layouts(reference_kernels, n):
    import tkjit.ops

    x = torch.randn(n, 576) * 3
    q, s = tkjit.ops.per_block_cast(x, (32, 128))
    rows = -(-n // 32)
    assert q.shape == (n, 576) and s.shape == (rows, 5) and s.dtype == torch.float32
    qc, sc = tkjit.ops.per_block_cast(x, (32, 128), col_major_scales=True)
    assert sc.shape == (rows, 5) and _same(qc, q) and torch.equal(sc, s)
    if n:
        assert s.stride() == (5, 1) and sc.stride() == (1, -(-rows // 4) * 4)
        full = get_spec(NAME).canonical_shape({"num_tokens": n, "hidden": 576, "block_m": 32, "block_k": 128,
                                               "in_dtype": "float32"})
        q_ref, s_ref = get_spec(NAME).reference(full, x)
        assert _same(q, q_ref) and _same(s, s_ref)
        assert _same(tkjit.ops.per_block_cast_with_sf(x, s_ref * 2, (32, 128)),
                     get_spec(WITH_SF).reference(full, x, s_ref * 2))
    qp, sp = tkjit.ops.per_block_cast(x, (32, 128), round_scale=True, col_major_scales=True, packed_ue8m0=True)
    assert sp.dtype == torch.int32 and sp.shape == (rows, 2)
    with pytest.raises(ShapeError, match="packed_ue8m0 needs col_major_scales"):
        tkjit.ops.per_block_cast(x, (32, 128), packed_ue8m0=True)


@pytest.mark.parametrize("n", [0, 5, 70])
def test_fake_impls(n):
    from torch._subclasses.fake_tensor import FakeTensorMode

    import tkjit.ops

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(n, 576, dtype=torch.bfloat16))
        q, s = torch.ops.tkjit.per_block_cast(x, 32, 128)
        _, storage = torch.ops.tkjit.per_block_cast_colmajor(x, 32, 32)
        q2, s2 = tkjit.ops.per_block_cast(x, (32, 128), col_major_scales=True)
        sf = mode.from_tensor(torch.ones(-(-n // 32), 5))
        q3 = torch.ops.tkjit.per_block_cast_with_sf(x, sf, 32, 128)
        with pytest.raises(TensorError, match=r"sf has shape \(\d+, 4\), expected \(ceil\(num_tokens / 32\), 5\)"):
            torch.ops.tkjit.per_block_cast_with_sf(x, mode.from_tensor(torch.ones(-(-n // 32), 4)), 32, 128)
        with pytest.raises(TensorError, match="input sf has dtype torch.float64, expected torch.float32"):
            torch.ops.tkjit.per_block_cast_with_sf(x, mode.from_tensor(torch.ones(-(-n // 32), 5).double()), 32, 128)
    rows = -(-n // 32)
    assert q.shape == (n, 576) and q.dtype == torch.float8_e4m3fn and s.shape == (rows, 5)
    assert storage.shape == (18, -(-rows // 4) * 4)
    assert q2.shape == (n, 576) and s2.shape == (rows, 5) and q3.shape == (n, 576)


def test_opcheck(reference_kernels):
    import tkjit.ops  # noqa: F401

    x = torch.randn(70, 256, dtype=torch.bfloat16)
    for op in (torch.ops.tkjit.per_block_cast.default, torch.ops.tkjit.per_block_cast_colmajor.default):
        torch.library.opcheck(op, (x, 32, 128, True, None))
    sf = torch.rand(3, 2) + 0.5
    torch.library.opcheck(torch.ops.tkjit.per_block_cast_with_sf.default, (x, sf, 32, 128, None))


def test_compat_signatures_are_tile_kernels():
    """TileKernels 1.0.0's signatures (quant/per_block_cast_kernel.py), hard-coded."""
    import tkjit.compat.tile_kernels as tk

    base = ("(x: torch.Tensor, fmt: str, block_size: tuple[int, int], {}use_tma_aligned_col_major_sf: bool = False, "
            "round_sf: bool = False, use_packed_ue8m0: bool = False)")

    def sig(f):
        return str(inspect.signature(f)).replace("'", "")  # (annotations are strings here)

    assert sig(tk.quant.per_block_cast) == base.format("") + " -> QuantTensor"
    assert sig(tk.quant.per_block_cast_with_sf_only) == base.format("") + " -> torch.Tensor"
    assert sig(tk.quant.per_block_cast_with_precomputed_sf) == base.format("sf: torch.Tensor, ") + " -> torch.Tensor"


def _strides(t):
    """Strides of the axes longer than 1 (a length-1 axis's stride is arbitrary)."""
    return [s for s, n in zip(t.stride(), t.shape) if n > 1]


def _tk_ref(x, block, round_sf=False, col=False, packed=False):
    """TileKernels' torch reference `cast` for e4m3 blocks, re-derived: masked block amax, scale layouts."""
    bm, bk = block
    n, h = x.shape
    spec = get_spec(NAME)
    full = spec.canonical_shape({"num_tokens": max(n, 1), "hidden": h, "block_m": bm, "block_k": bk,
                                 "in_dtype": "bfloat16" if x.dtype == torch.bfloat16 else "float32",
                                 "round_scale": round_sf})
    q, sf = spec.reference(full, x)
    if not col:
        return q, sf
    bits = sf.view(torch.int32)
    padded = torch.nn.functional.pad(bits, (0, (-bits.shape[1]) % 4 if packed else 0, 0, (-bits.shape[0]) % 4))
    dq = (padded >> 23).to(torch.int8).view(torch.int32) if packed else padded.view(torch.float32)
    return q, dq.T.contiguous().T[: sf.shape[0], :]


@pytest.mark.parametrize("n, hidden, block, dtype", [
    (70, 256, (32, 32), torch.bfloat16), (130, 576, (128, 128), torch.float32), (41, 576, (32, 128), torch.bfloat16),
    (200, 320, (128, 32), torch.bfloat16), (1, 64, (32, 32), torch.float32),
])
@pytest.mark.parametrize("col, round_sf, packed", [(False, False, False), (False, True, False), (True, False, False),
                                                   (True, True, True), (True, False, True)])
def test_compat_per_block_cast_layouts(reference_kernels, n, hidden, block, dtype, col, round_sf, packed):
    import tkjit.compat.tile_kernels as tk

    g = torch.Generator().manual_seed(n + hidden)
    x = (torch.randn(n, hidden, generator=g) * torch.exp(2 * torch.randn(n, 1, generator=g))).to(dtype)
    q, sf = tk.quant.per_block_cast(x, "e4m3", block, col, round_sf, packed)
    q_ref, sf_ref = _tk_ref(x, block, round_sf, col, packed)
    assert _same(q, q_ref) and q.is_contiguous()
    assert sf.dtype == sf_ref.dtype and sf.shape == sf_ref.shape and _strides(sf) == _strides(sf_ref)
    assert torch.equal(sf, sf_ref)
    only = tk.quant.per_block_cast_with_sf_only(x, "e4m3", block, col, round_sf, packed)
    assert torch.equal(only, sf) and only.stride() == sf.stride()
    if not col:
        assert _same(tk.quant.per_block_cast_with_precomputed_sf(x, "e4m3", block, sf * 1.5),
                     get_spec(WITH_SF).reference({"block_m": block[0], "block_k": block[1], "hidden": hidden}, x,
                                                 sf * 1.5))


@pytest.mark.parametrize("col, packed", [(False, False), (True, False), (True, True)])
def test_compat_no_tokens(reference_kernels, col, packed):
    import tkjit.compat.tile_kernels as tk

    x = torch.empty(0, 256, dtype=torch.bfloat16)
    q, sf = tk.quant.per_block_cast(x, "e4m3", (32, 128), col, packed, packed)
    assert q.shape == (0, 256) and sf.shape == (0, 1 if packed else 2)
    assert sf.dtype == (torch.int32 if packed else torch.float32)
    assert tk.quant.per_block_cast_with_precomputed_sf(x, "e4m3", (32, 128), torch.empty(0, 2)).shape == (0, 256)


def _compat(fn="per_block_cast"):
    import tkjit.compat.tile_kernels as tk

    return getattr(tk.quant, fn)


@pytest.mark.parametrize("call, error, match", [
    (lambda: _compat()(torch.zeros(4, 256), "e3m4", (32, 32)), ShapeError, "fmt must be one of"),
    (lambda: _compat()(torch.zeros(4, 256), "e2m1", (32, 32)), NotImplementedError, "fmt='e2m1'"),
    (lambda: _compat("per_block_cast_with_sf_only")(torch.zeros(4, 256), "e5m6", (32, 32)), NotImplementedError,
     "fmt='e5m6'"),
    (lambda: _compat()(torch.zeros(4, 256), "e4m3", (1, 128)), ShapeError, r"block_size=\(1, 128\) must be made of"),
    (lambda: _compat()(torch.zeros(4, 256), "e4m3", (32, 64)), ShapeError, "block_size"),
    (lambda: _compat()(torch.zeros(4, 256), "e4m3", 32), ShapeError, "block_size must be a"),
    (lambda: _compat()(torch.zeros(4, 256), "e4m3", ("32", 32)), ShapeError, "block_size must be an int"),
    (lambda: _compat()(torch.zeros(4, 256), "e4m3", (32, 32), False, True, True), ShapeError,
     "use_packed_ue8m0=True needs use_tma_aligned_col_major_sf=True"),
    (lambda: _compat()(torch.zeros(4, 96), "e4m3", (32, 32)), ShapeError, "multiple of 64"),
    (lambda: _compat()(torch.zeros(4, 256, dtype=torch.float16), "e4m3", (32, 32)), TensorError, "x must be"),
    (lambda: _compat()(torch.zeros(2, 4, 256), "e4m3", (32, 32)), TensorError, "x must be 2-D"),
    (lambda: _compat()(torch.zeros(256, 4).T, "e4m3", (32, 32)), TensorError, "x must be contiguous"),
    (lambda: _compat("per_block_cast_with_precomputed_sf")(torch.zeros(4, 256), "e4m3", (32, 32), torch.ones(1, 8),
                                                           True), ShapeError, "must be row-major"),
    (lambda: _compat("per_block_cast_with_precomputed_sf")(torch.zeros(4, 256), "e4m3", (32, 32), torch.ones(1, 8),
                                                           False, False, True), ShapeError, "must be row-major"),
    (lambda: _compat("per_block_cast_with_precomputed_sf")(torch.zeros(4, 256), "e4m3", (32, 32),
                                                           torch.ones(1, 8).double()), TensorError, "sf must be"),
    (lambda: _compat("per_block_cast_with_precomputed_sf")(torch.zeros(4, 256), "e4m3", (32, 32), [1.0]),
     TensorError, "sf must be a torch.Tensor"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_compat_refusals(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_compat_precomputed_sf_shape_is_checked(reference_kernels):
    x = torch.zeros(65, 256)
    with pytest.raises(TensorError, match="sf"):
        _compat("per_block_cast_with_precomputed_sf")(x, "e4m3", (32, 32), torch.ones(2, 8))
    with pytest.raises(TensorError, match="sf"):
        _compat("per_block_cast_with_precomputed_sf")(x, "e4m3", (32, 32), torch.ones(3, 4))


# -- sm_90a cross-compiles ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name, shape, config", [
    (NAME, {"hidden": 7168, "block_m": 128, "block_k": 128}, None),  # DeepSeek weights: 16 rows per pass
    (NAME, {"hidden": 7168, "block_m": 32, "block_k": 32, "round_scale": True}, None),
    (NAME, {"hidden": 576, "block_m": 32, "block_k": 128, "in_dtype": "float32"}, None),  # partial tile columns
    (NAME, {"hidden": 160, "block_m": 1, "block_k": 32}, None),  # one row per tile: no shared step
    (NAME, {"hidden": 4096, "block_m": 64, "block_k": 64}, {"vec": 16, "tile_k": 512, "threads": 512}),
    (COLMAJOR, {"hidden": 7168, "block_m": 128, "block_k": 128}, None),
    (COLMAJOR, {"hidden": 576, "block_m": 32, "block_k": 32, "round_scale": True},
     {"vec": 4, "tile_k": 64, "threads": 128}),
    (WITH_SF, {"hidden": 7168, "block_m": 128, "block_k": 128}, None),
    (WITH_SF, {"hidden": 576, "block_m": 32, "block_k": 128, "in_dtype": "float32"}, None),
])
def test_compiles_for_sm90a(cache_dir, name, shape, config):
    k = tkjit.get(name, {"num_tokens": 4001, **shape}, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    assert "__fdiv_rn" in src  # IEEE divisions whatever the fast-math setting
    assert "__NV_E4M3" in src
    if shape.get("round_scale"):
        assert "8388607" in src or "0x7fffff" in src.lower()
    if name == WITH_SF:
        assert "__shfl_xor_sync" not in src and "sf_stride" in src.replace("sf_stride0", "sf_stride")
    else:
        assert "__shfl_xor_sync" in src
        assert src.count("scales[") == (2 if name == COLMAJOR else 1)
