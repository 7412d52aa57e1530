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


# -- expand_to_mhc / pre_apply_mix ---------------------------------------------------------------------
# The eager pairs, as SinkhornFunction: the ops' implementations called directly (torch.compile and
# FakeTensors take the custom ops, whose autograd tkjit/torch_ops.py registers). Shapes here are the
# kernels' flat ones; tkjit.ops reshapes TileKernels' (..., mhc_mult, hidden) tensors to them.


class _MhcOnce(torch.autograd.Function):
    """Identity on a gradient, made to depend on what it depends on (the upstream gradient, the saved
    inputs), whose own backward (a double backward) raises naming the op."""

    @staticmethod
    def forward(ctx, op, grad, *deps):
        ctx.op = op
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(torch_ops._mhc_differentiable_once(ctx.op))


def _once(op: str, grad, *deps):
    # create_graph=True: the gradient's own backward must say why it fails, not silently give zeros
    if grad is None or not torch.is_grad_enabled():
        return grad
    return _MhcOnce.apply(op, grad, *deps)


class ExpandToMhcFunction(torch.autograd.Function):
    """Eager expand_to_mhc / expand_to_mhc_bwd: x (num_tokens, hidden) bf16 -> (num_tokens, mhc_mult, hidden),
    into `out` when given (as TileKernels' ExpandToMHCFn)."""

    @staticmethod
    def forward(ctx, x, mhc_mult, out, config, bwd_config):
        ctx.bwd_config = bwd_config
        return torch_ops.expand_to_mhc_impl(x, mhc_mult, config, out=out)

    @staticmethod
    def backward(ctx, grad):
        with torch.no_grad():
            grad_x = torch_ops.expand_to_mhc_bwd_impl(grad.to(torch.bfloat16).contiguous(), ctx.bwd_config)
        return _once("expand_to_mhc", grad_x, grad), None, None, None, None


class PreApplyMixFunction(torch.autograd.Function):
    """Eager pre_apply_mix and its backward: x (num_tokens, mhc_mult, hidden) bf16, mix (num_tokens, mhc_mult)
    float32 -> (num_tokens, hidden) bf16, into `out` when given. The backward follows TileKernels'
    MHCPreApplyMix: when mhc_post's backward left the residual gradient on x's storage
    (`x.untyped_storage().grad_from_mhc_post`), x's gradient is added into it in place and x gets None;
    otherwise x gets a fresh gradient."""

    @staticmethod
    def forward(ctx, x, mix, out, config, bwd_config):
        ctx.save_for_backward(x, mix)
        ctx.bwd_config = bwd_config
        return torch_ops.pre_apply_mix_impl(x, mix, config, out=out)

    @staticmethod
    def backward(ctx, grad):
        x, mix = ctx.saved_tensors
        upstream, grad = grad, grad.to(torch.bfloat16).contiguous()
        acc = residual_grad(x)
        with torch.no_grad():
            if acc is not None:
                mix_grad = torch_ops.pre_apply_mix_bwd_acc_impl(grad, x, mix, acc, ctx.bwd_config)
                x_grad = None
            else:
                x_grad, mix_grad = torch_ops.pre_apply_mix_bwd_impl(grad, x, mix, ctx.bwd_config)
        deps = (upstream, x, mix)
        return (_once("mhc_pre_apply_mix", x_grad, *deps), _once("mhc_pre_apply_mix", mix_grad, *deps),
                None, None, None)


def residual_grad(x: torch.Tensor) -> torch.Tensor | None:
    """The residual gradient TileKernels' mhc_post backward leaves on x's storage (`grad_from_mhc_post`),
    viewed as x (num_tokens, mhc_mult, hidden) bf16, or None when there is none."""
    acc = getattr(x.untyped_storage(), "grad_from_mhc_post", None)
    if acc is None:
        return None
    if not isinstance(acc, torch.Tensor) or acc.dtype != torch.bfloat16 or acc.numel() != x.numel() \
            or not acc.is_contiguous() or acc.device != x.device:
        raise TensorError(
            f"mhc_pre_apply_mix: x.untyped_storage().grad_from_mhc_post must be a contiguous bfloat16 tensor of "
            f"x's {x.numel()} elements on {x.device}, got {getattr(acc, 'dtype', type(acc).__name__)} "
            f"{tuple(getattr(acc, 'shape', ()))}"
        )
    return acc.view(x.shape)
