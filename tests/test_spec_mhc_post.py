"""mhc_post_fwd / mhc_post_bwd on a CPU host: the specs, their float64 references against hand-computed
values, finite differences and TileKernels' float32 torch reference, sm_90a cross-compiles (bf16 kernels
do not lower on TileLang's C target), the torch ops (opcheck, fake, autograd, torch.compile) and the
TileKernels compat entry points with the kernels replaced by ones writing the reference (the GPU tests
run the real kernels)."""

import inspect
import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as tk
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit_kernels.mhc._post import forward

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from reference_kernels import serve_references  # noqa: E402

pytestmark = pytest.mark.usefixtures("module_cache")
FWD, BWD = "mhc_post_fwd", "mhc_post_bwd"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
BF16_ULP = 2.0**-7  # relative spacing of bf16 values at the bottom of a binade


def spec(name=FWD):
    return tkjit.get_spec(name)


def _tk_ref(x, residual, post_layer_mix, comb_res_mix):
    """TileKernels' mhc_post_ref (tile_kernels/torch/mhc.py): float32 einsum, rounded to bf16."""
    term2 = torch.einsum("abmn,abmc->abnc", comb_res_mix, residual.float())
    return (x.float().unsqueeze(-2) * post_layer_mix + term2).bfloat16()


