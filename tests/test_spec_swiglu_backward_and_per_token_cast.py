"""swiglu_backward_and_per_token_cast spec on the CPU: shapes, constraints, defaults, the reference (the exact fma,
hand-checked values, clamping, padding rows, against an independent float64 autograd of SwiGLU), the torch op (fake
impl, opcheck), tkjit.ops and the TileKernels-compatible entry point (kernels that write the reference), sm_90a
cross-compiles."""

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
from reference_kernels import serve_references  # noqa: E402

NAME = "swiglu_backward_and_per_token_cast"


def _shape(**kw):
    return {"num_expand_tokens": 100, "num_tokens": 30, "num_topk": 4, "hidden": 256, **kw}


def test_spec_validates():
    spec = get_spec(NAME)
    validate(spec)
    assert spec.family == "quant"
    for ex in spec.examples:
        full = spec.canonical_shape(ex)
        assert spec.default_config(full, "sm_90a") in spec.configs(full, "sm_90a")
    import tkjit_kernels

    assert tkjit_kernels.INDEX[NAME] == f"tkjit_kernels.quant.{NAME}"
    assert [p.name for p in spec.params] == ["num_expand_tokens", "num_tokens", "num_topk", "hidden",
                                             "num_per_channels", "round_scale", "use_clamp"]
    assert [s.name for s in spec.scalars] == ["swiglu_clamp_value"]


@pytest.mark.parametrize("hidden", [256, 576, 2048, 2560, 3072, 4096, 6144, 7168])
@pytest.mark.parametrize("npc", [32, 128])
def test_defaults_valid(hidden, npc):
    if hidden % npc:
        pytest.skip("not a TileKernels shape")
    spec = get_spec(NAME)
    full = spec.canonical_shape(_shape(hidden=hidden, num_per_channels=npc))
    cfg = spec.default_config(full, "sm_90a")
    assert cfg in spec.configs(full, "sm_90a")


def test_default_heuristics():
    spec = get_spec(NAME)
    assert spec.default_config(spec.canonical_shape(_shape(hidden=7168))) == {"vec": 8, "threads": 512}
    assert spec.default_config(spec.canonical_shape(_shape(hidden=2048))) == {"vec": 8, "threads": 128}
    assert len(spec.configs(spec.canonical_shape(_shape(hidden=7168)))) == 12
    assert len(spec.configs(spec.canonical_shape(_shape(hidden=7168, num_per_channels=32)))) == 12


def test_bad_shapes_and_configs():
    spec = get_spec(NAME)
    with pytest.raises(ShapeError, match="num_per_channels"):
        spec.canonical_shape(_shape(hidden=192))  # not a multiple of 128
    with pytest.raises(ShapeError, match="num_per_channels"):
        spec.canonical_shape(_shape(num_per_channels=64))
    with pytest.raises(ShapeError, match="num_topk"):
        spec.canonical_shape(_shape(num_topk=0))
    with pytest.raises(ConfigError, match="channels per step"):
        tkjit.get(NAME, _shape(hidden=64, num_per_channels=32), arch="sm_90a", config={"vec": 16, "threads": 512})


# -- the reference -------------------------------------------------------------------------------------------

def test_fma_is_single_rounding():
    from tkjit_kernels.quant.swiglu_backward_and_per_token_cast import fma

    g = torch.Generator().manual_seed(0)
    a = torch.randn(200000, generator=g) * torch.exp2(torch.randint(-30, 30, (200000,), generator=g).float())
    b = torch.randn(200000, generator=g)
    c = torch.randn(200000, generator=g)
    got = fma(a, b, c)
    # Exact: the float64 sum of the exact product and c is exact here when exponents are close; check against
    # a float128-free exact path: Python's fractions on a sample.
    from fractions import Fraction

    for i in range(0, 200000, 997):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        lo = torch.tensor(float(exact), dtype=torch.float64).float()  # nearest double then float: check bracket
        cand = [torch.nextafter(lo, torch.tensor(-float("inf"))), lo, torch.nextafter(lo, torch.tensor(float("inf")))]
        best = min(cand, key=lambda v: (abs(Fraction(float(v)) - exact), int(v.view(torch.int32)) & 1))
        assert got[i].view(torch.int32) == best.view(torch.int32), (i, float(a[i]), float(b[i]), float(c[i]))
    # A product whose float32 rounding would lose the low bits of the result.
    a1, b1, c1 = torch.tensor([1 + 2**-12]), torch.tensor([1 + 2**-12]), torch.tensor([-1.0])
    assert fma(a1, b1, c1) == torch.tensor([2**-11 + 2**-24])


