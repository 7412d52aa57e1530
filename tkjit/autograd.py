"""torch.autograd wrappers pairing forward and backward kernels.

    y = tkjit.autograd.sinkhorn(x)      # x: (..., n, n) float32, CUDA (or CPU via the C target)
    y.backward(g)                       # grad via the sinkhorn_bwd kernel

The backward kernel recomputes the forward from x, so only x is saved for backward.
"""

from __future__ import annotations

import torch

from tkjit.errors import TensorError


def _arch_of(t: torch.Tensor) -> str:
    from tkjit.ops import _arch_of as arch_of

    return arch_of(t)


class SinkhornFunction(torch.autograd.Function):
    """sinkhorn_fwd forward, sinkhorn_bwd backward, on (num_tokens, n, n) float32 tensors."""

    @staticmethod
    def forward(ctx, x, repeat, eps, fwd_config, bwd_config):
        from tkjit.api import get

        shape = {"num_tokens": max(1, x.shape[0]), "n": x.shape[1], "repeat": repeat, "eps": eps}
        y = get("sinkhorn_fwd", shape, arch=_arch_of(x), config=fwd_config)(x)
        ctx.save_for_backward(x)
        ctx.shape = shape
        ctx.bwd_config = bwd_config
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        from tkjit.api import get

        (x,) = ctx.saved_tensors
        if grad_y.dtype != x.dtype:
            grad_y = grad_y.to(x.dtype)
        grad_x = get("sinkhorn_bwd", ctx.shape, arch=_arch_of(x), config=ctx.bwd_config)(grad_y.contiguous(), x)
        return grad_x, None, None, None, None


def sinkhorn(
    x: torch.Tensor, repeat: int = 10, eps: float = 1e-6, *, fwd_config=None, bwd_config=None
) -> torch.Tensor:
    """Differentiable Sinkhorn normalisation of (..., n, n) float32 matrices (TileKernels semantics)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-1] != x.shape[-2]:
        raise TensorError(f"sinkhorn: x must be a (..., n, n) tensor, got {getattr(x, 'shape', x)}")
    if x.dtype != torch.float32:
        raise TensorError(f"sinkhorn: x must be float32, got {x.dtype}")
    n = x.shape[-1]
    flat = x.contiguous().view(-1, n, n)
    return SinkhornFunction.apply(flat, int(repeat), float(eps), fwd_config, bwd_config).view(x.shape)
