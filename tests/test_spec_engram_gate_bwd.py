"""engram_gate_bwd and grad_w_reduce on a CPU host: the specs, their float64 references against torch
autograd through the float64 forward and hand-computed cases, sm_90a cross-compiles (bf16: no C target),
the torch ops (grad_w_reduce a mutating op), the autograd pairs (engram_gate_fwd's registered backward,
tkjit.autograd.engram_gate, TileKernels' EngramGateFn) and the compat entry points, with the kernels
replaced by ones writing the references (the GPU tests run the real ones)."""

import inspect
import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as tk
from tkjit.compat.tile_kernels import config as tk_config
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit.tuning_db import with_added
from tkjit_kernels.engram._gate import backward64, clamped, forward64, gate_inputs, partial_sums

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from reference_kernels import serve_references  # noqa: E402

pytestmark = pytest.mark.usefixtures("module_cache")
BWD, RED = "engram_gate_bwd", "grad_w_reduce"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
KERNELS = ("fused_weight", "engram_gate_fwd", BWD, RED)


def _full(t=64, m=4, h=512, **kw):
    return tkjit.get_spec(BWD).canonical_shape({"num_tokens": t, "hc_mult": m, "hidden_size": h, **kw})


# -- the specs ---------------------------------------------------------------------------------------

def test_registered_and_valid():
    s, r = tkjit.get_spec(BWD), tkjit.get_spec(RED)
    assert s.family == r.family == "engram" and [p.name for p in s.runtime_params] == ["num_tokens"]
    assert [p.name for p in s.params] == ["num_tokens", "hc_mult", "hidden_size", "clamp_value", "num_partials"]
    assert [a.name for a in s.inputs if a.strided] == ["k", "v"]
    assert [a.name for a in r.inputs if a.inout] == ["grad_weight_hidden", "grad_weight_embed"] and r.outputs == ()
    for spec in (s, r):
        for ex in spec.examples:
            full = spec.canonical_shape(ex)
            assert spec.default_config(full, "sm_90a") in spec.configs(full, "sm_90a")
            assert spec.configs(full, "cpu") == []  # bf16: CUDA targets only
    full = _full(4096, 4, 7168)
    assert full["num_partials"] == 132 and full["clamp_value"] == 1e-6
    assert s.default_config(full) == {"vec": 8, "threads": 512, "grad_w": "regs", "stage": "none"}
    assert s.default_config(_full(h=512)) == {"vec": 8, "threads": 128, "grad_w": "regs", "stage": "none"}
    assert s.default_config(_full(m=16, h=65536))["grad_w"] == "global"  # too wide for registers
    for m, h in ((1, 1), (4, 6), (3, 300), (4, 2560), (4, 7168), (16, 7168), (4, 1 << 16)):
        f = _full(m=m, h=h)
        assert s.constraint(f, s.default_config(f)) is None, (m, h)
    red = r.canonical_shape({"hc_mult": 4, "hidden_size": 7168})
    assert r.default_config(red) == {"block_elems": 256, "threads": 64, "vec": 4, "unroll": 8}
    assert r.bytes_moved(red) == 4 * 7168 * (4 * 132 + 20)


