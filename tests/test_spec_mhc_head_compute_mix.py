"""mhc_head_compute_mix / mhc_head_compute_mix_bwd on a CPU host: the specs, the references against hand
values and float64 autograd of TileKernels' torch reference, the forward kernel end to end on TileLang's C
target, the backward cross-compiled for sm_90a (warp shuffles: CUDA only) and served by its reference for the
op tests (opcheck, fake, autograd, torch.compile), and the TileKernels compat entry point."""

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
FWD, BWD = "mhc_head_compute_mix", "mhc_head_compute_mix_bwd"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def spec(name=FWD):
    return tkjit.get_spec(name)


def tk_ref(input_mix, mhc_scale, mhc_base, mhc_pre_eps):
    """TileKernels' mhc_head_compute_mix_ref (tile_kernels/torch/mhc.py)."""
    return torch.sigmoid(input_mix * mhc_scale + mhc_base) + mhc_pre_eps


def tk_data(n0, n1, m, seed=0):
    """TileKernels' generate_head_compute_mix_test_data: standard normal, eps 1e-2."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n0, n1, m, generator=g), torch.randn(1, generator=g), torch.randn(m, generator=g),
            torch.randn(n0, n1, m, generator=g))


def float64_grads(x, scale, base, eps, go):
    leaves = [t.detach().double().requires_grad_() for t in (x, scale, base)]
    tk_ref(*leaves, eps).backward(go.double())
    return [t.grad for t in leaves]


# -- the specs ---------------------------------------------------------------------------------------

def test_registered_and_valid():
    f, b = spec(FWD), spec(BWD)
    assert f.family == b.family == "mhc"
    assert [p.name for p in f.params] == ["num_tokens", "mhc_mult", "mhc_pre_eps"]
    assert [p.name for p in b.params] == ["num_tokens", "mhc_mult", "num_partials"]
    assert set(f.space) == {"block_tokens", "threads", "vec"} and set(b.space) == {"threads", "vec"}
    assert [t.name for t in f.inputs] == ["input_mix", "mhc_scale", "mhc_base"]
    assert [t.name for t in b.outputs] == ["input_mix_grad", "mhc_scale_grad_partial", "mhc_base_grad_partial"]
    for m in (1, 2, 3, 4, 8, 16):
        for t in (1, 1024, 8192, 1 << 20):
            for s in (f, b):
                full = s.canonical_shape({"num_tokens": t, "mhc_mult": m})
                assert s.default_config(full, "sm_90a") in s.configs(full, "sm_90a"), (s.name, m, t)
            full = f.canonical_shape({"num_tokens": t, "mhc_mult": m})
            assert f.default_config(full, "cpu") in f.configs(full, "cpu")
    full = b.canonical_shape({"num_tokens": 64, "mhc_mult": 4})
    assert b.configs(full, "cpu") == []
    assert b.default_config(full)["vec"] == 4 and b.default_config(b.canonical_shape(
        {"num_tokens": 64, "mhc_mult": 2}))["vec"] == 2


def test_defaults_and_bytes():
    f, b = spec(FWD), spec(BWD)
    assert f.default_config(f.canonical_shape({"num_tokens": 8192, "mhc_mult": 4})) == {
        "block_tokens": 64, "threads": 64, "vec": 4}
    assert f.default_config(f.canonical_shape({"num_tokens": 1 << 20, "mhc_mult": 4}))["block_tokens"] == 128
    assert b.default_config(b.canonical_shape({"num_tokens": 8192, "mhc_mult": 4})) == {"threads": 64, "vec": 4}
    full = f.canonical_shape({"num_tokens": 10, "mhc_mult": 4})
    assert f.bytes_moved(full) == 2 * 10 * 4 * 4 + 5 * 4
    full = b.canonical_shape({"num_tokens": 10, "mhc_mult": 4})
    assert b.bytes_moved(full) == 3 * 10 * 4 * 4 + 132 * 5 * 4


def test_bad_shapes_and_configs():
    f, b = spec(FWD), spec(BWD)
    for shape, match in (({"num_tokens": 8, "mhc_mult": 17}, "mhc_mult"), ({"num_tokens": 0}, "num_tokens"),
                         ({"num_tokens": 8, "mhc_pre_eps": 2.0}, "mhc_pre_eps"),
                         ({"num_tokens": 8, "n": 4}, "unknown")):
        with pytest.raises(ShapeError, match=match):
            f.canonical_shape(shape)
    with pytest.raises(ShapeError, match="num_partials"):
        b.canonical_shape({"num_tokens": 8, "num_partials": 0})
    full = f.canonical_shape({"num_tokens": 64, "mhc_mult": 2})
    with pytest.raises(ConfigError, match="vec=4 does not tile"):
        f.check_config(full, {"block_tokens": 64, "threads": 64, "vec": 4})
    with pytest.raises(ConfigError, match="multiple of threads"):
        f.check_config(full, {"block_tokens": 32, "threads": 64, "vec": 2})
    with pytest.raises(ConfigError, match="C target"):
        b.check_config(b.canonical_shape({"num_tokens": 64}), {"threads": 64, "vec": 4}, arch="cpu")


# -- the references ----------------------------------------------------------------------------------

def test_forward_reference_by_hand():
    s = spec()
    full = s.canonical_shape({"num_tokens": 2, "mhc_mult": 2, "mhc_pre_eps": 0.5})
    x = torch.tensor([[0.0, 1.0], [-2.0, 3.0]])
    got = s.reference(full, x, torch.tensor([2.0]), torch.tensor([0.0, -2.0]))
    # z = [[0, 0], [-4, 4]]: sigmoid 0.5, 0.5, 1/(1+e^4), 1 - 1/(1+e^4)
    e = 1 / (1 + torch.exp(torch.tensor(4.0, dtype=torch.float64)))
    want = torch.tensor([[1.0, 1.0], [float(e) + 0.5, float(1 - e) + 0.5]])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


@pytest.mark.parametrize("m, seed", [(4, 0), (2, 1), (8, 2)])
def test_forward_reference_matches_tile_kernels_reference(m, seed):
    s = spec()
    full = s.canonical_shape({"num_tokens": 97, "mhc_mult": m, "mhc_pre_eps": 1e-2})
    x, scale, base = s.make_inputs(full, seed=seed)
    torch.testing.assert_close(s.reference(full, x, scale, base), tk_ref(x, scale, base, 1e-2), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n, partials", [(300, 7), (5, 8), (1, 132)])
def test_backward_reference_is_float64_autograd(n, partials):
    s = spec(BWD)
    full = s.canonical_shape({"num_tokens": n, "mhc_mult": 4, "num_partials": partials})
    go, x, scale, base = s.make_inputs(full, seed=n)
    gx, sp, bp = s.reference(full, go, x, scale, base)
    assert sp.shape == (partials, 1) and bp.shape == (partials, 4)
    want = float64_grads(x, scale, base, 0.0, go)
    torch.testing.assert_close(gx, want[0].float(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sp.double().sum(0), want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bp.double().sum(0), want[2], rtol=1e-5, atol=1e-6)
    per = -(-n // partials)  # block b's partials cover tokens [b * per, (b + 1) * per)
    assert bool((bp[-(-n // per):] == 0).all())


def test_inputs_spread():
    s = spec(BWD)
    full = s.canonical_shape({"num_tokens": 64, "mhc_mult": 4})
    a, b = s.make_inputs(full, seed=0), s.make_inputs(full, seed=1)
    assert [t.shape for t in a] == [(64, 4), (64, 4), (1,), (4,)]
    assert not torch.equal(a[1], b[1])
    assert (b[1][:, -1] == 0).all() and (b[0][:, 0] == 0).all()


# -- the kernels -------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, config, sizes", [
    ({"num_tokens": 4096, "mhc_mult": 4}, None, (1, 63, 4097)),
    ({"num_tokens": 100, "mhc_mult": 2, "mhc_pre_eps": 0.25}, {"block_tokens": 128, "threads": 32, "vec": 2}, (5, 300)),
    ({"num_tokens": 100, "mhc_mult": 8}, {"block_tokens": 32, "threads": 32, "vec": 1}, (33,)),
])
def test_forward_runs_on_cpu(shape, config, sizes):
    k = tkjit.get(FWD, shape, arch="cpu", config=config)
    for i, n in enumerate(sizes):
        assert check(k, {**shape, "num_tokens": n}, device="cpu", seed=i) is None


@pytest.mark.parametrize("shape, config", [
    ({"num_tokens": 8192, "mhc_mult": 4}, None),
    ({"num_tokens": 100, "mhc_mult": 2}, {"threads": 256, "vec": 1}),
])
def test_backward_compiles_for_sm90a(shape, config):
    k = tkjit.get(BWD, shape, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    assert "warp_reduce_sum" in src or "__shfl" in src
    if config is None:
        assert "float4" in src


# -- torch ops (the backward kernel replaced by one writing its reference) -----------------------------

@pytest.fixture
def reference_bwd(monkeypatch):
    return serve_references(monkeypatch, (BWD,))


def flat(n=6, m=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, m, generator=g), torch.randn(1, generator=g), torch.randn(m, generator=g)


def test_ops_opcheck_and_fake(reference_bwd):
    from torch._subclasses.fake_tensor import FakeTensorMode

    fwd, bwd = torch.ops.tkjit.mhc_head_compute_mix.default, torch.ops.tkjit.mhc_head_compute_mix_bwd.default
    assert "(Tensor input_mix, Tensor mhc_scale, Tensor mhc_base, float mhc_pre_eps, str? config=None, " \
           "str? bwd_config=None) -> Tensor" in str(fwd._schema)
    x, scale, base = (t.requires_grad_() for t in flat())
    assert torch.library.opcheck(fwd, (x, scale, base, 1e-2), test_utils=OPCHECK_TESTS) == dict.fromkeys(
        OPCHECK_TESTS, "SUCCESS")
    go = torch.randn(6, 4)
    assert torch.library.opcheck(bwd, (go, *flat()), test_utils=OPCHECK_TESTS) == dict.fromkeys(
        OPCHECK_TESTS, "SUCCESS")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        out = fwd(*(mode.from_tensor(t) for t in flat(5, 3)), 0.1)
        assert out.shape == (5, 3) and out.dtype == torch.float32
        grads = bwd(mode.from_tensor(torch.randn(5, 3)), *(mode.from_tensor(t) for t in flat(5, 3)))
        assert [tuple(g.shape) for g in grads] == [(5, 3), (1,), (3,)]
    x, scale, base = (t.to("meta") for t in flat())
    assert fwd(x, scale, base, 0.0).is_meta
    with pytest.raises(TensorError, match="mhc_base has shape"):
        fwd(x, scale, base[:3], 0.0)
    with pytest.raises(TensorError, match="input_mix has dtype"):
        fwd(x.double(), scale, base, 0.0)


@pytest.mark.parametrize("lead", [(2, 3), (7,), ()])
def test_autograd_matches_float64(reference_bwd, lead):
    g = torch.Generator().manual_seed(len(lead))
    x = torch.randn(*lead, 4, generator=g).requires_grad_()
    scale, base = torch.randn(1, generator=g).requires_grad_(), torch.randn(4, generator=g).requires_grad_()
    go = torch.randn(*lead, 4, generator=g)
    out = tkjit.ops.mhc_head_compute_mix(x, scale, base, 1e-2)
    assert out.shape == x.shape and out.dtype == torch.float32
    # one autograd node, straight from the leaves: no views around the Function
    assert all(f.variable is t for (f, _), t in zip(out.grad_fn.next_functions, (x, scale, base)))
    torch.testing.assert_close(out, tk_ref(x, scale, base, 1e-2), rtol=1e-5, atol=1e-6)
    out.backward(go)
    for got, want in zip((x.grad, scale.grad, base.grad), float64_grads(x, scale, base, 1e-2, go)):
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)


def test_autograd_is_differentiable_once(reference_bwd):
    x, scale, base = (t.requires_grad_() for t in flat(3, 2))
    out = tkjit.ops.mhc_head_compute_mix(x, scale, base, 0.0)
    (gs,) = torch.autograd.grad(out.sum(), [scale], create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        gs.sum().backward()


def test_compiled_forward_and_backward(reference_bwd):
    x, scale, base = flat(5, 4, seed=3)
    go = torch.randn(5, 4)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(a, b, c):
        return tkjit.ops.mhc_head_compute_mix(a, b, c, 1e-2) * 1.0

    leaves = [t.clone().requires_grad_() for t in (x, scale, base)]
    out = f(*leaves)
    torch.testing.assert_close(out, tk_ref(x, scale, base, 1e-2), rtol=1e-5, atol=1e-6)
    out.backward(go)
    for got, want in zip((t.grad for t in leaves), float64_grads(x, scale, base, 1e-2, go)):
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)


def test_ops_bwd_and_errors(reference_bwd):
    x, scale, base = flat(9, 4, seed=1)
    go = torch.randn(9, 4)
    got = tkjit.ops.mhc_head_compute_mix_bwd(go, x, scale, base)
    for a, w in zip(got, float64_grads(x, scale, base, 0.0, go)):
        torch.testing.assert_close(a, w.float(), rtol=1e-5, atol=1e-6)
    with pytest.raises(TensorError, match="output_mix_grad must have input_mix's shape"):
        tkjit.ops.mhc_head_compute_mix_bwd(go[:3], x, scale, base)
    with pytest.raises(TensorError, match="mhc_scale must have shape"):
        tkjit.ops.mhc_head_compute_mix(x, torch.ones(2), base, 0.0)
    with pytest.raises(TensorError, match="mhc_base must be torch.float32"):
        tkjit.ops.mhc_head_compute_mix(x, scale, base.double(), 0.0)


# -- compat ------------------------------------------------------------------------------------------

def test_compat_signature_is_tile_kernels():
    P = inspect.Parameter
    params = inspect.signature(tk.modeling.mhc.ops.mhc_head_compute_mix).parameters.values()
    assert [(p.name, p.kind, p.default) for p in params] == [
        (n, P.POSITIONAL_OR_KEYWORD, P.empty) for n in ("input_mix", "mhc_scale", "mhc_base", "mhc_pre_eps")]


@pytest.mark.parametrize("n0, n1, m", [(1, 64, 4), (2, 33, 4), (1, 16, 2), (2, 8, 8)])
def test_compat_matches_tile_kernels_reference(reference_bwd, n0, n1, m):
    """TileKernels' test_head_compute_mix_comprehensive: forward and autograd against the reference, its
    tolerances (rtol 1e-4, atol 1e-5)."""
    x, scale, base, go = tk_data(n0, n1, m, seed=n1 + m)

    def run(impl):
        leaves = [t.clone().requires_grad_() for t in (x, scale, base)]
        out = impl(*leaves, 1e-2)
        torch.autograd.backward([out], [go])
        return out, *(t.grad for t in leaves)

    for a, b in zip(run(tk.modeling.mhc.ops.mhc_head_compute_mix), run(tk_ref)):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_compat_empty_batch(reference_bwd):
    x, scale, base, go = tk_data(0, 4, 4)
    x.requires_grad_()
    out = tk.modeling.mhc.ops.mhc_head_compute_mix(x, scale, base, 1e-2)
    assert out.shape == (0, 4, 4)


@pytest.mark.parametrize("args, err, match", [
    (lambda x, s, b: (x[0], s, b, 1e-2), TensorError, "input_mix must be 3-D"),
    (lambda x, s, b: (x.double(), s, b, 1e-2), TensorError, "input_mix must be torch.float32"),
    (lambda x, s, b: (x, s.expand(2), b, 1e-2), TensorError, r"mhc_scale must have shape \(1,\)"),
    (lambda x, s, b: (x, s, b[:2], 1e-2), TensorError, r"mhc_base must have shape \(4,\)"),
    (lambda x, s, b: (x, s, None, 1e-2), TensorError, "mhc_base must be a torch.Tensor"),
    (lambda x, s, b: (x, s, b, "eps"), ShapeError, "mhc_pre_eps must be a float"),
])
def test_compat_argument_errors(args, err, match):
    x, s, b, _ = tk_data(2, 3, 4)
    with pytest.raises(err, match=match):
        tk.modeling.mhc.ops.mhc_head_compute_mix(*args(x, s, b))


def test_compat_sizes_tkjit_lacks_are_not_implemented():
    x, s, b, _ = tk_data(1, 2, 17)
    with pytest.raises(NotImplementedError, match="mhc_mult"):
        tk.modeling.mhc.ops.mhc_head_compute_mix(x, s, b, 1e-2)
