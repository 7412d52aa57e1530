"""pre_apply_mix / pre_apply_mix_bwd / pre_apply_mix_bwd_acc on a CPU host: the specs, their references against
hand-computed fused multiply-adds and float64 autograd of TileKernels' torch reference, the ops (custom ops,
autograd with TileKernels' residual-gradient accumulation, torch.compile) and the TileKernels entry point over
reference-writing kernels (bf16 rows: the C target lowers none of them), and sm_90a cross-compiles."""

import inspect
import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops as ops
from tkjit.compat.tile_kernels.modeling.mhc import ops as tk

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from reference_kernels import serve_references  # noqa: E402

NAMES = ("pre_apply_mix", "pre_apply_mix_bwd", "pre_apply_mix_bwd_acc")
SHAPE = {"num_tokens": 4096, "mhc_mult": 4, "hidden": 7168}
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.fixture
def reference_kernels(monkeypatch):
    return serve_references(monkeypatch, NAMES)


def data(lead=(2, 5), m=4, h=32, seed=0):
    """TileKernels' test data: x = sigmoid(randn) bf16, mix softmax over the streams (..., m, 1), grad randn."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, m, h, generator=g).bfloat16().sigmoid()
    mix = torch.randn(*lead, m, 1, generator=g).softmax(-2)
    go = torch.randn(*lead, h, generator=g).bfloat16()
    return x, mix, go


def float64_autograd(x, mix, go):
    """TileKernels' mhc_pre_apply_mix_ref, (x * mix).sum(-2), and its gradients, in float64."""
    xd, md = x.double().requires_grad_(True), mix.double().requires_grad_(True)
    o = (xd * md).sum(-2)
    o.backward(go.double())
    return o.detach(), xd.grad, md.grad


def tk_close(a, b):
    """TileKernels' tolerance for this op (tests/mhc/test_pre_apply_mix.py)."""
    torch.testing.assert_close(a.double(), b.double(), atol=1e-2, rtol=1e-3)


# -- the specs ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_specs(name):
    s = tkjit.get_spec(name)
    assert s.family == "mhc" and [p.name for p in s.params] == ["num_tokens", "mhc_mult", "hidden"]
    full = s.canonical_shape(SHAPE)
    assert s.default_config(full) == {"threads": 128, "rows": 1, "vec_bytes": 16, "unroll": 7}
    assert len(s.configs(full)) > 100 and s.configs(full, arch="cpu") == []
    for h in (1, 7, 576, 1280, 2560, 4096, 7168, 7680):
        for m in (1, 2, 4, 8, 16):
            f = s.canonical_shape({"num_tokens": 3, "mhc_mult": m, "hidden": h})
            assert s.constraint(f, s.default_config(f)) is None, (h, m)
    assert [t.name for t in s.inputs][:3] == (["x", "mix"] if name == "pre_apply_mix" else ["grad_out", "x", "mix"])


def test_bwd_specs_in_place_and_traffic():
    fresh, acc = tkjit.get_spec("pre_apply_mix_bwd"), tkjit.get_spec("pre_apply_mix_bwd_acc")
    assert [t.name for t in fresh.outputs] == ["x_grad", "mix_grad"]
    assert [t.name for t in acc.outputs] == ["mix_grad"] and acc.inputs[3].inout
    s = {"num_tokens": 2, "mhc_mult": 4, "hidden": 8}
    # grad_out + x + x_grad (+ x_grad read) bf16, mix and mix_grad float32
    assert fresh.bytes_moved(s) == 2 * 8 * 2 * (1 + 2 * 4) + 2 * 2 * 4 * 4
    assert acc.bytes_moved(s) - fresh.bytes_moved(s) == 2 * 4 * 8 * 2
    assert tkjit.get_spec("pre_apply_mix").bytes_moved(s) == 2 * 8 * 2 * 5 + 2 * 4 * 4


