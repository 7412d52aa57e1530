"""sinkhorn_bwd and tkjit.autograd.sinkhorn on a GPU: every config against torch autograd of the
float64 reference, odd token counts, bad tensors, and a timing print (run with -s)."""


import pytest
import torch

import tkjit
from tkjit.arch import current_arch
from tkjit.pool import compile_many
from tkjit.testing import check
from tkjit.timing import median, time_cuda
from tkjit_kernels.mhc.sinkhorn import reference as fwd_reference

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]



CASES = [
    ({"n": 4, "repeat": 10}, (1, 31, 4001, 65536, 1 << 20)),
    ({"n": 4, "repeat": 20, "eps": 1e-4}, (4001, 64)),
    ({"n": 2, "repeat": 1}, (1, 1000)),
    ({"n": 3, "repeat": 5}, (77, 4096)),
    ({"n": 8, "repeat": 10}, (4001, 33)),
    ({"n": 16, "repeat": 3}, (513, 5)),
]


@pytest.mark.parametrize("static, token_counts", CASES, ids=str)
def test_default_config(static, token_counts):
    k = tkjit.get("sinkhorn_bwd", {**static, "num_tokens": token_counts[0]})
    for i, t in enumerate(token_counts):
        for seed in (i, 50 + i):
            assert check(k, {**static, "num_tokens": t}, seed=seed) is None


@pytest.mark.parametrize("static", [{"n": 4, "repeat": 10}], ids=str)  # 384 variants, ~3 min to compile
def test_every_config(static):
    spec = tkjit.get_spec("sinkhorn_bwd")
    arch = current_arch()
    full = spec.canonical_shape({**static, "num_tokens": 4001})
    cfgs = spec.configs(full, arch)
    errors = [(c, e) for c, (_, e) in zip(cfgs, compile_many(
        [("sinkhorn_bwd", spec.static_shape(full), c, arch, "explicit") for c in cfgs])) if e]
    assert not errors, errors[:3]
    failures = []
    for c in cfgs:
        k = tkjit.get("sinkhorn_bwd", full, config=c)
        for seed, t in enumerate((4001, 1, 256)):
            problem = check(k, {**full, "num_tokens": t}, seed=seed)
            if problem:
                failures.append(problem)
    assert not failures, f"{len(failures)} failures, e.g. {failures[:3]}"


def test_bad_tensors():
    k = tkjit.get("sinkhorn_bwd", {"num_tokens": 64, "n": 4})
    g = torch.randn(64, 4, 4, device="cuda")
    with pytest.raises(tkjit.TensorError, match="dtype"):
        k(g.double(), g.double())
    with pytest.raises(tkjit.TensorError, match="axis"):
        k(g, torch.randn(65, 4, 4, device="cuda"))
    with pytest.raises(tkjit.TensorError, match="compiled in"):
        k(torch.randn(64, 3, 3, device="cuda"), torch.randn(64, 3, 3, device="cuda"))
    with pytest.raises(tkjit.TensorError, match="cuda"):
        k(g.cpu(), g.cpu())
    with pytest.raises(tkjit.TensorError, match="2 input"):
        k(g)


@pytest.mark.parametrize("shape, repeat, eps", [((8, 512, 4, 4), 10, 1e-6), ((4001, 4, 4), 10, 1e-6),
                                                 ((3, 7, 8, 8), 5, 1e-4), ((1, 2, 2), 1, 1e-6)], ids=str)
def test_autograd_matches_reference(shape, repeat, eps):
    from tkjit.autograd import sinkhorn

    for seed in (0, 1):
        torch.manual_seed(seed)
        x = torch.randn(*shape, device="cuda", requires_grad=True)
        y = sinkhorn(x, repeat=repeat, eps=eps)
        g = torch.randn_like(y)
        y.backward(g)
        xd = x.detach().cpu().double().requires_grad_(True)
        n = shape[-1]
        yr = fwd_reference({"repeat": repeat, "eps": eps}, xd.view(-1, n, n)).view(xd.shape)
        yr.backward(g.cpu().double())
        assert float((y.detach().cpu().double() - yr).norm() / yr.norm()) < 1e-5
        assert float((x.grad.cpu().double() - xd.grad).norm() / xd.grad.norm()) < 1e-5
    # Also through a graph: sinkhorn output feeding more ops, non-contiguous upstream gradient.
    for w, bound in ((torch.randn(4, 4), None), (torch.arange(16.0).view(4, 4), "fp32")):
        err, fp32_err = _graph_grad_errors(w)
        # arange's pattern is w[i][j] = a_j + b_i: the doubly-stochastic output annihilates it, so the
        # true gradient is ~1e-3 of a generic one and float32 torch autograd itself is off by ~1e-4.
        # There the bar is float32 torch (H200, 2026-12-02: tkjit 2.7e-4 where the bar read 1e-5).
        assert err < (1e-5 if bound is None else max(1e-5, 2 * fp32_err)), (w, err, fp32_err)


def _graph_grad_errors(w):
    """(tkjit's, float32 torch autograd's) relative grad error against float64 on a small graph."""
    from tkjit.autograd import sinkhorn

    x = torch.randn(64, 4, 4, device="cuda", requires_grad=True)
    w = w.to("cuda")
    (sinkhorn(x).transpose(1, 2) * w).sum().backward()
    grads = {}
    for dtype in (torch.float64, torch.float32):
        xr = x.detach().to(dtype).requires_grad_(True)
        (fwd_reference({"repeat": 10, "eps": 1e-6}, xr, dtype).transpose(1, 2) * w.to(dtype)).sum().backward()
        grads[dtype] = xr.grad
    ref = grads[torch.float64]
    return [float((g.double() - ref).norm() / ref.norm()) for g in (x.grad, grads[torch.float32])]


def test_speed_1m_tokens():
    shape = {"num_tokens": 1 << 20, "n": 4}
    bwd = tkjit.get("sinkhorn_bwd", shape)
    fwd = tkjit.get("sinkhorn_fwd", shape)
    x = torch.randn(1 << 20, 4, 4, device="cuda")
    g = torch.randn_like(x)
    out = torch.empty_like(x)

    b_us = median(time_cuda(lambda: bwd(g, x, out=out)))
    f_us = median(time_cuda(lambda: fwd(x)))
    print(f"\nsinkhorn 1M tokens n=4: bwd {b_us:.1f} us ({3 * x.numel() * 4 / b_us / 1e3:.0f} GB/s) "
          f"{bwd.config}; fwd {f_us:.1f} us")
    assert check(bwd, shape, seed=7) is None
