"""per_channel_cast / per_channel_cast_and_transpose specs on the CPU: shapes, constraints, reference
semantics (hand-checked and against an independent block-by-block computation), the launcher's checks,
the torch ops (fake impls, opcheck), tkjit.ops and the TileKernels-compatible entry points (kernels that
write the reference), sm_90a cross-compiles."""

import inspect
import itertools
import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit.kernel import CompiledKernel
from tkjit.registry import get_spec
from tkjit.spec import validate

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from ptxas import ptxas_usage  # noqa: E402
from quant_checks import NO_HINT  # noqa: E402
from quant_checks import byte_same as _same  # noqa: E402
from reference_kernels import serve_references  # noqa: E402

CAST = "per_channel_cast"
TRANSPOSE = "per_channel_cast_and_transpose"
NAMES = (CAST, TRANSPOSE)
TK_HIDDEN = (576, 2048, 2560, 3072, 4096, 6144, 7168)  # TileKernels' test hidden sizes


def _shape(**kw):
    return {"token_blocks": 3, "hidden": 256, **kw}


@pytest.mark.parametrize("name", NAMES)
def test_spec_validates(name):
    spec = get_spec(name)
    validate(spec)
    assert spec.family == "quant" and spec.tolerance.exact
    for ex in spec.examples:
        full = spec.canonical_shape(ex)
        assert spec.default_config(full, "sm_90a") in spec.configs(full, "sm_90a")
    import tkjit_kernels

    assert tkjit_kernels.INDEX[name] == f"tkjit_kernels.quant.{name}"
    assert [p.name for p in spec.params] == ["token_blocks", "hidden", "num_per_tokens", "in_dtype", "round_scale"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("in_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("npt", [32, 128])
@pytest.mark.parametrize("hidden", [16, 32, 48, 64, 96, 112, 208, 1040, 65536, *TK_HIDDEN])
def test_defaults_valid(name, in_dtype, npt, hidden):
    spec = get_spec(name)
    full = spec.canonical_shape(_shape(hidden=hidden, num_per_tokens=npt, in_dtype=in_dtype))
    cfg = spec.default_config(full, "sm_90a")
    assert spec.check_config(full, cfg, "sm_90a") == cfg
    if name == CAST:  # TileKernels' staged tile (4 channels a thread) where it fits, else 16-byte register tiles
        if cfg["stage"] == "smem":
            assert cfg["vec"] == 4 and cfg["threads"] == 256
        else:
            assert hidden <= 32 and cfg["vec"] * (2 if in_dtype == "bfloat16" else 4) == 16
    else:
        assert cfg["vec_bytes"] == 16 and cfg["block_tokens"] % npt == 0


def test_default_heuristics():
    cast, tr = get_spec(CAST), get_spec(TRANSPOSE)
    full = cast.canonical_shape(_shape(hidden=7168))
    # TileKernels' design: 128 tokens x 128 channels, 256 threads, 4 channels a thread, x staged in shared memory
    assert cast.default_config(full) == {"vec": 4, "ch_threads": 32, "threads": 256, "stage": "smem", **NO_HINT}
    full = tr.canonical_shape(_shape(hidden=7168))
    assert tr.default_config(full) == {"block_tokens": 128, "block_ch": 128, "threads": 256, "vec_bytes": 16,
                                       "out_vec": 16, "swizzle": True}
    assert len(cast.configs(full)) > 20 and len(tr.configs(full)) > 40


@pytest.mark.parametrize("name", NAMES)
def test_bad_shapes(name):
    spec = get_spec(name)
    with pytest.raises(ShapeError, match="multiple of 16"):
        spec.canonical_shape(_shape(hidden=200))
    with pytest.raises(ShapeError, match="'num_per_tokens'=64 not allowed"):
        spec.canonical_shape(_shape(num_per_tokens=64))
    with pytest.raises(ShapeError, match="'hidden'=8 below its minimum 16"):
        spec.canonical_shape(_shape(hidden=8))
    with pytest.raises(ShapeError, match="in_dtype.*not allowed"):
        spec.canonical_shape(_shape(in_dtype="float16"))
    with pytest.raises(ShapeError, match="must be a bool"):
        spec.canonical_shape(_shape(round_scale=1))
    with pytest.raises(ShapeError, match="'token_blocks'=0 below"):
        spec.canonical_shape(_shape(token_blocks=0))


def test_bad_configs():
    cast, tr = get_spec(CAST), get_spec(TRANSPOSE)
    full = cast.canonical_shape(_shape(in_dtype="float32"))
    with pytest.raises(ConfigError, match="at most 32 bytes"):
        cast.check_config(full, {"vec": 16, "ch_threads": 32, "threads": 256, "stage": "regs", **NO_HINT})
    with pytest.raises(ConfigError, match="spill"):
        cast.check_config(cast.canonical_shape(_shape(hidden=7168)), {"vec": 16, "ch_threads": 32, "threads": 128,
                                                                      "stage": "regs", **NO_HINT})
    with pytest.raises(ConfigError, match="do not divide num_per_tokens"):
        cast.check_config(cast.canonical_shape(_shape(num_per_tokens=32)),
                          {"vec": 4, "ch_threads": 4, "threads": 512, "stage": "regs", **NO_HINT})
    with pytest.raises(ConfigError, match="missing"):
        cast.check_config(full, {"vec": 4, "ch_threads": 32, "threads": 256})
    # The staged tile: a warp's lanes along one row fill whole 128-byte wavefronts; two blocks an SM at least.
    wide = cast.canonical_shape(_shape(hidden=7168))
    with pytest.raises(ConfigError, match="bank conflicts"):
        cast.check_config(wide, {"vec": 4, "ch_threads": 8, "threads": 256, "stage": "smem", **NO_HINT})
    with pytest.raises(ConfigError, match="shared memory"):
        cast.check_config(wide, {"vec": 16, "ch_threads": 32, "threads": 256, "stage": "smem", **NO_HINT})
    with pytest.raises(ConfigError, match="CUDA targets only"):
        cast.check_config(full, cast.default_config(full), "cpu")
    full = tr.canonical_shape(_shape(hidden=7168))
    base = tr.default_config(full)
    with pytest.raises(ConfigError, match="whole scale blocks"):
        tr.check_config(full, {**base, "block_tokens": 64})
    with pytest.raises(ConfigError, match="shared memory"):
        tr.check_config(tr.canonical_shape(_shape(hidden=7168, in_dtype="float32")),
                        {**base, "block_tokens": 256, "block_ch": 128})
    with pytest.raises(ConfigError, match="CUDA targets only"):
        tr.check_config(full, base, "cpu")


@pytest.mark.parametrize("name", NAMES)
def test_output_dims_and_bytes(name):
    spec = get_spec(name)
    full = spec.canonical_shape(_shape(token_blocks=5, hidden=576, num_per_tokens=32))
    (x_decl,) = spec.inputs
    assert x_decl.name == "x" and x_decl.resolve(full) == ("bfloat16", (5, 32, 576))
    (o, odt, odims), (s, sdt, sdims) = spec.output_decls(full)
    assert (o, odt) == ("out", "float8_e4m3fn")
    assert odims == ((576, 5, 32) if name == TRANSPOSE else (5, 32, 576))
    assert (s, sdt, sdims) == ("scales", "float32", (5, 576))
    assert spec.bytes_moved(full) == 160 * 576 * 3 + 5 * 576 * 4
    assert spec.bytes_moved({**full, "in_dtype": "float32"}) == 160 * 576 * 5 + 5 * 576 * 4


# -- the reference --------------------------------------------------------------------------------

def _blockwise(x, npt, round_scale):
    """An independent computation, one (block, channel) at a time, in float32 scalars: (values (T, H) fp8,
    scales (T / npt, H))."""
    t, h = x.shape
    xf = x.float()
    q = torch.empty(t, h, dtype=torch.float8_e4m3fn)
    sf = torch.empty(t // npt, h)
    f448 = torch.tensor(448.0)
    for b in range(t // npt):
        for c in range(h):
            col = xf[b * npt:(b + 1) * npt, c]
            amax = torch.maximum(col.abs().max(), torch.tensor(1e-4))
            s = amax / f448
            if round_scale:
                e = torch.ceil(torch.log2(s.double()))
                s = torch.tensor(2.0 ** e.item(), dtype=torch.float32)
                inv = torch.tensor(1.0) / s
            else:
                inv = f448 / amax
            sf[b, c] = s
            q[b * npt:(b + 1) * npt, c] = torch.clamp(col * inv, -448.0, 448.0).to(torch.float8_e4m3fn)
    return q, sf


def _reference_2d(name, x, npt, round_scale):
    """The spec's reference on a (T, H) x, as TileKernels' 2-D tensors."""
    spec = get_spec(name)
    t, h = x.shape
    dt = "bfloat16" if x.dtype == torch.bfloat16 else "float32"
    full = spec.canonical_shape({"token_blocks": t // npt, "hidden": h, "num_per_tokens": npt, "in_dtype": dt,
                                 "round_scale": round_scale})
    q, sf = spec.reference(full, x.view(t // npt, npt, h))
    return (q.view(h, t) if name == TRANSPOSE else q.view(t, h)), sf


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("npt, dtype, round_scale", [(32, torch.bfloat16, False), (128, torch.float32, True),
                                                     (32, torch.float32, True), (128, torch.bfloat16, False)])
def test_reference_matches_blockwise(name, npt, dtype, round_scale):
    spec = get_spec(name)
    full = spec.canonical_shape({"token_blocks": 3, "hidden": 48, "num_per_tokens": npt, "in_dtype": str(dtype)[6:],
                                 "round_scale": round_scale})
    (x3,) = spec.make_inputs(full, "cpu", 1)
    x = x3.view(-1, 48)
    q, sf = _reference_2d(name, x, npt, round_scale)
    q_ref, sf_ref = _blockwise(x, npt, round_scale)
    assert torch.equal(sf.view(torch.int32), sf_ref.view(torch.int32))
    assert _same(q, q_ref.T.contiguous() if name == TRANSPOSE else q_ref)


def test_reference_hand_checked():
    x = torch.zeros(64, 32)
    x[:32, 0] = torch.linspace(-7.0, 3.5, 32)  # amax 7 -> scale 7/448 = 1/64, values * 64
    x[32:, 0] = 1e-6  # under the clamp: amax 1e-4
    x[:, 1] = 448.0
    x[40, 1] = -896.0  # second block: amax 896 -> scale 2, -896 -> -448, 448 -> 224
    x[5, 2] = 1000.0  # a large first block must not leak into the second
    x[33, 2] = 3.0  # 3 / (3 / 448) = 448
    q, sf = _reference_2d(CAST, x, 32, False)
    assert q.shape == (64, 32) and sf.shape == (2, 32) and sf.dtype == torch.float32
    assert sf[0, 0].item() == 7 / 448 and q[0, 0].float().item() == -448.0 and q[31, 0].float().item() == 224.0
    assert sf[1, 0].item() == torch.tensor(1e-4) / torch.tensor(448.0)
    assert q[40, 0].float().item() == 4.5  # 1e-6 * 448 / 1e-4 = 4.48 -> nearest e4m3 4.5
    assert sf[0, 1].item() == 1.0 and sf[1, 1].item() == 2.0
    assert q[40, 1].float().item() == -448.0 and q[41, 1].float().item() == 224.0 and q[0, 1].float().item() == 448.0
    assert sf[0, 2].item() == torch.tensor(1000.0) / torch.tensor(448.0)
    assert sf[1, 2] == torch.tensor(3.0) / torch.tensor(448.0)
    assert q[33, 2].float().item() == 448.0
    assert sf[0, 3].item() == torch.tensor(1e-4) / torch.tensor(448.0) and (q[:, 3].float() == 0).all()
    qt, sft = _reference_2d(TRANSPOSE, x, 32, False)
    assert torch.equal(sft, sf) and _same(qt, q.T.contiguous())


def test_reference_round_scale():
    x = torch.full((32, 16), 3.0)
    x[7, 0] = 5.0  # 5/448 -> rounded up to 2^-6 = 1/64; 5*64 = 320, 3*64 = 192
    x[:, 1] = 448.0 * 2**-3  # an exact power of two stays
    q, sf = _reference_2d(CAST, x, 32, True)
    assert sf[0, 0].item() == 2.0**-6 and sf[0, 1].item() == 2.0**-3
    assert q[7, 0].float().item() == 320.0 and q[0, 0].float().item() == 192.0 and q[0, 1].float().item() == 448.0


@pytest.mark.parametrize("name", NAMES)
def test_make_inputs(name):
    spec = get_spec(name)
    full = spec.canonical_shape(_shape(token_blocks=4, hidden=576, num_per_tokens=32))
    (x,) = spec.make_inputs(full, "cpu", 3)
    assert x.dtype == torch.bfloat16 and x.shape == (4, 32, 576)
    assert (x[:, :, 5] == 0).all() and x[:, :, 3].abs().max() < 1e-4 and x.isfinite().all()
    (y,) = spec.make_inputs({**full, "in_dtype": "float32"}, "cpu", 3)
    assert y.dtype == torch.float32 and not torch.equal(spec.make_inputs(full, "cpu", 4)[0], x)


# -- the launcher's checks (a kernel whose launch writes the reference) ----------------------------

def _fake_kernel(name, shape):
    spec = get_spec(name)
    full = spec.canonical_shape(shape)

    def launch(x, *outs):
        for o, r in zip(outs, spec.reference({**full, "token_blocks": x.shape[0]}, x)):
            o.copy_(r)

    return CompiledKernel(spec, full, spec.default_config(full), "cpu", "0" * 40, "explicit", Path("."), launch)


@pytest.mark.parametrize("name", NAMES)
def test_launcher_allocates_and_checks(name):
    k = _fake_kernel(name, {"token_blocks": 2, "hidden": 64, "num_per_tokens": 32})
    x = torch.randn(5, 32, 64, dtype=torch.bfloat16)
    q, s = k(x)
    assert q.shape == ((64, 5, 32) if name == TRANSPOSE else (5, 32, 64)) and s.shape == (5, 64)
    with pytest.raises(TensorError, match="axis 1 must be 32"):
        k(torch.randn(5, 128, 64, dtype=torch.bfloat16))
    with pytest.raises(TensorError, match="dtype"):
        k(x.float())
    with pytest.raises(TensorError, match="contiguous"):
        k(torch.randn(5, 64, 32, dtype=torch.bfloat16).transpose(1, 2))
    with pytest.raises(TensorError, match="other tensors say"):
        k(x, out=(torch.empty(q.shape, dtype=torch.float8_e4m3fn), torch.empty(4, 64)))


# -- torch ops and tkjit.ops ----------------------------------------------------------------------

@pytest.fixture
def reference_kernels(monkeypatch):
    return serve_references(monkeypatch, NAMES)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("tokens, hidden, npt, dtype, round_scale", [
    (128, 256, 128, torch.bfloat16, False),
    (96, 576, 32, torch.float32, True),
    (0, 64, 32, torch.bfloat16, False),
])
def test_ops_shapes_and_values(reference_kernels, transposed, tokens, hidden, npt, dtype, round_scale):
    g = torch.Generator().manual_seed(tokens + hidden)
    x = (torch.randn(tokens, hidden, generator=g) * torch.exp(torch.randn(1, hidden, generator=g))).to(dtype)
    op = tkjit.ops.per_channel_cast_and_transpose if transposed else tkjit.ops.per_channel_cast
    q, sf = op(x, npt, round_scale=round_scale)
    assert q.dtype == torch.float8_e4m3fn and q.is_contiguous()
    assert q.shape == ((hidden, tokens) if transposed else (tokens, hidden))
    assert sf.dtype == torch.float32 and sf.shape == (tokens // npt, hidden) and sf.is_contiguous()
    assert len(reference_kernels) == (1 if tokens else 0)  # an empty batch launches nothing
    if tokens:
        q_ref, sf_ref = _blockwise(x, npt, round_scale)
        assert torch.equal(sf, sf_ref) and _same(q, q_ref.T.contiguous() if transposed else q_ref)
    custom = getattr(torch.ops.tkjit, TRANSPOSE if transposed else CAST)
    q2, sf2 = custom(x, npt, round_scale)
    assert _same(q2, q) and torch.equal(sf2, sf)


@pytest.mark.parametrize("name", NAMES)
def test_ops_refuse_bad_input(reference_kernels, name):
    op = getattr(tkjit.ops, name)
    x = torch.randn(128, 256, dtype=torch.bfloat16)
    with pytest.raises(ShapeError, match=r"num_tokens \(x.shape\[0\] = 96\) must be a multiple of num_per_tokens"):
        op(x[:96], 128)
    with pytest.raises(ShapeError, match="num_per_tokens must be one of"):
        op(x, 64)
    with pytest.raises(ShapeError, match="num_per_tokens must be one of"):
        op(x, True)
    with pytest.raises(TensorError, match="x must be contiguous"):
        op(torch.randn(256, 128, dtype=torch.bfloat16).T, 32)
    with pytest.raises(TensorError, match="2-D"):
        op(x.view(2, 64, 256), 32)
    with pytest.raises(ShapeError, match="in_dtype"):
        op(x.half(), 32)
    with pytest.raises(ShapeError, match="multiple of 16"):
        op(torch.randn(32, 40), 32)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tokens", [0, 64])
def test_fake_impls(name, tokens):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(tokens, 576, dtype=torch.bfloat16))
        q, s = getattr(torch.ops.tkjit, name)(x, 32)
        with pytest.raises(ShapeError, match="multiple of num_per_tokens"):
            getattr(torch.ops.tkjit, name)(mode.from_tensor(torch.randn(48, 576)), 32)
    assert q.shape == ((576, tokens) if name == TRANSPOSE else (tokens, 576)) and q.dtype == torch.float8_e4m3fn
    assert s.shape == (tokens // 32, 576) and s.dtype == torch.float32


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tokens, npt, dtype, round_scale", [(64, 32, torch.bfloat16, False),
                                                             (128, 128, torch.float32, True),
                                                             (0, 32, torch.bfloat16, False)])
def test_opcheck(reference_kernels, name, tokens, npt, dtype, round_scale):
    x = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    result = torch.library.opcheck(getattr(torch.ops.tkjit, name).default, (x, npt, round_scale),
                                   test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result


def test_schemas():
    for name in NAMES:
        schema = str(getattr(torch.ops.tkjit, name).default._schema)
        assert schema == (f"tkjit::{name}(Tensor x, int num_per_tokens=128, bool round_scale=False, str? config=None) "
                          "-> (Tensor, Tensor)")


# -- TileKernels-compatible entry points ----------------------------------------------------------

def test_compat_signatures_are_tile_kernels():
    """TileKernels 1.0.0's signatures (quant/per_channel_cast_kernel.py, per_channel_cast_and_transpose_kernel.py)."""
    import tkjit.compat.tile_kernels as tk

    want = "(x: 'torch.Tensor', fmt: 'str', num_per_tokens: 'int', round_sf: 'bool' = False) -> 'QuantTensor'"
    for name in NAMES:
        assert str(inspect.signature(getattr(tk.quant, name))) == want


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tokens, hidden, npt, dtype, round_sf", [
    (128, 576, 128, torch.bfloat16, False),
    (256, 2048, 128, torch.bfloat16, True),
    (64, 256, 32, torch.float32, True),
    (0, 256, 128, torch.bfloat16, False),
])
def test_compat_returns_tile_kernels_layout(reference_kernels, name, tokens, hidden, npt, dtype, round_sf):
    import tkjit.compat.tile_kernels as tk

    x = (torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)) * 5).to(dtype)
    out = getattr(tk.quant, name)(x, "e4m3", npt, round_sf)
    assert type(out) is tuple and len(out) == 2
    q, sf = out
    transposed = name == TRANSPOSE
    assert q.dtype == torch.float8_e4m3fn and q.shape == ((hidden, tokens) if transposed else (tokens, hidden))
    assert q.is_contiguous() and sf.dtype == torch.float32 and sf.shape == (tokens // npt, hidden)
    assert sf.is_contiguous()  # TileKernels: torch.empty((num_tokens // num_per_tokens, hidden)), row-major
    if tokens:
        q_ref, sf_ref = _blockwise(x, npt, round_sf)
        assert torch.equal(sf, sf_ref) and _same(q, q_ref.T.contiguous() if transposed else q_ref)
    q2, sf2 = getattr(tk.quant, name)(x, fmt="e4m3", num_per_tokens=npt, round_sf=round_sf)
    assert _same(q2, q) and torch.equal(sf2, sf)


def _compat(name, x=None, *a):
    import tkjit.compat.tile_kernels as tk

    return getattr(tk.quant, name)(torch.zeros(128, 256, dtype=torch.bfloat16) if x is None else x, *a)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("args, error, match", [
    ((None, "e2m1", 128), ShapeError, "fmt must be 'e4m3', got 'e2m1'"),
    ((None, "e5m6", 128), ShapeError, "fmt must be 'e4m3'"),
    ((None, 3, 128), ShapeError, "fmt must be 'e4m3'"),
    ((None, "e4m3", 64), ShapeError, "num_per_tokens must be one of"),
    ((None, "e4m3", "128"), ShapeError, "num_per_tokens must be an int"),
    ((torch.zeros(96, 256), "e4m3", 128), ShapeError, r"num_tokens \(x.shape\[0\] = 96\) must be a multiple"),
    ((torch.zeros(128, 200), "e4m3", 128), ShapeError, r"hidden \(x.shape\[1\] = 200\) must be a multiple of 16"),
    ((torch.zeros(128, 256, dtype=torch.float16), "e4m3", 128), TensorError, "x must be"),
    ((torch.zeros(2, 128, 256), "e4m3", 128), TensorError, "x must be 2-D"),
    ((torch.zeros(256, 128).T, "e4m3", 128), TensorError, "x must be contiguous"),
    (("x", "e4m3", 128), TensorError, "x must be a torch.Tensor"),
])
def test_compat_refuses_what_tile_kernels_refuses(name, args, error, match):
    with pytest.raises(error, match=match) as err:
        _compat(name, *args)
    assert str(err.value).startswith(f"tile_kernels.quant.{name}: ")


@pytest.mark.parametrize("name", NAMES)
def test_compat_sizes_tkjit_lacks_are_not_implemented(name):
    with pytest.raises(NotImplementedError, match=r"hidden \(x.shape\[1\]\)=131072"):
        _compat(name, torch.zeros(32, 1 << 17), "e4m3", 32)


# -- sm_90a cross-compiles ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name, shape, config", [
    (CAST, {"hidden": 7168}, None),  # the DeepSeek default: bf16, 128 tokens per scale
    (CAST, {"hidden": 576, "num_per_tokens": 32, "in_dtype": "float32", "round_scale": True}, None),
    # channel tail (208 % 64)
    (CAST, {"hidden": 208}, {"vec": 8, "ch_threads": 8, "threads": 128, "stage": "regs", **NO_HINT}),
    (CAST, {"hidden": 208}, None),  # the staged tile with a channel tail (208 % 128)
    (CAST, {"hidden": 2048, "in_dtype": "float32"},
     {"vec": 8, "ch_threads": 16, "threads": 512, "stage": "smem", **NO_HINT}),
    (TRANSPOSE, {"hidden": 7168}, None),
    (TRANSPOSE, {"hidden": 576, "num_per_tokens": 32, "round_scale": True}, None),  # channel tail, 4 blocks a tile
    (TRANSPOSE, {"hidden": 2048, "in_dtype": "float32"}, {"block_tokens": 128, "block_ch": 32, "threads": 128,
                                                          "vec_bytes": 8, "out_vec": 8, "swizzle": False}),
])
def test_compiles_for_sm90a(cache_dir, name, shape, config):
    k = tkjit.get(name, {"token_blocks": 33, **shape}, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    assert "__fdiv_rn" in src  # IEEE divisions whatever the fast-math setting
    assert "int64_t" in src  # 64-bit offsets: x passes 2^31 elements at large token counts
    if shape.get("round_scale"):
        assert "8388607" in src or "0x7fffff" in src.lower()
    if name == CAST:  # the staged tile goes through shared memory, the register tile only reduces there
        assert ("void* tile = " in src) == (k.config["stage"] == "smem")
    if name == TRANSPOSE:
        lanes = shape.get("num_per_tokens", 128) // k.config["out_vec"]
        assert ("__shfl_xor_sync" in src) == (lanes > 1)
    assert src.count("scales[") + src.count("(scales +") >= 1


def test_occupancy_hint_rules():
    cast = get_spec(CAST)
    wide = cast.canonical_shape(_shape(hidden=7168))
    smem = {"vec": 4, "ch_threads": 16, "threads": 256, "stage": "smem", "factors": "thread"}
    assert cast.constraint(wide, {**smem, "min_threads_per_sm": 2048}) is None  # 8 blocks of 20 KiB
    assert "stage='smem'" in cast.constraint(wide, {**smem, "stage": "regs", "min_threads_per_sm": 1024})
    assert "at least two blocks" in cast.constraint(wide, {**smem, "threads": 512, "ch_threads": 32,
                                                           "min_threads_per_sm": 512})
    assert "multiple of threads" in cast.constraint(wide, {**smem, "min_threads_per_sm": 1000})
    # 8 blocks of 128 x 128 bf16 (32 KiB) + their maxima (4 KiB) do not fit an SM's 228 KiB
    assert "do not fit an SM" in cast.constraint(wide, {**smem, "ch_threads": 32, "min_threads_per_sm": 2048})
    hinted = [c for c in cast.configs(wide) if c["min_threads_per_sm"]]
    assert hinted and all(c["stage"] == "smem" for c in hinted)


def _staged_shape(name: str, **extra) -> dict:
    """A hidden-7168 shape of one of the three specs with the staged layout (the fused cast counts rows, not blocks)."""
    if name == "per_channel_cast_fused":
        return {"num_tokens_out": 4096, "num_tokens": 4096, "hidden": 7168, **extra}
    return {"token_blocks": 33, "hidden": 7168, **extra}


def _gather(name: str) -> dict:
    """per_channel_cast_fused's loads of the staged tile, as these register counts were set: one row at a time
    under its branch (gather="branch"; the default, "select", keeps all of a thread's rows in flight)."""
    return {"gather": "branch"} if name == "per_channel_cast_fused" else {}


@pytest.mark.slow
@pytest.mark.parametrize("name, hint", [(CAST, 2048), ("per_channel_cast_fused", 1536),
                                        ("swiglu_forward_and_per_channel_cast", 2048)])
def test_occupancy_hint_caps_registers(cache_dir, name, hint):
    """min_threads_per_sm at 256 threads: __launch_bounds__(256, hint / 256), so ptxas fits that many blocks an SM
    (2048: 32 registers a thread, 1536: 40; the fused gather keeps a row index and needs the 40) without
    spilling; unhinted, the unrolled loads take more."""
    shape = _staged_shape(name)
    cfg = {"vec": 4, "ch_threads": 16, "threads": 256, "stage": "smem", "min_threads_per_sm": hint, "factors": "thread",
           **_gather(name)}
    k = tkjit.get(name, shape, arch="sm_90a", config=cfg)
    src = (k.path / "kernel.cu").read_text()
    assert f"__launch_bounds__(256, {hint // 256})" in src
    usage = ptxas_usage(k.path / "kernel.cu")
    assert usage["registers"] <= 65536 // hint and usage["spill"] == 0, usage
    plain = tkjit.get(name, shape, arch="sm_90a", config={**cfg, "min_threads_per_sm": 0})
    assert "__launch_bounds__(256, 1)" in (plain.path / "kernel.cu").read_text()
    assert ptxas_usage(plain.path / "kernel.cu")["registers"] > 65536 // hint


@pytest.mark.slow
@pytest.mark.parametrize("name", [CAST, "per_channel_cast_fused", "swiglu_forward_and_per_channel_cast"])
@pytest.mark.parametrize("round_scale", [False, True])
def test_shared_factors(cache_dir, name, round_scale):
    """factors='shared': only the first row of threads divides (scales and factors), a second barrier, then every
    thread reads its channels' factors from shared memory; 'thread': every thread divides for its own channels
    (and, unrounded, only the first row for the scales); 'channel': one thread a channel folds the partial maxima
    and divides, the others only read their factors (one fold loop, in the threads under the block's width)."""
    shape = _staged_shape(name, round_scale=round_scale)
    hint = 1536 if name == "per_channel_cast_fused" else 2048  # (the gather's row index: 40 registers)
    cfg = {"vec": 4, "ch_threads": 16, "threads": 256, "stage": "smem", "min_threads_per_sm": hint, **_gather(name)}
    spec = get_spec(name)
    assert "stage='smem'" in spec.constraint(spec.canonical_shape(shape), {**cfg, "stage": "regs",
                                                                             "min_threads_per_sm": 0,
                                                                             "factors": "shared"})
    divs = {}
    for factors in ("thread", "shared", "channel"):
        k = tkjit.get(name, shape, arch="sm_90a", config={**cfg, "factors": factors})
        src = (k.path / "kernel.cu").read_text()
        divs[factors] = src.count("__fdiv_rn")
        # shared: a barrier before the factors are read (TileLang also lays them over the partial maxima, with one
        # more barrier before it writes them)
        assert (src.count("__syncthreads") >= 2) == (factors != "thread")
        if factors == "channel":
            assert "if (((int)threadIdx.x) < 64) {" in src  # 16 channel threads x 4 channels: a channel a thread
            # bf16 staged tiles keep their running maxima on packed pairs (per_channel_cast_fused stages FP8)
            assert ("tl::max2" in src) == (name != "per_channel_cast_fused")
        usage = ptxas_usage(k.path / "kernel.cu")
        assert usage["registers"] <= 65536 // hint and usage["spill"] == 0, (factors, usage)
    assert divs["shared"] <= divs["thread"] and divs["channel"] <= divs["thread"]


def test_space_has_every_tile_kernels_shape():
    """Every hidden and num_per_tokens of TileKernels' tests has valid configs in both specs, at both dtypes."""
    for name, hidden, npt, dt in itertools.product(NAMES, TK_HIDDEN, (32, 128), ("bfloat16", "float32")):
        spec = get_spec(name)
        full = spec.canonical_shape({"token_blocks": 32, "hidden": hidden, "num_per_tokens": npt, "in_dtype": dt})
        assert spec.configs(full, "sm_90a"), (name, hidden, npt, dt)
