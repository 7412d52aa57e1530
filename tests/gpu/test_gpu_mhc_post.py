"""mhc_post_fwd / mhc_post_bwd on the GPU: every config of both spaces against the float64 references, the
default configs at TileKernels' test and benchmark shapes, the TileKernels package as oracle (its
test_mhc_post_comprehensive: forward and autograd, its tolerances), gradients against float64 autograd,
the ops under opcheck, torch.compile and a CUDA graph."""

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as compat
from tkjit.testing import check, check_configs
from tkjit_kernels.mhc._post import forward

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
FWD, BWD = "mhc_post_fwd", "mhc_post_bwd"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# TileKernels' parametrisations: n0 in (1, 2), n1 in (1024, 4096), mhc 2 / 4 / 8, hidden 1280 .. 7168
# (its own test: mhc 4, n1 4096, hidden 1280 / 2560 / 7168; its backward kernel takes mhc 4 only).
TK_SHAPES = [(n0, n1, m, h) for n0 in (1, 2) for n1 in (1024, 4096) for m in (2, 4, 8)
             for h in (1280, 2560, 4096, 7168)]
ODD = [(1, 4001, 4, 7168), (1, 1, 4, 1280), (3, 7, 3, 1000), (1, 33, 1, 6), (1, 5, 16, 520), (2, 9, 8, 7)]


def _shape(t, m, h):
    return {"num_tokens": t, "mhc": m, "hidden": h}


def _tk_data(n0, n1, m, h, seed=0):
    """TileKernels' generate_mhc_post_test_data (standard normal), on the GPU."""
    g = torch.Generator().manual_seed(seed)
    data = (torch.randn(n0, n1, h, generator=g).bfloat16(), torch.randn(n0, n1, m, h, generator=g).bfloat16(),
            torch.randn(n0, n1, m, 1, generator=g), torch.randn(n0, n1, m, m, generator=g),
            torch.randn(n0, n1, m, h, generator=g).bfloat16())
    return tuple(t.cuda() for t in data)


def _float64_grads(x, res, post, comb, go):
    leaves = [t.detach().double().requires_grad_() for t in (x, res, post, comb)]
    forward(*leaves).backward(go.double())
    return [t.grad for t in leaves]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))


def _bits_differ(a, b):
    """Fraction of elements whose bits differ (a TileKernels kernel and ours in the same float order agree
    bit for bit unless nvcc contracts a multiply-add differently)."""
    return float((a.view(torch.int16) != b.view(torch.int16)).double().mean()) if a.numel() else 0.0


# -- every config, defaults ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", [FWD, BWD])
def test_every_config_in_the_space(name):
    sizes = [{"num_tokens": 4001}, {"num_tokens": 1}, {"num_tokens": 256}]
    failures = check_configs(name, [_shape(1, 4, 7168), _shape(1, 3, 1000)], sizes, seeds=(0, 1))
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("name", [FWD, BWD])
@pytest.mark.parametrize("n0, n1, m, h", TK_SHAPES + ODD, ids=str)
def test_default_config(name, n0, n1, m, h):
    kern = tkjit.get(name, _shape(n0 * n1, m, h))
    for seed in (0, 1) if (n0, n1, m, h) in ODD else (1,):  # odd seeds: tokens of many magnitudes
        assert check(kern, _shape(n0 * n1, m, h), seed=seed) is None


# -- TileKernels as the oracle -------------------------------------------------------------------------

@pytest.mark.parametrize("n0, n1, m, h", TK_SHAPES, ids=str)
def test_tile_kernels_forward_is_the_oracle(n0, n1, m, h):
    tk = pytest.importorskip("tile_kernels")
    x, res, post, comb, _ = _tk_data(n0, n1, m, h, seed=h + m)
    want = tk.modeling.mhc.ops.mhc_post_fwd(x, res, post, comb)
    got = compat.modeling.mhc.ops.mhc_post_fwd(x, res, post, comb)
    torch.testing.assert_close(got, want)
    # the same float32 order (post term, then an FMA per stream): at most a rare contraction difference
    assert _bits_differ(got, want) < 1e-3
    assert _rel(got, forward(x, res, post, comb)) < 1e-3