def test_bad_shapes_and_configs():
    s, r = tkjit.get_spec(BWD), tkjit.get_spec(RED)
    with pytest.raises(ShapeError, match="num_partials"):
        _full(num_partials=0)
    with pytest.raises(ShapeError, match="2\\*\\*31"):
        _full(m=16, h=65536, num_partials=4096)
    with pytest.raises(ShapeError, match="hc_mult"):
        r.canonical_shape({"hc_mult": 17, "hidden_size": 512})
    with pytest.raises(ConfigError, match="grad_w='global'"):
        s.check_config(_full(h=7168), {"vec": 8, "threads": 128, "grad_w": "regs", "stage": "none"})
    with pytest.raises(ConfigError, match="multiple of 8"):
        s.check_config(_full(h=300), {"vec": 8, "threads": 64, "grad_w": "global", "stage": "none"})
    with pytest.raises(ConfigError, match="fewer threads"):
        s.check_config(_full(h=512), {"vec": 8, "threads": 512, "grad_w": "regs", "stage": "none"})
    with pytest.raises(ConfigError, match="vec >= 2"):
        s.check_config(_full(h=512), {"vec": 1, "threads": 128, "grad_w": "global", "stage": "xk"})
    # 3 x 4 x 12288 x 2 bytes staged: more than a block's 227 KiB of shared memory (2 x: 192 KiB, fits)
    with pytest.raises(ConfigError, match="shared memory"):
        s.check_config(_full(h=12288), {"vec": 8, "threads": 512, "grad_w": "global", "stage": "xk_go"})
    s.check_config(_full(h=12288), {"vec": 8, "threads": 512, "grad_w": "global", "stage": "xk"})
    # a config tuned before `stage` was a tunable is the unstaged kernel it was built as
    assert with_added(s, {"vec": 8, "threads": 128, "grad_w": "regs"})["stage"] == "none"
    with pytest.raises(ConfigError, match="unroll=8"):
        r.check_config(r.canonical_shape({"hc_mult": 4, "hidden_size": 512, "num_partials": 4}),
                       {"block_elems": 256, "threads": 64, "vec": 4, "unroll": 8})


def test_partial_sums_are_the_kernels_block_ranges():
    t = torch.arange(1.0, 8.0).view(7, 1)  # 7 tokens over 3 blocks: ceil(7/3) = 3 -> [0,3) [3,6) [6,7)
    assert partial_sums(t, 3).flatten().tolist() == [6.0, 15.0, 7.0]
    assert partial_sums(t, 5).flatten().tolist() == [3.0, 7.0, 11.0, 7.0, 0.0]  # 2 a block, the last empty
    assert partial_sums(t[:2], 4).flatten().tolist() == [1.0, 2.0, 0.0, 0.0]
    assert partial_sums(t[:0], 2).flatten().tolist() == [0.0, 0.0]


