"""swiglu_forward_and_per_channel_cast(_and_transpose) specs on the CPU: shapes, the clamp params, the reference
(SwiGLU against hand-computed values and TileKernels' operation order, then per_channel_cast's cast), the torch
ops (fake impls, opcheck), tkjit.ops and TileKernels' entry point (kernels that write the reference), sm_90a
cross-compiles (the per_channel_cast builders with the SwiGLU prologue)."""

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
from quant_checks import byte_same as _same  # noqa: E402
from reference_kernels import serve_references  # noqa: E402

TRANSPOSE = "swiglu_forward_and_per_channel_cast_and_transpose"
CAST = "swiglu_forward_and_per_channel_cast"
NAMES = (TRANSPOSE, CAST)
TK_HIDDEN = (576, 2048, 2560, 3072, 4096, 6144, 7168)  # TileKernels' hidden sizes (x is twice as wide)


def _shape(**kw):
    return {"token_blocks": 3, "hidden": 256, **kw}


def _tk_swiglu(x, clamp):
    """TileKernels' torch reference `swiglu_forward` (torch/swiglu.py), as its maths reads: float32."""
    h = x.shape[1] // 2
    xf = x.float()
    left, right = xf[:, :h], xf[:, h:]
    if clamp is not None:
        left = torch.clamp(left, max=clamp)
        right = torch.clamp(right, min=-clamp, max=clamp)
    return left / (1.0 + torch.exp(-left)) * right


