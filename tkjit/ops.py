"""Convenience forms that infer the shape from tensors: `tkjit.ops.sinkhorn_fwd(x)` etc.

Each function calls its torch custom op (`torch.ops.tkjit.*`, registered by importing this module;
see tkjit/torch_ops.py), whose implementation goes through `tkjit.get` (memoised: ~1-2 us on a
hit), so it serves the tuned config for the tensor's GPU and size bucket. Being custom ops, they
trace under `torch.compile(fullgraph=True)` and record into CUDA graphs. `config` (a dict) pins
a kernel config instead.
"""

from __future__ import annotations

import torch

from tkjit.torch_ops import encode_config  # importing tkjit.torch_ops registers torch.ops.tkjit.*

_ops = torch.ops.tkjit
_sinkhorn_fwd = _ops.sinkhorn_fwd.default
_sinkhorn_bwd = _ops.sinkhorn_bwd.default
_topk_gate = _ops.topk_gate.default
_per_token_cast = _ops.per_token_cast.default
_per_token_cast_colmajor = _ops.per_token_cast_colmajor.default
_transpose = _ops.transpose.default


def sinkhorn_fwd(x: torch.Tensor, repeat: int = 10, eps: float = 1e-6, *, config=None) -> torch.Tensor:
    """(num_tokens, n, n) float32 -> Sinkhorn-normalised, TileKernels semantics. Differentiable
    (the gradient runs sinkhorn_bwd); `sinkhorn` takes any (..., n, n)."""
    return _sinkhorn_fwd(x, repeat, eps, encode_config(config))


def sinkhorn_bwd(grad_out: torch.Tensor, x: torch.Tensor, repeat: int = 10, eps: float = 1e-6, *,
                 config=None) -> torch.Tensor:
    """dL/dx of sinkhorn_fwd(x, repeat, eps) given dL/dy, both (num_tokens, n, n) float32."""
    return _sinkhorn_bwd(grad_out, x, repeat, eps, encode_config(config))


def sinkhorn(x: torch.Tensor, repeat: int = 10, eps: float = 1e-6) -> torch.Tensor:
    """Differentiable Sinkhorn (forward and backward kernels) over (..., n, n) float32."""
    from tkjit.autograd import sinkhorn as _sinkhorn

    return _sinkhorn(x, repeat, eps)


def topk_gate(scores: torch.Tensor, k: int, *, config=None) -> torch.Tensor:
    """(num_tokens, num_experts) float32 -> int64 (num_tokens, k) indices, best first, ties to lower index."""
    return _topk_gate(scores, k, encode_config(config))


def per_token_cast(
    x: torch.Tensor, group: int = 128, *, round_scale: bool = False, col_major_scales: bool = False, config=None
):
    """(num_tokens, hidden) bf16/f32 -> (fp8 e4m3 values, float32 scales per `group` channels).

    scales is (num_tokens, hidden // group) either way. col_major_scales: it is the strided view
    storage[:, :num_tokens].T of a TMA-aligned column-major (hidden // group, align(num_tokens, 4))
    buffer (strides (1, align(num_tokens, 4)); padding holds 0), the layout DeepGEMM consumes and
    TileKernels' `use_tma_aligned_col_major_sf` returns.
    """
    if not col_major_scales:
        return _per_token_cast(x, group, round_scale, encode_config(config))
    q, storage = _per_token_cast_colmajor(x, group, round_scale, encode_config(config))
    return q, storage[:, : x.shape[0]].T


def transpose(x: torch.Tensor, *, config=None) -> torch.Tensor:
    """(rows, cols) -> (cols, rows), or (batch, rows, cols) -> (batch, cols, rows), bit-exact."""
    return _transpose(x, encode_config(config))