@pytest.mark.parametrize("n0, n1, m, h", [s for s in TK_SHAPES if s[2] == 4], ids=str)
def test_tile_kernels_autograd_is_the_oracle(n0, n1, m, h):
    """TileKernels' test_mhc_post_comprehensive against its own kernels (mhc 4: its backward's only rate)."""
    tk = pytest.importorskip("tile_kernels")
    data = _tk_data(n0, n1, m, h, seed=n0 * n1 + h)

    def run(impl):
        leaves = [t.clone().requires_grad_() for t in data[:4]]
        out = impl(*leaves)
        torch.autograd.backward([out], [data[4]])
        return out, *(t.grad for t in leaves)

    got, want = run(compat.modeling.mhc.ops.mhc_post), run(tk.modeling.mhc.ops.mhc_post)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        if i < 3:  # out, grad_x, grad_residual: bf16
            torch.testing.assert_close(a, b)
            assert _bits_differ(a, b) < 1e-3, i
        else:  # the float32 sums over hidden: another order than TileKernels' reducer
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    d = compat.modeling.mhc.ops.mhc_post_bwd(*data, fuse_grad_acc=False)
    e = tk.modeling.mhc.ops.mhc_post_bwd(*data, fuse_grad_acc=False)
    torch.testing.assert_close(d[1], e[1])
    torch.testing.assert_close(d[3], e[3], atol=1e-4, rtol=1e-4)


# -- gradients against float64 ------------------------------------------------------------------------

@pytest.mark.parametrize("n0, n1, m, h", [(1, 4096, 4, 7168), (2, 1024, 4, 1280), (1, 1024, 2, 2560),
                                          (1, 1024, 8, 4096), (3, 7, 3, 1000)], ids=str)
def test_autograd_matches_float64(n0, n1, m, h):
    x, res, post, comb, go = _tk_data(n0, n1, m, h, seed=m)
    leaves = [t.clone().requires_grad_() for t in (x, res, post, comb)]
    out = tkjit.ops.mhc_post(*leaves)
    assert _rel(out, forward(x, res, post, comb)) < 1e-3
    out.backward(go)
    for leaf, want in zip(leaves, _float64_grads(x, res, post, comb, go)):
        assert leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape
        bound = 1e-3 if leaf.dtype == torch.bfloat16 else 1e-5
        assert _rel(leaf.grad, want) < bound
    # the compat entry's autograd is the same kernels
    leaves2 = [t.clone().requires_grad_() for t in (x, res, post, comb)]
    compat.modeling.mhc.ops.mhc_post(*leaves2).backward(go)
    for a, b in zip(leaves, leaves2):
        assert torch.equal(a.grad, b.grad)


def test_bad_tensors_raise():
    kern = tkjit.get(FWD, _shape(64, 4, 1280))
    x, res, post, comb, _ = (t.flatten(0, 1) for t in _tk_data(1, 64, 4, 1280))
    post = post.squeeze(-1)
    with pytest.raises(tkjit.TensorError, match="dtype"):
        kern(x.float(), res, post, comb)
    with pytest.raises(tkjit.TensorError, match="axis"):
        kern(x, res[:32], post, comb)
    with pytest.raises(tkjit.TensorError, match="cuda"):
        kern(x.cpu(), res.cpu(), post.cpu(), comb.cpu())
    with pytest.raises(tkjit.TensorError, match="post_layer_mix must be 4-D"):
        compat.modeling.mhc.ops.mhc_post(x[None], res[None], post[None], comb[None])


# -- ops: opcheck, torch.compile, CUDA graph -----------------------------------------------------------

def test_ops_opcheck_compile_and_cuda_graph():
    x, res, post, comb, go = (t.flatten(0, 1) for t in _tk_data(1, 256, 4, 1280, seed=5))
    post = post.squeeze(-1)
    fwd, bwd = torch.ops.tkjit.mhc_post_fwd.default, torch.ops.tkjit.mhc_post_bwd.default
    args = [t.clone().requires_grad_(t.dtype == torch.float32) for t in (x, res, post, comb)]
    assert torch.library.opcheck(fwd, args, test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    assert torch.library.opcheck(bwd, (go, x, res, post, comb), test_utils=OPCHECK_TESTS) == dict.fromkeys(
        OPCHECK_TESTS, "SUCCESS")

    eager = tkjit.ops.mhc_post_fwd(x, res, post, comb)
    f = torch.compile(lambda *a: tkjit.ops.mhc_post(*a), fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (x, res, post, comb)]
    out = f(*leaves)
    assert torch.equal(out, eager)
    out.backward(go)
    want = tkjit.ops.mhc_post_bwd(go, x, res, post, comb)
    for leaf, w in zip(leaves, want):
        assert torch.equal(leaf.grad, w)

    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        got = tkjit.ops.mhc_post_fwd(x, res, post, comb)
    x.copy_(torch.randn_like(x.float()).bfloat16())
    g.replay()
    torch.cuda.synchronize()
    assert _rel(got, forward(x, res, post, comb)) < 1e-3
