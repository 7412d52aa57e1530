"""TileKernels' `modeling.mhc`: the fused mHC layer functions. tkjit serves `expand_from_embedding`
(`ops.expand_to_mhc`); the others raise NotImplementedError naming them. Its Sinkhorn op is
`modeling.mhc.ops.sinkhorn_normalize`."""

from __future__ import annotations

import torch

from tkjit.compat.tile_kernels._support import missing
from tkjit.compat.tile_kernels.modeling.mhc import ops

FAMILY = "mhc"
__all__ = ["expand_from_embedding", "mhc_head", "mhc_pre", "ops"]


def expand_from_embedding(x: torch.Tensor, mhc_mult: int = 4) -> torch.Tensor:
    """The embedding (..., hidden) bf16 expanded to the mHC residual (..., mhc_mult, hidden): `ops.expand_to_mhc`."""
    return ops.expand_to_mhc(x, mhc_mult)


def mhc_head(
    residual: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-06,
    mhc_mult: int = 4,
    pre_eps: float = 1e-06,
    n_splits: int = 16,
) -> torch.Tensor:
    raise missing("modeling.mhc.mhc_head", FAMILY)


def mhc_pre(
    residual: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-06,
    mhc_mult: int = 4,
    post_mult_value: float = 1.0,
    pre_eps: float = 1e-06,
    sinkhorn_eps: float = 1e-06,
    sinkhorn_repeat: int = 10,
    n_splits: int = 16,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    raise missing("modeling.mhc.mhc_pre", FAMILY)


