"""TileKernels' `modeling.mhc.mhc_pre` / `mhc_head` compositions on the GPU: tkjit's compat functions against
TileKernels' (in inference mode both run their fused big_fuse kernels), forward and gradients (a TileKernels
failure skips the comparison, with the reason; float64 checks are the CPU test's, test_compat_mhc_functional)."""

import pytest
import torch

from tkjit.compat import tile_kernels as compat

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
SHAPES = [(1, 1024, 4, 1280), (2, 4096, 4, 7168), (1, 7, 4, 2560)]


def _data(n0, n1, m, h, rows, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = m * h
    residual = torch.randn(n0, n1, m, h, generator=g, device="cuda").bfloat16()
    fn = torch.randn(rows, k, generator=g, device="cuda") / k ** 0.5
    w = 1 + 0.1 * torch.randn(k, generator=g, device="cuda")
    return residual, fn, w


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _both(case, ours, theirs):
    """`case` run with tkjit's compat function, then with TileKernels' (forward and backward: its backward kernels
    build at the first backward). A TileKernels failure (a kernel that does not build on this TileLang, or fails
    at launch) skips the comparison; tkjit's failures fail the test."""
    got = case(ours)
    try:
        want = case(theirs)
    except Exception as e:
        pytest.skip(f"TileKernels' {theirs.__name__} failed: {type(e).__name__}: {str(e)[-300:]}")
    return got, want


@pytest.mark.parametrize("n0, n1, m, h", SHAPES)
@pytest.mark.parametrize("grad", [False, True])
def test_mhc_pre_against_tile_kernels(n0, n1, m, h, grad):
    tk = pytest.importorskip("tile_kernels")
    rows = m * (m + 2)
    residual, fn, w = _data(n0, n1, m, h, rows, seed=n1 + h)
    scale = torch.tensor([0.5, 1.5, 2.0], device="cuda")
    base = 0.1 * torch.randn(rows, device="cuda")

    def case(impl):
        leaves = [t.clone().requires_grad_(grad) for t in (residual, fn, scale, base)]
        # In a layer, mhc_post's backward leaves the residual's gradient on its storage; pre_apply_mix and
        # pre_norm_fn (fuse_grad_acc) add theirs into it (TileKernels' protocol; without it its backward fails).
        acc = torch.zeros_like(residual)
        leaves[0].untyped_storage().grad_from_mhc_post = acc
        with torch.set_grad_enabled(grad):
            x, (post, comb) = impl(*leaves, norm_weight=w if grad else None, post_mult_value=2.0)
        outs = [x, post, comb]
        if grad:
            g = torch.Generator(device="cuda").manual_seed(7)
            torch.autograd.backward(outs, [torch.randn(t.shape, generator=g, device="cuda").to(t.dtype) for t in outs])
            assert leaves[0].grad is None
            outs += [acc, *(t.grad for t in leaves[1:])]
        return outs

    for ours, theirs in zip(*_both(case, compat.modeling.mhc.mhc_pre, tk.modeling.mhc.mhc_pre)):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        assert _rel(ours, theirs) < 2e-3, (ours.shape, _rel(ours, theirs))


@pytest.mark.parametrize("n0, n1, m, h", SHAPES)
def test_mhc_head_against_tile_kernels(n0, n1, m, h):
    tk = pytest.importorskip("tile_kernels")
    residual, fn, w = _data(n0, n1, m, h, m, seed=n1 * 3 + h)
    scale, base = torch.tensor([0.7], device="cuda"), 0.1 * torch.randn(m, device="cuda")

    def case(impl):
        leaves = [residual.clone().requires_grad_(), fn.clone().requires_grad_()]
        acc = torch.zeros_like(residual)
        leaves[0].untyped_storage().grad_from_mhc_post = acc  # as in test_mhc_pre_against_tile_kernels
        out = impl(*leaves, scale, base, norm_weight=w)
        out.backward(torch.ones_like(out))
        return [out, acc, leaves[1].grad]

    for ours, theirs in zip(*_both(case, compat.modeling.mhc.mhc_head, tk.modeling.mhc.mhc_head)):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        assert _rel(ours, theirs) < 2e-3, (ours.shape, _rel(ours, theirs))