def _tk_data(n0, n1, h, m, seed=0):
    """TileKernels' generate_mhc_post_test_data: standard normal, (n0, n1, ...) shapes."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n0, n1, h, generator=g).bfloat16(), torch.randn(n0, n1, m, h, generator=g).bfloat16(),
            torch.randn(n0, n1, m, 1, generator=g), torch.randn(n0, n1, m, m, generator=g),
            torch.randn(n0, n1, m, h, generator=g).bfloat16())


def _float64_grads(x, res, post, comb, go):
    leaves = [t.detach().double().requires_grad_() for t in (x, res, post, comb)]
    forward(*leaves).backward(go.double())
    return [t.grad for t in leaves]


# -- the specs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [FWD, BWD])
def test_registered_and_valid(name):
    s = spec(name)
    assert s.family == "mhc" and [p.name for p in s.runtime_params] == ["num_tokens"]
    assert [p.name for p in s.params] == ["num_tokens", "mhc", "hidden"]
    assert set(s.space) == {"block_tokens", "vec", "threads"}
    for ex in s.examples:
        full = s.canonical_shape(ex)
        assert s.default_config(full, "sm_90a") in s.configs(full, "sm_90a")
        assert s.configs(full, "cpu") == []  # bf16: CUDA targets only
    for m in (1, 2, 3, 4, 8, 16):
        for h in (1, 6, 100, 1280, 2560, 4096, 7168, 65536):
            for t in (1, 1024, 8192, 1 << 20):
                f = s.canonical_shape({"num_tokens": t, "mhc": m, "hidden": h})
                assert s.constraint(f, s.default_config(f)) is None, (m, h, t)


def test_names_and_tensors():
    f, b = spec(FWD), spec(BWD)
    assert [t.name for t in f.inputs] == ["x", "residual", "post_layer_mix", "comb_res_mix"]
    assert [t.name for t in f.outputs] == ["out"]
    assert [t.name for t in b.inputs] == ["grad_out", "x", "residual", "post_layer_mix", "comb_res_mix"]
    assert [t.name for t in b.outputs] == ["grad_x", "grad_residual", "grad_post_layer_mix", "grad_comb_res_mix"]
    full = f.canonical_shape({"num_tokens": 8, "mhc": 4, "hidden": 64})
    assert f.bytes_moved(full) == 8 * (2 * 4 * 64 * 2 + 64 * 2 + (4 + 16) * 4)
    assert b.bytes_moved(full) == 8 * (4 * 4 * 64 * 2 + 2 * 64 * 2 + 2 * (4 + 16) * 4)


def test_defaults():
    f, b = spec(FWD), spec(BWD)

    def d(s, **shape):
        return s.default_config(s.canonical_shape(shape))

    assert d(f, num_tokens=4096, mhc=4, hidden=7168) == {"block_tokens": 1, "vec": 8, "threads": 128}
    assert d(f, num_tokens=8192, mhc=4, hidden=1280) == {"block_tokens": 4, "vec": 8, "threads": 128}
    assert d(f, num_tokens=1024, mhc=4, hidden=1280)["block_tokens"] == 1  # decode-sized: spread over the SMs
    assert d(f, num_tokens=64, mhc=4, hidden=6)["vec"] == 2
    assert d(b, num_tokens=4096, mhc=4, hidden=7168) == {"block_tokens": 1, "vec": 8, "threads": 128}
    assert d(b, num_tokens=4096, mhc=4, hidden=1280) == {"block_tokens": 1, "vec": 8, "threads": 64}
    assert d(b, num_tokens=4096, mhc=8, hidden=4096)["vec"] == 4


@pytest.mark.parametrize("name", [FWD, BWD])
@pytest.mark.parametrize("shape, match", [
    ({"num_tokens": 8, "mhc": 0, "hidden": 64}, "mhc"),
    ({"num_tokens": 8, "mhc": 17, "hidden": 64}, "mhc"),
    ({"num_tokens": 8, "hidden": 0}, "hidden"),
    ({"num_tokens": 8, "hidden": 65537}, "hidden"),
    ({"num_tokens": 0, "hidden": 64}, "num_tokens"),
    ({"hidden": 64}, "num_tokens"),
    ({"num_tokens": 8, "hidden": 64, "n": 4}, "unknown"),
])
def test_bad_shapes(name, shape, match):
    with pytest.raises(ShapeError, match=match):
        spec(name).canonical_shape(shape)


@pytest.mark.parametrize("name", [FWD, BWD])
def test_bad_configs(name):
    s = spec(name)
    full = s.canonical_shape({"num_tokens": 64, "mhc": 4, "hidden": 100})
    good = s.default_config(full)
    assert good["vec"] == 4
    with pytest.raises(ConfigError, match="multiple of 8"):
        s.check_config(full, {**good, "vec": 8})
    with pytest.raises(ConfigError, match="fewer threads"):
        s.check_config(full, {**good, "block_tokens": 1, "threads": 512})
    with pytest.raises(ConfigError, match="not in the space"):
        s.check_config(full, {**good, "threads": 96})
    with pytest.raises(ConfigError, match="C target"):
        s.check_config(full, good, arch="cpu")


# -- the references ----------------------------------------------------------------------------------

def test_forward_reference_by_hand():
    # mhc 2, hidden 3, one token: out[n] = post[n] * x + sum_m comb[m, n] * residual[m]
    x = torch.tensor([[1.0, 2.0, -3.0]]).bfloat16()
    res = torch.tensor([[[1.0, 0.0, 2.0], [0.5, -1.0, 4.0]]]).bfloat16()
    post = torch.tensor([[2.0, -1.0]])
    comb = torch.tensor([[[1.0, 3.0], [2.0, 0.25]]])
    want = torch.tensor([[[2 + 1 + 1, 4 + 0 - 2, -6 + 2 + 8],
                          [-1 + 3 + 0.125, -2 + 0 - 0.25, 3 + 6 + 1]]]).bfloat16()
    full = spec().canonical_shape({"num_tokens": 1, "mhc": 2, "hidden": 3})
    got = spec().reference(full, x, res, post, comb)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_forward_reference_rounds_once():
    # 1 + 2^-9 + 2^-9 is 1 + 2^-8, a bf16 tie that rounds to even (1.0); summing in bf16 or rounding the
    # post term first would differ. 256 + 1 + 0.5: 257.5 -> 258 (bf16 has 8 bits: 256, 258, ...).
    x = torch.tensor([[1.0, 256.0]]).bfloat16()
    res = torch.tensor([[[2.0**-9, 1.0], [2.0**-9, 0.5]]]).bfloat16()
    post = torch.tensor([[1.0, 0.0]])
    comb = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]])
    full = spec().canonical_shape({"num_tokens": 1, "mhc": 2, "hidden": 2})
    got = spec().reference(full, x, res, post, comb)
    assert got[0, 0].tolist() == [1.0, 258.0] and got[0, 1].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("m, h, seed", [(4, 1280, 0), (2, 300, 1), (8, 64, 2), (1, 7, 3)])
def test_forward_reference_matches_tile_kernels_reference(m, h, seed):
    s = spec()
    full = s.canonical_shape({"num_tokens": 37, "mhc": m, "hidden": h})
    x, res, post, comb = s.make_inputs(full, seed=seed)
    got = s.reference(full, x, res, post, comb)
    tk_out = _tk_ref(x[None], res[None], post[None, :, :, None], comb[None])[0]
    # float32 vs float64 rounding: the same bf16 value but where float32's error crosses a boundary
    diff = (got.double() - tk_out.double()).abs()
    assert float((diff > 0).double().mean()) < 1e-2
    assert bool((diff <= got.double().abs() * BF16_ULP + 1e-30).all())
    torch.testing.assert_close(got, tk_out)


def test_backward_reference_is_float64_autograd():
    s = spec(BWD)
    full = s.canonical_shape({"num_tokens": 5, "mhc": 3, "hidden": 40})
    go, x, res, post, comb = s.make_inputs(full, seed=4)
    got = s.reference(full, go, x, res, post, comb)
    assert [t.dtype for t in got] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    for g, want in zip(got, _float64_grads(x, res, post, comb, go)):
        assert g.shape == want.shape
        if g.dtype == torch.bfloat16:
            assert torch.equal(g, want.bfloat16())
        else:
            torch.testing.assert_close(g, want.float(), rtol=1e-6, atol=1e-6)


def test_backward_reference_matches_finite_differences():
    s = spec(BWD)
    full = s.canonical_shape({"num_tokens": 2, "mhc": 2, "hidden": 5})
    go, x, res, post, comb = s.make_inputs(full, seed=6)
    _, _, gpost, gcomb = s.reference(full, go, x, res, post, comb)

    def loss(p, c):
        return float((forward(x, res, p, c) * go.double()).sum())

    h = 1e-3  # the loss is linear in the mixes: central differences are exact up to rounding
    for idx in [(0, 0), (1, 1)]:
        e = torch.zeros_like(post, dtype=torch.float64)
        e[idx] = h
        fd = (loss(post.double() + e, comb.double()) - loss(post.double() - e, comb.double())) / (2 * h)
        assert abs(fd - float(gpost[idx])) < 1e-5 * max(1.0, abs(fd))
    for idx in [(0, 0, 1), (1, 1, 0)]:
        e = torch.zeros_like(comb, dtype=torch.float64)
        e[idx] = h
        fd = (loss(post.double(), comb.double() + e) - loss(post.double(), comb.double() - e)) / (2 * h)
        assert abs(fd - float(gcomb[idx])) < 1e-5 * max(1.0, abs(fd))


def test_inputs_are_fresh_and_spread():
    s = spec(BWD)
    full = s.canonical_shape({"num_tokens": 64, "mhc": 4, "hidden": 32})
    a, b = s.make_inputs(full, seed=0), s.make_inputs(full, seed=1)
    assert [t.dtype for t in a] == [torch.bfloat16] * 3 + [torch.float32] * 2
    assert not torch.equal(a[1], b[1])
    scale = b[1].float().abs().amax(-1)  # odd seeds: tokens 2^-8 .. 2^8 apart
    assert float(scale.max() / scale.min()) > 64
    assert (b[3] == 0).any() and (b[4] == 0).any()


# -- sm_90a cross-compiles ---------------------------------------------------------------------------

@pytest.mark.parametrize("name, shape, config", [
    (FWD, {"num_tokens": 4096, "mhc": 4, "hidden": 7168}, None),
    (FWD, {"num_tokens": 100, "mhc": 3, "hidden": 1000}, {"block_tokens": 16, "vec": 2, "threads": 256}),
    (BWD, {"num_tokens": 4096, "mhc": 4, "hidden": 7168}, None),
    (BWD, {"num_tokens": 100, "mhc": 8, "hidden": 1000}, {"block_tokens": 4, "vec": 1, "threads": 64}),
])
def test_compiles_for_sm90a(name, shape, config):
    k = tkjit.get(name, shape, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    assert src.count("__global__") >= 1
    if config is None:  # 16-byte vector loads and stores of the bf16 rows
        assert "uint4" in src


# -- torch ops (the kernels replaced by ones writing the reference) -----------------------------------

@pytest.fixture
def reference_kernels(monkeypatch):
    return serve_references(monkeypatch, (FWD, BWD))


def _flat_args(t=6, m=4, h=64, seed=0, grad=False):
    s = spec(BWD if grad else FWD)
    return s.make_inputs(s.canonical_shape({"num_tokens": t, "mhc": m, "hidden": h}), seed=seed)


def test_ops_opcheck_and_fake_shapes(reference_kernels):
    from torch._subclasses.fake_tensor import FakeTensorMode

    fwd, bwd = torch.ops.tkjit.mhc_post_fwd.default, torch.ops.tkjit.mhc_post_bwd.default
    assert "(Tensor x, Tensor residual, Tensor post_layer_mix, Tensor comb_res_mix, str? config=None, " \
           "str? bwd_config=None) -> Tensor" in str(fwd._schema)
    assert "-> (Tensor, Tensor, Tensor, Tensor)" in str(bwd._schema)
    args = [a.requires_grad_(a.dtype == torch.float32) for a in _flat_args()]
    assert torch.library.opcheck(fwd, args, test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    assert torch.library.opcheck(bwd, _flat_args(grad=True), test_utils=OPCHECK_TESTS) == dict.fromkeys(
        OPCHECK_TESTS, "SUCCESS")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        out = fwd(*(mode.from_tensor(a) for a in _flat_args(t=5, m=3, h=40)))
        assert out.shape == (5, 3, 40) and out.dtype == torch.bfloat16 and out.is_contiguous()
        grads = bwd(*(mode.from_tensor(a) for a in _flat_args(t=5, m=3, h=40, grad=True)))
        assert [tuple(g.shape) for g in grads] == [(5, 40), (5, 3, 40), (5, 3), (5, 3, 3)]
        assert [g.dtype for g in grads] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    x, res, post, comb = (a.to("meta") for a in _flat_args())
    assert fwd(x, res, post, comb).is_meta
    with pytest.raises(TensorError, match="residual has dtype torch.float32"):
        fwd(x, res.float(), post, comb)
    with pytest.raises(TensorError, match="comb_res_mix has shape"):
        fwd(x, res, post, comb[:, :3])
    with pytest.raises(TensorError, match="mhc_post_fwd: x: expected a 2-D"):
        fwd(x[0], res, post, comb)


def test_ops_eager_values(reference_kernels):
    x, res, post, comb = _flat_args(t=9, m=4, h=48, seed=1)
    want = spec().reference(spec().canonical_shape({"num_tokens": 9, "mhc": 4, "hidden": 48}), x, res, post, comb)
    assert torch.equal(tkjit.ops.mhc_post_fwd(x, res, post, comb), want)
    out = torch.full_like(res, float("nan"))
    assert tkjit.ops.mhc_post_fwd(x, res, post, comb, out=out) is out and torch.equal(out, want)
    go = torch.randn(9, 4, 48).bfloat16()
    grads = tkjit.ops.mhc_post_bwd(go, x, res, post, comb)
    full = spec(BWD).canonical_shape({"num_tokens": 9, "mhc": 4, "hidden": 48})
    for g, r in zip(grads, spec(BWD).reference(full, go, x, res, post, comb)):
        assert torch.equal(g, r)
    with pytest.raises(TensorError, match="out= is not differentiable"):
        tkjit.ops.mhc_post_fwd(x, res, post.requires_grad_(), comb, out=out)


@pytest.mark.parametrize("lead", [(2, 3), (7,), ()])
def test_autograd_matches_float64(reference_kernels, lead):
    m, h = 4, 24
    g = torch.Generator().manual_seed(len(lead))
    x = torch.randn(*lead, h, generator=g).bfloat16().requires_grad_()
    res = torch.randn(*lead, m, h, generator=g).bfloat16().requires_grad_()
    post = torch.randn(*lead, m, 1, generator=g).requires_grad_()
    comb = torch.randn(*lead, m, m, generator=g).requires_grad_()
    go = torch.randn(*lead, m, h, generator=g).bfloat16()
    out = tkjit.ops.mhc_post(x, res, post, comb)
    assert out.shape == res.shape and out.dtype == torch.bfloat16
    assert torch.equal(out, forward(x, res, post, comb).bfloat16())
    # one autograd node, straight from the leaves: no views around the Function
    assert all(f.variable is t for (f, _), t in zip(out.grad_fn.next_functions, (x, res, post, comb)))
    out.backward(go)
    for got, want in zip((x.grad, res.grad, post.grad, comb.grad), _float64_grads(x, res, post, comb, go)):
        assert got.dtype == (torch.bfloat16 if want.shape[-1] == h else torch.float32)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-6)
    # a gradient of another dtype (float32 upstream) is taken as bf16
    out = tkjit.ops.mhc_post(x, res, post, comb)
    x.grad = None
    (out.float() * go.float()).sum().backward()
    torch.testing.assert_close(x.grad, _float64_grads(x, res, post, comb, go)[0].bfloat16(), rtol=1e-5, atol=1e-6)


def test_autograd_is_differentiable_once(reference_kernels):
    x, res, post, comb = (a.requires_grad_() for a in _flat_args(t=3, m=2, h=16))
    out = tkjit.ops.mhc_post_fwd(x, res, post, comb)
    (gp,) = torch.autograd.grad(out.float().sum(), [post], create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        gp.sum().backward()


def test_autograd_errors():
    x, res, post, comb = _flat_args(t=3, m=2, h=16)
    with pytest.raises(TensorError, match="residual must be torch.bfloat16"):
        tkjit.ops.mhc_post(x, res.float(), post, comb)
    with pytest.raises(TensorError, match="post_layer_mix must have shape"):
        tkjit.ops.mhc_post(x, res, post[:, :1], comb)
    with pytest.raises(TensorError, match="x must have shape"):
        tkjit.ops.mhc_post(x[:, :8], res, post, comb)


def test_compiled_forward_and_backward(reference_kernels):
    x, res, post, comb = _flat_args(t=5, m=4, h=32, seed=3)
    post = post.view(1, 5, 4, 1)
    x, res, comb = x.view(1, 5, 32), res.view(1, 5, 4, 32), comb.view(1, 5, 4, 4)
    go = torch.randn(1, 5, 4, 32).bfloat16()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(a, b, c, d):
        return tkjit.ops.mhc_post(a, b, c, d) * 1.0

    leaves = [t.clone().requires_grad_() for t in (x, res, post, comb)]
    out = f(*leaves)
    assert torch.equal(out, forward(x, res, post, comb).bfloat16())
    out.backward(go)
    for got, want in zip((t.grad for t in leaves), _float64_grads(x, res, post, comb, go)):
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-6)


# -- compat ------------------------------------------------------------------------------------------

def test_compat_signatures_are_tile_kernels():
    P = inspect.Parameter
    empty, pk = P.empty, P.POSITIONAL_OR_KEYWORD
    four = [(n, pk, empty) for n in ("x", "residual", "post_layer_mix", "comb_res_mix")]
    ops = tk.modeling.mhc.ops
    for fn in (ops.mhc_post, ops.mhc_post_fwd):
        assert [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()] == [
            *four, ("out", pk, None)]
    assert [(p.name, p.kind, p.default) for p in inspect.signature(ops.mhc_post_bwd).parameters.values()] == [
        *four, ("d_o", pk, empty), ("fuse_grad_acc", pk, True)]


@pytest.mark.parametrize("n0, n1, h, m", [(1, 64, 1280, 4), (2, 33, 256, 4), (1, 16, 96, 2), (2, 8, 64, 8)])
def test_compat_matches_tile_kernels_reference(reference_kernels, n0, n1, h, m):
    """TileKernels' test_mhc_post_comprehensive: forward and autograd against mhc_post_ref, its tolerances."""
    data = _tk_data(n0, n1, h, m, seed=h + m)

    def run(impl):
        leaves = [t.clone().requires_grad_() for t in data[:4]]
        out = impl(*leaves)
        torch.autograd.backward([out], [data[4]])
        return out, *(t.grad for t in leaves)

    got, want = run(tk.modeling.mhc.ops.mhc_post), run(_tk_ref)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        if i < 3:
            torch.testing.assert_close(a, b)
        else:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_compat_fwd_out_and_bwd_fuse_grad_acc(reference_kernels):
    ops = tk.modeling.mhc.ops
    x, res, post, comb, d_o = _tk_data(2, 5, 64, 4)
    out = torch.empty_like(res)
    assert ops.mhc_post_fwd(x, res, post, comb, out) is out
    assert torch.equal(out, forward(x, res, post, comb).bfloat16())
    y = ops.mhc_post(x, res, post, comb, out=torch.empty_like(res))
    assert torch.equal(y, out)
    grads = ops.mhc_post_bwd(x, res, post, comb, d_o, fuse_grad_acc=False)
    assert not hasattr(res.untyped_storage(), "grad_from_mhc_post")
    assert [tuple(g.shape) for g in grads] == [(2, 5, 64), (2, 5, 4, 64), (2, 5, 4, 1), (2, 5, 4, 4)]
    for got, want in zip(grads, _float64_grads(x, res, post, comb, d_o)):
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-6)
    grads = ops.mhc_post_bwd(x, res, post, comb, d_o)
    stash = res.untyped_storage().grad_from_mhc_post  # TileKernels' hand-off to mhc_pre_apply_mix / norm_fn
    assert stash.shape == (10, 4, 64) and stash.data_ptr() == grads[1].data_ptr()
    del res.untyped_storage().grad_from_mhc_post
    # and through autograd: the backward is mhc_post_bwd with fuse_grad_acc=True
    r = res.clone().requires_grad_()
    ops.mhc_post(x, r, post, comb).backward(d_o)
    assert r.untyped_storage().grad_from_mhc_post.data_ptr() == r.grad.data_ptr()