def test_reference_is_the_fma_chain():
    """One fused multiply-add per stream from +0.0, rounded once: 1 + 2**-24 survives the fma (a product and a
    sum rounded separately would lose it), then bf16; a -0 product with +0 gives +0."""
    s = tkjit.get_spec("pre_apply_mix")
    x = torch.tensor([[[1.0, -0.0], [1.0, 2.0]]]).bfloat16()  # (1 token, 2 streams, hidden 2)
    mix = torch.tensor([[1.0 + 2.0**-23, -(1.0)]])
    # stream 0: fma(1 + 2^-23, 1, 0) = 1 + 2^-23; stream 1: fma(-1, 1, 1 + 2^-23) = 2^-23
    out = s.reference({"mhc_mult": 2}, x, mix)
    assert out.dtype == torch.bfloat16 and out[0, 0].item() == 2.0**-23
    # column 1: fma(1 + 2^-23, -0, +0) = +0, then fma(-1, 2, +0) = -2
    assert out[0, 1].item() == -2.0
    z = s.reference({"mhc_mult": 2}, torch.tensor([[[-0.0], [-0.0]]]).bfloat16(), torch.tensor([[1.0, 1.0]]))
    assert not torch.signbit(z).any()
    # fma: 3 * (1 + 2^-23) + (-3) is 3 * 2^-23 exactly; a rounded product would give 2^-22 (3 + 2^-22 - 3).
    f = s.reference({"mhc_mult": 2}, torch.tensor([[[3.0], [1.0]]]).bfloat16(), torch.tensor([[1.0, 0.0]]))
    assert f.item() == 3.0
    g = tkjit.get_spec("pre_apply_mix_bwd").reference(
        {"mhc_mult": 1}, torch.tensor([[3.0]]).bfloat16(), torch.tensor([[[1.0]]]).bfloat16(),
        torch.tensor([[1.0 + 2.0**-23]]))
    assert g[0].item() == 3.0 and g[1].item() == 3.0  # x_grad bf16(3 + 3 * 2^-23) = 3; mix_grad 3 * 1


def test_bwd_reference_in_place_base():
    s = tkjit.get_spec("pre_apply_mix_bwd_acc")
    go = torch.tensor([[2.0, -0.0]]).bfloat16()
    x = torch.tensor([[[1.0, 5.0]]]).bfloat16()
    mix = torch.tensor([[0.5]])
    xg = torch.tensor([[[1.0, -0.0]]]).bfloat16()
    new_xg, mix_grad = s.reference({"mhc_mult": 1}, go, x, mix, xg)
    assert new_xg.tolist() == [[[2.0, 0.0]]] and torch.signbit(new_xg[0, 0, 1])  # fma(0.5, -0, -0) = -0
    assert mix_grad.tolist() == [[2.0]]
    fresh, _ = tkjit.get_spec("pre_apply_mix_bwd").reference({"mhc_mult": 1}, go, x, mix)
    assert not torch.signbit(fresh[0, 0, 1])  # fma(0.5, -0, +0) = +0: TileKernels' add into zeros


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_references_match_float64_autograd(seed):
    """The references against float64 torch autograd of TileKernels' torch reference on the specs' inputs
    (rows of many magnitudes, mixes of any sign on odd seeds): within one bf16 rounding plus float32's on the
    summed magnitudes; mix_grad (float64, rounded once) to float32 precision. TileKernels' tolerance on its
    own data: test_ops_forward_backward."""
    fwd, bwd = tkjit.get_spec("pre_apply_mix"), tkjit.get_spec("pre_apply_mix_bwd")
    full = fwd.canonical_shape({"num_tokens": 40, "mhc_mult": 4, "hidden": 64})
    go, x, mix = bwd.make_inputs(full, seed=seed)
    o64, xg64, mg64 = float64_autograd(x, mix[..., None], go)
    out = fwd.reference(full, x, mix)
    xg, mg = bwd.reference(full, go, x, mix)
    mags = (x.double() * mix.double()[..., None]).abs().sum(-2)
    assert ((out.double() - o64).abs() <= o64.abs() * 2.0**-8 + mags * 2.0**-22).all()
    assert ((xg.double() - xg64).abs() <= xg64.abs() * 2.0**-8).all()
    assert float((mg.double() - mg64[..., 0]).norm() / mg64.norm()) < 1e-7


@pytest.mark.parametrize("name", NAMES)
def test_inputs(name):
    s = tkjit.get_spec(name)
    full = s.canonical_shape({"num_tokens": 16, "mhc_mult": 4, "hidden": 64})
    a, b = s.make_inputs(full, seed=0), s.make_inputs(full, seed=1)
    assert not torch.equal(a[0], b[0])
    assert any(bool((t == 0).any() & torch.signbit(t).any()) for t in b if t.dtype == torch.bfloat16)


