"""TileKernels' `moe`: MoE routing kernels. tkjit serves `topk_gate`, `normalize_weight`,
`mask_indices_by_tp`, `inplace_unique_group_indices`, `group_count`, `aux_fi`,
`topk_sum_and_topk_group_idx`, `get_fused_mapping`, `expand_to_fused`, `expand_to_fused_with_sf`,
`reduce_fused`, `top2_sum_gate`;
the others raise
NotImplementedError naming them."""

from __future__ import annotations

import torch

from tkjit import ops, torch_ops
from tkjit.api import call_memo
from tkjit.compat.tile_kernels._support import as_int, missing, off_alignment, require_kernel, rows_aligned, tensor
from tkjit.compat.tile_kernels.quant.types import QuantTensor
from tkjit.errors import ShapeError, TensorError
from tkjit.torch_ops import tp_scalars

FAMILY = "moe"
_top2_calls = call_memo(64)  # top2_sum_gate without optional tensors: signature -> (kernel object, its scalars)
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
    """The expert-major ("fused") layout of the routing in topk_idx and the maps both ways.

    topk_idx (num_tokens, num_topk) int64, contiguous, -1 = no expert (entries outside [-1, num_experts)
    count as -1). Each expert's segment is align(count, alignment) rows, in expert order; its entries in
    increasing token * num_topk + slot, then -1 padding. num_expanded_tokens=0 and not force_no_sync:
    sized to the largest layout, one host sync, pos_* cut to sum(num_tokens_per_expert_list). A buffer
    smaller than the layout drops the positions past it (their token_topk_to_pos is -1; TileKernels
    writes out of bounds there); with TKJIT_CHECK_INDICES=1 it is a ShapeError.

    Identical to TileKernels in the layout (pos_to_expert, expert_start/end, num_tokens_per_expert, the
    list), in which entries each segment holds, and in which are dropped. The order inside a segment
    differs: TileKernels' follows its warps' chunks of the flat entries (reversed inside each chunk), so it
    depends on its SM count; tkjit's is the flat order whatever the config. expand_to_fused and
    reduce_fused give the same results with either.
    """
    fn = "moe.get_fused_mapping"
    tensor(fn, "topk_idx", topk_idx, (2,), (torch.int64,))
    if not topk_idx.is_contiguous():
        raise TensorError(f"tile_kernels.{fn}: topk_idx must be contiguous, got strides {topk_idx.stride()}")
    num_tokens, num_topk = topk_idx.shape
    e = as_int(fn, "num_experts", num_experts)
    n_exp = as_int(fn, "num_expanded_tokens", num_expanded_tokens)
    a = as_int(fn, "alignment", alignment)
    if e < 1 or a < 1 or n_exp < 0 or num_topk < 1:
        raise ShapeError(f"tile_kernels.{fn}: needs num_experts >= 1 (got {e}), alignment >= 1 (got {a}), "
                         f"num_expanded_tokens >= 0 (got {n_exp}) and num_topk >= 1 (got {num_topk})")
    if not isinstance(force_no_sync, bool):
        raise ShapeError(f"tile_kernels.{fn}: force_no_sync must be a bool, got {type(force_no_sync).__name__}")
    require_kernel(fn, FAMILY, "get_fused_mapping", {"num_experts": e, "num_topk": num_topk, "alignment": a},
                   {"num_experts": "num_experts", "num_topk": "num_topk (topk_idx.shape[1])",
                    "alignment": "alignment", "num_tokens": "num_tokens (topk_idx.shape[0])",
                    "num_expanded_tokens": "num_expanded_tokens"},
                   {"num_tokens": max(1, num_tokens), "num_expanded_tokens": max(1, n_exp)})
    return ops.get_fused_mapping(topk_idx, e, n_exp, a, force_no_sync)


