"""TileKernels' `transpose`: swap the last two axes, bit for bit, on tkjit's transpose kernels.

    transpose(x)          (M, N)    -> (N, M)     contiguous, x's dtype and device
    batched_transpose(x)  (B, M, N) -> (B, N, M)  contiguous

TileKernels takes M and N multiples of 64 and row strides that are multiples of 4 elements; tkjit
takes those and any other sizes too. Element types: every 1, 2, 4 or 8-byte type tkjit's kernel has
(floats, bf16, fp8, ints); others raise NotImplementedError naming the dtype.
"""

from __future__ import annotations

import torch

from tkjit import ops
from tkjit.compat.tile_kernels._support import require_kernel, rows_aligned, tensor
from tkjit.kernel import dtype_name

FAMILY = "transpose"
__all__ = ["transpose", "batched_transpose"]
_NAMES = {"dtype": "x.dtype", "cols": "N (x.shape[-1])", "rows": "M (x.shape[-2])", "batch": "B (x.shape[0])"}


def _transpose(fn: str, x: torch.Tensor) -> torch.Tensor:
    kernel = "batched_transpose" if x.dim() == 3 else "transpose"
    runtime = {"rows": max(1, x.shape[-2])} | ({"batch": max(1, x.shape[0])} if x.dim() == 3 else {})
    require_kernel(fn, FAMILY, kernel, {"dtype": dtype_name(x.dtype), "cols": max(1, x.shape[-1])}, _NAMES, runtime)
    if x.numel() == 0:  # as TileKernels: nothing to launch
        return torch.empty((*x.shape[:-2], x.shape[-1], x.shape[-2]), dtype=x.dtype, device=x.device)
    return ops.transpose(rows_aligned(x))


def transpose(x: torch.Tensor) -> torch.Tensor:
    """Transpose a 2-D tensor (M, N) -> (N, M), contiguous."""
    tensor("transpose.transpose", "x", x, (2,))
    return _transpose("transpose.transpose", x)


def batched_transpose(x: torch.Tensor) -> torch.Tensor:
    """Transpose each matrix of a 3-D tensor (B, M, N) -> (B, N, M), contiguous."""
    tensor("transpose.batched_transpose", "x", x, (3,))
    return _transpose("transpose.batched_transpose", x)
