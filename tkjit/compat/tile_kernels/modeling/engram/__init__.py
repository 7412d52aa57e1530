"""TileKernels' `modeling.engram`: the fused Engram gate, `EngramGateFn` / `engram_gate`, served by tkjit's
fused_weight, engram_gate_fwd, engram_gate_bwd and grad_w_reduce kernels through the `engram` compat
entry points (TileKernels' argument checks, its get_num_sms() partial rows)."""

from __future__ import annotations

import torch

from tkjit.compat.tile_kernels import engram as _engram

FAMILY = "engram"
__all__ = ["EngramGateFn", "engram_gate"]


class EngramGateFn(torch.autograd.Function):
    """Fused Engram gate with RMSNorm (TileKernels' EngramGateFn):

        gate   = sigmoid(signed_sqrt(dot(RMSNorm(x, wh), RMSNorm(k, we)) / sqrt(hidden_size)))
        output = hidden_states + gate * v

    hidden_states, k [*, hc_mult, hidden_size], v [*, hidden_size], weight_hidden, weight_embed
    [hc_mult, hidden_size], all bfloat16 -> output like hidden_states. The backward accumulates a weight's
    gradient into its `main_grad` (float32) in place and returns None for it when it has one; otherwise
    it returns the float32 gradient (autograd casts it to the weight's dtype).
    """

    @staticmethod
    def forward(ctx, hidden_states, k, v, weight_hidden, weight_embed, clamp_value, eps):
        origin_shape = hidden_states.shape
        *_, hc_mult, hidden_size = origin_shape
        x = hidden_states.reshape(-1, hc_mult, hidden_size)
        k = k.reshape(-1, hc_mult, hidden_size)
        v = v.reshape(-1, hidden_size)
        weight_fused = _engram.fused_weight(weight_hidden, weight_embed)
        output, dot, gate_score, rstd_x, rstd_k = _engram.engram_gate_fwd(x, k, v, weight_fused, eps, clamp_value)
        ctx.save_for_backward(x, k, v, weight_hidden, weight_embed, weight_fused, dot, gate_score, rstd_x, rstd_k)
        ctx.clamp_value = clamp_value
        ctx.origin_shape = origin_shape
        return output.view(origin_shape)

    @staticmethod
    def backward(ctx, grad_output):
        x, k, v, weight_hidden, weight_embed, weight_fused, dot, gate_score, rstd_x, rstd_k = ctx.saved_tensors
        origin_shape = ctx.origin_shape
        *_, hc_mult, hidden_size = origin_shape
        grad_out = grad_output.to(torch.bfloat16).reshape(-1, hc_mult, hidden_size)
        grad_x, grad_k, grad_v, grad_w_partial = _engram.engram_gate_bwd(
            grad_out, x, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k, ctx.clamp_value)
        main_grad_wh = getattr(weight_hidden, "main_grad", None)
        main_grad_we = getattr(weight_embed, "main_grad", None)
        grad_wh = main_grad_wh if main_grad_wh is not None else torch.zeros_like(weight_hidden, dtype=torch.float32)
        grad_we = main_grad_we if main_grad_we is not None else torch.zeros_like(weight_embed, dtype=torch.float32)
        _engram.grad_w_reduce(grad_w_partial, weight_hidden, weight_embed, grad_wh, grad_we)
        v_origin_shape = tuple(origin_shape[:-2]) + (hidden_size,)
        return (
            grad_x.view(origin_shape),
            grad_k.view(origin_shape),
            grad_v.view(v_origin_shape),
            None if main_grad_wh is not None else grad_wh,
            None if main_grad_we is not None else grad_we,
            None,
            None,
        )


engram_gate = EngramGateFn.apply
