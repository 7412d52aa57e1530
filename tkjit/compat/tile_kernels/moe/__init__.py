"""TileKernels' `moe`: MoE routing kernels. tkjit serves `topk_gate`; the others raise
NotImplementedError naming them."""

from __future__ import annotations

import torch

from tkjit import ops
from tkjit.compat.tile_kernels._support import as_int, missing, require_kernel, rows_aligned, tensor
from tkjit.compat.tile_kernels.quant.types import QuantTensor
from tkjit.errors import ShapeError

FAMILY = "moe"
__all__ = [
    "get_fused_mapping", "reduce_fused", "expand_to_fused", "expand_to_fused_with_sf", "inplace_unique_group_indices",
    "aux_fi", "group_count", "mask_indices_by_tp", "normalize_weight", "top2_sum_gate", "topk_gate",
    "topk_sum_and_topk_group_idx",
]


def topk_gate(scores: torch.Tensor, num_topk: int) -> torch.Tensor:
    """The num_topk highest-scoring experts of each token, best first, ties to the smaller index.

    scores (num_tokens, num_experts) float32 -> (num_tokens, num_topk) int64, contiguous, on scores'
    device; bit-identical to TileKernels (and to a stable descending sort). NaN scores are not supported.
    """
    fn = "moe.topk_gate"
    tensor(fn, "scores", scores, (2,), (torch.float32,))
    num_tokens, num_experts = scores.shape
    k = as_int(fn, "num_topk", num_topk)
    if not 1 <= k <= num_experts:
        raise ShapeError(f"tile_kernels.{fn}: num_topk ({k}) must be in [1, num_experts ({num_experts})]")
    if num_tokens == 0:  # as TileKernels: nothing to launch, any expert count
        return torch.empty((0, k), dtype=torch.int64, device=scores.device)
    require_kernel(fn, FAMILY, "topk_gate", {"num_experts": num_experts, "k": k},
                   {"num_experts": "num_experts (scores.shape[1])", "k": "num_topk", "num_tokens": "num_tokens"},
                   {"num_tokens": num_tokens})
    return ops.topk_gate(rows_aligned(scores), k)


def get_fused_mapping(
    topk_idx: torch.Tensor,
    num_experts: int,
    num_expanded_tokens: int,
    alignment: int,
    force_no_sync: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    raise missing("moe.get_fused_mapping", FAMILY)


def reduce_fused(
    x: torch.Tensor | QuantTensor,
    topk_weights: torch.Tensor | None,
    token_topk_to_pos: torch.Tensor,
    fp8_format: str = '',
    sf: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    raise missing("moe.reduce_fused", FAMILY)


def expand_to_fused(x: torch.Tensor, token_topk_to_pos: torch.Tensor, pos_to_expert: torch.Tensor) -> torch.Tensor:
    raise missing("moe.expand_to_fused", FAMILY)


def expand_to_fused_with_sf(
    x: QuantTensor,
    num_per_channels: int,
    token_topk_to_pos: torch.Tensor,
    pos_to_expert: torch.Tensor,
    use_tma_aligned_col_major_sf: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    raise missing("moe.expand_to_fused_with_sf", FAMILY)


def inplace_unique_group_indices(group_indices: torch.Tensor, num_groups: int) -> None:
    raise missing("moe.inplace_unique_group_indices", FAMILY)


def aux_fi(topk_idx: torch.Tensor, num_experts: int, num_aux_topk: int) -> torch.Tensor:
    raise missing("moe.aux_fi", FAMILY)


def group_count(group_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    raise missing("moe.group_count", FAMILY)


def mask_indices_by_tp(
    indices: torch.Tensor,
    n: int,
    num_ep_ranks: int,
    tp_rank: int,
    num_tp_ranks: int,
) -> torch.Tensor:
    raise missing("moe.mask_indices_by_tp", FAMILY)


def normalize_weight(topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    raise missing("moe.normalize_weight", FAMILY)


def top2_sum_gate(
    logits: torch.Tensor,
    bias: torch.Tensor,
    num_topk: int,
    num_topk_groups: int,
    num_groups: int,
    use_shared_as_routed: bool,
    num_shared_experts: int,
    routed_scaling_factor: float,
    ep_rank: int,
    num_ep_ranks: int,
    tp_rank: int,
    num_tp_ranks: int,
    scoring_func: str,
    mask: torch.Tensor | None = None,
    fix_routing_mask: torch.Tensor | None = None,
    to_physical_map: torch.Tensor | None = None,
    logical_count: torch.Tensor | None = None,
    unmapped_topk_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    raise missing("moe.top2_sum_gate", FAMILY)


def topk_sum_and_topk_group_idx(scores: torch.Tensor, num_topk_sum: int, num_topk_groups: int) -> torch.Tensor:
    raise missing("moe.topk_sum_and_topk_group_idx", FAMILY)
