"""Convenience forms that infer the shape from tensors: `tkjit.ops.sinkhorn_fwd(x)` etc.

Each call goes through `tkjit.get` (memoised: ~1-2 us on a hit), so it serves the tuned config for
the tensor's GPU and size bucket.
"""

from __future__ import annotations

import torch

from tkjit.api import get
from tkjit.arch import arch_for_capability
from tkjit.errors import TensorError

_DTYPE_NAMES = {
    torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16",
    torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2", torch.uint8: "uint8",
    torch.int8: "int8", torch.int32: "int32", torch.int64: "int64", torch.float64: "float64",
}


def _arch_of(t: torch.Tensor) -> str:
    if t.device.type == "cuda":
        return arch_for_capability(*torch.cuda.get_device_capability(t.device))
    if t.device.type == "cpu":
        return "cpu"
    raise TensorError(f"tensors on {t.device} are not supported")


def _need(x, ndim: int, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != ndim:
        raise TensorError(f"{what}: expected a {ndim}-D tensor, got {getattr(x, 'shape', type(x).__name__)}")


def sinkhorn_fwd(x: torch.Tensor, repeat: int = 10, eps: float = 1e-6, *, config=None) -> torch.Tensor:
    """(num_tokens, n, n) float32 -> Sinkhorn-normalised, TileKernels semantics."""
    _need(x, 3, "sinkhorn_fwd")
    shape = {"num_tokens": max(1, x.shape[0]), "n": x.shape[1], "repeat": repeat, "eps": eps}
    return get("sinkhorn_fwd", shape, arch=_arch_of(x), config=config)(x)


def sinkhorn(x: torch.Tensor, repeat: int = 10, eps: float = 1e-6) -> torch.Tensor:
    """Differentiable Sinkhorn (forward and backward kernels) over (..., n, n) float32."""
    from tkjit.autograd import sinkhorn as _sinkhorn

    return _sinkhorn(x, repeat, eps)


def topk_gate(scores: torch.Tensor, k: int, *, config=None) -> torch.Tensor:
    """(num_tokens, num_experts) float32 -> int64 (num_tokens, k) indices, best first, ties to lower index."""
    _need(scores, 2, "topk_gate")
    shape = {"num_tokens": max(1, scores.shape[0]), "num_experts": scores.shape[1], "k": k}
    return get("topk_gate", shape, arch=_arch_of(scores), config=config)(scores)


def per_token_cast(
    x: torch.Tensor, group: int = 128, *, round_scale: bool = False, col_major_scales: bool = False, config=None
):
    """(num_tokens, hidden) bf16/f32 -> (fp8 e4m3 values, float32 scales per `group` channels).

    scales is (num_tokens, hidden // group) either way. col_major_scales: it is the strided view
    storage[:, :num_tokens].T of a TMA-aligned column-major (hidden // group, align(num_tokens, 4))
    buffer (strides (1, align(num_tokens, 4)); padding holds 0), the layout DeepGEMM consumes and
    TileKernels' `use_tma_aligned_col_major_sf` returns.
    """
    _need(x, 2, "per_token_cast")
    shape = {"num_tokens": max(1, x.shape[0]), "hidden": x.shape[1], "group": group,
             "in_dtype": _DTYPE_NAMES.get(x.dtype, str(x.dtype)), "round_scale": round_scale}
    if not col_major_scales:
        return get("per_token_cast", shape, arch=_arch_of(x), config=config)(x)
    q, storage = get("per_token_cast_colmajor", shape, arch=_arch_of(x), config=config)(x)
    return q, storage[:, : x.shape[0]].T


def transpose(x: torch.Tensor, *, config=None) -> torch.Tensor:
    """(rows, cols) -> (cols, rows), or (batch, rows, cols) -> (batch, cols, rows), bit-exact."""
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
        raise TensorError(f"transpose: expected a 2-D or 3-D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    shape = {"rows": max(1, x.shape[-2]), "cols": x.shape[-1], "dtype": _DTYPE_NAMES.get(x.dtype, str(x.dtype))}
    if x.dim() == 3:
        return get("batched_transpose", {**shape, "batch": max(1, x.shape[0])}, arch=_arch_of(x), config=config)(x)
    return get("transpose", shape, arch=_arch_of(x), config=config)(x)
