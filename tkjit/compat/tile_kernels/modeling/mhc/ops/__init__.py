"""TileKernels' `modeling.mhc.ops`: the mHC ops. tkjit serves `sinkhorn_normalize` (its sinkhorn_fwd /
sinkhorn_bwd kernels), `expand_to_mhc` (expand_to_mhc / expand_to_mhc_bwd) and `mhc_pre_apply_mix`
(pre_apply_mix / pre_apply_mix_bwd[_acc]); the others raise NotImplementedError naming them."""

from __future__ import annotations

import torch

from tkjit import ops
from tkjit.compat.tile_kernels._support import as_float, as_int, missing, require_kernel
from tkjit.errors import TensorError

FAMILY = "mhc"
__all__ = [
    "expand_to_mhc", "mhc_head_compute_mix", "mhc_multilayer_recompute", "mhc_pre_norm_fn", "mhc_post",
    "mhc_post_bwd", "mhc_post_fwd", "mhc_pre_apply_mix", "mhc_pre_big_fuse", "mhc_pre_split_mixes",
    "sinkhorn_normalize",
]


def sinkhorn_normalize(x: torch.Tensor, repeat: int = 10, eps: float = 1e-6) -> torch.Tensor:
    """Sinkhorn-Knopp normalisation of each n x n matrix of x (..., n, n) float32, differentiable.

    y = softmax(x, -1) + eps; y /= colsum(y) + eps; then (repeat - 1) times: rowsum, colsum. Returns a
    new contiguous tensor of x's shape (TileKernels: `x.contiguous().view(-1, n, n)`, normalised,
    `.view_as(x)`); its gradient runs tkjit's sinkhorn_bwd kernel. Not bit-identical to TileKernels'
    kernel (another order of float operations): within the rtol 1e-5 both keep to the torch reference.
    tkjit's fastest configs use fast-math exp and reciprocal-multiplies, which move the last bits;
    TKJIT_EXACT_MATH=1 (set before the first call) serves the same configs with IEEE exp and divisions.
    """
    fn = "modeling.mhc.ops.sinkhorn_normalize"
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-1] != x.shape[-2]:
        raise TensorError(f"tile_kernels.{fn}: x must be a (..., n, n) tensor, got {getattr(x, 'shape', type(x))}")
    if x.dtype != torch.float32:
        raise TensorError(f"tile_kernels.{fn}: x must be torch.float32, got {x.dtype}")
    repeat, eps = as_int(fn, "repeat", repeat), as_float(fn, "eps", eps)
    require_kernel(fn, FAMILY, "sinkhorn_fwd", {"n": x.shape[-1], "repeat": repeat, "eps": eps},
                   {"n": "n (x.shape[-1])", "num_tokens": "num_tokens (x.numel() / n**2)"},
                   {"num_tokens": max(1, x.numel() // max(1, x.shape[-1] ** 2))})
    return ops.sinkhorn(x, repeat, eps)


def expand_to_mhc(hidden: torch.Tensor, mhc_mult: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """hidden (..., hidden) bfloat16, contiguous -> (..., mhc_mult, hidden) bfloat16: each row copied to its
    mhc_mult residual streams, bit-exact; written into `out` (that shape, contiguous) when given.
    Differentiable: hidden's gradient is the streams' gradients summed in float32 in stream order from +0.0 and
    rounded once to bfloat16, bit-identical to TileKernels' backward kernel."""
    fn = "modeling.mhc.ops.expand_to_mhc"
    mhc_mult = as_int(fn, "mhc_mult", mhc_mult)
    ops.check_expand_to_mhc(f"tile_kernels.{fn}", hidden, mhc_mult, out)
    h = hidden.shape[-1]
    require_kernel(fn, FAMILY, "expand_to_mhc", {"mhc_mult": mhc_mult, "hidden": h},
                   {"hidden": "hidden (hidden.shape[-1])"}, {"num_tokens": max(1, hidden.numel() // max(1, h))})
    return ops.expand_to_mhc(hidden, mhc_mult, out)


def mhc_head_compute_mix(
    input_mix: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    mhc_pre_eps: float,
) -> torch.Tensor:
    raise missing("modeling.mhc.ops.mhc_head_compute_mix", FAMILY)


def mhc_multilayer_recompute(
    initial_residual: torch.Tensor,
    pre_mix_list: list[torch.Tensor],
    layer_output_list: list[torch.Tensor],
    post_mix_list: list[torch.Tensor],
    comb_mix_list: list[torch.Tensor],
    layer_input_list: list[torch.Tensor],
    residual_list: list[torch.Tensor],
) -> None:
    raise missing("modeling.mhc.ops.mhc_multilayer_recompute", FAMILY)


def mhc_pre_norm_fn(
    residual: torch.Tensor,
    mhc_fn: torch.Tensor,
    mhc_norm_weight: torch.Tensor | None,
    mhc_norm_eps: float,
    fuse_grad_acc: bool = True,
    n_splits: int = 16,
) -> torch.Tensor:
    raise missing("modeling.mhc.ops.mhc_pre_norm_fn", FAMILY)


def mhc_post(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_layer_mix: torch.Tensor,
    comb_res_mix: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    raise missing("modeling.mhc.ops.mhc_post", FAMILY)


def mhc_post_bwd(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_layer_mix: torch.Tensor,
    comb_res_mix: torch.Tensor,
    d_o: torch.Tensor,
    fuse_grad_acc: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    raise missing("modeling.mhc.ops.mhc_post_bwd", FAMILY)


def mhc_post_fwd(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_layer_mix: torch.Tensor,
    comb_res_mix: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    raise missing("modeling.mhc.ops.mhc_post_fwd", FAMILY)


def mhc_pre_apply_mix(x: torch.Tensor, mix: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., mhc_mult, hidden) bfloat16 (contiguous), mix (..., mhc_mult, 1) float32 -> (..., hidden) bfloat16,
    sum_m mix * x: float32 fused multiply-adds in stream order from +0.0, rounded once (bit-identical to
    TileKernels' kernel); written into `out` when given. Differentiable, with TileKernels' backward: x's
    gradient bf16(fma(mix, grad, base)) is added in place into mhc_post's residual gradient when x's storage
    carries one (`x.untyped_storage().grad_from_mhc_post`; x then gets None), else into zeros; mix's gradient
    <grad, x> is a float32 sum over hidden (its order, and so its last bits, are tkjit's own)."""
    fn = "modeling.mhc.ops.mhc_pre_apply_mix"
    ops.check_pre_apply_mix(f"tile_kernels.{fn}", x, mix, out)
    m, h = x.shape[-2:]
    require_kernel(fn, FAMILY, "pre_apply_mix", {"mhc_mult": m, "hidden": h},
                   {"mhc_mult": "mhc_mult (x.shape[-2])", "hidden": "hidden (x.shape[-1])"},
                   {"num_tokens": max(1, x.numel() // max(1, m * h))})
    return ops.mhc_pre_apply_mix(x, mix, out)


def mhc_pre_big_fuse(
    residual: torch.Tensor,
    fn: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    rms_eps: float,
    mhc_pre_eps: float,
    mhc_sinkhorn_eps: float,
    mhc_post_mult_value: float,
    sinkhorn_repeat: int,
    n_splits: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    raise missing("modeling.mhc.ops.mhc_pre_big_fuse", FAMILY)


def mhc_pre_split_mixes(
    input_mixes: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    mhc_mult: int,
    mhc_post_mult_value: float,
    mhc_pre_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    raise missing("modeling.mhc.ops.mhc_pre_split_mixes", FAMILY)
