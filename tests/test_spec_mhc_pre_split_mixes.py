"""mhc_pre_split_mixes / mhc_pre_split_mixes_bwd on a CPU host: the specs, the references against TileKernels'
torch reference and its float64 autograd, the forward kernel end to end on TileLang's C target, the backward
cross-compiled for sm_90a and served by its reference for the op tests, and the TileKernels compat entry
point."""

import inspect
import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as tk
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit.testing import check

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from reference_kernels import serve_references  # noqa: E402

pytestmark = pytest.mark.usefixtures("module_cache")
FWD, BWD = "mhc_pre_split_mixes", "mhc_pre_split_mixes_bwd"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def spec(name=FWD):
    return tkjit.get_spec(name)


def tk_ref(input_mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value, mhc_pre_eps):
    """TileKernels' mhc_pre_split_mixes_ref (tile_kernels/torch/mhc.py), on (n0, n1, W) tensors."""
    a, b = input_mixes.shape[:2]
    m = mhc_mult
    scale = torch.cat([mhc_scale[0].expand(m), mhc_scale[1].expand(m), mhc_scale[2].expand(m * m)])
    z = input_mixes * scale + mhc_base
    pre = z[:, :, :m].sigmoid().unsqueeze(-1) + mhc_pre_eps
    post = (z[:, :, m:2 * m].sigmoid() * mhc_post_mult_value).unsqueeze(-1)
    return pre, post, z[:, :, 2 * m:].view(a, b, m, m)


def tk_data(n0, n1, m, seed=0):
    """TileKernels' generate_pre_split_mixes_test_data: standard normal; mult 2.0, eps 1e-2 in the tests."""
    g = torch.Generator().manual_seed(seed)
    w = 2 * m + m * m
    return (torch.randn(n0, n1, w, generator=g), torch.randn(3, generator=g), torch.randn(w, generator=g),
            torch.randn(n0, n1, m, 1, generator=g), torch.randn(n0, n1, m, 1, generator=g),
            torch.randn(n0, n1, m, m, generator=g))


def float64_grads(x, scale, base, m, mult, eps, grads):
    leaves = [t.detach().double().requires_grad_() for t in (x, scale, base)]
    outs = tk_ref(*leaves, m, mult, eps)
    torch.autograd.backward(outs, [g.double() for g in grads])
    return [t.grad for t in leaves]


def test_registered_defaults_and_bytes():
    f, b = spec(FWD), spec(BWD)
    assert [p.name for p in f.params] == ["num_tokens", "mhc_mult", "mhc_post_mult_value", "mhc_pre_eps"]
    assert [p.name for p in b.params] == ["num_tokens", "mhc_mult", "mhc_post_mult_value", "num_partials"]
    assert [t.name for t in f.outputs] == ["pre_layer_mix", "post_layer_mix", "comb_res_mix"]
    assert [t.name for t in b.inputs] == ["pre_layer_mix_grad", "post_layer_mix_grad", "comb_res_mix_grad",
                                          "input_mixes", "mhc_scale", "mhc_base"]
    for m in (1, 2, 3, 4, 8, 16):
        for t in (1, 2048, 8192, 1 << 20):
            for s in (f, b):
                full = s.canonical_shape({"num_tokens": t, "mhc_mult": m})
                assert s.default_config(full, "sm_90a") in s.configs(full, "sm_90a"), (s.name, m, t)
    assert b.configs(b.canonical_shape({"num_tokens": 64}), "cpu") == []
    full = f.canonical_shape({"num_tokens": 10, "mhc_mult": 4})
    assert f.bytes_moved(full) == 2 * 10 * 24 * 4 + 27 * 4
    assert b.bytes_moved(b.canonical_shape({"num_tokens": 10})) == 3 * 10 * 24 * 4 + 132 * 27 * 4
    with pytest.raises(ShapeError, match="mhc_post_mult_value"):
        f.canonical_shape({"num_tokens": 8, "mhc_post_mult_value": -1.0})
    with pytest.raises(ConfigError, match="vec=4 does not tile"):  # mhc_mult 3: rows of 15 floats
        f.check_config(f.canonical_shape({"num_tokens": 8, "mhc_mult": 3}),
                       {"block_tokens": 64, "threads": 64, "vec": 4})