@pytest.mark.parametrize("seed, clamp_value", [(0, 1e-6), (1, 1e-6), (2, 0.3), (3, 1e-6)])
def test_reference_is_float64_autograd(seed, clamp_value):
    """backward64 (the reference) against torch autograd through the float64 forward: grad_x, grad_k, grad_v,
    and the partials summing to weight_fused's gradient."""
    shape = _full(37, 4, 512, clamp_value=clamp_value, num_partials=8)
    go, x, k, v, w = gate_inputs(shape, seed=seed, grad=True)
    xd, kd, vd, wd = (t.double().requires_grad_() for t in (x, k, v, w))
    out, dot, gate, rx, rk = forward64(xd, kd, vd, wd, 1e-6, clamp_value)
    gx, gk, gv, gw = torch.autograd.grad(out, (xd, kd, vd, wd), go.double())
    saved = [t.detach() for t in (dot, gate, rx, rk)]
    bx, bk, bv, bw = backward64(go, x, k, v, w, *saved, clamp_value, 8)
    assert bw.shape == (8, 4, 512)
    kw = dict(rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(bx, gx, **kw)
    torch.testing.assert_close(bk, gk, **kw)
    torch.testing.assert_close(bv, gv, **kw)
    torch.testing.assert_close(bw.sum(0), gw, **kw)
    if clamp_value == 0.3:
        assert bool(clamped(*saved[:1], *saved[2:], 512, 0.3).any())  # some heads under the clamp: no gate grad


def test_spec_reference_rounds_once():
    s = tkjit.get_spec(BWD)
    full = _full(20, 4, 256, num_partials=6)
    ins = s.make_inputs(full, seed=1)
    assert [a.dtype for a in ins] == [torch.bfloat16] * 4 + [torch.float32] * 5
    gx, gk, gv, gw = s.reference(full, *ins)
    assert (gx.dtype, gk.dtype, gv.dtype, gw.dtype) == (torch.bfloat16,) * 3 + (torch.float32,)
    assert gx.shape == gk.shape == (20, 4, 256) and gv.shape == (20, 256) and gw.shape == (6, 4, 256)
    want = backward64(*ins, full["clamp_value"], 6)
    assert torch.equal(gx, want[0].bfloat16()) and torch.equal(gw, want[3].float())


def test_hand_checked_token():
    # one token, one head, hidden 2, eps 0: x = (1, 1), k = (2, 0), w = (1, 1), v = (4, -2) -> dot = 2,
    # rstd_x = 1, rstd_k = 1/sqrt 2, s = 1, gate g = sigmoid(1). grad_out = (1, 0): dldg = 4,
    # dr = 4 g (1 - g) / 2 * sqrt(1 / (sqrt 2 * sqrt 2 * 2)) = g (1 - g); grad_v = g * (1, 0);
    # grad_w = dr * x * k = dr * (2, 0).
    x = torch.tensor([[[1.0, 1.0]]], dtype=torch.bfloat16)
    k = torch.tensor([[[2.0, 0.0]]], dtype=torch.bfloat16)
    v = torch.tensor([[4.0, -2.0]], dtype=torch.bfloat16)
    go = torch.tensor([[[1.0, 0.0]]], dtype=torch.bfloat16)
    w = torch.ones(1, 2)
    _, dot, gate, rx, rk = forward64(x, k, v, w, 0.0, 1e-6)
    _, _, gv, gw = backward64(go, x, k, v, w, dot, gate, rx, rk, 1e-6, 1)
    g = float(gate)
    assert gv.flatten().tolist() == pytest.approx([g, 0.0], rel=1e-12)
    assert gw.flatten().tolist() == pytest.approx([2 * g * (1 - g), 0.0], rel=1e-12)


def test_grad_w_reduce_reference():
    r = tkjit.get_spec(RED)
    shape = r.canonical_shape({"hc_mult": 1, "hidden_size": 2, "num_partials": 3})
    partial = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]]])  # sums (9, 12)
    wh = torch.tensor([[2.0, 0.5]], dtype=torch.bfloat16)
    we = torch.tensor([[1.0, -1.0]], dtype=torch.bfloat16)
    gh, ge = r.reference(shape, partial, wh, we, torch.ones(1, 2), torch.zeros(1, 2))
    assert gh.tolist() == [[1 + 9.0, 1 - 12.0]] and ge.tolist() == [[18.0, 6.0]]


# -- cross-compiles ------------------------------------------------------------------------------------

def test_bwd_cross_compiles_for_sm90a():
    kern = tkjit.get(BWD, {"num_tokens": 4096, "hc_mult": 4, "hidden_size": 7168}, arch="sm_90a")
    src = (kern.path / "kernel.cu").read_text()
    assert kern.config == {"vec": 8, "threads": 512, "grad_w": "regs", "stage": "none"}
    assert "k_stride0" in src and "v_stride0" in src and "float gw[64]" in src
    assert src.count("*(uint4*)(kv + 0)") == 1 and "sqrtf" in src and "__expf" not in src
    assert "cp_async" not in src
    # staged: x and k start for shared memory as 16-byte cp.async before pass 1 and are waited for before
    # pass 2, which reads them (and, with xk_go, grad_out) from there; grad_out is read from global once
    for stage, go_reads in (("xk", 2), ("xk_go", 1)):
        kern = tkjit.get(BWD, {"num_tokens": 4096, "hc_mult": 4, "hidden_size": 7168}, arch="sm_90a",
                         config={"vec": 8, "threads": 512, "grad_w": "global", "stage": stage})
        src = (kern.path / "kernel.cu").read_text()
        assert src.count("tl::cp_async_gs<16>") == 2 and src.count("tl::cp_async_commit()") == 1
        assert src.index("cp_async_commit") < src.index("(vv + 0)") < src.index("cp_async_wait<0>") < src.index(
            "(kv + 0) = *(uint4*)(((bfloat16_t*)ksm)")
        assert "*(uint4*)(xs + 0) = *(uint4*)(hidden_states" not in src
        # the kernel's own two barriers a token (the warps' sums, the end of the token), none around the copies
        assert src.count("__syncthreads()") == 2, stage
        assert src.count("*(uint4*)(grad_out + ") == go_reads, stage
    kern = tkjit.get(BWD, {"num_tokens": 7, "hc_mult": 3, "hidden_size": 300, "num_partials": 5}, arch="sm_90a",
                     config={"vec": 4, "threads": 64, "grad_w": "global", "stage": "none"})
    assert "gw[" not in (kern.path / "kernel.cu").read_text()