def _tiny(clamp=None, npc=32, hidden=32):
    """Two rows of one token with two slots, one padding row."""
    e = 3  # rows; one token of two slots
    x = torch.zeros(e, 2 * hidden, dtype=torch.float8_e4m3fn)
    x_sf = torch.ones(e, 2 * hidden // npc)
    vals = torch.tensor([1.0, -2.0, 0.5, 3.0])
    for r in range(e):
        x[r, :4] = vals.to(torch.float8_e4m3fn)
        x[r, hidden:hidden + 4] = (vals * -1.5).to(torch.float8_e4m3fn)
    grad = torch.zeros(e, hidden, dtype=torch.bfloat16)
    grad[:, :4] = torch.tensor([1.0, 0.5, -1.0, 2.0]).bfloat16()
    weight = torch.tensor([[0.25, 0.75]])
    pos = torch.tensor([1, -1, 0], dtype=torch.int32)
    t2p = torch.tensor([[2, 0]], dtype=torch.int32)
    return x, x_sf, grad, weight, pos, t2p


@pytest.mark.parametrize("clamp", [None, 1.0])
def test_reference_against_autograd(clamp):
    """out, x_grad and weight_grad against float64 autograd of silu(clamp(a)) * clamp(b) * w."""
    spec = get_spec(NAME)
    x, x_sf, grad, weight, pos, t2p = _tiny()
    full = spec.canonical_shape({"num_expand_tokens": 3, "num_tokens": 1, "num_topk": 2, "hidden": 32,
                                 "num_per_channels": 32, "use_clamp": clamp is not None})
    out, q, sf, xg, wg = spec.reference(full, x, x_sf, grad, weight, pos, t2p, clamp or 0.0)
    xd = (x.double() * x_sf.double().repeat_interleave(32, 1)).requires_grad_()
    w = torch.tensor([0.75, 0.0, 0.25], dtype=torch.float64).requires_grad_()
    a, b = xd[:, :32], xd[:, 32:]
    if clamp is not None:
        a, b = a.clamp(max=clamp), b.clamp(-clamp, clamp)
    y = torch.nn.functional.silu(a) * b * w[:, None]
    y.backward(grad.double())
    assert torch.allclose(out.double(), y.detach(), rtol=1e-2, atol=1e-6)
    assert torch.allclose(xg.double(), xd.grad, rtol=1e-2, atol=1e-6)
    assert wg[0, 0] == pytest.approx(float(w.grad[2]), rel=1e-5) and wg[0, 1] == pytest.approx(float(w.grad[0]),
                                                                                               rel=1e-5)
    assert (out[1] == 0).all() and (xg[1] == 0).all()  # the padding row: w = 0
    # The cast: per 32-channel group of the float32 gradient (bf16 x_grad is its rounding).
    assert sf.shape == (3, 2) and q.shape == (3, 64)
    assert (sf[1] == torch.tensor(1e-4) / 448).all()  # an all-zero group: the amax clamp


def test_reference_clamped_gradients_are_zero():
    spec = get_spec(NAME)
    x, x_sf, grad, weight, pos, t2p = _tiny()
    full = spec.canonical_shape({"num_expand_tokens": 3, "num_tokens": 1, "num_topk": 2, "hidden": 32,
                                 "num_per_channels": 32, "use_clamp": True})
    _, _, _, xg, _ = spec.reference(full, x, x_sf, grad, weight, pos, t2p, 1.0)
    # a = [1, -2, 0.5, 3]: a > 1 clamped at channel 3; b = [-1.5, 3, -0.75, -4.5]: |b| > 1 at 0, 1, 3
    assert xg[0, 3] == 0 and xg[0, :3].ne(0).all()
    assert (xg[0, [32, 33, 35]] == 0).all() and xg[0, 34] != 0


def test_reference_weight_grad_unsent_is_zero():
    spec = get_spec(NAME)
    full = spec.canonical_shape(_shape())
    ins = spec.make_inputs(full, "cpu", 0)
    *_, wg = spec.reference(full, *ins)
    t2p = ins[5]
    assert (wg[t2p < 0] == 0).all() and (wg[t2p >= 0] != 0).any()


def test_make_inputs():
    spec = get_spec(NAME)
    full = spec.canonical_shape(_shape())
    x, x_sf, grad, weight, pos, t2p, cv = spec.make_inputs(full, "cpu", 0)
    assert x.dtype == torch.float8_e4m3fn and x.shape == (100, 512) and x.float().isfinite().all()
    assert x_sf.shape == (100, 4) and grad.dtype == torch.bfloat16 and weight.shape == (30, 4)
    assert cv == 0.5 and spec.make_inputs(full, "cpu", 1)[-1] == 10.0
    sent = pos >= 0
    assert (t2p.view(-1)[pos[sent].long()] == torch.nonzero(sent).flatten().int()).all()  # a consistent map
    assert (~sent).any() and (t2p < 0).any()


# -- torch op, tkjit.ops and the compat entry point ----------------------------------------------

@pytest.fixture
def reference_kernels(monkeypatch):
    return serve_references(monkeypatch, (NAME,))


def _data(e=64, n=20, k=4, hidden=256, npc=128, seed=0):
    spec = get_spec(NAME)
    full = spec.canonical_shape({"num_expand_tokens": max(e, 1), "num_tokens": max(n, 1), "num_topk": k,
                                 "hidden": hidden, "num_per_channels": npc})
    x, x_sf, grad, weight, pos, t2p, _ = spec.make_inputs(full, "cpu", seed)
    return x[:e], x_sf[:e], grad[:e], weight[:n], pos[:e], t2p[:n]


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("npc, round_scale, clamp", [(128, False, None), (32, True, 0.5), (128, True, 10.0)])
def test_ops_shapes_and_values(reference_kernels, npc, round_scale, clamp):
    x, x_sf, grad, weight, pos, t2p = _data(npc=npc)
    got = tkjit.ops.swiglu_backward_and_per_token_cast(x, x_sf, grad, weight, pos, t2p, npc,
                                                       round_scale=round_scale, swiglu_clamp_value=clamp)
    spec = get_spec(NAME)
    full = spec.canonical_shape({"num_expand_tokens": 64, "num_tokens": 20, "num_topk": 4, "hidden": 256,
                                 "num_per_channels": npc, "round_scale": round_scale, "use_clamp": clamp is not None})
    ref = spec.reference(full, x, x_sf, grad, weight, pos, t2p, clamp or 0.0)
    assert len(got) == 5 and all(_same(a, b) for a, b in zip(got, ref))
    assert [t.dtype for t in got] == [torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.bfloat16,
                                      torch.float32]
    got2 = torch.ops.tkjit.swiglu_backward_and_per_token_cast(x, x_sf, grad, weight, pos, t2p, npc, round_scale,
                                                             clamp)
    assert all(_same(a, b) for a, b in zip(got2, ref))


def test_ops_empty(reference_kernels):
    x, x_sf, grad, weight, pos, t2p = _data(e=0)
    out, q, sf, xg, wg = tkjit.ops.swiglu_backward_and_per_token_cast(x, x_sf, grad, weight, pos, t2p)
    assert out.shape == (0, 256) and q.shape == (0, 512) and sf.shape == (0, 4) and xg.shape == (0, 512)
    assert wg.shape == (20, 4) and (wg == 0).all() and len(reference_kernels) == 0
    x, x_sf, grad, weight, pos, t2p = _data(n=0)
    pos.fill_(-1)
    out, q, sf, xg, wg = tkjit.ops.swiglu_backward_and_per_token_cast(x, x_sf, grad, weight, pos, t2p)
    assert wg.shape == (0, 4) and out.shape == (64, 256) and (out.float() == 0).all()


def test_ops_refuse_bad_input(reference_kernels):
    op = tkjit.ops.swiglu_backward_and_per_token_cast
    x, x_sf, grad, weight, pos, t2p = _data()
    with pytest.raises(ShapeError, match="num_per_channels must be one of"):
        op(x, x_sf, grad, weight, pos, t2p, 64)
    with pytest.raises(TensorError, match="grad_out"):
        op(x, x_sf, grad[0], weight, pos, t2p)
    with pytest.raises(TensorError, match="dtype"):
        op(x, x_sf, grad.float(), weight, pos, t2p)
    with pytest.raises(TensorError, match="dtype"):
        op(x, x_sf, grad, weight, pos.long(), t2p)
    with pytest.raises(TensorError, match="axis 1"):
        op(x, x_sf[:, :2].contiguous(), grad, weight, pos, t2p)
    with pytest.raises(TensorError):
        op(x, x_sf, grad[:32], weight, pos, t2p)


def test_fake_impl():
    from torch._subclasses.fake_tensor import FakeTensorMode

    tensors = _data()
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in tensors]
        out, q, sf, xg, wg = torch.ops.tkjit.swiglu_backward_and_per_token_cast(*fakes, 128, True, 0.5)
        with pytest.raises(ShapeError, match="num_per_channels"):
            torch.ops.tkjit.swiglu_backward_and_per_token_cast(*fakes, 32 + 1)
    assert out.shape == (64, 256) and out.dtype == torch.bfloat16
    assert q.shape == (64, 512) and q.dtype == torch.float8_e4m3fn
    assert sf.shape == (64, 4) and xg.shape == (64, 512) and wg.shape == (20, 4) and wg.dtype == torch.float32


