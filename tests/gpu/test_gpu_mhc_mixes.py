"""mhc_head_compute_mix / mhc_pre_split_mixes and their backwards on the GPU: every config of the four spaces
against the float64 references, the default configs at TileKernels' test shapes (n0 in 1, 2; n1 in 1024,
4096; mhc 2, 4, 8) and odd ones, the TileKernels package as oracle (forward and autograd at its tests'
tolerances), gradients against float64 autograd, the ops under opcheck and torch.compile."""

import warnings

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as compat
from tkjit.testing import check, check_configs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
HEAD, HEAD_BWD = "mhc_head_compute_mix", "mhc_head_compute_mix_bwd"
SPLIT, SPLIT_BWD = "mhc_pre_split_mixes", "mhc_pre_split_mixes_bwd"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
TK_SHAPES = [(n0, n1, m) for n0 in (1, 2) for n1 in (1024, 4096) for m in (2, 4, 8)]
ODD = [(1, 1, 4), (3, 7, 3), (1, 4001, 4), (1, 33, 1), (1, 5, 16), (2, 70001, 4)]


def _head_ref(x, scale, base, eps):
    return torch.sigmoid(x * scale + base) + eps


def _split_ref(x, scale, base, m, mult, eps):
    a, b = x.shape[:2]
    s = torch.cat([scale[0].expand(m), scale[1].expand(m), scale[2].expand(m * m)])
    z = x * s + base
    return (z[:, :, :m].sigmoid().unsqueeze(-1) + eps, (z[:, :, m:2 * m].sigmoid() * mult).unsqueeze(-1),
            z[:, :, 2 * m:].view(a, b, m, m))


def _head_data(n0, n1, m, seed=0):
    g = torch.Generator().manual_seed(seed)
    data = (torch.randn(n0, n1, m, generator=g), torch.randn(1, generator=g), torch.randn(m, generator=g),
            torch.randn(n0, n1, m, generator=g))
    return tuple(t.cuda() for t in data)