def _tk_cast(x, npt, round_sf):
    """TileKernels' `cast(x, 'e4m3', (npt, 1), round_sf=...)` for num_tokens a multiple of npt."""
    t, h = x.shape
    xf = x.float().view(t // npt, npt, h)
    amax = xf.abs().amax(1, keepdim=True).clamp(min=1e-4)
    full = torch.full_like(amax, 448.0)
    sf = amax / full
    if round_sf:
        sf = ((sf.view(torch.int32) + 0x007FFFFF) & 0x7F800000).view(torch.float32)
        inv = 1.0 / sf
    else:
        inv = full / amax
    q = (xf * inv).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(t, h)
    return q, sf.view(t // npt, h)


def _expected(x, npt, round_sf, clamp, transposed):
    """What TileKernels' kernel returns: the float32 activations staged in x's dtype, then the cast."""
    q, sf = _tk_cast(_tk_swiglu(x, clamp).to(x.dtype), npt, round_sf)
    return (q.T.contiguous() if transposed else q), sf


def _reference_2d(name, x, npt, round_scale, clamp):
    spec = get_spec(name)
    t, w = x.shape
    full = spec.canonical_shape({"token_blocks": t // npt, "hidden": w // 2, "num_per_tokens": npt,
                                 "in_dtype": str(x.dtype)[6:], "round_scale": round_scale,
                                 "use_clamp": clamp is not None, "clamp_value": 0.0 if clamp is None else clamp})
    q, sf = spec.reference(full, x.view(t // npt, npt, w))
    return (q.reshape(w // 2, t) if name == TRANSPOSE else q.reshape(t, w // 2)), sf


# -- the specs --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_spec_validates(name):
    spec = get_spec(name)
    validate(spec)
    assert spec.family == "quant" and not spec.tolerance.exact and spec.tolerance.rtol == 1e-3
    for ex in spec.examples:
        full = spec.canonical_shape(ex)
        assert spec.default_config(full, "sm_90a") in spec.configs(full, "sm_90a")
    import tkjit_kernels

    assert tkjit_kernels.INDEX[name] == f"tkjit_kernels.quant.{TRANSPOSE}"
    assert [p.name for p in spec.params] == ["token_blocks", "hidden", "num_per_tokens", "in_dtype", "round_scale",
                                             "use_clamp", "clamp_value"]
    assert spec.pass_configs({})["tl.enable_fast_math"] is False


def test_space_and_defaults_are_the_per_channel_casts():
    for name, base in ((TRANSPOSE, "per_channel_cast_and_transpose"), (CAST, "per_channel_cast")):
        spec, other = get_spec(name), get_spec(base)
        assert spec.space == other.space
        for hidden in (16, 208, *TK_HIDDEN):
            for npt in (32, 128):
                shape = {"token_blocks": 32, "hidden": hidden, "num_per_tokens": npt}
                full = spec.canonical_shape({**shape, "use_clamp": True, "clamp_value": 7.0})
                mine, theirs = spec.default_config(full, "sm_90a"), other.default_config(other.canonical_shape(shape),
                                                                                         "sm_90a")
                # bf16: the config tuned fastest for the SwiGLU (its expf and division per element), 2 token rows a
                # thread; where it does not fit, the previous default (8 rows a thread), then per_channel_cast's
                tuned = {**SWIGLU_CAST_DEFAULT, "ch_threads": 8 * 128 // npt}
                before = {**SWIGLU_CAST_BEFORE, "ch_threads": 16 * 128 // npt}
                fits = [c for c in (tuned, before)
                        if name == CAST and c["ch_threads"] <= 64 and spec.constraint(full, c) is None]
                assert mine == (fits[0] if fits else theirs)
                assert spec.configs(full, "sm_90a")
    f32 = get_spec(CAST).canonical_shape({"token_blocks": 32, "hidden": 2048, "in_dtype": "float32"})
    assert get_spec(CAST).default_config(f32) == get_spec("per_channel_cast").default_config(
        get_spec("per_channel_cast").canonical_shape({"token_blocks": 32, "hidden": 2048, "in_dtype": "float32"}))


SWIGLU_CAST_DEFAULT = {"vec": 8, "ch_threads": 8, "threads": 512, "stage": "smem", "min_threads_per_sm": 2048,
                       "factors": "channel"}
SWIGLU_CAST_BEFORE = {"vec": 4, "ch_threads": 16, "threads": 256, "stage": "smem", "min_threads_per_sm": 2048,
                      "factors": "thread"}


@pytest.mark.parametrize("name", NAMES)
def test_bad_shapes(name):
    spec = get_spec(name)
    with pytest.raises(ShapeError, match="multiple of 16"):
        spec.canonical_shape(_shape(hidden=200))
    with pytest.raises(ShapeError, match="'num_per_tokens'=64 not allowed"):
        spec.canonical_shape(_shape(num_per_tokens=64))
    with pytest.raises(ShapeError, match="clamp_value=7.0 is read only with use_clamp=True"):
        spec.canonical_shape(_shape(clamp_value=7.0))
    with pytest.raises(ShapeError, match="clamp_value"):
        spec.canonical_shape(_shape(use_clamp=True, clamp_value=-1.0))
    full = spec.canonical_shape(_shape())
    with pytest.raises(ConfigError, match="CUDA targets only"):
        spec.check_config(full, spec.default_config(full), "cpu")


@pytest.mark.parametrize("name", NAMES)
def test_dims_and_bytes(name):
    spec = get_spec(name)
    full = spec.canonical_shape(_shape(token_blocks=5, hidden=576, num_per_tokens=32))
    (x_decl,) = spec.inputs
    assert x_decl.resolve(full) == ("bfloat16", (5, 32, 1152))
    (o, odt, odims), (s, sdt, sdims) = spec.output_decls(full)
    assert (o, odt, s, sdt, sdims) == ("out", "float8_e4m3fn", "scales", "float32", (5, 576))
    assert odims == ((576, 5, 32) if name == TRANSPOSE else (5, 32, 576))
    assert spec.bytes_moved(full) == 160 * 576 * 5 + 5 * 576 * 4
    assert spec.bytes_moved({**full, "in_dtype": "float32"}) == 160 * 576 * 9 + 5 * 576 * 4


# -- the reference --------------------------------------------------------------------------------------

def test_swiglu_hand_checked():
    """silu(g) * u at a few points, in float32, clamps where TileKernels puts them."""
    from tkjit_kernels.quant.swiglu_forward_and_per_channel_cast_and_transpose import swiglu

    g = torch.tensor([[0.0, 1.0, -2.0, 8.0, 100.0, -100.0, 3.0, -9.0]])
    u = torch.tensor([[5.0, 2.0, 1.0, 1.0, -1.0, 1.0, 9.0, -9.0]])
    x = torch.cat([g, u], 1)
    shape = {"hidden": 8, "use_clamp": False, "clamp_value": 0.0}
    act = swiglu(shape, x)
    f = torch.tensor
    assert act[0, 0] == 0.0
    assert act[0, 1] == f(1.0) / (f(1.0) + torch.exp(f(-1.0))) * 2.0
    assert act[0, 4] == -100.0 and act[0, 5] == 0.0  # exp(-100) underflows to 0, exp(100) to inf: -0.0
    assert torch.signbit(act[0, 5])
    clamped = swiglu({**shape, "use_clamp": True, "clamp_value": 7.0}, x)
    # gate <= 7 (no lower clamp: -9 stays), up in [-7, 7]
    assert clamped[0, 3] == f(7.0) / (f(1.0) + torch.exp(f(-7.0)))
    assert clamped[0, 6] == f(3.0) / (f(1.0) + torch.exp(f(-3.0))) * 7.0
    assert clamped[0, 7] == f(-9.0) / (f(1.0) + torch.exp(f(9.0))) * -7.0
    assert clamped[0, 4] == f(7.0) / (f(1.0) + torch.exp(f(-7.0))) * -1.0
    assert torch.equal(act[0, :3], clamped[0, :3])
    assert swiglu(shape, x.bfloat16()).dtype == torch.bfloat16  # staged in x's dtype, as TileKernels' kernel


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("npt, dtype, round_sf, clamp", [(32, torch.bfloat16, False, None),
                                                         (128, torch.bfloat16, True, 7.0),
                                                         (32, torch.float32, True, 6.9),
                                                         (128, torch.float32, False, None)])
def test_reference_is_tile_kernels(name, npt, dtype, round_sf, clamp):
    """The spec's reference is TileKernels' swiglu_forward (float32), staged in x's dtype, then its cast."""
    spec = get_spec(name)
    full = spec.canonical_shape({"token_blocks": 3, "hidden": 48, "num_per_tokens": npt, "in_dtype": str(dtype)[6:],
                                 "round_scale": round_sf, "use_clamp": clamp is not None,
                                 "clamp_value": 0.0 if clamp is None else clamp})
    (x3,) = spec.make_inputs(full, "cpu", 1)
    x = x3.view(-1, 96)
    if clamp is not None:
        assert (x[:, :48].float() > clamp).any() and (x[:, 48:].float().abs() > clamp).any()
    q, sf = _reference_2d(name, x, npt, round_sf, clamp)
    q_ref, sf_ref = _expected(x, npt, round_sf, clamp, name == TRANSPOSE)
    assert torch.equal(sf.view(torch.int32), sf_ref.view(torch.int32))
    assert _same(q, q_ref)


def test_reference_hand_checked():
    """A block whose activations are exact: gate 0 gives 0, large gates give gate * up."""
    x = torch.zeros(32, 32)
    x[:, 0] = 100.0  # silu(100) = 100 exactly in float32
    x[:, 16] = torch.linspace(-0.07, 0.035, 32)  # act = 100 * up: -7 .. 3.5, amax 7 -> scale 1/64
    x[:, 17] = 5.0  # gate 0: act 0 everywhere -> amax clamped to 1e-4
    q, sf = _reference_2d(CAST, x, 32, False, None)
    act0 = torch.tensor(100.0) * x[:, 16]
    assert sf[0, 0] == act0.abs().max() / torch.tensor(448.0)
    assert q[0, 0].float().item() == -448.0
    assert sf[0, 1] == torch.tensor(1e-4) / torch.tensor(448.0) and (q[:, 1].float() == 0).all()
    qt, sft = _reference_2d(TRANSPOSE, x, 32, False, None)
    assert torch.equal(sft, sf) and _same(qt, q.T.contiguous())
    qc, sfc = _reference_2d(CAST, x, 32, False, 50.0)  # gate clamped to 50: act 50 * up
    assert sfc[0, 0] == (torch.tensor(50.0) * x[:, 16]).abs().max() / torch.tensor(448.0)


@pytest.mark.parametrize("name", NAMES)
def test_make_inputs(name):
    spec = get_spec(name)
    full = spec.canonical_shape(_shape(token_blocks=4, hidden=576, num_per_tokens=32))
    (x,) = spec.make_inputs(full, "cpu", 3)
    assert x.dtype == torch.bfloat16 and x.shape == (4, 32, 1152) and x.isfinite().all()
    gate, up = x[..., :576].float(), x[..., 576:].float()
    assert (gate > 20).any() and (gate < -20).any() and (up[:, :, 5] == 0).all()
    (y,) = spec.make_inputs({**full, "in_dtype": "float32"}, "cpu", 3)
    assert y.dtype == torch.float32 and not torch.equal(spec.make_inputs(full, "cpu", 4)[0], x)


# -- torch ops and tkjit.ops ----------------------------------------------------------------------------

@pytest.fixture
def reference_kernels(monkeypatch):
    return serve_references(monkeypatch, NAMES)


def _x(tokens, hidden, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = 4 * torch.randn(tokens, hidden, generator=g)
    up = torch.randn(tokens, hidden, generator=g) * torch.exp(torch.randn(1, hidden, generator=g))
    return torch.cat([gate, up], 1).to(dtype)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tokens, hidden, npt, dtype, round_scale, clamp", [
    (128, 256, 128, torch.bfloat16, False, None),
    (96, 576, 32, torch.float32, True, 7.0),
    (64, 64, 32, torch.bfloat16, True, 3),
    (0, 64, 32, torch.bfloat16, False, None),
])
def test_ops_shapes_and_values(reference_kernels, name, tokens, hidden, npt, dtype, round_scale, clamp):
    transposed = name == TRANSPOSE
    x = _x(tokens, hidden, dtype, tokens + hidden)
    q, sf = getattr(tkjit.ops, name)(x, npt, round_scale=round_scale, swiglu_clamp_value=clamp)
    assert q.dtype == torch.float8_e4m3fn and q.is_contiguous()
    assert q.shape == ((hidden, tokens) if transposed else (tokens, hidden))
    assert sf.dtype == torch.float32 and sf.shape == (tokens // npt, hidden) and sf.is_contiguous()
    assert len(reference_kernels) == (1 if tokens else 0)
    if tokens:
        q_ref, sf_ref = _expected(x, npt, round_scale, clamp, transposed)
        assert torch.equal(sf, sf_ref) and _same(q, q_ref)
    q2, sf2 = getattr(torch.ops.tkjit, name)(x, npt, round_scale, clamp)
    assert _same(q2, q) and torch.equal(sf2, sf)


@pytest.mark.parametrize("name", NAMES)
def test_ops_refuse_bad_input(reference_kernels, name):
    op = getattr(tkjit.ops, name)
    x = torch.randn(128, 256, dtype=torch.bfloat16)
    with pytest.raises(ShapeError, match=r"num_tokens \(x.shape\[0\] = 96\) must be a multiple of num_per_tokens"):
        op(x[:96], 128)
    with pytest.raises(ShapeError, match="num_per_tokens must be one of"):
        op(x, 64)
    with pytest.raises(TensorError, match="x must be contiguous"):
        op(torch.randn(256, 128, dtype=torch.bfloat16).T, 32)
    with pytest.raises(TensorError, match="2-D"):
        op(x.view(2, 64, 256), 32)
    with pytest.raises(ShapeError, match="must be even"):
        op(torch.randn(32, 35), 32)
    with pytest.raises(ShapeError, match="multiple of 16"):
        op(torch.randn(32, 48), 32)  # hidden 24
    with pytest.raises(ShapeError, match="swiglu_clamp_value must be finite and >= 0"):
        op(x, 32, swiglu_clamp_value=-1.0)
    with pytest.raises(ShapeError, match="swiglu_clamp_value must be finite and >= 0"):
        op(x, 32, swiglu_clamp_value=float("inf"))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tokens", [0, 64])
def test_fake_impls(name, tokens):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(tokens, 1152, dtype=torch.bfloat16))
        q, s = getattr(torch.ops.tkjit, name)(x, 32, False, 7.0)
        with pytest.raises(ShapeError, match="multiple of num_per_tokens"):
            getattr(torch.ops.tkjit, name)(mode.from_tensor(torch.randn(48, 1152)), 32)
    assert q.shape == ((576, tokens) if name == TRANSPOSE else (tokens, 576)) and q.dtype == torch.float8_e4m3fn
    assert s.shape == (tokens // 32, 576) and s.dtype == torch.float32


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tokens, npt, dtype, round_scale, clamp", [(64, 32, torch.bfloat16, False, None),
                                                                    (128, 128, torch.float32, True, 7.0),
                                                                    (0, 32, torch.bfloat16, False, 1.5)])
def test_opcheck(reference_kernels, name, tokens, npt, dtype, round_scale, clamp):
    x = _x(tokens, 48, dtype)
    result = torch.library.opcheck(getattr(torch.ops.tkjit, name).default, (x, npt, round_scale, clamp),
                                   test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result


def test_schemas():
    for name in NAMES:
        schema = str(getattr(torch.ops.tkjit, name).default._schema)
        assert schema == (f"tkjit::{name}(Tensor x, int num_per_tokens=128, bool round_scale=False, "
                          "float? swiglu_clamp_value=None, str? config=None) -> (Tensor, Tensor)")


# -- TileKernels' entry point ------------------------------------------------------------------------------

def test_compat_signature_is_tile_kernels():
    """TileKernels' quant/swiglu_forward_and_per_channel_cast_and_transpose_kernel.py."""
    import tkjit.compat.tile_kernels as tk

    assert str(inspect.signature(tk.quant.swiglu_forward_and_per_channel_cast_and_transpose)) == (
        "(x: 'torch.Tensor', fmt: 'str', num_per_tokens: 'int', round_sf: 'bool' = False, "
        "without_transpose: 'bool' = False, swiglu_clamp_value: 'float | None' = None) -> 'QuantTensor'")


@pytest.mark.parametrize("without_transpose", [False, True])
@pytest.mark.parametrize("tokens, hidden, npt, dtype, round_sf, clamp", [
    (128, 576, 128, torch.bfloat16, False, None),
    (256, 2048, 32, torch.bfloat16, True, 10.0),
    (64, 256, 32, torch.float32, True, 7),
    (0, 256, 128, torch.bfloat16, False, None),
])
def test_compat_returns_tile_kernels_layout(reference_kernels, without_transpose, tokens, hidden, npt, dtype,
                                            round_sf, clamp):
    import tkjit.compat.tile_kernels as tk

    fn = tk.quant.swiglu_forward_and_per_channel_cast_and_transpose
    x = _x(tokens, hidden, dtype, tokens)
    out = fn(x, "e4m3", npt, round_sf, without_transpose, clamp)
    assert type(out) is tuple and len(out) == 2
    q, sf = out
    assert q.dtype == torch.float8_e4m3fn and q.is_contiguous()
    assert q.shape == ((tokens, hidden) if without_transpose else (hidden, tokens))
    assert sf.dtype == torch.float32 and sf.shape == (tokens // npt, hidden) and sf.is_contiguous()
    if tokens:
        q_ref, sf_ref = _expected(x, npt, round_sf, clamp, not without_transpose)
        assert torch.equal(sf, sf_ref) and _same(q, q_ref)
    q2, sf2 = fn(x, fmt="e4m3", num_per_tokens=npt, round_sf=round_sf, without_transpose=without_transpose,
                 swiglu_clamp_value=clamp)
    assert _same(q2, q) and torch.equal(sf2, sf)


def _compat(x=None, *a, **kw):
    import tkjit.compat.tile_kernels as tk

    x = torch.zeros(128, 256, dtype=torch.bfloat16) if x is None else x
    return tk.quant.swiglu_forward_and_per_channel_cast_and_transpose(x, *a, **kw)


@pytest.mark.parametrize("args, kw, error, match", [
    ((None, "e2m1", 128), {}, ShapeError, "fmt must be 'e4m3', got 'e2m1'"),
    ((None, 3, 128), {}, ShapeError, "fmt must be 'e4m3'"),
    ((None, "e4m3", 64), {}, ShapeError, "num_per_tokens must be one of"),
    ((None, "e4m3", "128"), {}, ShapeError, "num_per_tokens must be an int"),
    ((torch.zeros(96, 256), "e4m3", 128), {}, ShapeError, r"num_tokens \(x.shape\[0\] = 96\) must be a multiple"),
    ((torch.zeros(128, 200), "e4m3", 128), {}, ShapeError, r"x.shape\[1\] = 200 must be a multiple of 32"),
    ((torch.zeros(128, 256, dtype=torch.float16), "e4m3", 128), {}, TensorError, "x must be"),
    ((torch.zeros(2, 128, 256), "e4m3", 128), {}, TensorError, "x must be 2-D"),
    ((torch.zeros(256, 128).T, "e4m3", 128), {}, TensorError, "x must be contiguous"),
    (("x", "e4m3", 128), {}, TensorError, "x must be a torch.Tensor"),
    ((None, "e4m3", 128), {"swiglu_clamp_value": -7.0}, ShapeError, "swiglu_clamp_value must be finite and >= 0"),
    ((None, "e4m3", 128), {"swiglu_clamp_value": float("nan")}, ShapeError, "finite and >= 0"),
    ((None, "e4m3", 128), {"swiglu_clamp_value": "7"}, ShapeError, "swiglu_clamp_value must be a float or None"),
])
def test_compat_refuses_bad_input(args, kw, error, match):
    with pytest.raises(error, match=match) as err:
        _compat(*args, **kw)
    assert str(err.value).startswith("tile_kernels.quant.swiglu_forward_and_per_channel_cast_and_transpose: ")


def test_compat_sizes_tkjit_lacks_are_not_implemented():
    with pytest.raises(NotImplementedError, match=r"hidden \(x.shape\[1\] / 2\)=131072"):
        _compat(torch.zeros(32, 1 << 18), "e4m3", 32)


# -- sm_90a cross-compiles ------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name, shape, config", [
    (TRANSPOSE, {"hidden": 2048, "use_clamp": True, "clamp_value": 7.0}, None),
    (TRANSPOSE, {"hidden": 576, "num_per_tokens": 32, "round_scale": True, "in_dtype": "float32"}, None),
    (CAST, {"hidden": 2048}, None),
    (CAST, {"hidden": 208, "use_clamp": True, "clamp_value": 6.9},
     {"vec": 8, "ch_threads": 8, "threads": 128, "stage": "regs", **NO_HINT}),
])
def test_compiles_for_sm90a(cache_dir, name, shape, config):
    k = tkjit.get(name, {"token_blocks": 33, **shape}, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    assert "expf(" in src and "__expf" not in src  # CUDA's precise expf, as torch's exp on CUDA
    assert src.count("__fdiv_rn") >= 2  # the SiLU's division and the scale's: IEEE
    assert "int64_t" in src
    if shape.get("use_clamp"):
        assert "min(" in src and "max(" in src
