"""TileKernels' `modeling.mhc` compositions (`mhc_pre`, `mhc_head`) on a CPU host: the CUDA-only kernels are served
by their references (`helpers/reference_kernels.py`; the GPU test runs the real ones), and the compositions are
compared with a float64 composition of TileKernels' torch references, forward and gradients, at the TF32
tolerance of pre_norm_fn's GEMM."""

import inspect
import sys
from pathlib import Path

import pytest
import torch

from tkjit.compat import tile_kernels as tk

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from reference_kernels import serve_references  # noqa: E402

pytestmark = pytest.mark.usefixtures("module_cache")
KERNELS = ("mhc_pre_norm_fn", "mhc_pre_norm_fn_bwd", "mhc_pre_split_mixes", "mhc_pre_split_mixes_bwd",
           "pre_apply_mix", "pre_apply_mix_bwd", "pre_apply_mix_bwd_acc", "mhc_head_compute_mix",
           "mhc_head_compute_mix_bwd",
           "sinkhorn_fwd", "sinkhorn_bwd", "mhc_pre_big_fuse")
TF32_RTOL = 2e-3  # pre_norm_fn rounds fn to TF32 (10 mantissa bits), as TileKernels does


@pytest.fixture
def refs(monkeypatch):
    return serve_references(monkeypatch, KERNELS)


def _mixes64(residual, fn, w, eps):
    fn = fn * w if w is not None else fn
    x = residual.flatten(-2, -1)
    return (x @ fn.T) * (x.square().sum(-1, keepdim=True) / fn.shape[-1] + eps).rsqrt()


def _sinkhorn64(x, repeat, eps):
    x = x.softmax(-1) + eps
    x = x / (x.sum(-2, keepdim=True) + eps)
    for _ in range(repeat - 1):
        x = x / (x.sum(-1, keepdim=True) + eps)
        x = x / (x.sum(-2, keepdim=True) + eps)
    return x


def pre64(residual, fn, scale, base, w, m=4, post_mult=1.0, pre_eps=1e-6, s_eps=1e-6, repeat=10, eps=1e-6):
    """TileKernels' unfused mhc_pre in float64: norm_fn, split_mixes, sinkhorn, apply_mix (no final rounding)."""
    z = _mixes64(residual, fn, w, eps)
    s = torch.cat([scale[0].expand(m), scale[1].expand(m), scale[2].expand(m * m)])
    z = z * s + base
    pre = z[..., :m].sigmoid().unsqueeze(-1) + pre_eps
    post = (z[..., m:2 * m].sigmoid() * post_mult).unsqueeze(-1)
    comb = _sinkhorn64(z[..., 2 * m:].unflatten(-1, (m, m)), repeat, s_eps)
    return (residual * pre).sum(-2), (post, comb)


def head64(residual, fn, scale, base, w, m=4, pre_eps=1e-6, eps=1e-6):
    z = _mixes64(residual, fn, w, eps)[..., :m]
    mix = torch.sigmoid(z * scale.reshape(1) + base) + pre_eps
    return (residual * mix.unsqueeze(-1)).sum(-2)


def data(n0, n1, m, h, rows, seed=0, weight=False):
    g = torch.Generator().manual_seed(seed)
    k = m * h
    residual = torch.randn(n0, n1, m, h, generator=g).to(torch.bfloat16)
    fn = torch.randn(rows, k, generator=g) / k ** 0.5
    w = (1 + 0.1 * torch.randn(k, generator=g)) if weight else None
    return residual, fn, w


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_signatures_are_tile_kernels():
    pre = inspect.signature(tk.modeling.mhc.mhc_pre)
    assert list(pre.parameters) == ["residual", "fn", "scale", "base", "norm_weight", "norm_eps", "mhc_mult",
                                    "post_mult_value", "pre_eps", "sinkhorn_eps", "sinkhorn_repeat", "n_splits"]
    assert [pre.parameters[n].default for n in list(pre.parameters)[4:]] == [None, 1e-6, 4, 1.0, 1e-6, 1e-6, 10, 16]
    head = inspect.signature(tk.modeling.mhc.mhc_head)
    assert list(head.parameters) == ["residual", "fn", "scale", "base", "norm_weight", "norm_eps", "mhc_mult",
                                     "pre_eps", "n_splits"]
    assert [head.parameters[n].default for n in list(head.parameters)[4:]] == [None, 1e-6, 4, 1e-6, 16]