# -- the ops -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lead", [(5,), (2, 7), (1, 1), (0,)])
def test_ops_forward_backward(reference_kernels, lead):
    x, mix, go = data(lead, seed=1)
    xr, mr = x.clone().requires_grad_(True), mix.clone().requires_grad_(True)
    o = ops.mhc_pre_apply_mix(xr, mr)
    assert o.shape == (*lead, 32) and o.dtype == torch.bfloat16
    # one autograd node, straight from the leaves: no views around the Function
    assert all(f.variable is t for (f, _), t in zip(o.grad_fn.next_functions, (xr, mr)))
    o.backward(go)
    fwd, bwd = tkjit.get_spec("pre_apply_mix"), tkjit.get_spec("pre_apply_mix_bwd")
    full = {"mhc_mult": 4}
    assert torch.equal(o, fwd.reference(full, x.view(-1, 4, 32), mix.view(-1, 4)).view(o.shape))
    xg, mg = bwd.reference(full, go.reshape(-1, 32), x.view(-1, 4, 32), mix.view(-1, 4))
    assert torch.equal(xr.grad, xg.view(x.shape)) and torch.equal(mr.grad, mg.view(mix.shape))
    xg2, mg2 = ops.mhc_pre_apply_mix_bwd(go, x, mix)
    assert torch.equal(xg2, xr.grad) and torch.equal(mg2, mr.grad)
    if x.numel():
        o64, xg64, mg64 = float64_autograd(x, mix, go)
        tk_close(o, o64), tk_close(xr.grad, xg64), tk_close(mr.grad, mg64)


def test_backward_accumulates_into_the_residual_gradient(reference_kernels):
    """TileKernels' protocol: mhc_post's backward leaves the residual gradient on x's storage; pre_apply_mix's
    backward adds x's gradient into it in place (one fma rounding) and gives x None."""
    x, mix, go = data((3, 4), seed=2)
    xr, mr = x.clone().requires_grad_(True), mix.clone().requires_grad_(True)
    o = ops.mhc_pre_apply_mix(xr, mr)
    acc = torch.randn(x.shape, generator=torch.Generator().manual_seed(9)).bfloat16()
    before = acc.clone()
    xr.untyped_storage().grad_from_mhc_post = acc
    o.backward(go)
    assert xr.grad is None
    bwd = tkjit.get_spec("pre_apply_mix_bwd_acc")
    want_xg, want_mg = bwd.reference({"mhc_mult": 4}, go.view(-1, 32), x.view(-1, 4, 32), mix.view(-1, 4),
                                     before.view(-1, 4, 32))
    assert torch.equal(acc, want_xg.view(acc.shape)) and torch.equal(mr.grad, want_mg.view(mix.shape))
    # the explicit form
    acc2 = before.clone()
    got, mg = ops.mhc_pre_apply_mix_bwd(go, x, mix, acc2)
    assert got is acc2 and torch.equal(acc2, acc) and torch.equal(mg, mr.grad)


def test_bad_residual_gradient_is_named(reference_kernels):
    x, mix, go = data((2,), seed=3)
    xr = x.clone().requires_grad_(True)
    o = ops.mhc_pre_apply_mix(xr, mix)
    xr.untyped_storage().grad_from_mhc_post = torch.zeros(x.shape)  # float32: not TileKernels' bf16
    with pytest.raises(tkjit.TensorError, match="grad_from_mhc_post"):
        o.backward(go)


def test_ops_out(reference_kernels):
    x, mix, _ = data((3, 2), seed=4)
    out = torch.full((3, 2, 32), float("nan"), dtype=torch.bfloat16)
    assert ops.mhc_pre_apply_mix(x, mix, out) is out
    assert torch.equal(out, ops.mhc_pre_apply_mix(x, mix))
    xr = x.clone().requires_grad_(True)
    out2 = torch.empty_like(out)
    y = ops.mhc_pre_apply_mix(xr, mix, out2)
    assert torch.equal(out2, out) and y.data_ptr() == out2.data_ptr()
    y.float().sum().backward()
    assert xr.grad is not None