OPCHECK_TESTS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("npc, clamp", [(128, None), (32, 0.5)])
def test_opcheck(reference_kernels, npc, clamp):
    tensors = _data(npc=npc)
    result = torch.library.opcheck(torch.ops.tkjit.swiglu_backward_and_per_token_cast.default,
                                   (*tensors, npc, True, clamp), test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result


def test_schema():
    schema = str(torch.ops.tkjit.swiglu_backward_and_per_token_cast.default._schema)
    assert schema == ("tkjit::swiglu_backward_and_per_token_cast(Tensor x, Tensor x_sf, Tensor grad_out, "
                      "Tensor weight, Tensor pos_to_token_topk, Tensor token_topk_to_pos, int num_per_channels=128, "
                      "bool round_scale=False, float? swiglu_clamp_value=None, str? config=None) "
                      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")


def test_compat_signature_is_tile_kernels():
    """TileKernels' signature (quant/swiglu_backward_and_per_token_cast_kernel.py)."""
    import tkjit.compat.tile_kernels as tk

    sig = inspect.signature(tk.quant.swiglu_backward_and_per_token_cast)
    assert list(sig.parameters) == ["x", "grad_out", "weight", "pos_to_token_topk", "token_topk_to_pos",
                                    "num_per_channels", "round_sf", "swiglu_clamp_value"]
    assert [p.default for p in sig.parameters.values()][5:] == [inspect.Parameter.empty, False, None]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in sig.parameters.values())


@pytest.mark.parametrize("npc, round_sf, clamp", [(128, False, None), (32, True, 0.5), (32, False, 10.0)])
def test_compat_returns_tile_kernels_layout(reference_kernels, npc, round_sf, clamp):
    import tkjit.compat.tile_kernels as tk

    x, x_sf, grad, weight, pos, t2p = _data(npc=npc, seed=2)
    out, (q, sf), xg, wg = tk.quant.swiglu_backward_and_per_token_cast((x, x_sf), grad, weight, pos, t2p, npc,
                                                                        round_sf, clamp)
    ref = tkjit.ops.swiglu_backward_and_per_token_cast(x, x_sf, grad, weight, pos, t2p, npc, round_scale=round_sf,
                                                       swiglu_clamp_value=clamp)
    assert all(_same(a, b) for a, b in zip((out, q, sf, xg, wg), ref))
    assert out.is_contiguous() and q.is_contiguous() and sf.is_contiguous() and xg.is_contiguous()
    # x as (.., .., 2 * hidden) and grad_out of any viewable shape, as TileKernels takes them
    out2, (q2, _), _, _ = tk.quant.swiglu_backward_and_per_token_cast(
        (x.view(8, 8, 512), x_sf), grad.view(8, 8, 256), weight, pos, t2p, num_per_channels=npc, round_sf=round_sf,
        swiglu_clamp_value=clamp)
    assert _same(out2, out) and _same(q2, q)


def _compat(*args, **kw):
    import tkjit.compat.tile_kernels as tk

    return tk.quant.swiglu_backward_and_per_token_cast(*args, **kw)


_X, _SF, _G, _W, _P, _T = _data()


@pytest.mark.parametrize("args, error, match", [
    ((_X, _G, _W, _P, _T, 128), TensorError, "pair"),
    (((_X, _SF), _G, _W, _P, _T, 64), ShapeError, "num_per_channels must be 32 or 128"),
    (((_X, _SF), _G, _W, _P, _T, "128"), ShapeError, "num_per_channels must be an int"),
    (((_X.float(), _SF), _G, _W, _P, _T, 128), TensorError, r"x\[0\] \(values\) must be"),
    (((_X, _SF.double()), _G, _W, _P, _T, 128), TensorError, r"x\[1\] \(scales\) must be"),
    (((_X, _SF.T.contiguous().T), _G, _W, _P, _T, 128), TensorError, "contiguous"),
    (((_X[:, :384].contiguous(), _SF), _G, _W, _P, _T, 128), ShapeError, "multiple of 2 \\* num_per_channels"),
    (((_X, _SF[:, :2].contiguous()), _G, _W, _P, _T, 128), TensorError, r"x\[1\] \(scales\) must have shape"),
    (((_X, _SF), _G[:32], _W, _P, _T, 128), TensorError, "grad_out must hold"),
    (((_X, _SF), _G.float(), _W, _P, _T, 128), TensorError, "grad_out must be"),
    (((_X, _SF), _G, _W[:4], _P, _T, 128), TensorError, "weight must have shape"),
    (((_X, _SF), _G, _W, _P.long(), _T, 128), TensorError, "pos_to_token_topk must be"),
    (((_X, _SF), _G, _W, _P[:8], _T, 128), TensorError, "pos_to_token_topk must have shape"),
    (((_X, _SF), _G, _W, _P, _T.view(-1), 128), TensorError, "token_topk_to_pos must be 2-D"),
    (((_X, _SF), _G, _W, _P, _T.T, 128), TensorError, "contiguous"),
])
def test_compat_refuses_what_tile_kernels_refuses(args, error, match):
    with pytest.raises(error, match=match) as err:
        _compat(*args)
    assert str(err.value).startswith("tile_kernels.quant.swiglu_backward_and_per_token_cast: ")


def test_compat_sizes_tkjit_lacks_are_not_implemented():
    x = torch.zeros(4, 1 << 17, dtype=torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match=r"hidden \(x\[0\].shape\[-1\] / 2\)=65536"):
        _compat((x, torch.ones(4, 1024)), torch.zeros(4, 1 << 16, dtype=torch.bfloat16), torch.ones(2, 2),
                torch.zeros(4, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32), 128)
    with pytest.raises(NotImplementedError, match="num_topk"):
        _compat((_X, _SF), _G, torch.ones(1, 65), _P, torch.zeros(1, 65, dtype=torch.int32), 128)


# -- sm_90a cross-compiles ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("shape, config", [
    ({"hidden": 7168, "num_topk": 6}, None),  # a tail step at 512 threads x 8
    ({"hidden": 2048, "num_topk": 8, "num_per_channels": 32, "round_scale": True, "use_clamp": True}, None),
    ({"hidden": 2560, "num_topk": 9, "use_clamp": True}, {"vec": 16, "threads": 64}),
    ({"hidden": 3072, "num_topk": 2, "num_per_channels": 32}, {"vec": 4, "threads": 256}),
])
def test_compiles_for_sm90a(cache_dir, shape, config):
    k = tkjit.get(NAME, {"num_expand_tokens": 4096, "num_tokens": 1000, **shape}, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    assert "__fdiv_rn" in src and "__fmaf_rn" in src and "expf(" in src  # IEEE divisions, the explicit fma
    assert "__expf" not in src
    assert "int64_t" in src
    assert ("swiglu_clamp_value <" in src) == shape.get("use_clamp", False)
    if shape.get("round_scale"):
        assert "8388607" in src