def test_grad_w_reduce_cross_compiles_for_sm90a():
    # The default config, named: a shipped tuned entry for this shape may take other vectors (the H100's: vec 2).
    spec = tkjit.get_spec(RED)
    shape = {"hc_mult": 4, "hidden_size": 7168}
    default = spec.default_config(spec.canonical_shape(shape))
    assert default["vec"] == 4
    kern = tkjit.get(RED, shape, arch="sm_90a", config=default)
    assert "float4" in (kern.path / "kernel.cu").read_text()
    tkjit.get(RED, {"hc_mult": 3, "hidden_size": 300, "num_partials": 13}, arch="sm_90a",
              config={"block_elems": 128, "threads": 32, "vec": 2, "unroll": 4})


# -- torch ops (the kernels replaced by ones writing the references) --------------------------------------

@pytest.fixture
def reference_kernels(monkeypatch):
    return serve_references(monkeypatch, KERNELS)


def _bwd_args(t=16, m=4, h=512, seed=0, P=132):
    s = tkjit.get_spec(BWD)
    return s.make_inputs(_full(t, m, h, num_partials=P), seed=seed)


def test_bwd_op_opcheck_and_fake(reference_kernels):
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.tkjit.engram_gate_bwd.default
    args = (*_bwd_args(P=8), 1e-6, 8)
    assert torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    got = tkjit.ops.engram_gate_bwd(*args[:9], 1e-6, num_partials=8)
    want = tkjit.get_spec(BWD).reference(_full(16, 4, 512, num_partials=8), *args[:9])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        outs = op(*(mode.from_tensor(a) for a in _bwd_args(5, 3, 256)), 1e-6)
        assert [tuple(o.shape) for o in outs] == [(5, 3, 256), (5, 3, 256), (5, 256), (132, 3, 256)]
        assert [o.dtype for o in outs] == [torch.bfloat16] * 3 + [torch.float32]
    a = _bwd_args()
    with pytest.raises(TensorError, match="dot has dtype torch.bfloat16"):
        op(*(t.to("meta") for t in a[:5]), a[5].to("meta").bfloat16(), *(t.to("meta") for t in a[6:]), 1e-6)
    with pytest.raises(TensorError, match=r"input grad_out has 2 dims \(16, 512\), expected 3"):
        op(a[3].to("meta"), *(t.to("meta") for t in a[1:]), 1e-6)


def _red_args(m=4, h=512, P=8, seed=0):
    r = tkjit.get_spec(RED)
    return r.make_inputs(r.canonical_shape({"hc_mult": m, "hidden_size": h, "num_partials": P}), seed=seed)