def test_ops_refuse_bad_inputs(reference_kernels):
    x, mix, go = data((4,), seed=5)
    with pytest.raises(tkjit.TensorError, match="x must be torch.bfloat16"):
        ops.mhc_pre_apply_mix(x.float(), mix)
    with pytest.raises(tkjit.TensorError, match="mix must be torch.float32"):
        ops.mhc_pre_apply_mix(x, mix.double())
    with pytest.raises(tkjit.TensorError, match="mix must have shape"):
        ops.mhc_pre_apply_mix(x, mix[..., 0])
    with pytest.raises(tkjit.TensorError, match="mix must have shape"):
        ops.mhc_pre_apply_mix(x, mix[:3])
    with pytest.raises(tkjit.TensorError, match="x must be contiguous"):
        ops.mhc_pre_apply_mix(x.transpose(0, 1).contiguous().transpose(0, 1), mix)
    with pytest.raises(tkjit.TensorError, match="out must be"):
        ops.mhc_pre_apply_mix(x, mix, torch.empty(4, 33, dtype=torch.bfloat16))
    with pytest.raises(tkjit.TensorError, match="grad_out must have shape"):
        ops.mhc_pre_apply_mix_bwd(go[:3], x, mix)
    with pytest.raises(tkjit.TensorError, match="x_grad must be"):
        ops.mhc_pre_apply_mix_bwd(go, x, mix, torch.empty(4, 4, 32))


def test_fake_impls():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(37, 4, 96, dtype=torch.bfloat16)
        mix = torch.empty(37, 4)
        o = torch.ops.tkjit.pre_apply_mix(x, mix)
        assert o.shape == (37, 96) and o.dtype == torch.bfloat16
        go = torch.empty(37, 96, dtype=torch.bfloat16)
        xg, mg = torch.ops.tkjit.pre_apply_mix_bwd(go, x, mix)
        assert xg.shape == x.shape and xg.dtype == torch.bfloat16 and mg.shape == mix.shape
        assert mg.dtype == torch.float32
        mg = torch.ops.tkjit.pre_apply_mix_bwd_acc(go, x, mix, torch.empty_like(x))
        assert mg.shape == mix.shape
        with pytest.raises(tkjit.TensorError, match="dtype"):
            torch.ops.tkjit.pre_apply_mix(x, mix.double())
        with pytest.raises(tkjit.TensorError, match="axis 1"):
            torch.ops.tkjit.pre_apply_mix(x, torch.empty(37, 3))


@pytest.mark.parametrize("n", [37, 0])
def test_opcheck(reference_kernels, n):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(n, 4, 64, generator=g).bfloat16()
    mix = torch.rand(n, 4, generator=g)
    go = torch.randn(n, 64, generator=g).bfloat16()
    for op, args in ((torch.ops.tkjit.pre_apply_mix.default, (x, mix)),
                     (torch.ops.tkjit.pre_apply_mix_bwd.default, (go, x, mix)),
                     (torch.ops.tkjit.pre_apply_mix_bwd_acc.default, (go, x, mix, torch.randn(n, 4, 64).bfloat16()))):
        r = torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS)
        assert r == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), (op, r)


def test_compile_fullgraph_forward_and_backward(reference_kernels):
    x, mix, go = data((2, 9), seed=7)
    xc, mc = x.clone().requires_grad_(True), mix.clone().requires_grad_(True)
    f = torch.compile(lambda a, b: ops.mhc_pre_apply_mix(a, b), fullgraph=True, backend="aot_eager")
    y = f(xc, mc)
    y.backward(go)
    xe, me = x.clone().requires_grad_(True), mix.clone().requires_grad_(True)
    ops.mhc_pre_apply_mix(xe, me).backward(go)
    assert torch.equal(y, ops.mhc_pre_apply_mix(x, mix))
    assert torch.equal(xc.grad, xe.grad) and torch.equal(mc.grad, me.grad)


def test_double_backward_says_it_is_not_supported(reference_kernels):
    x, mix, _ = data((3,), seed=8)
    xr, mr = x.clone().requires_grad_(True), mix.clone().requires_grad_(True)
    y = ops.mhc_pre_apply_mix(xr, mr)
    (gm,) = torch.autograd.grad(y.float().sum(), mr, create_graph=True)
    with pytest.raises(RuntimeError, match="mhc_pre_apply_mix is differentiable once"):
        gm.sum().backward()


