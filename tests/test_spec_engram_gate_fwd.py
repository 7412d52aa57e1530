"""engram_gate_fwd on a CPU host: the spec, its float64 reference against TileKernels' formula (float32
torch, as its `engram_gate_ref`) and hand-computed cases, an sm_90a cross-compile (bf16: no C target),
the torch op and the TileKernels compat entry with the kernel replaced by one writing the reference
(the GPU tests run the real one)."""

import inspect
import math
import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as tk
from tkjit.errors import ConfigError, ShapeError, TensorError

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from reference_kernels import serve_references  # noqa: E402

pytestmark = pytest.mark.usefixtures("module_cache")
NAME = "engram_gate_fwd"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def spec():
    return tkjit.get_spec(NAME)


def _full(t=64, m=4, h=512, **kw):
    return spec().canonical_shape({"num_tokens": t, "hc_mult": m, "hidden_size": h, **kw})


def tk_formula(x, k, v, w, eps, clamp_value):
    """TileKernels' engram_gate_ref maths in float32 torch (weight_fused in place of wh * we), with the
    kernel's copysign for the sign: (out, dot, gate, rstd_x, rstd_k)."""
    x, kf = x.float(), k.float()
    h = x.shape[-1]
    rx = torch.rsqrt(x.pow(2).mean(-1) + eps)
    rk = torch.rsqrt(kf.pow(2).mean(-1) + eps)
    raw = torch.einsum("...d,...d->...", x * w, kf)
    d = raw * rx * rk * h**-0.5
    g = torch.copysign(d.abs().clamp_min(clamp_value).sqrt(), d).sigmoid()
    return (x + g.unsqueeze(-1) * v.unsqueeze(-2)).bfloat16(), raw, g, rx, rk


def test_registered_and_valid():
    s = spec()
    assert s.family == "engram" and [p.name for p in s.runtime_params] == ["num_tokens"]
    assert [a.name for a in s.inputs if a.strided] == ["k", "v"]
    for ex in s.examples:
        full = s.canonical_shape(ex)
        assert s.default_config(full, "sm_90a") in s.configs(full, "sm_90a")
        assert s.configs(full, "cpu") == []  # bf16: CUDA targets only
    full = _full(4096, 4, 7168)
    assert full["eps"] == 1e-6 and full["clamp_value"] == 1e-6
    assert s.default_config(full) == {"block_tokens": 1, "vec": 8, "threads": 128, "grid": "heads_inner"}
    assert s.default_config(_full(h=4096)) == {"block_tokens": 1, "vec": 8, "threads": 64, "grid": "heads_inner"}
    assert len(s.configs(full)) == 120
    for h in (1, 6, 300, 512, 2560, 7168, 1 << 16):
        f = _full(h=h)
        assert s.constraint(f, s.default_config(f)) is None, h
    assert s.bytes_moved(full) == 4096 * 4 * 7168 * 2 * 3 + 4096 * 7168 * 2 + 4 * 7168 * 4 + 4096 * 4 * 16


@pytest.mark.parametrize("shape, match", [
    ({"num_tokens": 1, "hc_mult": 0, "hidden_size": 512}, "hc_mult"),
    ({"num_tokens": 1, "hc_mult": 17, "hidden_size": 512}, "hc_mult"),
    ({"num_tokens": 1, "hidden_size": 0}, "hidden_size"),
    ({"num_tokens": 1, "hidden_size": 512, "eps": -1.0}, "eps"),
    ({"num_tokens": 1, "hidden_size": 512, "clamp_value": -1e-6}, "clamp_value"),
    ({"num_tokens": 1}, "hidden_size"),
])
def test_bad_shapes(shape, match):
    with pytest.raises(ShapeError, match=match):
        spec().canonical_shape(shape)


def test_bad_configs():
    s = spec()
    with pytest.raises(ConfigError, match="multiple of 8"):
        s.check_config(_full(h=300), {"block_tokens": 1, "vec": 8, "threads": 32, "grid": "heads_inner"})
    with pytest.raises(ConfigError, match="fewer threads"):
        s.check_config(_full(h=512), {"block_tokens": 1, "vec": 8, "threads": 512, "grid": "heads_inner"})
    with pytest.raises(ConfigError, match="CUDA targets only|C target"):
        s.check_config(_full(), {"block_tokens": 1, "vec": 8, "threads": 64, "grid": "heads_inner"}, arch="cpu")


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_reference_matches_tile_kernels_formula(seed):
    s, full = spec(), _full(97, 4, 512)
    ins = s.make_inputs(full, seed=seed)
    assert [a.dtype for a in ins] == [torch.bfloat16] * 3 + [torch.float32]
    ref = s.reference(full, *ins)
    want = tk_formula(*ins, full["eps"], full["clamp_value"])
    assert ref[0].dtype == torch.bfloat16 and all(r.dtype == torch.float32 for r in ref[1:])
    assert [tuple(r.shape) for r in ref] == [(97, 4, 512)] + [(97, 4)] * 4
    # float32 vs float64 sums: out within a bf16 ulp, rarely; the saved values to float32 rounding.
    diff = (ref[0].float() - want[0].float()).abs()
    assert float((diff > 0).float().mean()) < 1e-3
    scale = ins[0].float().abs() + ins[2].float().abs().unsqueeze(1)  # |x| + |v| >= |x + gate * v|
    assert bool((diff <= scale * 2**-7).all())  # one bf16 ulp of |out| <= scale (8 significant bits)
    for r, w in zip(ref[1:], want[1:]):
        torch.testing.assert_close(r, w, rtol=1e-4, atol=1e-4 * float(w.abs().max()))