def test_compat_out_under_torch_compile(reference_kernels):
    # Under torch.compile the compat op is tkjit's custom op: out= is filled and returned, and the gradients
    # flow through it as in eager code (where TileKernels' Function returns out).
    x, res, post, comb, d_o = _tk_data(2, 5, 64, 4)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(a, b, c, d, o):
        return tk.modeling.mhc.ops.mhc_post(a, b, c, d, out=o)

    leaves = [t.clone().requires_grad_() for t in (x, res, post, comb)]
    out = torch.zeros_like(res)
    y = f(*leaves, out)
    assert torch.equal(out, forward(x, res, post, comb).bfloat16()) and torch.equal(y, out)
    y.backward(d_o)
    for got, want in zip((t.grad for t in leaves), _float64_grads(x, res, post, comb, d_o)):
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match="out must be a contiguous"):  # (fullgraph wraps it in dynamo's error)
        f(x, res, post, comb, torch.empty(2, 5, 64, 4, dtype=torch.bfloat16).transpose(2, 3))


def test_compat_empty_batch(reference_kernels):
    x, res, post, comb, d_o = _tk_data(0, 4, 64, 4)
    out = tk.modeling.mhc.ops.mhc_post_fwd(x, res, post, comb)
    assert out.shape == (0, 4, 4, 64) and out.dtype == torch.bfloat16
    grads = tk.modeling.mhc.ops.mhc_post_bwd(x, res, post, comb, d_o)
    assert [tuple(g.shape) for g in grads] == [(0, 4, 64), (0, 4, 4, 64), (0, 4, 4, 1), (0, 4, 4, 4)]