# -- the TileKernels entry point -----------------------------------------------------------------------------

def test_compat_signature():
    """TileKernels' modeling/mhc/ops/pre_apply_mix.py, hard-coded."""
    pk, empty = "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty
    got = [(p.name, p.kind.name, p.default) for p in inspect.signature(tk.mhc_pre_apply_mix).parameters.values()]
    assert got == [("x", pk, empty), ("mix", pk, empty), ("out", pk, None)]


def test_compat_as_tile_kernels_test_runs_it(reference_kernels):
    """TileKernels' own test: backward with grad_from_mhc_post = zeros; x's gradient read off the storage."""
    x, mix, go = data((2, 16), m=4, h=64, seed=9)
    x_, mix_ = x.clone().requires_grad_(), mix.clone().requires_grad_()
    o = tk.mhc_pre_apply_mix(x_, mix_)
    x_.untyped_storage().grad_from_mhc_post = torch.zeros_like(x_)
    torch.autograd.backward([o], [go])
    xg = x_.untyped_storage().grad_from_mhc_post if x_.grad is None else x_.grad
    assert x_.grad is None
    o64, xg64, mg64 = float64_autograd(x, mix, go)
    tk_close(o, o64), tk_close(xg, xg64), tk_close(mix_.grad, mg64)


@pytest.mark.parametrize("call, error, match", [
    (lambda x, m: tk.mhc_pre_apply_mix(x.float(), m), tkjit.TensorError, "tile_kernels.*x must be torch.bfloat16"),
    (lambda x, m: tk.mhc_pre_apply_mix(x, m[..., 0]), tkjit.TensorError, "mix must have shape"),
    (lambda x, m: tk.mhc_pre_apply_mix(x, m.bfloat16()), tkjit.TensorError, "mix must be torch.float32"),
    (lambda x, m: tk.mhc_pre_apply_mix(x[0, 0], m), tkjit.TensorError, "mix must have shape"),
    (lambda x, m: tk.mhc_pre_apply_mix(x, m, torch.empty(2, 5, 32)), tkjit.TensorError, "out must be"),
    (lambda x, m: tk.mhc_pre_apply_mix([x], m), tkjit.TensorError, "x must be a torch.Tensor"),
])
def test_compat_refuses_what_tile_kernels_refuses(reference_kernels, call, error, match):
    x, mix, _ = data(seed=10)
    with pytest.raises(error, match=match):
        call(x, mix)


def test_compat_missing_sizes(reference_kernels):
    x = torch.zeros(2, 17, 32, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="mhc_mult.*17"):
        tk.mhc_pre_apply_mix(x, torch.zeros(2, 17, 1))


# -- sm_90a cross-compiles -----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name, shape, config", [
    ("pre_apply_mix", SHAPE, None),
    ("pre_apply_mix", {"num_tokens": 8, "mhc_mult": 8, "hidden": 1284},
     {"threads": 64, "rows": 4, "vec_bytes": 4, "unroll": 3}),
    ("pre_apply_mix_bwd", SHAPE, None),
    ("pre_apply_mix_bwd", {"num_tokens": 8, "mhc_mult": 2, "hidden": 1280},
     {"threads": 256, "rows": 8, "vec_bytes": 8, "unroll": 2}),  # 32 lanes a token: shuffles only
    ("pre_apply_mix_bwd_acc", SHAPE, None),
    ("pre_apply_mix_bwd_acc", {"num_tokens": 8, "mhc_mult": 8, "hidden": 7680},
     {"threads": 256, "rows": 1, "vec_bytes": 16, "unroll": 1}),  # 8 warps a token, 4 chunks walked
])
def test_compiles_for_sm90a(cache_dir, name, shape, config):
    k = tkjit.get(name, shape, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    assert "__fmaf_rn" in src
    if name != "pre_apply_mix":
        assert "__shfl_xor_sync" in src
        lanes = (config or {"threads": 128, "rows": 1})["threads"] // (config or {"rows": 1})["rows"]
        assert ("__syncthreads" in src) == (lanes > 32)
