"""TileKernels' `modeling.engram`: the fused Engram gate. tkjit serves its weight fusion
(`engram.fused_weight`) and forward kernel (`engram.engram_gate_fwd`) but not the backward kernels
(`engram_gate_bwd`, `grad_w_reduce`) yet: applying `EngramGateFn` (or `engram_gate`) raises
NotImplementedError naming it."""

from __future__ import annotations

import torch

from tkjit.compat.tile_kernels._support import missing

FAMILY = "engram"
__all__ = ["EngramGateFn", "engram_gate"]


class EngramGateFn(torch.autograd.Function):
    """TileKernels' fused Engram gate with RMSNorm (output = hidden_states + gate * v); not served yet."""

    @staticmethod
    def forward(ctx, hidden_states, k, v, weight_hidden, weight_embed, clamp_value, eps):
        raise missing("modeling.engram.EngramGateFn", FAMILY)

    @staticmethod
    def backward(ctx, grad_output):
        raise missing("modeling.engram.EngramGateFn", FAMILY)


engram_gate = EngramGateFn.apply