def test_compat_non_contiguous_inputs_are_read_from_copies(reference_kernels):
    x, res, post, comb, _ = _tk_data(1, 6, 64, 4)
    xt = x.transpose(0, 1).contiguous().transpose(0, 1)
    buf = torch.zeros(res.numel() + 1, dtype=torch.bfloat16)
    buf[1:] = res.reshape(-1)
    res_off = buf[1:].view(res.shape)  # contiguous, but off the 16-byte alignment
    got = tk.modeling.mhc.ops.mhc_post_fwd(xt, res_off, post, comb)
    assert torch.equal(got, forward(x, res, post, comb).bfloat16())


@pytest.mark.parametrize("fn", ["mhc_post", "mhc_post_fwd", "mhc_post_bwd"])
@pytest.mark.parametrize("args, match", [
    (lambda x, r, p, c, g: (x.float(), r, p, c, g), "x must be torch.bfloat16"),
    (lambda x, r, p, c, g: (x, r.float(), p, c, g), "residual must be torch.bfloat16"),
    (lambda x, r, p, c, g: (x, r, p.double(), c, g), "post_layer_mix must be torch.float32"),
    (lambda x, r, p, c, g: (x, r, p, c.bfloat16(), g), "comb_res_mix must be torch.float32"),
    (lambda x, r, p, c, g: (x, r[0], p, c, g), "residual must be 4-D"),
    (lambda x, r, p, c, g: (x[:, :, :32], r, p, c, g), r"x must have shape \(2, 3, 64\)"),
    (lambda x, r, p, c, g: (x, r, p.squeeze(-1), c, g), "post_layer_mix must be 4-D"),
    (lambda x, r, p, c, g: (x, r, p, c[:, :, :2], g), r"comb_res_mix must have shape \(2, 3, 4, 4\)"),
    (lambda x, r, p, c, g: (x, r, p, None, g), "comb_res_mix must be a torch.Tensor"),
])
def test_compat_argument_errors(fn, args, match):
    x, r, p, c, g = args(*_tk_data(2, 3, 64, 4))
    call = getattr(tk.modeling.mhc.ops, fn)
    with pytest.raises(TensorError, match=match):
        call(x, r, p, c, g) if fn == "mhc_post_bwd" else call(x, r, p, c)


def test_compat_bad_d_o_and_out():
    ops = tk.modeling.mhc.ops
    x, r, p, c, g = _tk_data(2, 3, 64, 4)
    with pytest.raises(TensorError, match="d_o must be torch.bfloat16"):
        ops.mhc_post_bwd(x, r, p, c, g.float())
    with pytest.raises(TensorError, match="d_o must have residual's shape"):
        ops.mhc_post_bwd(x, r, p, c, g[:1])
    with pytest.raises(TensorError, match="out must be a contiguous"):
        ops.mhc_post_fwd(x, r, p, c, torch.empty(2, 3, 64, 4, dtype=torch.bfloat16).transpose(2, 3))
    with pytest.raises(TensorError, match="out must be torch.bfloat16"):
        ops.mhc_post_fwd(x, r, p, c, torch.empty(2, 3, 4, 64))


def test_compat_sizes_tkjit_lacks_are_not_implemented():
    x, r, p, c, _ = _tk_data(1, 2, 16, 17)
    with pytest.raises(NotImplementedError, match=r"mhc_post: mhc \(residual.shape\[2\]\)=17"):
        tk.modeling.mhc.ops.mhc_post(x, r, p, c)