def test_reference_hand_checked():
    # one token, one head, hidden 2: x = (1, 1), k = (2, 0), w = (1, 1): dot = 2, mean x^2 = 1,
    # mean k^2 = 2, s = 2 * 1 * (1 / sqrt 2) / sqrt 2 = 1, gate = sigmoid(1), out = x + gate * v.
    x = torch.tensor([[[1.0, 1.0]]], dtype=torch.bfloat16)
    k = torch.tensor([[[2.0, 0.0]]], dtype=torch.bfloat16)
    v = torch.tensor([[4.0, -2.0]], dtype=torch.bfloat16)
    w = torch.ones(1, 2)
    full = spec().canonical_shape({"num_tokens": 1, "hc_mult": 1, "hidden_size": 2, "eps": 0.0})
    out, dot, gate, rx, rk = spec().reference(full, x, k, v, w)
    g = 1 / (1 + math.exp(-1))
    assert dot.item() == 2.0 and rx.item() == 1.0 and rk.item() == pytest.approx(2**-0.5)
    assert gate.item() == pytest.approx(g, rel=1e-7)
    assert out.flatten().tolist() == torch.tensor([1 + 4 * g, 1 - 2 * g]).bfloat16().tolist()


def test_reference_zero_dot_and_clamp():
    # A zero x row: dot 0, rstd_x = rsqrt(eps), gate = sigmoid(+sqrt(clamp)) (copysign, as the kernel;
    # TileKernels' torch reference would give 0.5). A tiny score is clamped up to sqrt(clamp) too.
    full = spec().canonical_shape({"num_tokens": 2, "hc_mult": 1, "hidden_size": 4, "clamp_value": 0.25})
    x = torch.tensor([[[0.0] * 4], [[1.0, -1.0, 1.0, -1.0]]], dtype=torch.bfloat16)
    k = torch.tensor([[[1.0] * 4], [[1.0, 1.0, 1.0, -1.0]]], dtype=torch.bfloat16)
    v = torch.ones(2, 4, dtype=torch.bfloat16)
    _, dot, gate, rx, _ = spec().reference(full, x, k, v, torch.ones(1, 4))
    assert dot[0, 0] == 0.0 and rx[0, 0] == pytest.approx(1e3, rel=1e-6)
    assert gate[0, 0] == pytest.approx(1 / (1 + math.exp(-0.5)), rel=1e-7)
    # token 1: dot = 2, rstds 1 (up to eps), s = 2 / 2 = 1 >= 0.25: sigmoid(1)
    assert gate[1, 0] == pytest.approx(1 / (1 + math.exp(-1)), rel=1e-6)
    x[1, 0] = torch.tensor([1.0, -1.0, 1.0, 1.0])  # dot = -2, s = -1: the negative root
    k[1, 0] = torch.tensor([1.0, 1.0, -1.0, -1.0])
    _, dot, gate, _, _ = spec().reference(full, x, k, v, torch.ones(1, 4))
    assert dot[1, 0] == -2.0 and gate[1, 0] == pytest.approx(1 / (1 + math.exp(1)), rel=1e-6)


def test_cross_compiles_for_sm90a_with_vector_loads():
    kern = tkjit.get(NAME, {"num_tokens": 4096, "hc_mult": 4, "hidden_size": 7168}, arch="sm_90a")
    src = (kern.path / "kernel.cu").read_text()
    assert kern.config == {"block_tokens": 1, "vec": 8, "threads": 128, "grid": "heads_inner"}
    assert "k_stride0" in src and "v_stride0" in src and "k_stride1" in src
    # heads_inner: one flat grid, token = block / hc_mult and head = block % hc_mult (a token's heads side by side)
    assert "blockIdx.y" not in src and "(((int)blockIdx.x) & 3)" in src
    assert "(((int64_t)((int)blockIdx.x)) >> (int64_t)2)" in src
    assert src.count("*(uint4*)(kv + 0)") == 2  # k's and v's strided rows read as 16-byte vectors
    assert "__expf" not in src and "rsqrtf" in src and "copysignf" in src


