"""TileKernels' `modeling.mhc`: the mHC layer functions, composed of `modeling.mhc.ops` as TileKernels composes
them: `expand_from_embedding` (`ops.expand_to_mhc`), `mhc_pre` (pre_norm_fn, pre_split_mixes,
sinkhorn_normalize, pre_apply_mix; mhc_pre_big_fuse without gradients) and `mhc_head` (pre_norm_fn,
head_compute_mix, pre_apply_mix).

With gradients disabled `mhc_pre` calls the fused `ops.mhc_pre_big_fuse` instead, as TileKernels' does, with
its arguments: the fused call takes no norm weight and reads mhc_mult off the residual, so in that mode
`norm_weight` and `mhc_mult` are ignored, here as in TileKernels. (Its outputs equal the unfused ops' up to
the Sinkhorn kernels' settings: within rtol 1e-5.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    """The lm-head input (..., hidden) from the residual (..., mhc_mult, hidden): fn (mhc_mult, mhc_mult *
    hidden), padded with zero rows to pre_norm_fn's mhc_mult * (mhc_mult + 2), its first mhc_mult mixes through
    head_compute_mix (scale (1,) or a scalar, base (mhc_mult,)), then pre_apply_mix."""
    rows = mhc_mult * (2 + mhc_mult)
    if fn.shape[0] < rows:
        fn = F.pad(fn, (0, 0, 0, rows - fn.shape[0]))
    mixes = ops.mhc_pre_norm_fn(residual, fn, norm_weight, norm_eps, n_splits=n_splits)[..., :mhc_mult]
    if scale.numel() == 1:
        scale = scale.reshape(1)
    mix = ops.mhc_head_compute_mix(mixes, scale, base, pre_eps)
    return ops.mhc_pre_apply_mix(residual, mix.unsqueeze(-1))


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
    """One sublayer's mHC pre-processing: (layer_input (..., hidden), (post_mix (..., mhc_mult, 1), comb_mix
    (..., mhc_mult, mhc_mult))) for `mhc_post`. fn (mhc_mult * (mhc_mult + 2), mhc_mult * hidden), scale (3,),
    base (mhc_mult * (mhc_mult + 2),); comb_mix Sinkhorn-normalised (sinkhorn_repeat, sinkhorn_eps)."""
    if not torch.is_grad_enabled():  # TileKernels' fused inference path (see the module docstring)
        post_mix, comb_mix, layer_input = ops.mhc_pre_big_fuse(
            residual, fn, scale, base, rms_eps=norm_eps, mhc_pre_eps=pre_eps, mhc_sinkhorn_eps=sinkhorn_eps,
            mhc_post_mult_value=post_mult_value, sinkhorn_repeat=sinkhorn_repeat, n_splits=n_splits)
        return layer_input, (post_mix, comb_mix)
    mixes = ops.mhc_pre_norm_fn(residual, fn, norm_weight, norm_eps, n_splits=n_splits)
    pre_mix, post_mix, comb_mix = ops.mhc_pre_split_mixes(mixes, scale, base, mhc_mult, post_mult_value, pre_eps)
    comb_mix = ops.sinkhorn_normalize(comb_mix, repeat=sinkhorn_repeat, eps=sinkhorn_eps)
    return ops.mhc_pre_apply_mix(residual, pre_mix), (post_mix, comb_mix)