def test_grad_w_reduce_op_mutates_in_place(reference_kernels):
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.tkjit.grad_w_reduce.default
    assert [a.name for a in op._schema.arguments if a.is_write] == ["grad_weight_hidden", "grad_weight_embed"]
    assert torch.library.opcheck(op, _red_args(), test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    partial, wh, we, gh, ge = _red_args(seed=2)
    want = tkjit.get_spec(RED).reference(tkjit.get_spec(RED).canonical_shape(
        {"hc_mult": 4, "hidden_size": 512, "num_partials": 8}), partial, wh, we, gh, ge)
    ptrs = (gh.data_ptr(), ge.data_ptr())
    assert tkjit.ops.grad_w_reduce(partial, wh, we, gh, ge) is None
    assert (gh.data_ptr(), ge.data_ptr()) == ptrs and torch.equal(gh, want[0]) and torch.equal(ge, want[1])
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        assert op(*(mode.from_tensor(a) for a in _red_args(3, 256, 4))) is None
    with pytest.raises(TensorError, match="grad_weight_embed has dtype torch.bfloat16"):
        op(*(t.to("meta") for t in _red_args()[:4]), ge.to("meta").bfloat16())

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(p, a, b, c, d):
        tkjit.ops.grad_w_reduce(p, a, b, c, d)
        return c * 1.0, d * 1.0

    partial, wh, we, gh, ge = _red_args(seed=0)
    want = tkjit.get_spec(RED).reference(tkjit.get_spec(RED).canonical_shape(
        {"hc_mult": 4, "hidden_size": 512, "num_partials": 8}), partial, wh, we, gh, ge)
    c, d = f(partial, wh, we, gh, ge)
    assert torch.equal(c, want[0]) and torch.equal(gh, want[0]) and torch.equal(ge, want[1])


# -- autograd --------------------------------------------------------------------------------------------

def _autograd64(x, k, v, wh, we, go, clamp_value=1e-6, eps=1e-6):
    """Float64 autograd through the forward with weight_fused = wh * we: (out, grads of x, k, v, wh, we)."""
    leaves = [t.double().requires_grad_() for t in (x, k, v, wh, we)]
    out, *_ = forward64(*leaves[:3], leaves[3] * leaves[4], eps, clamp_value)
    return (out, *torch.autograd.grad(out, leaves, go.double()))


def _close(got, want, rtol=1e-3):
    """Relative L2 error below rtol against the float64 gradient rounded once to got's dtype (a bf16
    gradient's own rounding is ~1e-3 of it: the float64 value unrounded would need a looser bound)."""
    got, want = got.double(), want.to(got.dtype).double()
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    assert err < rtol, err


def _gate_data(t=21, m=4, h=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    go, x, k, v, _ = gate_inputs({"num_tokens": t, "hc_mult": m, "hidden_size": h}, seed=seed, grad=True)
    wh = (1.0 + 0.1 * torch.randn(m, h, generator=g)).bfloat16()
    we = (1.0 + 0.1 * torch.randn(m, h, generator=g)).bfloat16()
    return x, k, v, wh, we, go


@pytest.mark.parametrize("seed", [0, 1])
def test_engram_gate_fwd_op_is_differentiable(reference_kernels, seed):
    x, k, v, wh, we, go = _gate_data(seed=seed)
    w = wh.float() * we.float()
    leaves = [t.clone().requires_grad_() for t in (x, k, v, w)]
    out, dot, gate, rx, rk = tkjit.ops.engram_gate_fwd(*leaves, 1e-6, 1e-6)
    assert out.requires_grad and not any(t.requires_grad for t in (dot, gate, rx, rk))
    out.backward(go)
    xd, kd, vd, wd = (t.double().requires_grad_() for t in (x, k, v, w))
    o64, *_ = forward64(xd, kd, vd, wd, 1e-6, 1e-6)
    want = torch.autograd.grad(o64, (xd, kd, vd, wd), go.double())
    for leaf, wt in zip(leaves, want):
        assert leaf.grad.dtype == leaf.dtype
        _close(leaf.grad, wt)
    with pytest.raises(RuntimeError, match="differentiable once"):
        leaves = [t.clone().requires_grad_() for t in (x, k, v, w)]
        out = tkjit.ops.engram_gate_fwd(*leaves, 1e-6, 1e-6)[0]
        (gx,) = torch.autograd.grad(out, leaves[0], go, create_graph=True)
        gx.float().sum().backward()


@pytest.mark.parametrize("seed", [0, 1])
def test_tkjit_engram_gate_matches_float64_autograd(reference_kernels, seed):
    x, k, v, wh, we, go = _gate_data(seed=seed)
    shape = (3, 7, 4, 1024)  # TileKernels' (..., hc_mult, hidden_size) leading dims
    leaves = [x.view(shape), k.view(shape), v.view(3, 7, 1024), wh, we]
    leaves = [t.clone().requires_grad_() for t in leaves]
    out = tkjit.ops.engram_gate(*leaves, 1e-6, 1e-6)
    assert out.shape == shape and out.dtype == torch.bfloat16
    # one autograd node, straight from the leaves: no views around the Function
    assert all(f.variable is t for (f, _), t in zip(out.grad_fn.next_functions, leaves))
    out.backward(go.view(shape))
    want = _autograd64(x, k, v, wh, we, go)
    assert torch.equal(out.view(-1, 4, 1024), want[0].bfloat16())
    for leaf, wt in zip(leaves, want[1:]):
        assert leaf.grad.dtype == torch.bfloat16
        _close(leaf.grad.reshape(wt.shape), wt)


def test_tkjit_engram_gate_main_grad_and_compile(reference_kernels):
    x, k, v, wh, we, go = _gate_data(seed=3)
    want = _autograd64(x, k, v, wh, we, go)
    wh_p, we_p = torch.nn.Parameter(wh.clone()), torch.nn.Parameter(we.clone())
    wh_p.main_grad = torch.ones(4, 1024)
    we_p.main_grad = torch.zeros(4, 1024)
    out = tkjit.ops.engram_gate(x, k, v, wh_p, we_p, 1e-6, 1e-6)
    out.backward(go)
    assert wh_p.grad is None and we_p.grad is None  # accumulated into main_grad instead
    _close(wh_p.main_grad - 1.0, want[4])
    _close(we_p.main_grad, want[5])

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(a, b, c, d, e):
        return tkjit.ops.engram_gate(a, b, c, d, e, 1e-6, 1e-6)

    leaves = [t.clone().requires_grad_() for t in (x, k, v, wh, we)]
    out = f(*leaves)
    out.backward(go)
    assert torch.equal(out, want[0].bfloat16())
    for leaf, wt in zip(leaves, want[1:]):
        _close(leaf.grad, wt)


# -- compat ------------------------------------------------------------------------------------------

def test_compat_signatures_are_tile_kernels():
    empty = inspect.Parameter.empty
    params = list(inspect.signature(tk.engram.engram_gate_bwd).parameters.values())
    assert [(p.name, p.default) for p in params] == [(n, empty) for n in (
        "grad_out", "hidden_states", "k", "v", "weight_fused", "dot", "gate_score", "rstd_x", "rstd_k",
        "clamp_value")]
    params = list(inspect.signature(tk.engram.grad_w_reduce).parameters.values())
    assert [(p.name, p.default) for p in params] == [(n, empty) for n in (
        "grad_w_partial", "weight_hidden", "weight_embed", "grad_weight_hidden", "grad_weight_embed")]
    params = list(inspect.signature(tk.modeling.engram.EngramGateFn.forward).parameters)
    assert params == ["ctx", "hidden_states", "k", "v", "weight_hidden", "weight_embed", "clamp_value", "eps"]
    assert tk.modeling.engram.engram_gate == tk.modeling.engram.EngramGateFn.apply


@pytest.fixture
def num_sms(monkeypatch):
    monkeypatch.setattr(tk_config, "_num_sms", 8)  # set_num_sms(8), undone after the test
    return 8


def test_compat_bwd_and_reduce_match_the_references(reference_kernels, num_sms):
    a = _bwd_args(33, 4, 1024, seed=1, P=8)
    got = tk.engram.engram_gate_bwd(*a, 1e-6)
    want = tkjit.get_spec(BWD).reference(_full(33, 4, 1024, num_partials=8), *a)
    assert len(got) == 4 and got[3].shape == (8, 4, 1024)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    partial, wh, we, gh, ge = _red_args(4, 1024, 8)
    want = tkjit.get_spec(RED).reference(tkjit.get_spec(RED).canonical_shape(
        {"hc_mult": 4, "hidden_size": 1024, "num_partials": 8}), partial, wh, we, gh, ge)
    # a gradient buffer the kernel cannot write in place (a column slice) is still updated in place
    gbuf = torch.zeros(4, 2048)
    gbuf[:, ::2] = ge
    assert tk.engram.grad_w_reduce(partial, wh, we, gh, gbuf[:, ::2]) is None
    assert torch.equal(gh, want[0]) and torch.equal(gbuf[:, ::2], want[1]) and bool((gbuf[:, 1::2] == 0).all())


def test_compat_engram_gate_fn(reference_kernels, num_sms):
    x, k, v, wh, we, go = _gate_data(t=24, seed=1)
    shape = (2, 12, 4, 1024)
    leaves = [t.clone().requires_grad_() for t in (x.view(shape), k.view(shape), v.view(2, 12, 1024), wh, we)]
    out = tk.modeling.engram.engram_gate(*leaves, 1e-6, 1e-6)
    out.backward(go.view(shape))
    want = _autograd64(x, k, v, wh, we, go)
    assert out.shape == shape and torch.equal(out.view(-1, 4, 1024), want[0].bfloat16())
    for leaf, wt in zip(leaves, want[1:]):
        _close(leaf.grad.reshape(wt.shape), wt)


@pytest.mark.parametrize("change, err, match", [
    (lambda a: {**a, "grad_out": a["grad_out"].float()}, TensorError, "grad_out must be torch.bfloat16"),
    (lambda a: {**a, "grad_out": a["grad_out"][:4]}, TensorError, r"grad_out has shape \(4, 4, 1024\)"),
    (lambda a: {**a, "dot": a["dot"][:, :2]}, TensorError, r"dot has shape \(8, 2\)"),
    (lambda a: {**a, "rstd_k": a["rstd_k"].double()}, TensorError, "rstd_k must be torch.float32"),
    (lambda a: {**a, "k": a["k"][:, :, :512]}, TensorError, r"k has shape \(8, 4, 512\)"),
    (lambda a: {**a, "clamp_value": "x"}, ShapeError, "clamp_value must be a float"),
])
def test_compat_bwd_argument_errors(change, err, match, num_sms):
    names = ("grad_out", "hidden_states", "k", "v", "weight_fused", "dot", "gate_score", "rstd_x", "rstd_k")
    args = change({**dict(zip(names, _bwd_args(8, 4, 1024, P=8))), "clamp_value": 1e-6})
    with pytest.raises(err, match=match):
        tk.engram.engram_gate_bwd(**args)


@pytest.mark.parametrize("m, h, match", [(4, 768, "multiple of 512"), (4, 512, "at least 1024"),
                                         (2, 1024, "must be 4")])
def test_compat_bwd_shapes_tile_kernels_refuses(m, h, match, num_sms):
    with pytest.raises(ShapeError, match=match):
        tk.engram.engram_gate_bwd(*_bwd_args(2, m, h, P=8), 1e-6)


@pytest.mark.parametrize("change, err, match", [
    (lambda a: {**a, "grad_w_partial": a["grad_w_partial"][:6]}, ShapeError, "multiple of 4"),
    (lambda a: {**a, "grad_w_partial": a["grad_w_partial"][..., :768], "weight_hidden": a["weight_hidden"][:, :768],
                "weight_embed": a["weight_embed"][:, :768], "grad_weight_hidden": a["grad_weight_hidden"][:, :768],
                "grad_weight_embed": a["grad_weight_embed"][:, :768]}, ShapeError, "multiple of 512"),
    (lambda a: {**a, "weight_embed": a["weight_embed"].float()}, TensorError, "weight_embed must be torch.bfloat16"),
    (lambda a: {**a, "grad_weight_hidden": a["grad_weight_hidden"][:2]}, TensorError,
     r"grad_weight_hidden has shape \(2, 1024\)"),
    (lambda a: {**a, "grad_w_partial": a["grad_w_partial"][0]}, TensorError, "grad_w_partial must be 3-D"),
])
def test_compat_reduce_argument_errors(change, err, match):
    names = ("grad_w_partial", "weight_hidden", "weight_embed", "grad_weight_hidden", "grad_weight_embed")
    args = change(dict(zip(names, _red_args(4, 1024, 8))))
    with pytest.raises(err, match=match):
        tk.engram.grad_w_reduce(**args)