def _split_data(n0, n1, m, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = 2 * m + m * m
    data = (torch.randn(n0, n1, w, generator=g), torch.randn(3, generator=g), torch.randn(w, generator=g),
            torch.randn(n0, n1, m, 1, generator=g), torch.randn(n0, n1, m, 1, generator=g),
            torch.randn(n0, n1, m, m, generator=g))
    return tuple(t.cuda() for t in data)


def _run(impl, leaves_in, extra, grads):
    leaves = [t.clone().requires_grad_() for t in leaves_in]
    outs = impl(*leaves, *extra)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(list(outs), list(grads))
    return (*outs, *(t.grad for t in leaves))


def _float64(impl, leaves_in, extra, grads):
    return _run(impl, [t.double() for t in leaves_in], extra, [g.double() for g in grads])


# -- every config, defaults ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", [HEAD, HEAD_BWD, SPLIT, SPLIT_BWD])
def test_every_config_in_the_space(name):
    sizes = [{"num_tokens": 4001}, {"num_tokens": 1}, {"num_tokens": 8192}]
    shapes = [{"num_tokens": 8192, "mhc_mult": 4}, {"num_tokens": 8192, "mhc_mult": 2}]
    failures = check_configs(name, shapes, sizes, seeds=(0, 1))
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("name", [HEAD, HEAD_BWD, SPLIT, SPLIT_BWD])
@pytest.mark.parametrize("n0, n1, m", TK_SHAPES + ODD, ids=str)
def test_default_config(name, n0, n1, m):
    shape = {"num_tokens": n0 * n1, "mhc_mult": m}
    kern = tkjit.get(name, shape)
    for seed in (0, 1):  # odd seeds: rows of many magnitudes (saturated sigmoids), zero columns
        assert check(kern, shape, seed=seed) is None


# -- TileKernels as the oracle, and float64 autograd ----------------------------------------------------

@pytest.mark.parametrize("n0, n1, m", TK_SHAPES, ids=str)
def test_head_compute_mix_against_tile_kernels_and_float64(n0, n1, m):
    x, scale, base, go = _head_data(n0, n1, m, seed=n1 + m)
    got = _run(compat.modeling.mhc.ops.mhc_head_compute_mix, (x, scale, base), (1e-2,), (go,))
    want = _float64(_head_ref, (x, scale, base), (1e-2,), (go,))
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape
        torch.testing.assert_close(a, b.float(), rtol=1e-4, atol=1e-5)  # TileKernels' test tolerances
    tk = pytest.importorskip("tile_kernels")
    oracle = _run(tk.modeling.mhc.ops.mhc_head_compute_mix, (x, scale, base), (1e-2,), (go,))
    names = ("output_mix", "input_mix grad", "mhc_scale grad", "mhc_base grad")
    for name, a, b, ref in zip(names, got, oracle, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        if m == 2 and name == "mhc_scale grad" and not torch.allclose(b, ref.float(), rtol=1e-4, atol=1e-5):
            # On the H200 (TileLang 0.1.15) TileKernels' scale gradient with 2 streams is off from float64
            # by 3 to 14 (its v1 `alloc_reducer`); tkjit's matched float64 above. The oracle is wrong here.
            warnings.warn(f"TileKernels' {name} at mhc_mult 2: {b.item()} against float64 {ref.item()}",
                          stacklevel=2)
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n0, n1, m", TK_SHAPES, ids=str)
def test_pre_split_mixes_against_tile_kernels_and_float64(n0, n1, m):
    x, scale, base, gp, gq, gc = _split_data(n0, n1, m, seed=n1 + m)
    extra = (m, 2.0, 1e-2)
    got = _run(compat.modeling.mhc.ops.mhc_pre_split_mixes, (x, scale, base), extra, (gp, gq, gc))
    want = _float64(_split_ref, (x, scale, base), extra, (gp, gq, gc))
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == torch.float32 and a.shape == b.shape
        # TileKernels' tolerances (rtol 1e-5, atol 2e-5); the parameters' gradients are sums over up to 8K
        # tokens of float32 terms, so their rounding is relative to the sum of magnitudes, not the sum
        atol = 2e-5 if i < 4 else 2e-5 * float(want[i].abs().max().clamp(min=1)) * 10
        torch.testing.assert_close(a, b.float(), rtol=1e-5, atol=atol)
    tk = pytest.importorskip("tile_kernels")
    oracle = _run(tk.modeling.mhc.ops.mhc_pre_split_mixes, (x, scale, base), extra, (gp, gq, gc))
    for i, (a, b) in enumerate(zip(got, oracle)):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5 if i < 4 else 1e-4, atol=2e-5 if i < 4 else 1e-3)


# -- ops: opcheck, torch.compile ------------------------------------------------------------------------

def test_ops_opcheck_and_compile():
    x, scale, base, go = _head_data(1, 256, 4, seed=5)
    fwd, bwd = torch.ops.tkjit.mhc_head_compute_mix.default, torch.ops.tkjit.mhc_head_compute_mix_bwd.default
    flat = x[0]
    args = (flat.clone().requires_grad_(), scale.clone().requires_grad_(), base.clone().requires_grad_(), 1e-2)
    assert torch.library.opcheck(fwd, args, test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    assert torch.library.opcheck(bwd, (go[0], flat, scale, base), test_utils=OPCHECK_TESTS) == dict.fromkeys(
        OPCHECK_TESTS, "SUCCESS")
    xs, s3, bs, gp, gq, gc = _split_data(1, 256, 4, seed=6)
    fwd, bwd = torch.ops.tkjit.mhc_pre_split_mixes.default, torch.ops.tkjit.mhc_pre_split_mixes_bwd.default
    args = (xs[0].clone().requires_grad_(), s3.clone().requires_grad_(), bs.clone().requires_grad_(), 4, 2.0, 1e-2)
    assert torch.library.opcheck(fwd, args, test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    bargs = (gp[0, ..., 0], gq[0, ..., 0], gc[0].reshape(256, 16), xs[0], s3, bs, 2.0)
    assert torch.library.opcheck(bwd, bargs, test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")

    head = torch.compile(lambda *a: tkjit.ops.mhc_head_compute_mix(*a, 1e-2), fullgraph=True)
    got = _run(head, (x, scale, base), (), (go,))
    want = _run(lambda *a: tkjit.ops.mhc_head_compute_mix(*a, 1e-2), (x, scale, base), (), (go,))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    split = torch.compile(lambda *a: tkjit.ops.mhc_pre_split_mixes(*a, 4, 2.0, 1e-2), fullgraph=True)
    got = _run(split, (xs, s3, bs), (), (gp, gq, gc))
    want = _run(lambda *a: tkjit.ops.mhc_pre_split_mixes(*a, 4, 2.0, 1e-2), (xs, s3, bs), (), (gp, gq, gc))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
