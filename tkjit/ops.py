"""Convenience forms that infer the shape from tensors: `tkjit.ops.sinkhorn_fwd(x)` etc.

Each function is its torch custom op (`torch.ops.tkjit.*`, registered by importing this module;
see tkjit/torch_ops.py), whose implementation goes through `tkjit.get` (memoised: ~1-2 us on a
hit), so it serves the tuned config for the tensor's GPU and size bucket. Under torch.compile,
with FakeTensor/meta inputs or when a gradient is wanted, the call goes through the custom op
(traced with no graph break, autograd registered); in plain eager calls the op's implementation
runs directly, without the dispatcher's host cost. Both record into CUDA graphs. `config` (a dict) pins
a kernel config instead.
"""

from __future__ import annotations

import torch

from tkjit import torch_ops  # importing it registers torch.ops.tkjit.*
from tkjit.autograd import SinkhornFunction, plain
from tkjit.torch_ops import encode_config

_ops = torch.ops.tkjit
_sinkhorn_fwd = _ops.sinkhorn_fwd.default
_sinkhorn_bwd = _ops.sinkhorn_bwd.default
_topk_gate = _ops.topk_gate.default
_per_token_cast = _ops.per_token_cast.default
_per_token_cast_colmajor = _ops.per_token_cast_colmajor.default
_transpose = _ops.transpose.default
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


def _eager(*tensors: torch.Tensor) -> bool:
    """True when a call needs neither the dispatcher nor autograd: plain tensors, not traced, no
    gradient wanted. Then the op's implementation runs directly (the same code the custom op runs)
    and the dispatcher's host cost is saved; anything else (torch.compile, FakeTensor or meta
    tensors, subclasses, inputs that require grad) goes through `torch.ops.tkjit`."""
    if _is_compiling():
        return False
    for t in tensors:
        if type(t) is not torch.Tensor or t.is_meta or (t.requires_grad and _grad_enabled()):
            return False
    return True


def sinkhorn_fwd(x: torch.Tensor, repeat: int = 10, eps: float = 1e-6, *, config=None) -> torch.Tensor:
    """(num_tokens, n, n) float32 -> Sinkhorn-normalised, TileKernels semantics. Differentiable
    (the gradient runs sinkhorn_bwd); `sinkhorn` takes any (..., n, n)."""
    if _eager(x):
        return torch_ops.sinkhorn_fwd_impl(x, repeat, eps, encode_config(config))
    if plain(x):  # eager, with a gradient wanted: the autograd.Function, not the op's Python wrapper
        return SinkhornFunction.apply(x, repeat, eps, encode_config(config), None)
    return _sinkhorn_fwd(x, repeat, eps, encode_config(config))


def sinkhorn_bwd(grad_out: torch.Tensor, x: torch.Tensor, repeat: int = 10, eps: float = 1e-6, *,
                 config=None) -> torch.Tensor:
    """dL/dx of sinkhorn_fwd(x, repeat, eps) given dL/dy, both (num_tokens, n, n) float32."""
    if _eager(grad_out, x):
        return torch_ops.sinkhorn_bwd_impl(grad_out, x, repeat, eps, encode_config(config))
    return _sinkhorn_bwd(grad_out, x, repeat, eps, encode_config(config))


def sinkhorn(x: torch.Tensor, repeat: int = 10, eps: float = 1e-6) -> torch.Tensor:
    """Differentiable Sinkhorn (forward and backward kernels) over (..., n, n) float32."""
    from tkjit.autograd import sinkhorn as _sinkhorn

    return _sinkhorn(x, repeat, eps)


def topk_gate(scores: torch.Tensor, k: int, *, config=None) -> torch.Tensor:
    """(num_tokens, num_experts) float32 -> int64 (num_tokens, k) indices, best first, ties to lower index."""
    if _eager(scores):
        return torch_ops.topk_gate_impl(scores, k, encode_config(config))
    return _topk_gate(scores, k, encode_config(config))


def per_token_cast(
    x: torch.Tensor, group: int = 128, *, round_scale: bool = False, col_major_scales: bool = False, config=None
):
    """(num_tokens, hidden) bf16/f32 -> (fp8 e4m3 values, float32 scales per `group` channels).

    group is 16, 32, 64, 128 or hidden; hidden is a multiple of 16 but need not be one of group: a
    token has num_groups = ceil(hidden / group) scales, the last one over the partial last group's
    channels only (hidden 576, group 128: five scales, the fifth over channels 512..575).
    scales is (num_tokens, num_groups) either way. col_major_scales: it is the strided view
    storage[:, :num_tokens].T of a TMA-aligned column-major (num_groups, align(num_tokens, 4))
    buffer (strides (1, align(num_tokens, 4)); padding holds 0), the layout DeepGEMM consumes and
    TileKernels' `use_tma_aligned_col_major_sf` returns.
    """
    eager = _eager(x)
    if not col_major_scales:
        op = torch_ops.per_token_cast_impl if eager else _per_token_cast
        return op(x, group, round_scale, encode_config(config))
    op = torch_ops.per_token_cast_colmajor_impl if eager else _per_token_cast_colmajor
    q, storage = op(x, group, round_scale, encode_config(config))
    return q, storage[:, : x.shape[0]].T


def transpose(x: torch.Tensor, *, config=None) -> torch.Tensor:
    """(rows, cols) -> (cols, rows), or (batch, rows, cols) -> (batch, cols, rows), bit-exact."""
    if _eager(x):
        return torch_ops.transpose_impl(x, encode_config(config))
    return _transpose(x, encode_config(config))