def reduce_fused(
    x: torch.Tensor | QuantTensor,
    topk_weights: torch.Tensor | None,
    token_topk_to_pos: torch.Tensor,
    fp8_format: str = '',
    sf: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each token's rows of the fused layout summed back: out[t] = sum over valid k, in order, of
    fma(float(x[pos]), topk_weights[t, k] (or 1) * x_sf[pos] (when x is a QuantTensor), acc), times
    sf[0] when given, cast to x's dtype or e4m3 (fp8_format='e4m3', saturating). Bit-identical to
    TileKernels. x (num_expanded_tokens, hidden) bfloat16/float16/float32/float8_e4m3fn (an e4m3 x gives an
    e4m3 output, saturating, with or without fp8_format), hidden a multiple of 256."""
    fn = "moe.reduce_fused"
    x_sf = None
    if isinstance(x, tuple):
        if len(x) != 2:
            raise TensorError(f"tile_kernels.{fn}: x as a QuantTensor must be a (data, sf) pair, got {len(x)} items")
        x, x_sf = x
    tensor(fn, "x", x, (2,))
    tensor(fn, "token_topk_to_pos", token_topk_to_pos, (2,), (torch.int32,))
    num_expanded_tokens, hidden = x.shape
    num_tokens, num_topk = token_topk_to_pos.shape
    if hidden % 256:
        raise ShapeError(f"tile_kernels.{fn}: hidden (x.shape[1] = {hidden}) must be a multiple of 256")
    if fp8_format not in ("", "e4m3"):
        raise ShapeError(f"tile_kernels.{fn}: fp8_format must be '' or 'e4m3', got {fp8_format!r}")
    if fp8_format == "" and sf is not None:
        raise ShapeError(f"tile_kernels.{fn}: sf is only taken with an FP8 output (fp8_format='e4m3')")
    if topk_weights is not None:
        tensor(fn, "topk_weights", topk_weights, (2,), (torch.float32,))
        if tuple(topk_weights.shape) != (num_tokens, num_topk):
            raise TensorError(f"tile_kernels.{fn}: topk_weights has shape {tuple(topk_weights.shape)}, expected "
                              f"{(num_tokens, num_topk)} (token_topk_to_pos's)")
    if sf is not None:
        tensor(fn, "sf", sf, (1,), (torch.float32,))
    if x_sf is not None:
        tensor(fn, "x's sf", x_sf, (1,), (torch.float32,))
        if x_sf.shape[0] != num_expanded_tokens:
            raise TensorError(f"tile_kernels.{fn}: x's sf has {x_sf.shape[0]} rows, x has {num_expanded_tokens}")
    out_dtype = torch.float8_e4m3fn if fp8_format == "e4m3" else x.dtype
    if out is not None:
        tensor(fn, "out", out, (2,), (out_dtype,))
        if tuple(out.shape) != (num_tokens, hidden):
            raise TensorError(f"tile_kernels.{fn}: out has shape {tuple(out.shape)}, expected {(num_tokens, hidden)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn):
        raise missing(fn, FAMILY, f"x of dtype {x.dtype} (tkjit reduces bfloat16, float16, float32 and float8_e4m3fn)")
    if num_tokens == 0:
        return out if out is not None else torch.empty((0, hidden), dtype=out_dtype, device=x.device)
    require_kernel(fn, FAMILY, "reduce_fused", {"hidden": hidden, "num_topk": num_topk},
                   {"hidden": "hidden (x.shape[1])", "num_topk": "num_topk (token_topk_to_pos.shape[1])",
                    "num_tokens": "num_tokens", "num_expanded_tokens": "num_expanded_tokens (x.shape[0])"},
                   {"num_tokens": num_tokens, "num_expanded_tokens": max(1, num_expanded_tokens)})
    return ops.reduce_fused(x.contiguous(), topk_weights if topk_weights is None else topk_weights.contiguous(),
                            token_topk_to_pos.contiguous(), fp8_format, sf, x_sf if x_sf is None else x_sf.contiguous(),
                            out=out)


def expand_to_fused(x: torch.Tensor, token_topk_to_pos: torch.Tensor, pos_to_expert: torch.Tensor) -> torch.Tensor:
    """x (num_tokens, hidden) copied into the fused layout (num_expanded_tokens, hidden): row t to each
    position token_topk_to_pos[t, k] >= 0; padding rows (pos_to_expert < 0) zero. Bit-identical to
    TileKernels (any element type tkjit copies: bfloat16, float16, float32, float8 e4m3/e5m2)."""
    fn = "moe.expand_to_fused"
    tensor(fn, "x", x, (2,))
    tensor(fn, "token_topk_to_pos", token_topk_to_pos, (2,), (torch.int32,))
    tensor(fn, "pos_to_expert", pos_to_expert, (1,), (torch.int32,))
    if not x.is_contiguous() or not token_topk_to_pos.is_contiguous():
        raise TensorError(f"tile_kernels.{fn}: x and token_topk_to_pos must be contiguous")
    num_tokens, hidden = x.shape
    if token_topk_to_pos.shape[0] != num_tokens:
        raise TensorError(f"tile_kernels.{fn}: token_topk_to_pos has {token_topk_to_pos.shape[0]} rows, x has "
                          f"{num_tokens} tokens")
    num_expanded_tokens = pos_to_expert.shape[0]
    if num_tokens == 0:
        return torch.zeros((num_expanded_tokens, hidden), dtype=x.dtype, device=x.device)
    from tkjit.kernel import dtype_name

    require_kernel(fn, FAMILY, "expand_to_fused",
                   {"hidden": hidden, "num_topk": token_topk_to_pos.shape[1], "dtype": dtype_name(x.dtype)},
                   {"hidden": "hidden (x.shape[1])", "num_topk": "num_topk (token_topk_to_pos.shape[1])",
                    "dtype": "x.dtype", "num_tokens": "num_tokens",
                    "num_expanded_tokens": "num_expanded_tokens (pos_to_expert.shape[0])"},
                   {"num_tokens": num_tokens, "num_expanded_tokens": max(1, num_expanded_tokens)})
    return ops.expand_to_fused(x, token_topk_to_pos, pos_to_expert.contiguous())


def expand_to_fused_with_sf(
    x: QuantTensor,
    num_per_channels: int,
    token_topk_to_pos: torch.Tensor,
    pos_to_expert: torch.Tensor,
    use_tma_aligned_col_major_sf: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x = (data (num_tokens, hidden), sf (num_tokens, hidden_sf)) and its scales copied into the fused
    layout: (out (num_expanded_tokens, hidden), out_sf (num_expanded_tokens, hidden_sf)), row t's data and
    scales to each position token_topk_to_pos[t, k] >= 0; padding rows (pos_to_expert < 0) zero in both.
    Bit-identical to TileKernels. As there: sf is float32, or int32 (four packed UE8M0 exponents, only with
    use_tma_aligned_col_major_sf), row-major and contiguous, hidden_sf = ceil(hidden / num_per_channels)
    (then / 4 for int32, rounded up), num_per_channels 32 or 128. use_tma_aligned_col_major_sf: out_sf is
    the view [:, :num_expanded_tokens].T of a (hidden_sf, align(num_expanded_tokens, 4)) buffer (padding
    columns hold 0; TileKernels leaves them unwritten)."""
    fn = "moe.expand_to_fused_with_sf"
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise TensorError(f"tile_kernels.{fn}: x must be a QuantTensor (data, sf) pair, got {type(x).__name__}")
    data, sf = x
    tensor(fn, "x[0] (data)", data, (2,))
    tensor(fn, "x[1] (sf)", sf, (2,), (torch.float32, torch.int32))
    tensor(fn, "token_topk_to_pos", token_topk_to_pos, (2,), (torch.int32,))
    tensor(fn, "pos_to_expert", pos_to_expert, (1,), (torch.int32,))
    if not all(t.is_contiguous() for t in (data, sf, token_topk_to_pos, pos_to_expert)):
        raise TensorError(f"tile_kernels.{fn}: x (data and sf), token_topk_to_pos and pos_to_expert must be "
                          "contiguous (sf row-major, whatever use_tma_aligned_col_major_sf)")
    npc = as_int(fn, "num_per_channels", num_per_channels)
    if npc not in (32, 128):
        raise ShapeError(f"tile_kernels.{fn}: num_per_channels must be 32 or 128, got {npc}")
    col_major = bool(use_tma_aligned_col_major_sf)
    num_tokens, hidden = data.shape
    for name, t in (("token_topk_to_pos", token_topk_to_pos), ("x[1] (sf)", sf)):
        if t.shape[0] != num_tokens:
            raise TensorError(f"tile_kernels.{fn}: {name} has {t.shape[0]} rows, x[0] has {num_tokens} tokens")
    packed = sf.dtype == torch.int32
    if packed and not col_major:
        raise ShapeError(f"tile_kernels.{fn}: int32 (packed UE8M0) sf needs use_tma_aligned_col_major_sf=True")
    hidden_sf = -(-hidden // npc)
    hidden_sf = -(-hidden_sf // 4) if packed else hidden_sf
    if sf.shape[1] != hidden_sf:
        raise TensorError(f"tile_kernels.{fn}: x[1] (sf) has {sf.shape[1]} columns, expected {hidden_sf} "
                          f"(ceil(hidden={hidden} / num_per_channels={npc}){' / 4, packed' if packed else ''})")
    if num_tokens:
        from tkjit.kernel import dtype_name

        require_kernel(fn, FAMILY, "expand_to_fused_with_sf_colmajor" if col_major else "expand_to_fused_with_sf",
                       {"hidden": hidden, "num_topk": token_topk_to_pos.shape[1], "num_per_channels": npc,
                        "dtype": dtype_name(data.dtype), "sf_dtype": dtype_name(sf.dtype)},
                       {"hidden": "hidden (x[0].shape[1])", "num_topk": "num_topk (token_topk_to_pos.shape[1])",
                        "dtype": "x[0].dtype", "sf_dtype": "x[1].dtype", "num_tokens": "num_tokens",
                        "num_expanded_tokens": "num_expanded_tokens (pos_to_expert.shape[0])"},
                       {"num_tokens": num_tokens, "num_expanded_tokens": max(1, pos_to_expert.shape[0])})
    return ops.expand_to_fused_with_sf((data, sf), npc, token_topk_to_pos, pos_to_expert, col_major)


def inplace_unique_group_indices(group_indices: torch.Tensor, num_groups: int) -> None:
    """In place: in each row of group_indices (num_tokens, num_topk) int64, every repeat of a group id
    after its first occurrence becomes -1. Returns None, as TileKernels.

    num_groups <= 128 as TileKernels asserts (tkjit's kernel would take more; the compat layer keeps
    TileKernels' limit). Ids outside [0, num_groups) are left as they are (TileKernels' kernel leaves
    negative ones and asserts on larger ones); no memory is touched by them.
    """
    fn = "moe.inplace_unique_group_indices"
    tensor(fn, "group_indices", group_indices, (2,), (torch.int64,))
    groups = as_int(fn, "num_groups", num_groups)
    if not 1 <= groups <= 128:
        raise ShapeError(f"tile_kernels.{fn}: num_groups ({groups}) must be in [1, 128]")
    num_tokens, num_topk = group_indices.shape
    if num_tokens == 0:  # as TileKernels: nothing to launch
        return None
    if not group_indices.is_contiguous():
        raise TensorError(f"tile_kernels.{fn}: group_indices must be contiguous (it is updated in place)")
    require_kernel(fn, FAMILY, "inplace_unique_group_indices", {"num_topk": num_topk, "num_groups": groups},
                   {"num_topk": "num_topk (group_indices.shape[1])", "num_groups": "num_groups",
                    "num_tokens": "num_tokens"}, {"num_tokens": num_tokens})
    if off_alignment(group_indices, 16):  # a view the kernel's 16-byte accesses cannot take in place
        work = group_indices.clone()
        ops.inplace_unique_group_indices(work, groups)
        group_indices.copy_(work)
        return None
    ops.inplace_unique_group_indices(group_indices, groups)
    return None


def _index_rows(fn: str, name: str, idx: torch.Tensor, ids: int, ids_name: str) -> None:
    """TileKernels' asserts on an (num_tokens, num_topk) int64 index tensor, and the id count's range."""
    tensor(fn, name, idx, (2,), (torch.int64,))
    if not idx.is_contiguous():
        raise TensorError(f"tile_kernels.{fn}: {name} must be contiguous, got strides {tuple(idx.stride())}")
    if ids < 1:
        raise ShapeError(f"tile_kernels.{fn}: {ids_name} ({ids}) must be >= 1")


def aux_fi(topk_idx: torch.Tensor, num_experts: int, num_aux_topk: int) -> torch.Tensor:
    """Per-expert f_i = count * num_experts / (num_tokens * num_aux_topk) for the auxiliary loss.

    topk_idx (num_tokens, num_topk) int64 -> (num_experts,) float32 on its device; entries < 0 are padding
    (skipped), as are entries >= num_experts. Bit-identical to TileKernels' torch reference evaluated on the
    CPU (counts summed as integers, one IEEE division per expert); 0 tokens give zeros.
    """
    fn = "moe.aux_fi"
    e = as_int(fn, "num_experts", num_experts)
    k_aux = as_int(fn, "num_aux_topk", num_aux_topk)
    _index_rows(fn, "topk_idx", topk_idx, e, "num_experts")
    num_tokens, num_topk = topk_idx.shape
    require_kernel(fn, FAMILY, "aux_fi", {"num_topk": num_topk, "num_experts": e},
                   {"num_topk": "num_topk (topk_idx.shape[1])", "num_experts": "num_experts",
                    "num_tokens": "num_tokens"}, {"num_tokens": max(1, num_tokens)})
    return ops.aux_fi(topk_idx, e, k_aux)


def group_count(group_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """How many entries of group_idx (num_tokens, num_topk) int64 equal each group id.

    -> (num_groups,) int32 on group_idx's device; entries < 0 are padding (skipped), as are entries
    >= num_groups (never a write out of bounds). Exact; 0 tokens give zeros.
    """
    fn = "moe.group_count"
    g = as_int(fn, "num_groups", num_groups)
    _index_rows(fn, "group_idx", group_idx, g, "num_groups")
    num_tokens, num_topk = group_idx.shape
    require_kernel(fn, FAMILY, "group_count", {"num_topk": num_topk, "num_groups": g},
                   {"num_topk": "num_topk (group_idx.shape[1])", "num_groups": "num_groups",
                    "num_tokens": "num_tokens"}, {"num_tokens": max(1, num_tokens)})
    return ops.group_count(group_idx, g)


def mask_indices_by_tp(
    indices: torch.Tensor,
    n: int,
    num_ep_ranks: int,
    tp_rank: int,
    num_tp_ranks: int,
) -> torch.Tensor:
    """Expert indices (num_tokens, num_topk) int32/int64 -> same dtype and shape: -1 for negative indices
    and experts of other TP ranks, the local expert index otherwise (n // num_ep_ranks experts per GPU,
    GPU g on TP rank g % num_tp_ranks). One kernel binary serves every rank and expert count.

    TileKernels asserts nothing here; a size that would divide by zero or a tp_rank outside
    [0, num_tp_ranks) is a ShapeError naming it. n need not be a multiple of num_ep_ranks (TileKernels
    floors n // num_ep_ranks, and so does tkjit).
    """
    fn = "moe.mask_indices_by_tp"
    tensor(fn, "indices", indices, (2,), (torch.int32, torch.int64))
    vals = {name: as_int(fn, name, v) for name, v in
            (("n", n), ("num_ep_ranks", num_ep_ranks), ("tp_rank", tp_rank), ("num_tp_ranks", num_tp_ranks))}
    try:
        tp_scalars(fn, **vals)
    except ShapeError as e:
        raise ShapeError(f"tile_kernels.{e}") from None
    num_tokens, num_topk = indices.shape
    if num_tokens == 0:  # as TileKernels: nothing to launch
        return torch.empty_like(indices)
    require_kernel(fn, FAMILY, "mask_indices_by_tp",
                   {"num_topk": num_topk, "dtype": "int64" if indices.dtype == torch.int64 else "int32"},
                   {"num_topk": "num_topk (indices.shape[1])", "num_tokens": "num_tokens"}, {"num_tokens": num_tokens})
    return ops.mask_indices_by_tp(indices.contiguous(), vals["n"], vals["num_ep_ranks"], vals["tp_rank"],
                                  vals["num_tp_ranks"])


def normalize_weight(topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(denominator (num_tokens,), normalized (num_tokens, num_topk)), both float32, bit-identical to
    TileKernels: the row's weights added in order to 1e-20 in float32, then an IEEE division."""
    fn = "moe.normalize_weight"
    tensor(fn, "topk_weights", topk_weights, (2,), (torch.float32,))
    if not topk_weights.is_contiguous():  # TileKernels asserts it
        raise TensorError(f"tile_kernels.{fn}: topk_weights must be contiguous")
    num_tokens, num_topk = topk_weights.shape
    if num_tokens == 0:  # as TileKernels: nothing to launch
        return (torch.empty((0,), dtype=torch.float32, device=topk_weights.device),
                torch.empty((0, num_topk), dtype=torch.float32, device=topk_weights.device))
    require_kernel(fn, FAMILY, "normalize_weight", {"num_topk": num_topk},
                   {"num_topk": "num_topk (topk_weights.shape[1])", "num_tokens": "num_tokens"},
                   {"num_tokens": num_tokens})
    return ops.normalize_weight(rows_aligned(topk_weights))


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
    """DeepSeek-V3-style grouped routing: (topk_idx int64, topk_weights float32), both (num_tokens,
    num_topk + shared experts). Scores (sigmoid / sqrtsoftplus / softmax), bias-steered selection of the
    num_topk_groups groups with the largest top-2 sums and the num_topk best experts in them (ties to the
    smaller index), weights normalised over the selected scores times routed_scaling_factor, shared experts
    (weight 1), replica mapping through to_physical_map / logical_count, EP/TP remap (-1: another rank).

    Bit-identical to TileKernels' kernel (its softmax sum order, its weight sum from 1e-20 in slot order).
    mask (bool, num_tokens): False -> that token's row is -1 / 0.0, as TileKernels. unmapped_topk_idx (int64,
    (num_tokens, num_topk), stride(1) == 1, any row stride) is updated in place: each routed token's num_topk
    logical indices (before the replica map and the EP/TP remap), -1 in a masked token's row.
    fix_routing_mask (bool, (num_tokens,), contiguous; needs unmapped_topk_idx): True -> that token is not
    selected for but keeps the indices in its unmapped_topk_idx row (in that order), weighted by their unbiased
    scores normalised as above; shared experts, replica map and remap as usual.
    Non-finite logits are not supported (TileKernels asserts on them); outputs then stay in bounds. Neither
    are fixed indices outside [0, num_experts) (TileKernels asserts >= 0): the score is then read at the index
    clamped into range and the index kept; nothing is read or written out of bounds.
    A logical_count entry outside [1, num_extra_experts + 1] gives -1 (TileKernels reads out of bounds).
    """
    key = None
    if (mask is None and fix_routing_mask is None and to_physical_map is None and logical_count is None
            and unmapped_topk_idx is None and ops.is_eager(logits, bias)):
        # A signature checked before goes straight to its kernel: the checks below hold for every call with it
        # (the tensors' shapes, strides, dtypes and devices, the other arguments' values and types).
        args = (num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts,
                routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func)
        try:
            key = (logits.shape, logits.stride(), logits.dtype, logits.device, bias.shape, bias.stride(), bias.dtype,
                   bias.device, args, tuple(map(type, args)))
            hit = _top2_calls.get(key)
        except TypeError:  # an unhashable argument: the checks below name it
            key = hit = None
        if hit is not None:
            return hit[0](logits, bias, *hit[1])
    fn = "moe.top2_sum_gate"
    tensor(fn, "logits", logits, (2,), (torch.float32,))
    tensor(fn, "bias", bias, (1,), (torch.float32,))
    if not logits.is_contiguous() or not bias.is_contiguous():
        raise TensorError(f"tile_kernels.{fn}: logits and bias must be contiguous")
    num_tokens, e = logits.shape
    if bias.shape[0] != e:
        raise TensorError(f"tile_kernels.{fn}: bias has {bias.shape[0]} entries, logits has {e} experts")
    if mask is not None:  # any shape with num_tokens entries, as TileKernels asserts
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TensorError(f"tile_kernels.{fn}: mask must be a torch.bool tensor, got "
                              f"{getattr(mask, 'dtype', type(mask).__name__)}")
        if mask.numel() != num_tokens:
            raise TensorError(f"tile_kernels.{fn}: mask has {mask.numel()} entries, logits has {num_tokens} tokens")
    if fix_routing_mask is not None:  # as TileKernels asserts
        if unmapped_topk_idx is None:
            raise TensorError(f"tile_kernels.{fn}: fix_routing_mask needs unmapped_topk_idx (the fixed tokens' "
                              "indices are read from it)")
        tensor(fn, "fix_routing_mask", fix_routing_mask, (1,), (torch.bool,))
        if fix_routing_mask.shape[0] != num_tokens or not fix_routing_mask.is_contiguous():
            raise TensorError(f"tile_kernels.{fn}: fix_routing_mask must be contiguous with num_tokens "
                              f"({num_tokens}) entries, got shape {tuple(fix_routing_mask.shape)} and strides "
                              f"{fix_routing_mask.stride()}")
    if (to_physical_map is None) != (logical_count is None):
        raise TensorError(f"tile_kernels.{fn}: to_physical_map and logical_count must be given together")
    k = as_int(fn, "num_topk", num_topk)
    if unmapped_topk_idx is not None:  # as TileKernels asserts
        tensor(fn, "unmapped_topk_idx", unmapped_topk_idx, (2,), (torch.int64,))
        if tuple(unmapped_topk_idx.shape) != (num_tokens, k) or unmapped_topk_idx.stride(1) != 1:
            raise TensorError(f"tile_kernels.{fn}: unmapped_topk_idx must be (num_tokens, num_topk) = "
                              f"({num_tokens}, {k}) with stride(1) == 1, got shape "
                              f"{tuple(unmapped_topk_idx.shape)} and strides {unmapped_topk_idx.stride()}")
    kg = as_int(fn, "num_topk_groups", num_topk_groups)
    g = as_int(fn, "num_groups", num_groups)
    s = as_int(fn, "num_shared_experts", num_shared_experts)
    ints = {name: as_int(fn, name, v) for name, v in (("ep_rank", ep_rank), ("num_ep_ranks", num_ep_ranks),
                                                      ("tp_rank", tp_rank), ("num_tp_ranks", num_tp_ranks))}
    if not isinstance(use_shared_as_routed, bool):
        raise ShapeError(f"tile_kernels.{fn}: use_shared_as_routed must be a bool, got {use_shared_as_routed!r}")
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)):
        raise ShapeError(f"tile_kernels.{fn}: routed_scaling_factor must be a float, got {routed_scaling_factor!r}")
    if not isinstance(scoring_func, str) or scoring_func.lower() not in ("sigmoid", "sqrtsoftplus", "softmax",
                                                                         "identity"):
        raise ShapeError(f"tile_kernels.{fn}: scoring_func must be 'sigmoid', 'sqrtsoftplus' or 'softmax', "
                         f"got {scoring_func!r}")
    scoring = scoring_func.lower()  # TileKernels' ScoringFunc.from_str takes any case
    if scoring == "identity":
        raise ShapeError(f"tile_kernels.{fn}: scoring_func 'identity' is not supported for top-2 sum routing "
                         "(as TileKernels)")
    if (g == 0) != (kg == 0):
        raise ShapeError(f"tile_kernels.{fn}: num_groups ({g}) and num_topk_groups ({kg}) must be both zero or "
                         "both non-zero")
    if not 1 <= k <= e:
        raise ShapeError(f"tile_kernels.{fn}: num_topk ({k}) must be in [1, num_experts (logits.shape[1] = {e})]")
    if not 0 <= kg <= g:
        raise ShapeError(f"tile_kernels.{fn}: num_topk_groups ({kg}) must be in [0, num_groups ({g})]")
    if g and e % g:
        raise ShapeError(f"tile_kernels.{fn}: num_experts (logits.shape[1] = {e}) must be divisible by "
                         f"num_groups ({g})")
    if not use_shared_as_routed:
        s = 0
    elif s not in (1, 2) or k % s or e % (k // s):
        raise ShapeError(f"tile_kernels.{fn}: with use_shared_as_routed, num_shared_experts ({s}) must be 1 or 2, "
                         f"num_topk ({k}) a multiple of it and num_experts ({e}) of num_topk // num_shared_experts")
    d = 1
    if to_physical_map is not None:
        tensor(fn, "to_physical_map", to_physical_map, (2,), (torch.int32,))
        tensor(fn, "logical_count", logical_count, (1,), (torch.int32,))
        if not to_physical_map.is_contiguous() or not logical_count.is_contiguous():
            raise TensorError(f"tile_kernels.{fn}: to_physical_map and logical_count must be contiguous")
        if to_physical_map.shape[0] != e + s or logical_count.shape[0] != e + s:
            raise TensorError(f"tile_kernels.{fn}: to_physical_map and logical_count need num_experts + "
                              f"num_shared_experts = {e + s} rows, got {to_physical_map.shape[0]} and "
                              f"{logical_count.shape[0]}")
        d = to_physical_map.shape[1]
    if s > d - 1:
        raise ShapeError(f"tile_kernels.{fn}: num_shared_experts ({s}) must be <= num_extra_experts "
                         f"(to_physical_map.shape[1] - 1 = {d - 1})")
    if ints["ep_rank"] < 0:
        raise ShapeError(f"tile_kernels.{fn}: ep_rank ({ints['ep_rank']}) must be >= 0")
    try:
        tp_scalars(fn, e + d - 1, ints["num_ep_ranks"], ints["tp_rank"], ints["num_tp_ranks"])
    except ShapeError as err:
        raise ShapeError(f"tile_kernels.{err}") from None
    if num_tokens == 0:  # as TileKernels: nothing to launch
        return (torch.empty((0, k + s), dtype=torch.int64, device=logits.device),
                torch.empty((0, k + s), dtype=torch.float32, device=logits.device))
    require_kernel(fn, FAMILY, "top2_sum_gate",
                   {"num_experts": e, "num_topk": k, "num_groups": g, "num_topk_groups": kg, "num_shared_experts": s,
                    "scoring_func": scoring, "has_mask": mask is not None, "has_map": to_physical_map is not None,
                    "num_duplicates": d, "has_fix": fix_routing_mask is not None,
                    "has_unmapped": unmapped_topk_idx is not None},
                   {"num_experts": "num_experts (logits.shape[1])", "num_topk": "num_topk", "num_groups": "num_groups",
                    "num_topk_groups": "num_topk_groups", "num_shared_experts": "num_shared_experts",
                    "scoring_func": "scoring_func", "has_mask": "mask", "has_map": "to_physical_map",
                    "num_duplicates": "num_extra_experts + 1 (to_physical_map.shape[1])", "num_tokens": "num_tokens",
                    "has_fix": "fix_routing_mask", "has_unmapped": "unmapped_topk_idx"},
                   {"num_tokens": num_tokens})
    if key is not None:
        kern, tensors, scalars = torch_ops.top2_sum_gate_launch(
            logits, bias, k, kg, g, use_shared_as_routed, s, float(routed_scaling_factor), ints["ep_rank"],
            ints["num_ep_ranks"], ints["tp_rank"], ints["num_tp_ranks"], scoring)
        got = kern(*tensors, *scalars)  # (topk_idx, topk_weights): no unmapped_topk_idx on this path
        _top2_calls.remember(key, (kern, scalars))
        return got
    return ops.top2_sum_gate(logits, bias, k, kg, g, use_shared_as_routed, s, float(routed_scaling_factor),
                             ints["ep_rank"], ints["num_ep_ranks"], ints["tp_rank"], ints["num_tp_ranks"], scoring,
                             mask, fix_routing_mask, to_physical_map, logical_count, unmapped_topk_idx)


def topk_sum_and_topk_group_idx(scores: torch.Tensor, num_topk_sum: int, num_topk_groups: int) -> torch.Tensor:
    """The num_topk_groups groups with the largest sums of their num_topk_sum (1 or 2) best scores.

    scores (num_tokens, num_groups, num_experts_per_group) float32, contiguous -> (num_tokens,
    num_topk_groups) int64 group indices, best first, equal sums to the smaller index; bit-identical to
    TileKernels. num_groups <= 32. NaN scores are not supported.
    """
    fn = "moe.topk_sum_and_topk_group_idx"
    tensor(fn, "scores", scores, (3,), (torch.float32,))
    if not scores.is_contiguous():
        raise TensorError(f"tile_kernels.{fn}: scores must be contiguous, got strides {tuple(scores.stride())}")
    num_tokens, num_groups, per_group = scores.shape
    ks = as_int(fn, "num_topk_sum", num_topk_sum)
    kg = as_int(fn, "num_topk_groups", num_topk_groups)
    if ks not in (1, 2) or ks > per_group:
        raise ShapeError(f"tile_kernels.{fn}: num_topk_sum ({ks}) must be 1 or 2 and <= num_experts_per_group "
                         f"(scores.shape[2] = {per_group})")
    if not 1 <= kg <= num_groups:
        raise ShapeError(f"tile_kernels.{fn}: num_topk_groups ({kg}) must be in [1, num_groups "
                         f"(scores.shape[1] = {num_groups})]")
    if num_groups > 32:
        raise ShapeError(f"tile_kernels.{fn}: num_groups (scores.shape[1] = {num_groups}) must be <= 32")
    if num_tokens == 0:  # as TileKernels: nothing to launch
        return torch.empty((0, kg), dtype=torch.int64, device=scores.device)
    require_kernel(fn, FAMILY, "topk_sum_and_topk_group_idx",
                   {"num_groups": num_groups, "num_experts_per_group": per_group, "num_topk_sum": ks,
                    "num_topk_groups": kg},
                   {"num_groups": "num_groups (scores.shape[1])",
                    "num_experts_per_group": "num_experts_per_group (scores.shape[2])",
                    "num_topk_sum": "num_topk_sum", "num_topk_groups": "num_topk_groups",
                    "num_tokens": "num_tokens"}, {"num_tokens": num_tokens})
    return ops.topk_sum_and_topk_group_idx(scores, ks, kg)