def test_odd_shapes_cross_compile():
    kern = tkjit.get(NAME, {"num_tokens": 7, "hc_mult": 3, "hidden_size": 300}, arch="sm_90a",
                     config={"block_tokens": 2, "vec": 4, "threads": 32, "grid": "heads_inner"})
    assert "if (" in (kern.path / "kernel.cu").read_text()


# -- torch op (the kernel replaced by one writing the reference) --------------------------------------

@pytest.fixture
def reference_kernels(monkeypatch):
    return serve_references(monkeypatch, (NAME,))


def _args(t=16, m=4, h=512, seed=0):
    return spec().make_inputs(_full(t, m, h), seed=seed)


def test_op_opcheck_and_fake_shapes(reference_kernels):
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.tkjit.engram_gate_fwd.default
    assert ("(Tensor hidden_states, Tensor k, Tensor v, Tensor weight_fused, float eps, float clamp_value, "
            "str? config=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)") in str(op._schema)
    args = (*_args(), 1e-6, 1e-6)
    assert torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        outs = op(*(mode.from_tensor(a) for a in _args(5, 3, 256)), 1e-6, 1e-6)
        assert [tuple(o.shape) for o in outs] == [(5, 3, 256)] + [(5, 3)] * 4
        assert [o.dtype for o in outs] == [torch.bfloat16] + [torch.float32] * 4
    x, k, v, w = _args()
    with pytest.raises(TensorError, match="weight_fused has dtype torch.bfloat16"):
        op(x.to("meta"), k.to("meta"), v.to("meta"), w.to("meta").bfloat16(), 1e-6, 1e-6)
    with pytest.raises(TensorError, match=r"input v has 3 dims \(16, 4, 512\), expected 2"):
        op(x.to("meta"), k.to("meta"), k.to("meta"), w.to("meta"), 1e-6, 1e-6)


