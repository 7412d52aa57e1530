"""per_channel_cast_fused spec on the CPU: shapes, constraints, defaults, the reference (hand-checked and against an
independent block-by-block computation of TileKernels' semantics), the torch op (fake impl, opcheck), tkjit.ops and
the TileKernels-compatible entry point (kernels that write the reference), sm_90a cross-compiles."""

import inspect
import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit.registry import get_spec
from tkjit.spec import validate

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from quant_checks import NO_HINT  # noqa: E402

SEL = {**NO_HINT, "gather": "select"}  # the staged tile's default loads (unconditional, zeros selected)
BR = {**NO_HINT, "gather": "branch"}  # the register tile's (and the staged tile's loads of before)
from reference_kernels import serve_references  # noqa: E402

NAME = "per_channel_cast_fused"
FP8 = "float8_e4m3fn"


def _shape(**kw):
    return {"num_tokens": 100, "num_tokens_out": 100, "hidden": 256, **kw}


def _same(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_spec_validates():
    spec = get_spec(NAME)
    validate(spec)
    assert spec.family == "quant" and spec.tolerance.exact
    for ex in spec.examples:
        full = spec.canonical_shape(ex)
        assert spec.default_config(full, "sm_90a") in spec.configs(full, "sm_90a")
    import tkjit_kernels

    assert tkjit_kernels.INDEX[NAME] == f"tkjit_kernels.quant.{NAME}"
    assert [p.name for p in spec.params] == ["num_tokens_out", "num_tokens", "hidden", "num_per_tokens", "in_dtype",
                                             "round_scale", "has_x_sf", "has_pos"]
    # per_channel_cast's space: the register tile and TileKernels' shared-memory staged tile (stage="smem")
    assert spec.space == {**get_spec("per_channel_cast").space, "gather": ("select", "branch")}
    assert spec.space["stage"] == ("regs", "smem")


def test_default_heuristics():
    spec = get_spec(NAME)
    # TileKernels' block: 256 threads, 32 along a row with 8-byte vectors (128 channels of bf16, 256 of FP8)
    full = spec.canonical_shape(_shape(hidden=7168, has_pos=True, num_tokens_out=4096))
    assert spec.default_config(full) == {"vec": 4, "ch_threads": 32, "threads": 256, "stage": "smem", **SEL}
    full = spec.canonical_shape(_shape(hidden=7168, in_dtype=FP8, has_x_sf=True, has_pos=True))
    assert spec.default_config(full) == {"vec": 8, "ch_threads": 32, "threads": 256, "stage": "smem", **SEL}
    assert len(spec.configs(full)) > 20
    assert {c["stage"] for c in spec.configs(full)} == {"regs", "smem"}
    # the register tile's default where no staged tile fits: 16 channels of float32 x 32 rows per scale
    full = spec.canonical_shape(_shape(hidden=16, num_per_tokens=32, in_dtype="float32"))
    assert spec.default_config(full)["stage"] == "regs"


def test_smem_constraint():
    spec = get_spec(NAME)
    full = spec.canonical_shape(_shape(hidden=7168, in_dtype=FP8, has_x_sf=True, has_pos=True))
    smem = {"vec": 8, "ch_threads": 32, "threads": 256, "stage": "smem", **SEL}
    assert spec.constraint(full, smem) is None
    # FP8: 4-byte vectors x 32 lanes fill a 128-byte wavefront, 4 x 16 lanes do not
    assert spec.constraint(full, {**smem, "vec": 4}) is None
    assert "bank conflicts" in spec.constraint(full, {**smem, "vec": 4, "ch_threads": 16})
    assert "shared memory" in spec.constraint(full, {"vec": 16, "ch_threads": 64, "threads": 512, "stage": "smem",
                                                     **SEL})
    bf16 = spec.canonical_shape(_shape(hidden=7168, has_pos=True))
    assert spec.constraint(bf16, {"vec": 8, "ch_threads": 16, "threads": 128, "stage": "smem", **SEL}) is None


@pytest.mark.parametrize("in_dtype", ["bfloat16", "float32", FP8])
@pytest.mark.parametrize("npt", [32, 128])
@pytest.mark.parametrize("hidden", [128, 256, 576, 2048, 2560, 4096, 7168, 65536])
@pytest.mark.parametrize("has_pos", [False, True])
def test_defaults_valid(in_dtype, npt, hidden, has_pos):
    if in_dtype == FP8 and hidden % 128:
        pytest.skip("FP8 input: hidden a multiple of 128")
    spec = get_spec(NAME)
    full = spec.canonical_shape(_shape(hidden=hidden, num_per_tokens=npt, in_dtype=in_dtype,
                                       has_x_sf=in_dtype == FP8, has_pos=has_pos))
    cfg = spec.default_config(full, "sm_90a")
    assert spec.check_config(full, cfg, "sm_90a") == cfg
    nbytes = cfg["vec"] * {"bfloat16": 2, "float32": 4, FP8: 1}[in_dtype]
    if cfg["stage"] == "smem":  # TileKernels' 8-byte vectors (float32: the space's narrowest, 16 bytes)
        assert nbytes == max(8, 4 * {"bfloat16": 2, "float32": 4, FP8: 1}[in_dtype])
    else:
        assert nbytes == 16


def test_bad_shapes():
    spec = get_spec(NAME)
    with pytest.raises(ShapeError, match="come together"):
        spec.canonical_shape(_shape(in_dtype=FP8))
    with pytest.raises(ShapeError, match="come together"):
        spec.canonical_shape(_shape(has_x_sf=True))
    with pytest.raises(ShapeError, match="multiple of 128 with FP8"):
        spec.canonical_shape(_shape(hidden=208, in_dtype=FP8, has_x_sf=True))
    with pytest.raises(ShapeError, match="multiple of 16"):
        spec.canonical_shape(_shape(hidden=200))
    with pytest.raises(ShapeError, match="must equal num_tokens=100 without a map"):
        spec.canonical_shape(_shape(num_tokens_out=96))
    spec.canonical_shape(_shape(num_tokens_out=96, has_pos=True))  # a map: any length
    with pytest.raises(ShapeError, match="'num_per_tokens'=64 not allowed"):
        spec.canonical_shape(_shape(num_per_tokens=64))
    with pytest.raises(ShapeError, match="in_dtype.*not allowed"):
        spec.canonical_shape(_shape(in_dtype="float16"))


def test_bad_configs():
    spec = get_spec(NAME)
    full = spec.canonical_shape(_shape(hidden=7168, in_dtype=FP8, has_x_sf=True))
    with pytest.raises(ConfigError, match="spill"):  # 16 rows of 16 FP8 channels a thread
        spec.check_config(full, {"vec": 16, "ch_threads": 32, "threads": 256, "stage": "regs", **BR})
    with pytest.raises(ConfigError, match="bank conflicts"):
        spec.check_config(full, {"vec": 4, "ch_threads": 16, "threads": 256, "stage": "smem", **SEL})
    with pytest.raises(ConfigError, match="CUDA targets only"):
        spec.check_config(full, spec.default_config(full), "cpu")


def test_output_dims_and_bytes():
    spec = get_spec(NAME)
    full = spec.canonical_shape(_shape(num_tokens_out=80, hidden=256, num_per_tokens=32, in_dtype=FP8,
                                       has_x_sf=True, has_pos=True))
    assert [a.resolve(full) for a in spec.inputs] == [(FP8, (100, 256)), ("float32", (100, 2)), ("int32", (80,))]
    assert spec.output_decls(full) == [("out", FP8, (80, 256)), ("scales", "float32", (3, 256))]
    assert spec.bytes_moved(full) == 80 * (256 * 2 + 4 + 8) + 3 * 256 * 4


# -- the reference --------------------------------------------------------------------------------

def _rows(x, x_sf, pos):
    """TileKernels' torch reference's input to its cast, independently: gather (clamp, mask), dequantise."""
    xf = x.float()
    if x_sf is not None:
        xf = xf * torch.stack([x_sf[:, c // 128] for c in range(x.shape[1])], 1)
    if pos is None:
        return xf
    out = torch.zeros(pos.shape[0], x.shape[1])
    for i, p in enumerate(pos.tolist()):
        if 0 <= p < x.shape[0]:
            out[i] = xf[p]
    return out


def _blockwise(v, npt, round_scale):
    """One (block, channel) at a time in float32 scalars, the last block partial: (values fp8, scales)."""
    m, h = v.shape
    nb = -(-m // npt)
    q = torch.empty(m, h, dtype=torch.float8_e4m3fn)
    sf = torch.empty(nb, h)
    f448 = torch.tensor(448.0)
    for b in range(nb):
        for c in range(h):
            col = v[b * npt:(b + 1) * npt, c]
            amax = torch.maximum(col.abs().max(), torch.tensor(1e-4))
            s = amax / f448
            if round_scale:
                s = torch.tensor(2.0 ** torch.ceil(torch.log2(s.double())).item(), dtype=torch.float32)
                inv = torch.tensor(1.0) / s
            else:
                inv = f448 / amax
            sf[b, c] = s
            q[b * npt:(b + 1) * npt, c] = torch.clamp(col * inv, -448.0, 448.0).to(torch.float8_e4m3fn)
    return q, sf


@pytest.mark.parametrize("in_dtype, has_pos, npt, round_scale, m, seed", [
    ("bfloat16", True, 32, False, 80, 1),
    ("float32", True, 32, True, 48, 0),
    (FP8, True, 32, False, 96, 1),
    (FP8, True, 32, True, 40, 0),
    (FP8, False, 32, False, 64, 0),
    ("bfloat16", False, 32, True, 64, 1),
    (FP8, True, 128, False, 144, 3),
])
def test_reference_matches_blockwise(in_dtype, has_pos, npt, round_scale, m, seed):
    spec = get_spec(NAME)
    n = 64 if has_pos else m
    full = spec.canonical_shape({"num_tokens": n, "num_tokens_out": m, "hidden": 256, "num_per_tokens": npt,
                                 "in_dtype": in_dtype, "round_scale": round_scale, "has_x_sf": in_dtype == FP8,
                                 "has_pos": has_pos})
    inputs = spec.make_inputs(full, "cpu", seed)
    x = inputs[0]
    x_sf = inputs[1] if in_dtype == FP8 else None
    pos = inputs[-1] if has_pos else None
    if pos is not None and seed % 2:
        assert ((pos >= n) | (pos < -1)).any() and (pos == -1).any()  # out-of-range entries on odd seeds
    q, sf = spec.reference(full, *inputs)
    q_ref, sf_ref = _blockwise(_rows(x, x_sf, pos), npt, round_scale)
    assert sf.shape == (-(-m // npt), 256) and torch.equal(sf.view(torch.int32), sf_ref.view(torch.int32))
    assert _same(q, q_ref)


def test_reference_hand_checked():
    spec = get_spec(NAME)
    x = torch.zeros(4, 32)
    x[0, 0], x[1, 0], x[2, 0] = 7.0, -3.5, 1000.0
    x[3, 1] = -0.0
    pos = torch.tensor([0, -1, 1, 5, 0, 3, -7, 1] + [-1] * 8, dtype=torch.int32)  # 16 rows: blocks of 32 partial
    full = spec.canonical_shape({"num_tokens": 4, "num_tokens_out": 16, "hidden": 32, "num_per_tokens": 32,
                                 "in_dtype": "float32", "has_pos": True})
    q, sf = spec.reference(full, x, pos)
    assert q.shape == (16, 32) and sf.shape == (1, 32)
    assert sf[0, 0].item() == 7 / 448  # row 2 (x[2] = 1000) is never gathered; row 3 (5) is out of range
    assert q[0, 0].float().item() == 448.0 and q[2, 0].float().item() == -224.0 and q[4, 0].float().item() == 448.0
    zero_rows = [1, 3, 6] + list(range(8, 16))
    assert (q[zero_rows].view(torch.uint8) == 0).all()  # +0.0, not -0.0
    assert q[5, 1].view(torch.uint8).item() == 0x80  # a gathered -0.0 stays -0.0
    assert sf[0, 2].item() == torch.tensor(1e-4) / torch.tensor(448.0)


def test_reference_fp8_rounds_twice():
    """FP8 input: value * scale rounded to float32, then times the quantisation factor (TileKernels' order)."""
    spec = get_spec(NAME)
    x = torch.full((32, 128), 1.125).to(torch.float8_e4m3fn)
    x[0, 0] = 448.0
    s = torch.full((32, 1), 1.0 / 3.0)
    full = spec.canonical_shape({"num_tokens": 32, "num_tokens_out": 32, "hidden": 128, "num_per_tokens": 32,
                                 "in_dtype": FP8, "has_x_sf": True})
    q, sf = spec.reference(full, x, s)
    v = torch.tensor(1.125) * torch.tensor(1.0 / 3.0)
    amax = torch.tensor(448.0) * torch.tensor(1.0 / 3.0)
    assert sf[0, 0] == amax / 448.0 and sf[0, 1] == v / 448.0
    assert q[1, 0] == (v * (torch.tensor(448.0) / amax)).to(torch.float8_e4m3fn)


def test_make_inputs():
    spec = get_spec(NAME)
    full = spec.canonical_shape(_shape(num_tokens_out=160, hidden=256, in_dtype=FP8, has_x_sf=True, has_pos=True))
    x, s, pos = spec.make_inputs(full, "cpu", 3)
    assert x.dtype == torch.float8_e4m3fn and x.shape == (100, 256) and x.float().isfinite().all()
    assert s.shape == (100, 2) and s.dtype == torch.float32 and (s > 0).all()
    assert pos.dtype == torch.int32 and pos.shape == (160,) and pos.max() >= 100 and pos.min() < -1
    (y,) = spec.make_inputs(spec.canonical_shape(_shape()), "cpu", 0)
    assert y.dtype == torch.bfloat16 and y.shape == (100, 256) and (y[:, 5] == 0).all()


# -- torch op, tkjit.ops and the compat entry point ----------------------------------------------

@pytest.fixture
def reference_kernels(monkeypatch):
    return serve_references(monkeypatch, (NAME,))


def _data(n, hidden, fp8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g) * torch.exp(torch.randn(1, hidden, generator=g))
    if not fp8:
        return x.to(torch.bfloat16), None
    return (x * 16).to(torch.float8_e4m3fn), torch.rand(n, hidden // 128, generator=g) + 0.01


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("n, m, npt, round_scale", [(64, 48, 32, False), (128, None, 128, True), (0, 32, 32, False),
                                                   (64, 0, 128, False), (0, None, 32, False)])
def test_ops_shapes_and_values(reference_kernels, fp8, n, m, npt, round_scale):
    x, x_sf = _data(n, 256, fp8, seed=n)
    pos = None if m is None else torch.randint(-1, max(n, 1), (m,), generator=torch.Generator().manual_seed(m),
                                                dtype=torch.int32)
    q, sf = tkjit.ops.per_channel_cast_fused(x, npt, x_sf=x_sf, pos_to_token=pos, round_scale=round_scale)
    rows = n if m is None else m
    assert q.dtype == torch.float8_e4m3fn and q.shape == (rows, 256) and q.is_contiguous()
    assert sf.dtype == torch.float32 and sf.shape == (-(-rows // npt), 256) and sf.is_contiguous()
    assert len(reference_kernels) == (1 if rows else 0)  # nothing to write launches nothing
    q_ref, sf_ref = _blockwise(_rows(x, x_sf, pos), npt, round_scale)
    assert torch.equal(sf, sf_ref) and _same(q, q_ref)
    q2, sf2 = torch.ops.tkjit.per_channel_cast_fused(x, x_sf, pos, npt, round_scale)
    assert _same(q2, q) and torch.equal(sf2, sf)


def test_ops_refuse_bad_input(reference_kernels):
    op = tkjit.ops.per_channel_cast_fused
    x, x_sf = _data(64, 256, True)
    pos = torch.zeros(32, dtype=torch.int32)
    with pytest.raises(ShapeError, match="come together"):
        op(x, 32)  # FP8 without its scales
    with pytest.raises(ShapeError, match="come together"):
        op(x.float(), 32, x_sf=x_sf)
    with pytest.raises(ShapeError, match="num_per_tokens must be one of"):
        op(x, 64, x_sf=x_sf)
    with pytest.raises(TensorError, match="x_sf"):
        op(x, 32, x_sf=x_sf[0])
    with pytest.raises(TensorError, match="pos_to_token"):
        op(x, 32, x_sf=x_sf, pos_to_token=pos.view(4, 8))
    with pytest.raises(TensorError, match="dtype"):
        op(x, 32, x_sf=x_sf, pos_to_token=pos.long())
    with pytest.raises(TensorError, match="axis 1"):
        op(x, 32, x_sf=x_sf[:, :1].contiguous())
    with pytest.raises(TensorError, match="contiguous"):
        op(x.float().T.contiguous().T, 32)


@pytest.mark.parametrize("fp8, m", [(False, None), (True, 48), (False, 0)])
def test_fake_impl(fp8, m):
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, x_sf = _data(64, 256, fp8)
    pos = None if m is None else torch.zeros(m, dtype=torch.int32)
    with FakeTensorMode() as mode:
        fx, fsf, fpos = (mode.from_tensor(t) if t is not None else None for t in (x, x_sf, pos))
        q, s = torch.ops.tkjit.per_channel_cast_fused(fx, fsf, fpos, 32)
        with pytest.raises(ShapeError, match="come together"):
            torch.ops.tkjit.per_channel_cast_fused(fx, None if fp8 else mode.from_tensor(torch.ones(64, 2)), fpos, 32)
    rows = 64 if m is None else m
    assert q.shape == (rows, 256) and q.dtype == torch.float8_e4m3fn
    assert s.shape == (-(-rows // 32), 256) and s.dtype == torch.float32


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("fp8, m, npt", [(False, None, 32), (True, 48, 32), (False, 80, 128), (True, None, 128)])
def test_opcheck(reference_kernels, fp8, m, npt):
    x, x_sf = _data(128, 256, fp8)
    pos = None if m is None else torch.randint(-1, 128, (m,), generator=torch.Generator().manual_seed(2),
                                                dtype=torch.int32)
    tests = OPCHECK_TESTS if not fp8 else ("test_autograd_registration", "test_faketensor",
                                           "test_aot_dispatch_dynamic")  # (no float8 arithmetic for test_schema)
    result = torch.library.opcheck(torch.ops.tkjit.per_channel_cast_fused.default, (x, x_sf, pos, npt, True),
                                   test_utils=tests)
    assert result == dict.fromkeys(tests, "SUCCESS"), result


def test_schema():
    schema = str(torch.ops.tkjit.per_channel_cast_fused.default._schema)
    assert schema == ("tkjit::per_channel_cast_fused(Tensor x, Tensor? x_sf=None, Tensor? pos_to_token=None, "
                      "int num_per_tokens=128, bool round_scale=False, str? config=None) -> (Tensor, Tensor)")


def test_compat_signature_is_tile_kernels():
    """TileKernels 1.0.0's signature (quant/per_channel_cast_fused_kernel.py)."""
    import tkjit.compat.tile_kernels as tk

    sig = inspect.signature(tk.quant.per_channel_cast_fused)
    assert list(sig.parameters) == ["x", "fmt", "num_per_tokens", "round_sf", "num_per_channels", "pos_to_token"]
    assert [p.default for p in sig.parameters.values()][3:] == [False, None, None]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in sig.parameters.values())


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("n, m, round_sf", [(256, None, False), (128, 144, True), (64, 16, False), (0, 32, False)])
def test_compat_returns_tile_kernels_layout(reference_kernels, fp8, n, m, round_sf):
    import tkjit.compat.tile_kernels as tk

    x, x_sf = _data(n, 256, fp8, seed=3)
    pos = None if m is None else torch.randint(-1, max(n, 1), (m,), generator=torch.Generator().manual_seed(m),
                                                dtype=torch.int32)
    if n == 0 and pos is not None:
        pos.fill_(-1)
    arg = (x, x_sf) if fp8 else x
    q, sf = tk.quant.per_channel_cast_fused(arg, "e4m3", 128, round_sf, 128 if fp8 else None, pos)
    rows = n if m is None else m
    assert q.dtype == torch.float8_e4m3fn and q.shape == (rows, 256) and q.is_contiguous()
    assert sf.dtype == torch.float32 and sf.shape == (-(-rows // 128), 256) and sf.is_contiguous()
    q_ref, sf_ref = _blockwise(_rows(x, x_sf, pos), 128, round_sf)
    assert torch.equal(sf, sf_ref) and _same(q, q_ref)
    q2, sf2 = tk.quant.per_channel_cast_fused(arg, fmt="e4m3", num_per_tokens=128, round_sf=round_sf,
                                              num_per_channels=128 if fp8 else None, pos_to_token=pos)
    assert _same(q2, q) and torch.equal(sf2, sf)


def _compat(*args, **kw):
    import tkjit.compat.tile_kernels as tk

    return tk.quant.per_channel_cast_fused(*args, **kw)


_BF = torch.zeros(128, 256, dtype=torch.bfloat16)
_Q = (torch.zeros(128, 256, dtype=torch.float8_e4m3fn), torch.ones(128, 2))
_POS = torch.zeros(32, dtype=torch.int32)


@pytest.mark.parametrize("args, kw, error, match", [
    ((_BF, "e2m1", 128), {}, ShapeError, "fmt must be 'e4m3', got 'e2m1'"),
    ((_BF, "e4m3", 64), {}, ShapeError, "num_per_tokens must be one of"),
    ((_BF, "e4m3", "128"), {}, ShapeError, "num_per_tokens must be an int"),
    ((_BF, "e4m3", 128), {"num_per_channels": 128}, ShapeError, "for a \\(values, scales\\) x only"),
    ((_Q, "e4m3", 128), {}, ShapeError, "num_per_channels must be given"),
    ((_Q, "e4m3", 128), {"num_per_channels": 64}, ShapeError, "num_per_channels must be 128"),
    ((_Q[:1], "e4m3", 128), {"num_per_channels": 128}, TensorError, "pair"),
    (((_BF, _Q[1]), "e4m3", 128), {"num_per_channels": 128}, TensorError, r"x\[0\] \(values\) must be"),
    (((_Q[0], _Q[1].T.contiguous().T), "e4m3", 128), {"num_per_channels": 128}, TensorError, "row-major"),
    (((_Q[0], _Q[1][:64]), "e4m3", 128), {"num_per_channels": 128}, TensorError, r"\(128, 2\)"),
    (((_Q[0], _Q[1].double()), "e4m3", 128), {"num_per_channels": 128}, TensorError, "float32"),
    (((_Q[0][:, :192].contiguous(), torch.ones(128, 2)), "e4m3", 128), {"num_per_channels": 128}, ShapeError,
     "multiple of 128"),
    ((_BF.half(), "e4m3", 128), {}, TensorError, "x must be"),
    ((torch.zeros(2, 128, 256), "e4m3", 128), {}, TensorError, "x must be 2-D"),
    ((torch.zeros(256, 128).T, "e4m3", 128), {}, TensorError, "x must be contiguous"),
    ((_BF[:96], "e4m3", 128), {}, ShapeError, r"num_tokens \(x.shape\[0\] = 96\) must be a multiple"),
    ((torch.zeros(128, 200), "e4m3", 128), {}, ShapeError, r"hidden \(x.shape\[1\] = 200\) must be a multiple of 16"),
    ((_BF, "e4m3", 128), {"pos_to_token": _POS[:24]}, ShapeError, r"pos_to_token.shape\[0\] = 24\) must be a multiple"),
    ((_BF, "e4m3", 128), {"pos_to_token": _POS.long()}, TensorError, "pos_to_token must be torch.int32"),
    ((_BF, "e4m3", 128), {"pos_to_token": _POS.view(2, 16)}, TensorError, "pos_to_token must be 1-D"),
    ((_BF, "e4m3", 128), {"pos_to_token": torch.zeros(64, dtype=torch.int32)[::2]}, TensorError, "contiguous"),
    (("x", "e4m3", 128), {}, TensorError, "x must be a torch.Tensor"),
])
def test_compat_refuses_what_tile_kernels_refuses(args, kw, error, match):
    with pytest.raises(error, match=match) as err:
        _compat(*args, **kw)
    assert str(err.value).startswith("tile_kernels.quant.per_channel_cast_fused: ")


def test_compat_sizes_tkjit_lacks_are_not_implemented():
    with pytest.raises(NotImplementedError, match=r"hidden \(x.shape\[1\]\)=131072"):
        _compat(torch.zeros(32, 1 << 17), "e4m3", 32)


# -- sm_90a cross-compiles ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("shape, config", [
    ({"hidden": 7168, "has_pos": True}, None),  # DeepSeek's MoE expansion, bf16
    ({"hidden": 7168, "in_dtype": FP8, "has_x_sf": True, "has_pos": True, "round_scale": True}, None),
    ({"hidden": 4096, "in_dtype": FP8, "has_x_sf": True}, None),  # no map: num_tokens_out == num_tokens
    ({"hidden": 576, "num_per_tokens": 32, "in_dtype": "float32", "has_pos": True},
     {"vec": 4, "ch_threads": 32, "threads": 128, "stage": "regs", **BR}),  # a channel tail (576 % 128)
    # the staged tile with a channel tail: FP8 with a map (640 % 256), bf16 (576 % 128)
    ({"hidden": 640, "in_dtype": FP8, "has_x_sf": True, "has_pos": True},
     {"vec": 8, "ch_threads": 32, "threads": 256, "stage": "smem", **SEL}),
    ({"hidden": 576, "num_per_tokens": 32, "has_pos": True}, {"vec": 4, "ch_threads": 32, "threads": 256,
                                                              "stage": "smem", **SEL}),
    ({"hidden": 7168, "has_pos": True}, {"vec": 4, "ch_threads": 32, "threads": 256, "stage": "smem", **BR}),
])
def test_compiles_for_sm90a(cache_dir, shape, config):
    n = 4096
    k = tkjit.get(NAME, {"num_tokens": n, "num_tokens_out": n, **shape}, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    assert "__fdiv_rn" in src  # IEEE divisions
    assert "int64_t" in src  # 64-bit row offsets
    assert ("pos_to_token[" in src) == shape.get("has_pos", False)
    assert ("x_sf[" in src) == shape.get("has_x_sf", False)
    if shape.get("in_dtype") == FP8:
        vec = (config or k.config)["vec"]
        assert f"fp8_e4_{vec}_t*)(x +" in src  # whole-vector FP8 loads of x
    if (config or k.config)["stage"] == "smem":
        assert "__launch_bounds__(256, 1)" in src and "buf_dyn_shmem" in src  # the tile and the maxima
        # gather=select: no load of x under a branch on its row (each row's load in flight with the others')
        assert ("if ((int64_t)0 <= src[0])" in src) == ((config or k.config)["gather"] == "branch")
    if shape.get("round_scale"):
        assert "8388607" in src or "0x7fffff" in src.lower()