@pytest.mark.parametrize("weight", [False, True])
def test_mhc_pre_forward_and_gradients_match_float64(refs, weight):
    residual, fn, w = data(2, 3, 4, 64, 24, seed=1, weight=weight)
    scale, base = torch.tensor([0.5, 1.5, 2.0]), 0.1 * torch.randn(24, generator=torch.Generator().manual_seed(2))
    leaves = [residual.clone().requires_grad_(), fn.clone().requires_grad_(), scale.clone().requires_grad_(),
              base.clone().requires_grad_()]
    layer_input, (post, comb) = tk.modeling.mhc.mhc_pre(*leaves, norm_weight=w, post_mult_value=2.0)
    assert layer_input.shape == (2, 3, 64) and layer_input.dtype == torch.bfloat16
    assert post.shape == (2, 3, 4, 1) and comb.shape == (2, 3, 4, 4)
    leaves64 = [t.detach().double().requires_grad_() for t in (residual, fn, scale, base)]
    want, (post64, comb64) = pre64(*leaves64, w.double() if w is not None else None, post_mult=2.0)
    for got, ref in ((layer_input, want), (post, post64), (comb, comb64)):
        assert rel(got, ref) < TF32_RTOL
    g = torch.Generator().manual_seed(3)
    grads = (torch.randn(2, 3, 64, generator=g).bfloat16(), torch.randn(2, 3, 4, 1, generator=g),
             torch.randn(2, 3, 4, 4, generator=g))
    torch.autograd.backward([layer_input, post, comb], list(grads))
    torch.autograd.backward([want, post64, comb64], [t.double() for t in grads])
    for ours, ref in zip(leaves, leaves64):
        assert rel(ours.grad, ref.grad) < 1e-2  # bf16 layer-input gradient, TF32 GEMMs


def test_mhc_pre_without_grad_ignores_norm_weight_as_tile_kernels(refs):
    """TileKernels' inference path (its fused big_fuse kernel) takes no norm weight."""
    residual, fn, w = data(1, 5, 4, 64, 24, seed=4, weight=True)
    scale, base = torch.tensor([0.5, 1.5, 2.0]), torch.zeros(24)
    with torch.no_grad():
        plain = tk.modeling.mhc.mhc_pre(residual, fn, scale, base)
        weighted = tk.modeling.mhc.mhc_pre(residual, fn, scale, base, norm_weight=w)
    assert torch.equal(plain[0], weighted[0]) and torch.equal(plain[1][1], weighted[1][1])
    want, _ = pre64(residual.double(), fn.double(), scale.double(), base.double(), None)
    assert rel(plain[0], want) < TF32_RTOL


@pytest.mark.parametrize("scale_shape", [(1,), ()])
def test_mhc_head_matches_float64(refs, scale_shape):
    residual, fn, w = data(2, 3, 4, 64, 4, seed=5, weight=True)  # fn has mhc_mult rows: padded to 24 inside
    scale, base = torch.tensor(0.7).reshape(scale_shape), 0.1 * torch.randn(4, generator=torch.Generator())
    leaves = [residual.clone().requires_grad_(), fn.clone().requires_grad_()]
    out = tk.modeling.mhc.mhc_head(*leaves, scale, base, norm_weight=w)
    assert out.shape == (2, 3, 64) and out.dtype == torch.bfloat16
    leaves64 = [t.detach().double().requires_grad_() for t in (residual, fn)]
    want = head64(*leaves64, scale.double(), base.double(), w.double())
    assert rel(out, want) < TF32_RTOL
    g = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(6))
    out.backward(g.bfloat16())
    want.backward(g.double())
    for ours, ref in zip(leaves, leaves64):
        assert ours.grad.shape == ref.grad.shape and rel(ours.grad, ref.grad) < 1e-2


def test_mhc_pre_adds_the_residual_gradient_into_mhc_posts(refs):
    """TileKernels' protocol: with grad_from_mhc_post on the residual's storage (mhc_post's backward leaves it),
    pre_apply_mix and pre_norm_fn add their residual gradients into it and the residual gets none."""
    residual, fn, _ = data(1, 4, 4, 64, 24, seed=8)
    scale, base = torch.tensor([0.5, 1.5, 2.0]), torch.zeros(24)
    leaf = residual.clone().requires_grad_()
    start = torch.randn(residual.shape, generator=torch.Generator().manual_seed(9)).bfloat16()
    acc = start.clone()
    leaf.untyped_storage().grad_from_mhc_post = acc
    x, (post, comb) = tk.modeling.mhc.mhc_pre(leaf, fn, scale, base)
    (x.float().sum() + post.sum() + comb.sum()).backward()
    assert leaf.grad is None and not hasattr(leaf.untyped_storage(), "grad_from_mhc_post")
    r64 = residual.double().requires_grad_()
    want, (p64, c64) = pre64(r64, fn.double(), scale.double(), base.double(), None)
    (want.sum() + p64.sum() + c64.sum()).backward()
    assert rel(acc.double() - start.double(), r64.grad) < 1e-2