def test_op_eager_strided_and_compiled(reference_kernels):
    x, k, v, w = _args(seed=1)
    want = spec().reference(_full(16, 4, 512), x, k, v, w)
    got = tkjit.ops.engram_gate_fwd(x, k, v, w, 1e-6, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # k and v as slices of wider projections: read in place (strided), same values
    kbuf = torch.zeros(16, 4, 1024, dtype=torch.bfloat16)
    kbuf[:, :, 256:768] = k
    vbuf = torch.zeros(16, 2048, dtype=torch.bfloat16)
    vbuf[:, 512:1024] = v
    got = tkjit.ops.engram_gate_fwd(x, kbuf[:, :, 256:768], vbuf[:, 512:1024], w, 1e-6, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(a, b, c, d):
        out, *saved = tkjit.ops.engram_gate_fwd(a, b, c, d, 1e-6, 1e-6)
        return out.float() * 1.0, saved[1] + 0.0

    out, gate = f(x, k, v, w)
    assert torch.equal(out, want[0].float()) and torch.equal(gate, want[2])


# -- compat ------------------------------------------------------------------------------------------

def test_compat_signature_is_tile_kernels():
    params = list(inspect.signature(tk.engram.engram_gate_fwd).parameters.values())
    assert [(p.name, p.default) for p in params] == [
        ("hidden_states", inspect.Parameter.empty), ("k", inspect.Parameter.empty), ("v", inspect.Parameter.empty),
        ("weight_fused", inspect.Parameter.empty), ("eps", inspect.Parameter.empty),
        ("clamp_value", inspect.Parameter.empty), ("save_for_backward", True)]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)


def test_compat_matches_the_reference(reference_kernels):
    x, k, v, w = _args(33, 4, 1024, seed=3)
    want = spec().reference(_full(33, 4, 1024, eps=1e-5, clamp_value=1e-3), x, k, v, w)
    got = tk.engram.engram_gate_fwd(x, k, v, w, 1e-5, 1e-3)
    assert len(got) == 5 and all(torch.equal(a, b) for a, b in zip(got, want))
    assert got[0].is_contiguous()
    out, *rest = tk.engram.engram_gate_fwd(x, k, v, w, 1e-5, 1e-3, save_for_backward=False)
    assert torch.equal(out, want[0]) and rest == [None] * 4
    # a broadcast k (stride 0 over heads), a transposed-storage x and an unaligned v are copied first
    kb = k[:, :1].expand(33, 4, 1024)
    want = spec().reference(_full(33, 4, 1024), x, kb.contiguous(), v, w)
    buf = torch.zeros(v.numel() + 1, dtype=torch.bfloat16)
    buf[1:] = v.flatten()
    got = tk.engram.engram_gate_fwd(x.transpose(0, 1).contiguous().transpose(0, 1), kb, buf[1:].view(33, 1024), w,
                                    1e-6, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_compat_empty_batch(reference_kernels):
    from tkjit_kernels.engram._gate import gate_inputs

    x, k, v, w = gate_inputs({"num_tokens": 0, "hc_mult": 4, "hidden_size": 512})
    out, dot, gate, rx, rk = tk.engram.engram_gate_fwd(x, k, v, w, 1e-6, 1e-6)
    assert out.shape == (0, 4, 512) and dot.shape == gate.shape == rx.shape == rk.shape == (0, 4)
    assert reference_kernels == []


@pytest.mark.parametrize("change, err, match", [
    (lambda a: {**a, "hidden_states": a["hidden_states"].float()}, TensorError, "hidden_states must be torch.bfloat16"),
    (lambda a: {**a, "k": a["k"][:, :, :256]}, TensorError, r"k has shape \(8, 4, 256\), expected \(8, 4, 512\)"),
    (lambda a: {**a, "v": a["v"][:4]}, TensorError, r"v has shape \(4, 512\)"),
    (lambda a: {**a, "v": a["v"].t().contiguous().t()}, TensorError, "v must have a contiguous last axis"),
    (lambda a: {**a, "weight_fused": a["weight_fused"].bfloat16()}, TensorError, "weight_fused must be torch.float32"),
    (lambda a: {**a, "weight_fused": a["weight_fused"][:2]}, TensorError, "weight_fused has shape"),
    (lambda a: {**a, "k": a["k"][0]}, TensorError, "k must be 3-D"),
    (lambda a: {**a, "eps": "small"}, ShapeError, "eps must be a float"),
    (lambda a: {**a, "clamp_value": -1.0}, NotImplementedError, "clamp_value"),
])
def test_compat_argument_errors(change, err, match):
    x, k, v, w = _args(8, 4, 512)
    args = change({"hidden_states": x, "k": k, "v": v, "weight_fused": w, "eps": 1e-6, "clamp_value": 1e-6})
    with pytest.raises(err, match=match):
        tk.engram.engram_gate_fwd(**args)


@pytest.mark.parametrize("h", [256, 300, 640])
def test_compat_hidden_sizes_tile_kernels_refuses(h):
    x = torch.zeros(2, 4, h, dtype=torch.bfloat16)
    with pytest.raises(ShapeError, match=rf"hidden_size \(hidden_states.shape\[2\] = {h}\) must be a multiple of 256"):
        tk.engram.engram_gate_fwd(x, x, x[:, 0], torch.ones(4, h), 1e-6, 1e-6)


def test_compat_sizes_tkjit_lacks_are_not_implemented():
    x = torch.zeros(2, 17, 512, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"engram_gate_fwd: hc_mult \(hidden_states.shape\[1\]\)=17"):
        tk.engram.engram_gate_fwd(x, x, x[:, 0], torch.ones(17, 512), 1e-6, 1e-6)


# -- the backward's maths (groundwork for engram_gate_bwd): float64 autograd of the forward ----------

@pytest.mark.parametrize("seed, clamp_value", [(0, 1e-6), (1, 1e-6), (2, 0.3)])
def test_gate_gradient_formulas_match_float64_autograd(seed, clamp_value):
    """The closed forms TileKernels' backward kernel uses (via `_gate.gate_grad64`, from the saved
    values) against torch autograd through the float64 forward: grad_x, grad_k, grad_v, grad_w."""
    from tkjit_kernels.engram._gate import forward64, gate_grad64

    g = torch.Generator().manual_seed(seed)
    x, k, v, w = spec().make_inputs(_full(23, 4, 512), seed=seed)
    xd, kd, vd, wd = (t.double().requires_grad_() for t in (x, k, v, w))
    out, dot, gate, rx, rk = forward64(xd, kd, vd, wd, 1e-6, clamp_value)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64)
    gx, gk, gv, gw = torch.autograd.grad(out, (xd, kd, vd, wd), go)
    h = x.shape[-1]
    x64, k64, v64, w64 = x.double(), k.double(), v.double(), w.double()
    dldg = (go * v64.unsqueeze(1)).sum(-1)
    dr = gate_grad64(dldg, dot.detach(), gate.detach(), rx.detach(), rk.detach(), h, clamp_value).unsqueeze(-1)
    d, rx2, rk2 = dot.detach().unsqueeze(-1), rx.detach().unsqueeze(-1) ** 2, rk.detach().unsqueeze(-1) ** 2
    torch.testing.assert_close(go + dr * (k64 * w64 - x64 * d * rx2 / h), gx, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dr * (x64 * w64 - k64 * d * rk2 / h), gk, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close((go * gate.detach().unsqueeze(-1)).sum(1), gv, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close((dr * x64 * k64).sum(0), gw, rtol=1e-10, atol=1e-12)
    if clamp_value == 0.3:  # some scores under the clamp: their gate gradient is 0
        assert bool((dr == 0).any())
