"""Differentiable kernel pairs.

    y = tkjit.autograd.sinkhorn(x)      # x: (..., n, n) float32, CUDA (or CPU via the C target)
    y.backward(g)                       # grad via the sinkhorn_bwd kernel

Under torch.compile (and for FakeTensor or subclass inputs) the pair is the custom op
`torch.ops.tkjit.sinkhorn_fwd` with its autograd formula registered (tkjit/torch_ops.py). In plain
eager code it is `SinkhornFunction`, the same formula as a torch.autograd.Function calling the ops'
implementations directly: the custom op's Python autograd wrapper and two dispatcher round trips
cost more host time per step than both kernels take at small sizes. Either way the backward kernel
recomputes the forward from x, so only x is saved, and it is differentiable once (double backward
raises).
"""

from __future__ import annotations

import torch

from tkjit import torch_ops
from tkjit.errors import TensorError
from tkjit.torch_ops import encode_config

_sinkhorn_fwd = torch.ops.tkjit.sinkhorn_fwd.default


class SinkhornFunction(torch.autograd.Function):
    """Eager sinkhorn_fwd / sinkhorn_bwd on (num_tokens, n, n) float32 (see the module doc)."""

    @staticmethod
    def forward(ctx, x, repeat, eps, fwd_config, bwd_config):
        ctx.save_for_backward(x)
        ctx.args = (repeat, eps, bwd_config)
        return torch_ops.sinkhorn_fwd_impl(x, repeat, eps, fwd_config)

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        if grad_y.dtype != x.dtype:
            grad_y = grad_y.to(x.dtype)
        with torch.no_grad():
            grad_x = torch_ops.sinkhorn_bwd_impl(grad_y.contiguous(), x, *ctx.args)
        if torch.is_grad_enabled():  # create_graph=True: the gradient's own backward must say why it fails
            grad_x = _OnceDifferentiable.apply(grad_x, x)
        return grad_x, None, None, None, None


class _OnceDifferentiable(torch.autograd.Function):
    """Identity on a gradient, whose backward (a double backward) raises a clear error."""

    @staticmethod
    def forward(ctx, grad_x, x):
        return grad_x.view_as(grad_x)

    @staticmethod
    def backward(ctx, _):
        raise RuntimeError(torch_ops.DIFFERENTIABLE_ONCE)


def plain(x: torch.Tensor) -> bool:
    """A plain tensor outside torch.compile: the eager Function serves it."""
    return type(x) is torch.Tensor and not x.is_meta and not torch.compiler.is_compiling()


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
    args = (int(repeat), float(eps), encode_config(fwd_config), encode_config(bwd_config))
    y = SinkhornFunction.apply(flat, *args) if plain(flat) else _sinkhorn_fwd(flat, *args)
    return y.view(x.shape)
