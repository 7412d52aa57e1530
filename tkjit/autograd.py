"""Differentiable kernel pairs.

    y = tkjit.autograd.sinkhorn(x)      # x: (..., n, n) float32, CUDA (or CPU via the C target)
    y.backward(g)                       # grad via the sinkhorn_bwd kernel

The pair is the custom op `torch.ops.tkjit.sinkhorn_fwd` with its autograd formula registered
(tkjit/torch_ops.py): the backward kernel recomputes the forward from x, so only x is saved for
backward. It is differentiable once (double backward raises).
"""

from __future__ import annotations

import torch

from tkjit.errors import TensorError
from tkjit.torch_ops import encode_config

_sinkhorn_fwd = torch.ops.tkjit.sinkhorn_fwd.default


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
    y = _sinkhorn_fwd(flat, int(repeat), float(eps), encode_config(fwd_config), encode_config(bwd_config))
    return y.view(x.shape)