@pytest.mark.parametrize("m, seed", [(4, 0), (2, 1), (8, 2), (3, 3)])
def test_forward_reference_matches_tile_kernels_reference(m, seed):
    s = spec()
    full = s.canonical_shape({"num_tokens": 53, "mhc_mult": m, "mhc_post_mult_value": 2.0, "mhc_pre_eps": 1e-2})
    x, scale, base = s.make_inputs(full, seed=seed)
    want = tk_ref(x[None], scale, base, m, 2.0, 1e-2)
    for got, w in zip(s.reference(full, x, scale, base), want):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, w.reshape(got.shape), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n, m, partials", [(300, 4, 7), (5, 2, 8), (40, 8, 132)])
def test_backward_reference_is_float64_autograd(n, m, partials):
    s = spec(BWD)
    full = s.canonical_shape({"num_tokens": n, "mhc_mult": m, "num_partials": partials, "mhc_post_mult_value": 2.0})
    gp, gq, gc, x, scale, base = s.make_inputs(full, seed=n)
    gx, sp, bp = s.reference(full, gp, gq, gc, x, scale, base)
    assert sp.shape == (partials, 3) and bp.shape == (partials, 2 * m + m * m)
    want = float64_grads(x[None], scale, base, m, 2.0, 0.0, (gp[None, ..., None], gq[None, ..., None],
                                                            gc.view(1, n, m, m)))
    torch.testing.assert_close(gx, want[0][0].float(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sp.double().sum(0), want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bp.double().sum(0), want[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape, config, sizes", [
    ({"num_tokens": 4096, "mhc_mult": 4}, None, (1, 63, 4097)),
    ({"num_tokens": 100, "mhc_mult": 2, "mhc_post_mult_value": 0.5}, {"block_tokens": 64, "threads": 32, "vec": 4},
     (5, 300)),
    ({"num_tokens": 100, "mhc_mult": 8}, {"block_tokens": 32, "threads": 32, "vec": 2}, (33,)),
    ({"num_tokens": 100, "mhc_mult": 3}, None, (17,)),
])
def test_forward_runs_on_cpu(shape, config, sizes):
    k = tkjit.get(FWD, shape, arch="cpu", config=config)
    for i, n in enumerate(sizes):
        assert check(k, {**shape, "num_tokens": n}, device="cpu", seed=i) is None


def test_backward_compiles_for_sm90a():
    k = tkjit.get(BWD, {"num_tokens": 8192, "mhc_mult": 4}, arch="sm_90a")
    src = (k.path / "kernel.cu").read_text()
    assert "float4" in src and src.count("__global__") >= 1


@pytest.fixture
def reference_bwd(monkeypatch):
    return serve_references(monkeypatch, (BWD,))


def test_ops_opcheck_and_fake(reference_bwd):
    from torch._subclasses.fake_tensor import FakeTensorMode

    fwd, bwd = torch.ops.tkjit.mhc_pre_split_mixes.default, torch.ops.tkjit.mhc_pre_split_mixes_bwd.default
    x, scale, base, gp, gq, gc = tk_data(1, 6, 4)
    x = x[0]
    args = (x.clone().requires_grad_(), scale.clone().requires_grad_(), base.clone().requires_grad_(), 4, 2.0, 1e-2)
    assert torch.library.opcheck(fwd, args, test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    bargs = (gp[0, ..., 0], gq[0, ..., 0], gc[0].reshape(6, 16), x, scale, base, 2.0)
    assert torch.library.opcheck(bwd, bargs, test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        outs = fwd(mode.from_tensor(x), scale, base, 4, 2.0, 1e-2)
        assert [tuple(o.shape) for o in outs] == [(6, 4), (6, 4), (6, 16)]
        grads = bwd(*(mode.from_tensor(t) for t in bargs[:6]), 2.0)
        assert [tuple(g.shape) for g in grads] == [(6, 24), (3,), (24,)]
    with pytest.raises(TensorError, match="2 \\* mhc_mult \\+ mhc_mult\\*\\*2 = 15"):
        fwd(x.to("meta"), scale, base, 3, 2.0, 1e-2)


@pytest.mark.parametrize("compiled", [False, True])
def test_autograd_matches_float64(reference_bwd, compiled):
    x, scale, base, gp, gq, gc = tk_data(2, 5, 4, seed=int(compiled))

    def f(a, b, c):
        return tkjit.ops.mhc_pre_split_mixes(a, b, c, 4, 2.0, 1e-2)

    if compiled:
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
    leaves = [t.clone().requires_grad_() for t in (x, scale, base)]
    outs = f(*leaves)
    if not compiled:  # one autograd node for the three outputs, straight from the leaves: no views around it
        assert len({o.grad_fn for o in outs}) == 1
        assert all(f.variable is t for (f, _), t in zip(outs[0].grad_fn.next_functions, leaves))
    for got, want in zip(outs, tk_ref(x, scale, base, 4, 2.0, 1e-2)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.autograd.backward(outs, [gp, gq, gc])
    for got, want in zip((t.grad for t in leaves), float64_grads(x, scale, base, 4, 2.0, 1e-2, (gp, gq, gc))):
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


def test_autograd_one_output_used_and_once(reference_bwd):
    x, scale, base, gp, gq, gc = tk_data(1, 4, 2)
    leaves = [t.clone().requires_grad_() for t in (x, scale, base)]
    pre, post, comb = tkjit.ops.mhc_pre_split_mixes(*leaves, 2, 2.0, 1e-2)
    comb.sum().backward()  # the other two outputs' gradients are zeros
    want = float64_grads(x, scale, base, 2, 2.0, 1e-2, (torch.zeros_like(gp), torch.zeros_like(gq),
                                                        torch.ones_like(gc)))
    for got, w in zip((t.grad for t in leaves), want):
        torch.testing.assert_close(got, w.float(), rtol=1e-5, atol=1e-6)
    pre, _, _ = tkjit.ops.mhc_pre_split_mixes(*leaves, 2, 2.0, 1e-2)
    (gs,) = torch.autograd.grad(pre.sum(), [leaves[1]], create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        gs.sum().backward()


def test_compat_signature_is_tile_kernels():
    P = inspect.Parameter
    params = inspect.signature(tk.modeling.mhc.ops.mhc_pre_split_mixes).parameters.values()
    assert [(p.name, p.kind, p.default) for p in params] == [
        (n, P.POSITIONAL_OR_KEYWORD, P.empty) for n in (
            "input_mixes", "mhc_scale", "mhc_base", "mhc_mult", "mhc_post_mult_value", "mhc_pre_eps")]


@pytest.mark.parametrize("n0, n1, m", [(1, 64, 4), (2, 33, 4), (1, 16, 2), (2, 8, 8)])
def test_compat_matches_tile_kernels_reference(reference_bwd, n0, n1, m):
    """TileKernels' test_pre_split_mixes_comprehensive: outputs and gradients at its tolerances (rtol 1e-5,
    atol 2e-5)."""
    x, scale, base, gp, gq, gc = tk_data(n0, n1, m, seed=n1 + m)

    def run(impl):
        leaves = [t.clone().requires_grad_() for t in (x, scale, base)]
        outs = impl(*leaves, m, 2.0, 1e-2)
        torch.autograd.backward(outs, [gp, gq, gc])
        return *outs, *(t.grad for t in leaves)

    got, want = run(tk.modeling.mhc.ops.mhc_pre_split_mixes), run(tk_ref)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("args, err, match", [
    (lambda x, s, b: (x[0], s, b, 4, 2.0, 1e-2), TensorError, "input_mixes must be 3-D"),
    (lambda x, s, b: (x, s, b, 3, 2.0, 1e-2), TensorError, "= 15 columns"),
    (lambda x, s, b: (x, s, b, 4.0, 2.0, 1e-2), ShapeError, "mhc_mult must be an int"),
    (lambda x, s, b: (x, s[:1], b, 4, 2.0, 1e-2), TensorError, r"mhc_scale must have shape \(3,\)"),
    (lambda x, s, b: (x, s, b.double(), 4, 2.0, 1e-2), TensorError, "mhc_base must be torch.float32"),
    (lambda x, s, b: (x.bfloat16(), s, b, 4, 2.0, 1e-2), TensorError, "input_mixes must be torch.float32"),
    (lambda x, s, b: (x, s, b, 4, None, 1e-2), ShapeError, "mhc_post_mult_value must be a float"),
])
def test_compat_argument_errors(args, err, match):
    x, s, b, *_ = tk_data(2, 3, 4)
    with pytest.raises(err, match=match):
        tk.modeling.mhc.ops.mhc_pre_split_mixes(*args(x, s, b))


def test_compat_options_tkjit_lacks_are_not_implemented():
    x, s, b, *_ = tk_data(1, 2, 4)
    with pytest.raises(NotImplementedError, match="mhc_post_mult_value"):
        tk.modeling.mhc.ops.mhc_pre_split_mixes(x, s, b, 4, -1.0, 1e-2)
