"""per_block_cast(_colmajor, _with_sf) specs on the CPU, fmt e4m3 and e2m1: shapes, constraints, reference
semantics (hand-checked and block by block; e2m1 also against nearest rounding and a dequantisation), scale layouts
(CeilDiv rows), the ops, torch ops and compat layer over reference-writing kernels (the kernels are CUDA-only),
sm_90a cross-compiles."""

import inspect
import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops
import tkjit.torch_ops
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit.kernel import CompiledKernel
from tkjit.registry import get_spec
from tkjit.spec import CeilDiv, validate
from tkjit_kernels.quant import _e2m1
from tkjit_kernels.quant import per_block_cast as pbc

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
    fmt = next(p for p in spec.params if p.name == "fmt")
    assert fmt.default == "e4m3" and tuple(fmt.values) == ("e4m3", "e2m1")
    assert any(ex.get("fmt") == "e2m1" for ex in spec.examples)  # CI cross-compiles the examples' defaults


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("in_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("block_m", [1, 32, 64, 128])
@pytest.mark.parametrize("block_k", [32, 64, 128])
@pytest.mark.parametrize("hidden", [7168, 4096, 2048, 576, 1536, 64, 16, 48, 65536])
def test_defaults_valid(in_dtype, block_m, block_k, hidden, fmt):
    spec = get_spec(NAME)
    full = spec.canonical_shape(_shape(hidden=hidden, block_m=block_m, block_k=block_k, in_dtype=in_dtype, fmt=fmt))
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
    for name in NAMES:
        with pytest.raises(ShapeError, match="fmt.*not allowed"):
            get_spec(name).canonical_shape(_shape(fmt="e5m6"))
        with pytest.raises(ShapeError, match="fmt"):
            get_spec(name).canonical_shape(_shape(fmt=4))


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


def test_e2m1_space_is_e4m3s():
    """e2m1 changes only the store (vec / 2 bytes a chunk): the same configs, the same defaults; a chunk of an odd
    number of codes (no candidate of the space has one) would not fill whole bytes."""
    spec = get_spec(NAME)
    for shape in (_shape(hidden=7168, block_m=128, block_k=128), _shape(hidden=576, block_m=1, block_k=64),
                  _shape(hidden=48, in_dtype="float32")):
        e4, e2 = spec.canonical_shape(shape), spec.canonical_shape({**shape, "fmt": "e2m1"})
        assert spec.configs(e4, "sm_90a") == spec.configs(e2, "sm_90a")
        assert spec.default_config(e4, "sm_90a") == spec.default_config(e2, "sm_90a")
    full = spec.canonical_shape(_shape(hidden=7168, fmt="e2m1"))
    odd = {"vec": 5, "tile_k": 160, "threads": 128}  # passes every other rule at blocks 32 x 32
    assert "whole bytes" in pbc.constraint(full, odd)
    assert pbc.constraint({**full, "fmt": "e4m3"}, odd) is None


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
    # e2m1: int8 values of two codes per byte, hidden / 2 of them a row; the same scales.
    fp4 = {**full, "fmt": "e2m1"}
    eb = 2  # bfloat16 x
    assert get_spec(NAME).output_decls(fp4) == [("out", "int8", (n, hidden // 2)), ("scales", "float32", (rows, cols))]
    assert get_spec(NAME).bytes_moved(fp4) == n * hidden * eb + n * hidden // 2 + rows * cols * 4
    assert get_spec(COLMAJOR).output_decls(fp4)[0] == ("out", "int8", (n, hidden // 2))
    assert get_spec(COLMAJOR).bytes_moved(fp4) == n * hidden * eb + n * hidden // 2 + cols * padded * 4
    assert sf.output_decls({k: v for k, v in fp4.items() if k != "round_scale"}) == [("out", "int8", (n, hidden // 2))]


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


# -- e2m1 references ----------------------------------------------------------------------------------
E2M1_FLOOR = 6 * 2.0**-126  # TileKernels' e2m1 amax clamp
GRID = torch.tensor(_e2m1.E2M1[:8], dtype=torch.float64)  # the eight magnitudes
TIE_CODES = (0, 10, 2, 12, 4, 14, 6, 15, 0, 8, 0, 9, 7, 6, 5, 1)  # _e2m1.TIES at scale 1, worked by hand


def _blockwise_e2m1(x, bm, bk, round_scale):
    """An independent per-block path for e2m1: each tile's real elements scaled on their own (UE8M0 in float64) and
    encoded by `_e2m1.encode` (itself checked against a brute-force nearest-even search in
    test_spec_per_token_cast_e2m1.py); (packed values, scales, the float32 products x * inv)."""
    n, h = x.shape
    rows, cols = -(-n // bm), -(-h // bk)
    y = torch.empty(n, h)
    sf = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            tile = x[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk].float()
            amax = tile.abs().max().clamp(min=E2M1_FLOOR).reshape(1)
            s = amax / torch.tensor([6.0])
            if round_scale:
                s = torch.pow(2.0, torch.ceil(torch.log2(s.double()))).float()  # s >= 2^-126: exact
                inv = torch.tensor([1.0]) / s
            else:
                inv = torch.tensor([6.0]) / amax
            sf[i, j] = s
            y[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk] = tile * inv
    return _e2m1.pack(_e2m1.encode(y)), sf, y


def _is_nearest_even(codes, y):
    """Whether each code is the e2m1 value nearest y (saturating at 6), ties to the even code, with y's sign."""
    mag, yd = codes & 7, y.double().abs()
    dist = (GRID[None, :] - yd.reshape(-1, 1)).abs()
    best = dist.min(dim=1).values.view(y.shape)
    got = (GRID[mag] - yd).abs()
    ties = (dist == best.reshape(-1, 1)).sum(dim=1).view(y.shape) > 1
    return bool((got == best).all() and (~ties | (mag % 2 == 0)).all() and ((codes >= 8) == y.signbit()).all())


E2M1_CASES = [(70, 256, 32, 32, "bfloat16"), (130, 576, 128, 128, "float32"), (41, 576, 32, 128, "bfloat16"),
              (5, 48, 32, 32, "float32"), (9, 160, 1, 64, "bfloat16"), (129, 384, 64, 128, "bfloat16")]


@pytest.mark.parametrize("round_scale", [False, True])
@pytest.mark.parametrize("n, hidden, bm, bk, dtype", E2M1_CASES)
def test_e2m1_reference_matches_block_by_block(n, hidden, bm, bk, dtype, round_scale):
    spec = get_spec(NAME)
    s = spec.canonical_shape({"num_tokens": n, "hidden": hidden, "block_m": bm, "block_k": bk, "in_dtype": dtype,
                              "round_scale": round_scale, "fmt": "e2m1"})
    (x,) = spec.make_inputs(s, "cpu", n)
    q, sf = spec.reference(s, x)
    q2, sf2, y = _blockwise_e2m1(x, bm, bk, round_scale)
    assert q.dtype == torch.int8 and q.shape == (n, hidden // 2) and q.is_contiguous()
    assert _same(sf, sf2) and torch.equal(q, q2)
    codes = _e2m1.unpack(q)
    assert _is_nearest_even(codes, y)
    # Dequantised, each value is within half an e2m1 step (0.5 below 2, 1 below 4, 2 up to 6) of x, in scale units.
    scale = sf.repeat_interleave(bm, 0).repeat_interleave(bk, 1)[:n, :hidden].double()
    step = torch.where(y.abs() < 2, 0.5, torch.where(y.abs() < 4, 1.0, 2.0)).double()
    err = (_e2m1.decode(codes).double() * scale - x.double()).abs()
    assert (err <= step / 2 * scale * (1 + 1e-5)).all()
    if round_scale:  # the given-scales cast with these scales gives the same values (1 / sf both ways)
        assert torch.equal(get_spec(WITH_SF).reference(s, x, sf), q)


def test_e2m1_reference_hand_checked():
    """hidden 64, blocks 32 x 32, 40 tokens: tiles (0, 0), (0, 1) 32 x 32, (1, 0), (1, 1) 8 x 32. Byte j of a row
    holds channel 2j in its low nibble."""
    spec = get_spec(NAME)
    s = spec.canonical_shape({"num_tokens": 40, "hidden": 64, "block_m": 32, "block_k": 32, "in_dtype": "float32",
                              "fmt": "e2m1"})
    x = torch.zeros(40, 64)
    x[0, 0], x[1, 1], x[2, 2] = 3.0, 0.3, -1.25  # tile (0, 0): scale 0.5, inv 2: 6, 0.6 -> 0.5, -2.5 -> -2 (even)
    x[5, 40], x[6, 41], x[7, 42], x[7, 43] = -12.0, 7.0, 0.5, -0.0  # (0, 1): inv 0.5: -6, 3.5 -> 4, 0.25 -> 0, -0
    x[33, 3] = -0.0  # tile (1, 0): all zeros, amax clamped to 6 * 2^-126: scale 2^-126; -0.0 keeps its sign
    x[39, 63] = 3 * 2.0**-128  # tile (1, 1): under the clamp too, inv 2^126: 0.75 -> 1 (the even code)
    q, sf = spec.reference(s, x)
    assert q.shape == (40, 32) and q.dtype == torch.int8 and sf.shape == (2, 2)
    assert sf.tolist() == [[0.5, 2.0], [2.0**-126, 2.0**-126]]
    assert (q[0, 0].item(), q[1, 0].item(), q[2, 1].item()) == (7, 1 << 4, 12)  # codes 7 | 0, 0 | 1, 4 + 8 | 0
    assert (q[5, 20].item(), q[6, 20].item(), q[7, 21].item()) == (15, 6 << 4, -128)  # 15 | 0, 0 | 6, 0 | 8
    assert (q[33, 1].item(), q[39, 31].item()) == (-128, 2 << 4)  # 0 | 8, 0 | 2
    nonzero = {(0, 0), (1, 0), (2, 1), (5, 20), (6, 20), (7, 21), (33, 1), (39, 31)}
    assert all(q[r, c].item() == 0 for r in range(40) for c in range(32) if (r, c) not in nonzero)
    q_c, storage = get_spec(COLMAJOR).reference(s, x)
    assert torch.equal(q_c, q) and storage.shape == (2, 4) and torch.equal(storage[:, :2].T, sf)
    q_r, sf_r = spec.reference({**s, "round_scale": True}, x)  # every scale is a power of two already
    assert torch.equal(q_r, q) and torch.equal(sf_r, sf)


def test_e2m1_reference_with_sf_hand_checked():
    spec = get_spec(WITH_SF)
    s = spec.canonical_shape({"num_tokens": 3, "hidden": 64, "block_m": 32, "block_k": 32, "in_dtype": "float32",
                              "fmt": "e2m1"})
    x = torch.zeros(3, 64)
    x[0, 0], x[0, 1], x[1, 1], x[2, 40], x[2, 41] = 3.0, -0.1, 1000.0, -10.0, 0.3
    q = spec.reference(s, x, torch.tensor([[0.5, 1.0 / 3.0]]))
    assert q.shape == (3, 32) and q.dtype == torch.int8
    # 6 | -0.2 -> -0 (code 8); 2000 saturates (code 7, high nibble); about -30 saturates | 0.9 -> 1 (code 2).
    assert (q[0, 0].item(), q[1, 0].item(), q[2, 20].item()) == ((7 | 8 << 4) - 256, 7 << 4, 15 | 2 << 4)


def test_e2m1_make_inputs_holds_ties():
    """The last block row is rows of `_e2m1.TIES` scaled per block column: at scale 1 and 2^-100 (exact inverses)
    their codes are the hand-worked ones."""
    spec = get_spec(NAME)
    for dtype in ("bfloat16", "float32"):
        s = spec.canonical_shape({"num_tokens": 70, "hidden": 576, "block_m": 32, "block_k": 128, "in_dtype": dtype,
                                  "fmt": "e2m1"})
        (x,) = spec.make_inputs(s, "cpu", 3)
        assert x.dtype == getattr(torch, dtype) and x.shape == (70, 576)
        ties = torch.tensor(_e2m1.TIES).repeat(8).to(x.dtype)
        assert torch.equal(x[64:, :128], ties.expand(6, -1)) and (x[64:, 128:256] == ties * 2.0**-100).all()
        (e4,) = spec.make_inputs({**s, "fmt": "e4m3"}, "cpu", 3)
        assert torch.equal(x[:64], e4[:64])  # the other rows are e4m3's
        codes = _e2m1.unpack(spec.reference(s, x)[0])[64:, :256]
        assert torch.equal(codes, torch.tensor(TIE_CODES).repeat(16).expand(6, -1))
    # One block row only (or one token): nothing replaced.
    one = spec.canonical_shape({"num_tokens": 32, "hidden": 64, "block_m": 32, "block_k": 32, "fmt": "e2m1"})
    assert torch.equal(spec.make_inputs(one, "cpu", 0)[0], spec.make_inputs({**one, "fmt": "e4m3"}, "cpu", 0)[0])


def test_e2m1_make_inputs_with_sf_saturates():
    s = get_spec(WITH_SF).canonical_shape({"num_tokens": 70, "hidden": 576, "block_m": 32, "block_k": 32,
                                           "in_dtype": "float32", "fmt": "e2m1"})
    x, sf = get_spec(WITH_SF).make_inputs(s, "cpu", 3)
    assert sf.shape == (3, 18) and (sf > 0).all()
    inv = sf.reciprocal().repeat_interleave(32, 0).repeat_interleave(32, 1)[:70, :576]
    assert (x * inv).abs().max() > 6  # some products saturate
    q = get_spec(WITH_SF).reference(s, x, sf)
    assert q.shape == (70, 288) and _is_nearest_even(_e2m1.unpack(q), x * inv)


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
    return serve_references(monkeypatch, (*NAMES, "cast_back", "cast_back_colmajor"))


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


@pytest.mark.parametrize("n", [0, 1, 70])
def test_ops_e2m1(reference_kernels, n):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, 576, generator=g) * 3).bfloat16()
    rows = -(-n // 32)
    q, s = tkjit.ops.per_block_cast(x, (32, 128), fmt="e2m1")
    assert q.dtype == torch.int8 and q.shape == (n, 288) and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (rows, 5)
    qc, sc = tkjit.ops.per_block_cast(x, (32, 128), col_major_scales=True, fmt="e2m1")
    assert torch.equal(qc, q) and torch.equal(sc, s)
    qp, sp = tkjit.ops.per_block_cast(x, (32, 128), round_scale=True, col_major_scales=True, packed_ue8m0=True,
                                      fmt="e2m1")
    assert qp.shape == (n, 288) and sp.dtype == torch.int32 and sp.shape == (rows, 2)
    if n:
        assert sc.stride() == (1, -(-rows // 4) * 4)
        full = get_spec(NAME).canonical_shape({"num_tokens": n, "hidden": 576, "block_m": 32, "block_k": 128,
                                               "fmt": "e2m1"})
        q_ref, s_ref = get_spec(NAME).reference(full, x)
        assert torch.equal(q, q_ref) and _same(s, s_ref)
        assert torch.equal(tkjit.ops.per_block_cast_with_sf(x, s_ref * 2, (32, 128), fmt="e2m1"),
                           get_spec(WITH_SF).reference(full, x, s_ref * 2))
    assert tkjit.ops.per_block_cast_with_sf(x, s, (32, 128), fmt="e2m1").shape == (n, 288)


@pytest.mark.parametrize("fmt", ["e5m6", "", "E2M1", None, 3])
def test_ops_refuse_bad_fmt(reference_kernels, fmt):
    x = torch.zeros(5, 576)
    for call in (lambda: tkjit.ops.per_block_cast(x, (32, 128), fmt=fmt),
                 lambda: tkjit.ops.per_block_cast(x, (32, 128), col_major_scales=True, fmt=fmt),
                 lambda: tkjit.ops.per_block_cast_with_sf(x, torch.ones(1, 5), (32, 128), fmt=fmt),
                 lambda: tkjit.torch_ops.per_block_cast_impl(x, 32, 128, False, fmt)):
        with pytest.raises(ShapeError, match=r"fmt must be one of \['e4m3', 'e2m1'\], got " + repr(fmt)):
            call()


@pytest.mark.parametrize("n", [0, 5, 70])
def test_fake_impls_e2m1(n):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(n, 576, dtype=torch.bfloat16))
        q, s = torch.ops.tkjit.per_block_cast(x, 32, 128, fmt="e2m1")
        _, storage = torch.ops.tkjit.per_block_cast_colmajor(x, 32, 32, True, "e2m1")
        q2, s2 = tkjit.ops.per_block_cast(x, (32, 128), col_major_scales=True, packed_ue8m0=True, fmt="e2m1")
        q3 = torch.ops.tkjit.per_block_cast_with_sf(x, mode.from_tensor(torch.ones(-(-n // 32), 5)), 32, 128, "e2m1")
        with pytest.raises(ShapeError, match="fmt must be one of"):
            torch.ops.tkjit.per_block_cast(x, 32, 128, fmt="e5m6")
        with pytest.raises(ShapeError, match="fmt must be one of"):
            torch.ops.tkjit.per_block_cast_with_sf(x, mode.from_tensor(torch.ones(-(-n // 32), 5)), 32, 128, "")
        with pytest.raises(ShapeError, match="multiple of 16"):
            torch.ops.tkjit.per_block_cast(mode.from_tensor(torch.randn(n, 40)), 32, 32, fmt="e2m1")
    rows = -(-n // 32)
    assert q.shape == (n, 288) and q.dtype == torch.int8 and s.shape == (rows, 5) and s.dtype == torch.float32
    assert storage.shape == (18, -(-rows // 4) * 4)
    assert q2.shape == (n, 288) and q2.dtype == torch.int8 and s2.shape == (rows, 2) and s2.dtype == torch.int32
    assert q3.shape == (n, 288) and q3.dtype == torch.int8


def test_torch_compile_traces_e2m1(reference_kernels):
    x = torch.randn(37, 256) * 2

    def f(x):
        q, s = tkjit.ops.per_block_cast(x, (32, 128), round_scale=True, col_major_scales=True, fmt="e2m1")
        return q, s, tkjit.ops.per_block_cast_with_sf(x, s.contiguous(), (32, 128), fmt="e2m1")

    got = torch.compile(f, fullgraph=True, backend="eager")(x)
    want = f(x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert got[0].dtype == torch.int8 and got[0].shape == (37, 128) and got[1].stride() == want[1].stride()
    assert torch.equal(got[2], got[0])  # round_scale: 1 / sf both ways


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


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_opcheck(reference_kernels, fmt):
    import tkjit.ops  # noqa: F401

    x = torch.randn(70, 256, dtype=torch.bfloat16)
    for op in (torch.ops.tkjit.per_block_cast.default, torch.ops.tkjit.per_block_cast_colmajor.default):
        torch.library.opcheck(op, (x, 32, 128, True, fmt, None))
        torch.library.opcheck(op, (x, 32, 128), {"fmt": fmt})
    sf = torch.rand(3, 2) + 0.5
    torch.library.opcheck(torch.ops.tkjit.per_block_cast_with_sf.default, (x, sf, 32, 128, fmt, None))


def test_op_schemas_default_to_e4m3():
    """fmt comes before config and defaults to e4m3: callers that leave it out keep their FP8 values."""
    import tkjit.ops  # noqa: F401

    for name in NAMES:
        args = {a.name: a for a in getattr(torch.ops.tkjit, name).default._schema.arguments}
        assert list(args)[-2:] == ["fmt", "config"] and args["fmt"].default_value == "e4m3"


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


def _tk_ref(x, block, round_sf=False, col=False, packed=False, fmt="e4m3"):
    """TileKernels' torch reference `cast` for e4m3 / e2m1 blocks, re-derived: masked block amax, scale layouts."""
    bm, bk = block
    n, h = x.shape
    spec = get_spec(NAME)
    full = spec.canonical_shape({"num_tokens": max(n, 1), "hidden": h, "block_m": bm, "block_k": bk,
                                 "in_dtype": "bfloat16" if x.dtype == torch.bfloat16 else "float32",
                                 "round_scale": round_sf, "fmt": fmt})
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
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_compat_per_block_cast_layouts(reference_kernels, n, hidden, block, dtype, col, round_sf, packed, fmt):
    import tkjit.compat.tile_kernels as tk

    g = torch.Generator().manual_seed(n + hidden)
    x = (torch.randn(n, hidden, generator=g) * torch.exp(2 * torch.randn(n, 1, generator=g))).to(dtype)
    q, sf = tk.quant.per_block_cast(x, fmt, block, col, round_sf, packed)
    q_ref, sf_ref = _tk_ref(x, block, round_sf, col, packed, fmt)
    assert _same(q, q_ref) and q.is_contiguous()
    assert q.shape == (n, hidden // 2 if fmt == "e2m1" else hidden)
    assert sf.dtype == sf_ref.dtype and sf.shape == sf_ref.shape and _strides(sf) == _strides(sf_ref)
    assert torch.equal(sf, sf_ref)
    only = tk.quant.per_block_cast_with_sf_only(x, fmt, block, col, round_sf, packed)
    assert torch.equal(only, sf) and only.stride() == sf.stride()
    if not col:
        assert _same(tk.quant.per_block_cast_with_precomputed_sf(x, fmt, block, sf * 1.5),
                     get_spec(WITH_SF).reference({"block_m": block[0], "block_k": block[1], "hidden": hidden,
                                                  "fmt": fmt}, x, sf * 1.5))


def test_compat_per_block_cast_e2m1_is_served(reference_kernels):
    """TileKernels' per_block_cast(x, 'e2m1', ...) (refused with NotImplementedError before tkjit had the FP4 block
    cast): the per-block FP4 codes and scales of the independent block-by-block path."""
    import tkjit.compat.tile_kernels as tk

    g = torch.Generator().manual_seed(7)
    x = (torch.randn(45, 320, generator=g) * torch.exp(2 * torch.randn(45, 1, generator=g))).bfloat16()
    for block, round_sf in (((32, 32), False), ((128, 32), True), ((32, 128), False)):
        q, sf = tk.quant.per_block_cast(x, "e2m1", block, round_sf=round_sf)
        q_ref, sf_ref, _ = _blockwise_e2m1(x, *block, round_sf)
        assert q.dtype == torch.int8 and torch.equal(q, q_ref) and _same(sf, sf_ref)
        assert torch.equal(tk.quant.per_block_cast_with_sf_only(x, "e2m1", block, round_sf=round_sf), sf)
        if round_sf:
            assert torch.equal(tk.quant.per_block_cast_with_precomputed_sf(x, "e2m1", block, sf), q)


@pytest.mark.parametrize("col, round_sf, packed", [(False, False, False), (True, False, False), (True, True, True)])
@pytest.mark.parametrize("block", [(32, 32), (128, 128), (32, 128)])
def test_compat_e2m1_round_trip_through_cast_back(reference_kernels, col, round_sf, packed, block):
    """per_block_cast(e2m1) -> cast_back with the same block: the codes' values times their block scales, close to x."""
    import tkjit.compat.tile_kernels as tk

    g = torch.Generator().manual_seed(block[0] + block[1])
    x = torch.randn(130, 576, generator=g) * torch.exp(torch.randn(130, 1, generator=g))
    q, sf = tk.quant.per_block_cast(x, "e2m1", block, col, round_sf, packed)
    back = tk.quant.cast_back((q, sf), "fp32", block)
    _, sf_row = tkjit.ops.per_block_cast(x, block, round_scale=round_sf, fmt="e2m1")
    scale = sf_row.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:130, :576]
    assert torch.equal(back, _e2m1.decode(_e2m1.unpack(q)) * scale)
    # Half a step of the coarsest e2m1 spacing (2, between 4 and 6) times the scale bounds the error.
    assert ((back - x).abs() <= scale).all()


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
    (lambda: _compat()(torch.zeros(4, 256), 5, (32, 32)), ShapeError, "fmt must be one of"),
    (lambda: _compat()(torch.zeros(4, 256), "e5m6", (32, 32)), NotImplementedError, "fmt='e5m6'"),
    (lambda: _compat("per_block_cast_with_precomputed_sf")(torch.zeros(4, 256), "e5m6", (32, 32), torch.ones(1, 8)),
     NotImplementedError, "fmt='e5m6'"),
    (lambda: _compat()(torch.zeros(4, 96), "e2m1", (32, 32)), ShapeError, "multiple of 64"),
    (lambda: _compat()(torch.zeros(4, 256), "e2m1", (64, 32)), ShapeError, "block_size"),
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
    # e2m1: the defaults at DeepSeek's blocks, partial tile columns, each chunk width (2-, 4- and 8-byte stores).
    (NAME, {"hidden": 7168, "block_m": 128, "block_k": 128, "fmt": "e2m1"}, None),
    (NAME, {"hidden": 7168, "block_m": 32, "block_k": 32, "fmt": "e2m1", "round_scale": True}, None),
    (NAME, {"hidden": 576, "block_m": 32, "block_k": 128, "in_dtype": "float32", "fmt": "e2m1"},
     {"vec": 4, "tile_k": 256, "threads": 128}),
    (NAME, {"hidden": 4096, "block_m": 64, "block_k": 64, "fmt": "e2m1"}, {"vec": 16, "tile_k": 512, "threads": 512}),
    (NAME, {"hidden": 160, "block_m": 1, "block_k": 32, "fmt": "e2m1"}, None),
    (COLMAJOR, {"hidden": 576, "block_m": 32, "block_k": 32, "round_scale": True, "fmt": "e2m1"}, None),
    (WITH_SF, {"hidden": 7168, "block_m": 128, "block_k": 128, "fmt": "e2m1"}, None),
])
def test_compiles_for_sm90a(cache_dir, name, shape, config):
    k = tkjit.get(name, {"num_tokens": 4001, **shape}, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    assert "__fdiv_rn" in src  # IEEE divisions whatever the fast-math setting
    if shape.get("fmt") == "e2m1":  # integer encoding, int8 values: no FP8 (nor FP4) conversion
        assert "__NV_E4M3" not in src and "fp4" not in src.lower() and "signed char* __restrict__ out" in src
        if name != WITH_SF:  # the amax clamp 6 * 2^-126, as its bits
            assert "29360128" in src or "0x1c00000" in src.lower()
    else:
        assert "__NV_E4M3" in src
    if shape.get("round_scale"):
        assert "8388607" in src or "0x7fffff" in src.lower()
    if name == WITH_SF:
        assert "__shfl_xor_sync" not in src and "sf_stride" in src.replace("sf_stride0", "sf_stride")
    else:
        assert "__shfl_xor_sync" in src
        assert src.count("scales[") == (2 if name == COLMAJOR else 1)
