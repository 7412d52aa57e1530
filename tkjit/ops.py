"""Convenience forms that infer the shape from tensors: `tkjit.ops.sinkhorn_fwd(x)` etc.

Each function is its torch custom op (`torch.ops.tkjit.*`, registered by importing this module;
see tkjit/torch_ops/), whose implementation goes through `tkjit.get` (memoised: ~1-2 us on a
hit), so it serves the tuned config for the tensor's GPU and size bucket. Under torch.compile,
with FakeTensor/meta inputs or when a gradient is wanted, the call goes through the custom op
(traced with no graph break, autograd registered); in plain eager calls the op's implementation
runs directly, without the dispatcher's host cost. Both record into CUDA graphs. `config` (a dict) pins
a kernel config instead.
"""

from __future__ import annotations

import torch

from tkjit import torch_ops  # importing it registers torch.ops.tkjit.*
from tkjit.autograd import ExpandToMhcFunction, PreApplyMixFunction, SinkhornFunction, plain
from tkjit.autograd import sinkhorn as _sinkhorn
from tkjit.errors import ShapeError, TensorError
from tkjit.scales import pack_ue8m0
from tkjit.torch_ops import encode_config
from tkjit.torch_ops.checks import need

_ops = torch.ops.tkjit
_sinkhorn_fwd = _ops.sinkhorn_fwd.default
_sinkhorn_bwd = _ops.sinkhorn_bwd.default
_topk_gate = _ops.topk_gate.default
_per_token_cast = _ops.per_token_cast.default
_per_token_cast_colmajor = _ops.per_token_cast_colmajor.default
_transpose = _ops.transpose.default
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


def is_eager(*tensors: torch.Tensor) -> bool:
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
    if is_eager(x):
        return torch_ops.sinkhorn_fwd_impl(x, repeat, eps, encode_config(config))
    if plain(x):  # eager, with a gradient wanted: the autograd.Function, not the op's Python wrapper
        return SinkhornFunction.apply(x, repeat, eps, encode_config(config), None)
    return _sinkhorn_fwd(x, repeat, eps, encode_config(config))


def sinkhorn_bwd(grad_out: torch.Tensor, x: torch.Tensor, repeat: int = 10, eps: float = 1e-6, *,
                 config=None) -> torch.Tensor:
    """dL/dx of sinkhorn_fwd(x, repeat, eps) given dL/dy, both (num_tokens, n, n) float32."""
    if is_eager(grad_out, x):
        return torch_ops.sinkhorn_bwd_impl(grad_out, x, repeat, eps, encode_config(config))
    return _sinkhorn_bwd(grad_out, x, repeat, eps, encode_config(config))


def sinkhorn(x: torch.Tensor, repeat: int = 10, eps: float = 1e-6) -> torch.Tensor:
    """Differentiable Sinkhorn (forward and backward kernels) over (..., n, n) float32."""
    return _sinkhorn(x, repeat, eps)


def topk_gate(scores: torch.Tensor, k: int, *, config=None) -> torch.Tensor:
    """(num_tokens, num_experts) float32 -> int64 (num_tokens, k) indices, best first, ties to lower index."""
    if is_eager(scores):
        return torch_ops.topk_gate_impl(scores, k, encode_config(config))
    return _topk_gate(scores, k, encode_config(config))


def per_token_cast(
    x: torch.Tensor, group: int = 128, *, round_scale: bool = False, col_major_scales: bool = False,
    packed_ue8m0: bool = False, config=None
):
    """(num_tokens, hidden) bf16/f32 -> (fp8 e4m3 values, float32 scales per `group` channels).

    group is 16, 32, 64, 128 or hidden; hidden is a multiple of 16 but need not be one of group: a
    token has num_groups = ceil(hidden / group) scales, the last one over the partial last group's
    channels only (hidden 576, group 128: five scales, the fifth over channels 512..575).
    scales is (num_tokens, num_groups) either way. col_major_scales: it is the strided view
    storage[:, :num_tokens].T of a TMA-aligned column-major (num_groups, align(num_tokens, 4))
    buffer (strides (1, align(num_tokens, 4)); padding holds 0), the layout DeepGEMM consumes and
    TileKernels' `use_tma_aligned_col_major_sf` returns. packed_ue8m0 (with col_major_scales): the scales'
    exponents, four groups per int32, as the int32 view (num_tokens, ceil(num_groups / 4)) of a column-major
    (ceil(num_groups / 4), align(num_tokens, 4)) buffer (`tkjit.scales.pack_ue8m0`; TileKernels'
    `use_packed_ue8m0`); exact scales need round_scale.
    """
    if packed_ue8m0 and not col_major_scales:
        raise ShapeError("per_token_cast: packed_ue8m0 needs col_major_scales=True (the packed layout is column-major)")
    eager = is_eager(x)
    if not col_major_scales:
        op = torch_ops.per_token_cast_impl if eager else _per_token_cast
        return op(x, group, round_scale, encode_config(config))
    op = torch_ops.per_token_cast_colmajor_impl if eager else _per_token_cast_colmajor
    q, storage = op(x, group, round_scale, encode_config(config))
    if packed_ue8m0:
        storage = pack_ue8m0(storage)
    return q, storage[:, : x.shape[0]].T


def transpose(x: torch.Tensor, *, config=None) -> torch.Tensor:
    """(rows, cols) -> (cols, rows), or (batch, rows, cols) -> (batch, cols, rows), bit-exact."""
    if is_eager(x):
        return torch_ops.transpose_impl(x, encode_config(config))
    return _transpose(x, encode_config(config))


def normalize_weight(topk_weights: torch.Tensor, *, config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_tokens, num_topk) float32 -> (denominator, normalized): the in-order float32 sum from 1e-20
    and the weights divided by it, bit-identical to TileKernels."""
    if is_eager(topk_weights):
        return torch_ops.normalize_weight_impl(topk_weights, encode_config(config))
    return torch.ops.tkjit.normalize_weight.default(topk_weights, encode_config(config))


def mask_indices_by_tp(indices: torch.Tensor, n: int, num_ep_ranks: int, tp_rank: int, num_tp_ranks: int, *,
                       config=None) -> torch.Tensor:
    """int32/int64 expert indices -> this TP rank's local expert indices, -1 for other ranks' experts."""
    if is_eager(indices):
        return torch_ops.mask_indices_by_tp_impl(indices, n, num_ep_ranks, tp_rank, num_tp_ranks, encode_config(config))
    return torch.ops.tkjit.mask_indices_by_tp.default(indices, n, num_ep_ranks, tp_rank, num_tp_ranks,
                                                      encode_config(config))


def inplace_unique_group_indices(group_indices: torch.Tensor, num_groups: int, *, config=None) -> None:
    """In place on (num_tokens, num_topk) int64: repeats of a group id in a row after its first occurrence -> -1."""
    if is_eager(group_indices):
        return torch_ops.inplace_unique_group_indices_impl(group_indices, num_groups, encode_config(config))
    return torch.ops.tkjit.inplace_unique_group_indices.default(group_indices, num_groups, encode_config(config))


def group_count(group_idx: torch.Tensor, num_groups: int, *, config=None) -> torch.Tensor:
    """int64 (num_tokens, num_topk) ids -> int32 (num_groups,) counts; entries < 0 (or >= num_groups) skipped."""
    if is_eager(group_idx):
        return torch_ops.group_count_impl(group_idx, num_groups, encode_config(config))
    return torch.ops.tkjit.group_count.default(group_idx, num_groups, encode_config(config))


def aux_fi(topk_idx: torch.Tensor, num_experts: int, num_aux_topk: int, *, config=None) -> torch.Tensor:
    """int64 (num_tokens, num_topk) expert ids -> float32 (num_experts,) f_i = count * num_experts /
    (num_tokens * num_aux_topk), bit-identical to TileKernels' torch reference on the CPU."""
    if is_eager(topk_idx):
        return torch_ops.aux_fi_impl(topk_idx, num_experts, num_aux_topk, encode_config(config))
    return torch.ops.tkjit.aux_fi.default(topk_idx, num_experts, num_aux_topk, encode_config(config))


def topk_sum_and_topk_group_idx(scores: torch.Tensor, num_topk_sum: int, num_topk_groups: int, *,
                                config=None) -> torch.Tensor:
    """(num_tokens, num_groups, experts_per_group) float32 -> int64 (num_tokens, num_topk_groups): the groups
    with the largest sums of their num_topk_sum (1 or 2) best scores, best first, ties to the smaller group."""
    if is_eager(scores):
        return torch_ops.topk_sum_and_topk_group_idx_impl(scores, num_topk_sum, num_topk_groups,
                                                          encode_config(config))
    return torch.ops.tkjit.topk_sum_and_topk_group_idx.default(scores, num_topk_sum, num_topk_groups,
                                                               encode_config(config))


def expand_to_fused(x: torch.Tensor, token_topk_to_pos: torch.Tensor, pos_to_expert: torch.Tensor, *,
                    config=None) -> torch.Tensor:
    """x (num_tokens, hidden) -> (num_expanded_tokens, hidden): row t copied to every valid position
    token_topk_to_pos[t, k]; padding rows (pos_to_expert < 0) zero; bit-exact (TileKernels semantics)."""
    if is_eager(x, token_topk_to_pos, pos_to_expert):
        return torch_ops.expand_to_fused_impl(x, token_topk_to_pos, pos_to_expert, encode_config(config))
    return torch.ops.tkjit.expand_to_fused.default(x, token_topk_to_pos, pos_to_expert, encode_config(config))


def reduce_fused(x: torch.Tensor, topk_weights: torch.Tensor | None, token_topk_to_pos: torch.Tensor,
                 fp8_format: str = "", sf: torch.Tensor | None = None, x_sf: torch.Tensor | None = None, *,
                 out: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """x (num_expanded_tokens, hidden) bf16/f32 -> (num_tokens, hidden): each token's valid rows summed in
    slot order with one FMA per slot (topk_weights times x_sf[pos]), times sf, cast to x's dtype or e4m3
    (fp8_format='e4m3'). out: written in place and returned."""
    tensors = [t for t in (x, topk_weights, token_topk_to_pos, sf, x_sf, out) if t is not None]
    cfg = encode_config(config)
    if out is not None:
        if is_eager(*tensors):
            torch_ops.reduce_fused_out_impl(x, topk_weights, token_topk_to_pos, out, fp8_format, sf, x_sf, cfg)
        else:
            torch.ops.tkjit.reduce_fused_out.default(x, topk_weights, token_topk_to_pos, out, fp8_format, sf, x_sf,
                                                     cfg)
        return out
    if is_eager(*tensors):
        return torch_ops.reduce_fused_impl(x, topk_weights, token_topk_to_pos, fp8_format, sf, x_sf, cfg)
    return torch.ops.tkjit.reduce_fused.default(x, topk_weights, token_topk_to_pos, fp8_format, sf, x_sf, cfg)


def get_fused_mapping(topk_idx: torch.Tensor, num_experts: int, num_expanded_tokens: int, alignment: int,
                      force_no_sync: bool = False, *, config=None) -> tuple:
    """MoE routing's expert-major layout, TileKernels' `moe.get_fused_mapping`: (pos_to_expert, pos_to_token,
    pos_to_token_topk, token_topk_to_pos, expert_start, expert_end, num_tokens_per_expert,
    num_tokens_per_expert_list).

    num_expanded_tokens=0 and not force_no_sync: the maps are sized to the largest layout possible, then
    one host sync reads num_tokens_per_expert (the list, python ints) and the three pos_* maps are cut to
    its sum. Otherwise the maps have num_expanded_tokens rows (positions past the layout hold -1;
    entries whose position falls at or past it are dropped) and the list is []."""
    from tkjit_kernels.moe.get_fused_mapping import upper_bound

    should_sync = num_expanded_tokens == 0 and not force_no_sync
    if should_sync:
        n, k = topk_idx.shape
        num_expanded_tokens = upper_bound(n, k, num_experts, alignment)
    if is_eager(topk_idx):
        outs = torch_ops.get_fused_mapping_pooled(topk_idx, num_experts, num_expanded_tokens, alignment,
                                                  encode_config(config))
    else:
        outs = torch.ops.tkjit.get_fused_mapping.default(topk_idx, num_experts, num_expanded_tokens, alignment,
                                                         encode_config(config))
    counts: list[int] = []
    if should_sync:
        counts = outs[6].tolist()
        total = sum(counts)
        outs = (*(t[:total] for t in outs[:3]), *outs[3:])
    return (*outs, counts)


def expand_to_fused_with_sf(x: tuple[torch.Tensor, torch.Tensor], num_per_channels: int,
                            token_topk_to_pos: torch.Tensor, pos_to_expert: torch.Tensor,
                            use_tma_aligned_col_major_sf: bool = False, *,
                            config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """x = (data (num_tokens, hidden), sf (num_tokens, hidden_sf) float32 or packed-UE8M0 int32, row-major)
    -> (out (num_expanded_tokens, hidden), out_sf (num_expanded_tokens, hidden_sf)): each token's data and scale
    rows copied to every valid position token_topk_to_pos[t, k]; padding rows (pos_to_expert < 0) zero in both;
    bit-exact (TileKernels' `moe.expand_to_fused_with_sf`). use_tma_aligned_col_major_sf: out_sf is the view
    storage[:, :num_expanded_tokens].T of a (hidden_sf, align(num_expanded_tokens, 4)) column-major buffer
    (strides (1, align(num_expanded_tokens, 4)); padding holds 0), as TileKernels returns it."""
    data, sf = x
    cfg = encode_config(config)
    args = (data, sf, num_per_channels, token_topk_to_pos, pos_to_expert, bool(use_tma_aligned_col_major_sf), cfg)
    if is_eager(data, sf, token_topk_to_pos, pos_to_expert):
        out, out_sf = torch_ops.expand_to_fused_with_sf_impl(*args)
    else:
        out, out_sf = torch.ops.tkjit.expand_to_fused_with_sf.default(*args)
    if use_tma_aligned_col_major_sf:
        out_sf = out_sf[:, : pos_to_expert.shape[0]].T
    return out, out_sf


def top2_sum_gate(logits: torch.Tensor, bias: torch.Tensor, num_topk: int, num_topk_groups: int, num_groups: int,
                  use_shared_as_routed: bool, num_shared_experts: int, routed_scaling_factor: float, ep_rank: int,
                  num_ep_ranks: int, tp_rank: int, num_tp_ranks: int, scoring_func: str,
                  mask: torch.Tensor | None = None, fix_routing_mask: torch.Tensor | None = None,
                  to_physical_map: torch.Tensor | None = None, logical_count: torch.Tensor | None = None,
                  unmapped_topk_idx: torch.Tensor | None = None, *,
                  config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 grouped routing (TileKernels' `top2_sum_gate`, its argument order): float32 logits
    (num_tokens, num_experts) and bias (num_experts,) -> (topk_idx int64, topk_weights float32), (num_tokens,
    num_topk + shared experts): scores, bias-steered selection of the top groups (top-2 sums) and experts,
    normalised weights, shared experts, replica mapping (to_physical_map / logical_count) and EP/TP remap; mask
    (bool, num_tokens): False -> that token's row is -1 / 0.0. unmapped_topk_idx (int64, (num_tokens, num_topk),
    stride(1) == 1): updated in place with the logical indices (-1 for a masked token); fix_routing_mask (bool,
    num_tokens; needs unmapped_topk_idx): True -> that token keeps the indices in its unmapped_topk_idx row."""
    args = (logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts,
            routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func, mask, fix_routing_mask,
            to_physical_map, logical_count, unmapped_topk_idx, encode_config(config))
    tensors = [t for t in (logits, bias, mask, fix_routing_mask, to_physical_map, logical_count, unmapped_topk_idx)
               if t is not None]
    if is_eager(*tensors):
        return torch_ops.top2_sum_gate_impl(*args)
    return torch.ops.tkjit.top2_sum_gate.default(*args)


def engram_hash(ngram_token_ids: torch.Tensor, multipliers: torch.Tensor, vocab_sizes: torch.Tensor,
                offsets: torch.Tensor, *, config=None) -> torch.Tensor:
    """Engram's n-gram hash embedding indices (TileKernels' `engram.engram_hash`): ngram_token_ids
    (num_tokens, N) int32, multipliers (L, N) int64, vocab_sizes (L, N - 1, E) int32, offsets
    (L, (N - 1) * E) int32 -> int32 (L, num_tokens, (N - 1) * E): the xor of the wrapping int64 products
    id * multiplier over the n-gram's tokens, floor-mod each table's size, plus its offset; bit-exact."""
    if is_eager(ngram_token_ids, multipliers, vocab_sizes, offsets):
        return torch_ops.engram_hash_impl(ngram_token_ids, multipliers, vocab_sizes, offsets, encode_config(config))
    return torch.ops.tkjit.engram_hash.default(ngram_token_ids, multipliers, vocab_sizes, offsets,
                                               encode_config(config))


def fused_weight(weight_hidden: torch.Tensor, weight_embed: torch.Tensor, *, config=None) -> torch.Tensor:
    """(hc_mult, hidden_size) bfloat16 weights -> float32 weight_hidden * weight_embed (TileKernels'
    `engram.fused_weight`), bit-identical to torch's float32 product."""
    if is_eager(weight_hidden, weight_embed):
        return torch_ops.fused_weight_impl(weight_hidden, weight_embed, encode_config(config))
    return torch.ops.tkjit.fused_weight.default(weight_hidden, weight_embed, encode_config(config))


def cast_back(x: torch.Tensor, sf: torch.Tensor, block_size: tuple[int, int] = (1, 128), *,
              out_dtype: torch.dtype = torch.bfloat16, config=None) -> torch.Tensor:
    """Dequantise: x (num_tokens, hidden) float8_e4m3fn, or int8 (num_tokens, hidden / 2) holding two FP4 e2m1
    codes per byte (low nibble first, TileKernels' packing), times its scales -> (num_tokens, hidden) out_dtype
    (bfloat16 or float32), one float32 multiply rounded once, bit-exact (TileKernels' `cast_back`).
    block_size = (block_tokens, block_channels): tokens and channels per scale, (1, 128) per token and group.
    sf holds the scales as (ceil(num_tokens / block_tokens), ceil(hidden / block_channels)): float32 row-major
    (rows at any stride), or column-major (sf.stride(0) == 1, e.g. per_token_cast's col_major_scales view),
    float32 or, with packed_ue8m0's layout, int32 of four UE8M0 exponents (ceil(num_sf_cols / 4) columns).
    The layout is read off sf's strides, as TileKernels does."""
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ShapeError(f"cast_back: out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    return _cast_back("cast_back", x, sf, block_size, out_dtype, config)


def _cast_back(name: str, x: torch.Tensor, sf: torch.Tensor, block_size, out_dtype: torch.dtype,
               config) -> torch.Tensor:
    """cast_back(_e5m6) with block_size checked: the row-major op, or the `_colmajor` one for column-major sf
    (sf.stride(0) == 1), whose kernel reads the storage view (rows: sf's columns)."""
    if not isinstance(block_size, (tuple, list)) or len(block_size) != 2:
        raise ShapeError(f"{name}: block_size must be (block_tokens, block_channels), got {block_size!r}")
    need(sf, (2,), name)
    bt, bc = block_size
    od = "bfloat16" if out_dtype == torch.bfloat16 else "float32"
    cfg = encode_config(config)
    if sf.stride(0) == 1:
        name, sf = f"{name}_colmajor", sf.T
    if is_eager(x, sf):
        return getattr(torch_ops, f"{name}_impl")(x, sf, bt, bc, od, cfg)
    return getattr(torch.ops.tkjit, name).default(x, sf, bt, bc, od, cfg)


# -- per_block_cast ----------------------------------------------------------------------------------

def per_block_cast(
    x: torch.Tensor, block_size: tuple[int, int] = (128, 128), *, round_scale: bool = False,
    col_major_scales: bool = False, packed_ue8m0: bool = False, fmt: str = "e4m3", config=None
):
    """(num_tokens, hidden) bf16/f32 -> (values, float32 scales), one scale per
    block_size = (block_m, block_k) tile: scales is (ceil(num_tokens / block_m), ceil(hidden / block_k)),
    a partial last tile's scale over its real elements. fmt 'e4m3': fp8 values (num_tokens, hidden), scales
    amax / 448; 'e2m1': FP4 values as TileKernels stores them, int8 (num_tokens, hidden / 2) with two codes per
    byte (the even channel in the low nibble), scales amax / 6. col_major_scales: the strided view
    storage[:, :rows].T of a TMA-aligned column-major (cols, align(rows, 4)) buffer (padding 0), as
    TileKernels' `use_tma_aligned_col_major_sf` returns; packed_ue8m0 (with col_major_scales): the
    exponents, four column blocks per int32 (`tkjit.scales.pack_ue8m0`); exact scales need round_scale.
    """
    if packed_ue8m0 and not col_major_scales:
        raise ShapeError("per_block_cast: packed_ue8m0 needs col_major_scales=True (the packed layout is column-major)")
    block_m, block_k = block_size
    cfg = encode_config(config)
    eager = is_eager(x)
    if not col_major_scales:
        op = torch_ops.per_block_cast_impl if eager else torch.ops.tkjit.per_block_cast.default
        return op(x, block_m, block_k, round_scale, fmt, cfg)
    op = torch_ops.per_block_cast_colmajor_impl if eager else torch.ops.tkjit.per_block_cast_colmajor.default
    q, storage = op(x, block_m, block_k, round_scale, fmt, cfg)
    if packed_ue8m0:
        storage = pack_ue8m0(storage)
    return q, storage[:, : (x.shape[0] + block_m - 1) // block_m].T


def per_block_cast_with_sf(x: torch.Tensor, sf: torch.Tensor, block_size: tuple[int, int] = (128, 128), *,
                           fmt: str = "e4m3", config=None) -> torch.Tensor:
    """per_block_cast's values with given float32 scales sf (ceil(num_tokens / block_m), ceil(hidden / block_k)),
    row-major (any row stride): fmt 'e4m3' fp8 of clamp(x * (1 / sf), -448, 448) per tile, or 'e2m1' the FP4 codes
    of x * (1 / sf) (saturating at 6), two per int8 (num_tokens, hidden / 2)."""
    block_m, block_k = block_size
    op = torch_ops.per_block_cast_with_sf_impl if is_eager(x, sf) else torch.ops.tkjit.per_block_cast_with_sf.default
    return op(x, sf, block_m, block_k, fmt, encode_config(config))


# -- per_channel_cast ---------------------------------------------------------------------------------

def per_channel_cast(x: torch.Tensor, num_per_tokens: int = 128, *, round_scale: bool = False,
                     config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_tokens, hidden) bf16/f32, contiguous -> (fp8 e4m3 values (num_tokens, hidden), float32 scales
    (num_tokens / num_per_tokens, hidden)): one scale per channel and block of num_per_tokens (32 or 128)
    consecutive tokens, amax / 448 (round_scale: rounded up to a power of two); TileKernels'
    `per_channel_cast`. num_tokens must be a multiple of num_per_tokens."""
    if is_eager(x):
        return torch_ops.per_channel_cast_impl(x, num_per_tokens, round_scale, encode_config(config))
    return torch.ops.tkjit.per_channel_cast.default(x, num_per_tokens, round_scale, encode_config(config))


def per_channel_cast_and_transpose(x: torch.Tensor, num_per_tokens: int = 128, *, round_scale: bool = False,
                                   config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """per_channel_cast with the values transposed: (fp8 e4m3 (hidden, num_tokens), float32 scales
    (num_tokens / num_per_tokens, hidden)); TileKernels' `per_channel_cast_and_transpose`."""
    args = (x, num_per_tokens, round_scale, encode_config(config))
    if is_eager(x):
        return torch_ops.per_channel_cast_and_transpose_impl(*args)
    return torch.ops.tkjit.per_channel_cast_and_transpose.default(*args)


# -- expand_to_mhc / mhc_pre_apply_mix ----------------------------------------------------------------


def _mhc_tensor(fn: str, name: str, t, ndim: int, dtype: torch.dtype, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TensorError(f"{fn}: {name} must be a torch.Tensor {what}, got {type(t).__name__}")
    if t.dim() < ndim:
        raise TensorError(f"{fn}: {name} must be {what} (at least {ndim}-D), got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TensorError(f"{fn}: {name} must be {dtype} {what}, got {t.dtype}")


def _mhc_out(fn: str, out, shape: tuple, device: torch.device, name: str = "out") -> None:
    """out= must be the contiguous bfloat16 tensor the op returns (TileKernels writes it through a view)."""
    _mhc_tensor(fn, name, out, len(shape), torch.bfloat16, f"of shape {shape}")
    if tuple(out.shape) != shape or not out.is_contiguous() or out.device != device:
        raise TensorError(f"{fn}: {name} must be a contiguous bfloat16 tensor of shape {shape} on {device}, got "
                          f"{tuple(out.shape)} (contiguous={out.is_contiguous()}) on {out.device}")


def check_expand_to_mhc(fn: str, hidden, mhc_mult, out) -> None:
    """TensorError / ShapeError naming the bad argument of expand_to_mhc (fn: the caller's name)."""
    _mhc_tensor(fn, "hidden", hidden, 1, torch.bfloat16, "(..., hidden)")
    if not hidden.is_contiguous():
        raise TensorError(f"{fn}: hidden must be contiguous, got strides {hidden.stride()}")
    if isinstance(mhc_mult, bool) or not isinstance(mhc_mult, int) or mhc_mult < 1:
        raise ShapeError(f"{fn}: mhc_mult must be an int >= 1, got {mhc_mult!r}")
    if out is not None:
        _mhc_out(fn, out, (*hidden.shape[:-1], mhc_mult, hidden.shape[-1]), hidden.device)


def check_pre_apply_mix(fn: str, x, mix, out) -> None:
    """TensorError naming the bad argument of mhc_pre_apply_mix: x (..., mhc_mult, hidden) bf16 contiguous,
    mix (..., mhc_mult, 1) float32 with x's leading dims, out (..., hidden) bf16."""
    _mhc_tensor(fn, "x", x, 2, torch.bfloat16, "(..., mhc_mult, hidden)")
    if not x.is_contiguous():
        raise TensorError(f"{fn}: x must be contiguous, got strides {x.stride()}")
    _mhc_tensor(fn, "mix", mix, 2, torch.float32, "(..., mhc_mult, 1)")
    want = (*x.shape[:-1], 1)
    if tuple(mix.shape) != want:
        raise TensorError(f"{fn}: mix must have shape {want} (x's leading dims, mhc_mult, 1), got {tuple(mix.shape)}")
    if mix.device != x.device:
        raise TensorError(f"{fn}: mix is on {mix.device}, x on {x.device}")
    if out is not None:
        _mhc_out(fn, out, (*x.shape[:-2], x.shape[-1]), x.device)


def expand_to_mhc(hidden: torch.Tensor, mhc_mult: int, out: torch.Tensor | None = None, *, config=None,
                  bwd_config=None) -> torch.Tensor:
    """hidden (..., hidden) bf16 -> (..., mhc_mult, hidden) bf16, each row copied to its mhc_mult residual streams
    (TileKernels' `expand_to_mhc`), bit-exact; into `out` when given. Differentiable: the gradient runs
    expand_to_mhc_bwd (the streams summed in float32, in order, rounded once)."""
    check_expand_to_mhc("expand_to_mhc", hidden, mhc_mult, out)
    h = hidden.shape[-1]
    flat = hidden.view(-1, h)
    o = out.view(-1, mhc_mult, h) if out is not None else None
    cfg, bcfg = encode_config(config), encode_config(bwd_config)
    if is_eager(flat, *([o] if o is not None else [])):
        if o is not None:
            torch_ops.expand_to_mhc_impl(flat, mhc_mult, cfg, out=o)
            return out
        return torch_ops.expand_to_mhc_impl(flat, mhc_mult, cfg).view(*hidden.shape[:-1], mhc_mult, h)
    if plain(hidden):  # (the Function flattens the leading dims itself: no view nodes around it)
        return ExpandToMhcFunction.apply(hidden, mhc_mult, out, cfg, bcfg)
    y = torch.ops.tkjit.expand_to_mhc.default(flat, mhc_mult, cfg, bcfg)
    if o is not None:
        y = o.copy_(y)
    return y.view(*hidden.shape[:-1], mhc_mult, h)


def expand_to_mhc_bwd(out_grad: torch.Tensor, *, config=None) -> torch.Tensor:
    """expand_to_mhc's gradient: out_grad (..., mhc_mult, hidden) bf16 -> (..., hidden) bf16, the streams
    summed in float32 from +0.0 in order and rounded once (TileKernels' backward kernel, bit-exact)."""
    _mhc_tensor("expand_to_mhc_bwd", "out_grad", out_grad, 2, torch.bfloat16, "(..., mhc_mult, hidden)")
    m, h = out_grad.shape[-2:]
    flat = out_grad.reshape(-1, m, h)
    if is_eager(flat):
        g = torch_ops.expand_to_mhc_bwd_impl(flat, encode_config(config))
    else:
        g = torch.ops.tkjit.expand_to_mhc_bwd.default(flat, encode_config(config))
    return g.view(*out_grad.shape[:-2], h)


def mhc_pre_apply_mix(x: torch.Tensor, mix: torch.Tensor, out: torch.Tensor | None = None, *, config=None,
                      bwd_config=None) -> torch.Tensor:
    """x (..., mhc_mult, hidden) bf16 residual streams, mix (..., mhc_mult, 1) float32 -> (..., hidden) bf16:
    sum_m mix * x as float32 fused multiply-adds in stream order from +0.0, rounded once (TileKernels'
    `mhc_pre_apply_mix`, bit-exact with its kernel); into `out` when given. Differentiable: x's gradient is
    bf16(fma(mix, grad, base)), mix's <grad, x> in float32. In eager code the backward follows TileKernels:
    when x's storage carries mhc_post's residual gradient (`x.untyped_storage().grad_from_mhc_post`), x's
    gradient is added into it in place (one rounding) and x itself gets None. Under torch.compile x always
    gets its own gradient (autograd then adds it to the residual's other gradients, in bf16)."""
    check_pre_apply_mix("mhc_pre_apply_mix", x, mix, out)
    m, h = x.shape[-2:]
    xf, mf = x.view(-1, m, h), mix.reshape(-1, m)
    o = out.view(-1, h) if out is not None else None
    cfg, bcfg = encode_config(config), encode_config(bwd_config)
    if is_eager(xf, mf, *([o] if o is not None else [])):
        if o is not None:
            torch_ops.pre_apply_mix_impl(xf, mf, cfg, out=o)
            return out
        return torch_ops.pre_apply_mix_impl(xf, mf, cfg).view(*x.shape[:-2], h)
    if plain(x) and plain(mix):  # (the Function flattens the leading dims itself: no view nodes around it)
        return PreApplyMixFunction.apply(x, mix, out, cfg, bcfg)
    y = torch.ops.tkjit.pre_apply_mix.default(xf, mf, cfg, bcfg)
    if o is not None:
        y = o.copy_(y)
    return y.view(*x.shape[:-2], h)


def mhc_pre_apply_mix_bwd(grad_out: torch.Tensor, x: torch.Tensor, mix: torch.Tensor,
                          x_grad: torch.Tensor | None = None, *, config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """mhc_pre_apply_mix's gradients: (x_grad, mix_grad) for grad_out (..., hidden) bf16, x (..., mhc_mult,
    hidden) bf16, mix (..., mhc_mult, 1) float32. x_grad given (x's shape, bf16, contiguous): the gradient is
    added into it in place, bf16(fma(mix, grad_out, x_grad)), and it is returned; else a fresh one
    (base +0.0). mix_grad has mix's shape."""
    fn = "mhc_pre_apply_mix_bwd"
    check_pre_apply_mix(fn, x, mix, None)
    m, h = x.shape[-2:]
    _mhc_tensor(fn, "grad_out", grad_out, 1, torch.bfloat16, "(..., hidden)")
    if tuple(grad_out.shape) != (*x.shape[:-2], h):
        raise TensorError(f"{fn}: grad_out must have shape {(*x.shape[:-2], h)}, got {tuple(grad_out.shape)}")
    g, xf, mf = grad_out.reshape(-1, h), x.view(-1, m, h), mix.reshape(-1, m)
    cfg = encode_config(config)
    eager = is_eager(g, xf, mf)
    if x_grad is not None:
        _mhc_out(fn, x_grad, tuple(x.shape), x.device, "x_grad")
        xg = x_grad.view(-1, m, h)
        if eager and is_eager(xg):
            mix_grad = torch_ops.pre_apply_mix_bwd_acc_impl(g, xf, mf, xg, cfg)
        else:
            mix_grad = torch.ops.tkjit.pre_apply_mix_bwd_acc.default(g, xf, mf, xg, cfg)
        return x_grad, mix_grad.view(mix.shape)
    if eager:
        xg, mix_grad = torch_ops.pre_apply_mix_bwd_impl(g, xf, mf, cfg)
    else:
        xg, mix_grad = torch.ops.tkjit.pre_apply_mix_bwd.default(g, xf, mf, cfg)
    return xg.view(x.shape), mix_grad.view(mix.shape)


# -- mhc_post ----------------------------------------------------------------------------------------

def mhc_post_fwd(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor,
                 *, out: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """x (num_tokens, hidden) and residual (num_tokens, mhc, hidden) bf16, post_layer_mix (num_tokens, mhc)
    and comb_res_mix (num_tokens, mhc, mhc) float32 -> out (num_tokens, mhc, hidden) bf16 =
    post_layer_mix * x + comb_res_mix^T @ residual per token. Differentiable (the gradient runs
    mhc_post_bwd), except with out= (written in place, like torch's out= ops: no autograd)."""
    from tkjit.autograd import mhc_post_flat
    from tkjit.errors import TensorError

    tensors = (x, residual, post_layer_mix, comb_res_mix)
    if out is not None:
        if _grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
            raise TensorError("mhc_post_fwd: out= is not differentiable (an input requires grad); call it without out")
        if is_eager(*tensors, out):
            return torch_ops.mhc_post_fwd_into(*tensors, encode_config(config), out=out)
        return out.copy_(mhc_post_flat(*tensors, config))  # traced: the op, then a copy the graph may fuse
    if is_eager(*tensors):
        return torch_ops.mhc_post_fwd_impl(*tensors, encode_config(config))
    return mhc_post_flat(*tensors, config)


def mhc_post_bwd(grad_out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor,
                 comb_res_mix: torch.Tensor, *, config=None) -> tuple[torch.Tensor, ...]:
    """mhc_post_fwd's gradients given grad_out = dL/d out (num_tokens, mhc, hidden) bf16: (grad_x,
    grad_residual) bf16, (grad_post_layer_mix, grad_comb_res_mix) float32, shaped as their inputs."""
    tensors = (grad_out, x, residual, post_layer_mix, comb_res_mix)
    if is_eager(*tensors):
        return torch_ops.mhc_post_bwd_impl(*tensors, encode_config(config))
    return torch.ops.tkjit.mhc_post_bwd.default(*tensors, encode_config(config))


def mhc_post(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor,
             comb_res_mix: torch.Tensor) -> torch.Tensor:
    """Differentiable mHC post mix over any leading dims (TileKernels' mhc_post): x (..., hidden),
    residual (..., mhc, hidden) bf16, post_layer_mix (..., mhc, 1) and comb_res_mix (..., mhc, mhc) float32."""
    from tkjit.autograd import mhc_post as _mhc_post

    return _mhc_post(x, residual, post_layer_mix, comb_res_mix)


# -- per_token_cast_e5m6 / cast_back_e5m6 ------------------------------------------------------------

def per_token_cast_e5m6(x: torch.Tensor, *, round_scale: bool = False, col_major_scales: bool = False,
                        packed_ue8m0: bool = False, config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_tokens, hidden) bf16/f32, hidden a multiple of 8 -> (e5m6 values, float32 scales), one scale per
    token (amax / 65024), TileKernels' `per_token_cast(x, 'e5m6', hidden)`: the values as uint8
    (num_tokens, hidden * 3 / 2), eight 12-bit values per 12 bytes; the scales (num_tokens, 1), or with
    col_major_scales the view storage[:, :num_tokens].T of a (1, align(num_tokens, 4)) buffer (padding 0), and
    with packed_ue8m0 as well its exponent as int32 (`tkjit.scales.pack_ue8m0`); exact scales need round_scale.
    """
    if packed_ue8m0 and not col_major_scales:
        raise ShapeError("per_token_cast_e5m6: packed_ue8m0 needs col_major_scales=True (the packed layout is "
                         "column-major)")
    cfg = encode_config(config)
    eager = is_eager(x)
    if not col_major_scales:
        op = torch_ops.per_token_cast_e5m6_impl if eager else torch.ops.tkjit.per_token_cast_e5m6.default
        words, sf = op(x, round_scale, cfg)
        return words.view(torch.uint8), sf
    op = torch_ops.per_token_cast_e5m6_colmajor_impl if eager else torch.ops.tkjit.per_token_cast_e5m6_colmajor.default
    words, storage = op(x, round_scale, cfg)
    if packed_ue8m0:
        storage = pack_ue8m0(storage)
    return words.view(torch.uint8), storage[:, : x.shape[0]].T


def _e5m6_words(x: torch.Tensor) -> torch.Tensor:
    """Packed e5m6 values as the kernels read them: uint8 (n, hidden * 3 / 2) viewed as int32 words (a copy
    first where the rows cannot be viewed so: not 4-byte aligned); int32 words as they are."""
    from tkjit.errors import TensorError

    need(x, (2,), "cast_back_e5m6")
    if x.dtype != torch.uint8:
        return x
    if x.shape[1] % 12:
        raise TensorError(f"cast_back_e5m6: x has {x.shape[1]} bytes per row, not 12 per 8 e5m6 values "
                          f"(hidden * 3 / 2 with hidden a multiple of 8)")
    if _is_compiling():  # (dynamo does not trace storage_offset: a traced call views contiguous rows as they are)
        x = x.contiguous()
    elif x.stride(1) != 1 or x.stride(0) % 4 or x.storage_offset() % 4:
        x = x.clone(memory_format=torch.contiguous_format)  # a fresh allocation: offset 0, rows of 4-byte words
    return x.view(torch.int32)


def cast_back_e5m6(x: torch.Tensor, sf: torch.Tensor, block_size: tuple[int, int] | None = None, *,
                   out_dtype: torch.dtype = torch.bfloat16, config=None) -> torch.Tensor:
    """Dequantise packed e5m6 values: x uint8 (num_tokens, hidden * 3 / 2) as per_token_cast_e5m6 returns
    them (or their int32 words, (num_tokens, hidden * 3 / 8)), times their scales -> (num_tokens, hidden)
    out_dtype (bfloat16 or float32), bit-exact (TileKernels' `cast_back(..., x_special_fmt='e5m6')`).
    block_size = (block_tokens, block_channels), default (1, hidden): one scale per token. sf's forms and layout
    are cast_back's, read off its strides (stride(0) == 1: column-major, float32 or packed UE8M0 int32)."""
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ShapeError(f"cast_back_e5m6: out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    words = _e5m6_words(x)
    if block_size is None:
        block_size = (1, words.shape[1] // 3 * 8)
    return _cast_back("cast_back_e5m6", words, sf, block_size, out_dtype, config)


# -- engram_gate ---------------------------------------------------------------------------------------

def engram_gate_fwd(hidden_states: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight_fused: torch.Tensor,
                    eps: float, clamp_value: float, *, config=None) -> tuple[torch.Tensor, ...]:
    """TileKernels' `engram.engram_gate_fwd` on the flattened tokens: hidden_states, k (num_tokens, hc_mult,
    hidden_size) and v (num_tokens, hidden_size) bf16 (k and v may be row-strided views), weight_fused
    (hc_mult, hidden_size) float32 -> (out bf16 like hidden_states, dot, gate_score, rstd_x, rstd_k
    (num_tokens, hc_mult) float32). Not differentiable by itself (see tkjit.autograd)."""
    tensors = (hidden_states, k, v, weight_fused)
    if is_eager(*tensors):
        return torch_ops.engram_gate_fwd_impl(*tensors, eps, clamp_value, encode_config(config))
    return torch.ops.tkjit.engram_gate_fwd.default(*tensors, float(eps), float(clamp_value), encode_config(config))


# -- per_channel_cast_fused ---------------------------------------------------------------------------

def per_channel_cast_fused(x: torch.Tensor, num_per_tokens: int = 128, *, x_sf: torch.Tensor | None = None,
                           pos_to_token: torch.Tensor | None = None, round_scale: bool = False,
                           config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """per_channel_cast of rows gathered through pos_to_token ((num_tokens_out,) int32; a position outside
    [0, num_tokens) gives a zero row), from x (num_tokens, hidden) bf16/f32, or FP8 e4m3 x dequantised by
    x_sf (num_tokens, hidden / 128) float32, both contiguous: (fp8 e4m3 values (num_tokens_out, hidden), float32
    scales (ceil(num_tokens_out / num_per_tokens), hidden)); TileKernels' `per_channel_cast_fused`. The last
    block of rows may be partial."""
    args = (x, x_sf, pos_to_token, num_per_tokens, round_scale, encode_config(config))
    if is_eager(*[t for t in (x, x_sf, pos_to_token) if t is not None]):
        return torch_ops.per_channel_cast_fused_impl(*args)
    return torch.ops.tkjit.per_channel_cast_fused.default(*args)


# -- mhc_head_compute_mix / mhc_pre_split_mixes -------------------------------------------------------

def _mix_param(fn: str, name: str, t, shape: tuple, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TensorError(f"{fn}: {name} must be a torch.Tensor of shape {shape}, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TensorError(f"{fn}: {name} must be torch.float32, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise TensorError(f"{fn}: {name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise TensorError(f"{fn}: {name} is on {t.device}, the mixes on {device}")


def check_head_compute_mix(fn: str, input_mix, mhc_scale, mhc_base) -> int:
    """TensorError naming the bad argument of mhc_head_compute_mix: input_mix (..., mhc_mult) float32,
    mhc_scale (1,), mhc_base (mhc_mult,) float32 on its device. Returns mhc_mult."""
    _mhc_tensor(fn, "input_mix", input_mix, 1, torch.float32, "(..., mhc_mult)")
    m = input_mix.shape[-1]
    _mix_param(fn, "mhc_scale", mhc_scale, (1,), input_mix.device)
    _mix_param(fn, "mhc_base", mhc_base, (m,), input_mix.device)
    return m


def check_pre_split_mixes(fn: str, input_mixes, mhc_scale, mhc_base, mhc_mult) -> int:
    """ShapeError / TensorError naming the bad argument of mhc_pre_split_mixes: mhc_mult an int >= 1,
    input_mixes (..., 2 * mhc_mult + mhc_mult**2) float32, mhc_scale (3,), mhc_base (2m + m*m,). Returns the
    row width."""
    if isinstance(mhc_mult, bool) or not isinstance(mhc_mult, int) or mhc_mult < 1:
        raise ShapeError(f"{fn}: mhc_mult must be an int >= 1, got {mhc_mult!r}")
    w = 2 * mhc_mult + mhc_mult * mhc_mult
    _mhc_tensor(fn, "input_mixes", input_mixes, 1, torch.float32, f"(..., {w})")
    if input_mixes.shape[-1] != w:
        raise TensorError(f"{fn}: input_mixes must have 2 * mhc_mult + mhc_mult**2 = {w} columns (mhc_mult="
                          f"{mhc_mult}), got shape {tuple(input_mixes.shape)}")
    _mix_param(fn, "mhc_scale", mhc_scale, (3,), input_mixes.device)
    _mix_param(fn, "mhc_base", mhc_base, (w,), input_mixes.device)
    return w


def mhc_head_compute_mix(input_mix: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor,
                         mhc_pre_eps: float, *, config=None, bwd_config=None) -> torch.Tensor:
    """input_mix (..., mhc_mult) float32, mhc_scale (1,), mhc_base (mhc_mult,) float32 -> (..., mhc_mult)
    float32 = sigmoid(input_mix * mhc_scale + mhc_base) + mhc_pre_eps (TileKernels' mhc_head_compute_mix).
    Differentiable in all three tensors (the gradient runs mhc_head_compute_mix_bwd)."""
    from tkjit.autograd import mhc_head_compute_mix as differentiable

    m = check_head_compute_mix("mhc_head_compute_mix", input_mix, mhc_scale, mhc_base)
    scale, base = mhc_scale.contiguous(), mhc_base.contiguous()
    if not is_eager(input_mix, scale, base):  # (the Function flattens the leading dims itself: one autograd node)
        return differentiable(input_mix, scale, base, mhc_pre_eps, config, bwd_config)
    flat = input_mix.reshape(-1, m).contiguous()
    out = torch_ops.mhc_head_compute_mix_impl(flat, scale, base, float(mhc_pre_eps), encode_config(config))
    return out.view(input_mix.shape)


def mhc_head_compute_mix_bwd(output_mix_grad: torch.Tensor, input_mix: torch.Tensor, mhc_scale: torch.Tensor,
                             mhc_base: torch.Tensor, *, config=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mhc_head_compute_mix's gradients given output_mix_grad (input_mix's shape) float32: (input_mix_grad,
    mhc_scale_grad (1,), mhc_base_grad (mhc_mult,)), float32."""
    fn = "mhc_head_compute_mix_bwd"
    m = check_head_compute_mix(fn, input_mix, mhc_scale, mhc_base)
    _mhc_tensor(fn, "output_mix_grad", output_mix_grad, 1, torch.float32, "(..., mhc_mult)")
    if output_mix_grad.shape != input_mix.shape:
        raise TensorError(f"{fn}: output_mix_grad must have input_mix's shape {tuple(input_mix.shape)}, got "
                          f"{tuple(output_mix_grad.shape)}")
    tensors = (output_mix_grad.reshape(-1, m).contiguous(), input_mix.reshape(-1, m).contiguous(),
               mhc_scale.contiguous(), mhc_base.contiguous())
    if is_eager(*tensors):
        g, gs, gb = torch_ops.mhc_head_compute_mix_bwd_impl(*tensors, encode_config(config))
    else:
        g, gs, gb = torch.ops.tkjit.mhc_head_compute_mix_bwd.default(*tensors, encode_config(config))
    return g.view(input_mix.shape), gs, gb


def mhc_pre_split_mixes(input_mixes: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor, mhc_mult: int,
                        mhc_post_mult_value: float, mhc_pre_eps: float, *, config=None,
                        bwd_config=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_mixes (..., 2m + m*m) float32, mhc_scale (3,), mhc_base (2m + m*m,) float32 -> pre_layer_mix
    (..., m, 1) = sigmoid(z[:m]) + mhc_pre_eps, post_layer_mix (..., m, 1) = sigmoid(z[m:2m]) *
    mhc_post_mult_value, comb_res_mix (..., m, m) = z[2m:], z = input_mixes * mhc_scale[k] + mhc_base
    (TileKernels' mhc_pre_split_mixes). Differentiable (the gradient runs mhc_pre_split_mixes_bwd)."""
    from tkjit.autograd import mhc_pre_split_mixes as differentiable

    w = check_pre_split_mixes("mhc_pre_split_mixes", input_mixes, mhc_scale, mhc_base, mhc_mult)
    scale, base = mhc_scale.contiguous(), mhc_base.contiguous()
    args = (mhc_mult, float(mhc_post_mult_value), float(mhc_pre_eps))
    if not is_eager(input_mixes, scale, base):  # (the Function flattens the leading dims itself: one autograd node)
        return differentiable(input_mixes, scale, base, *args, config, bwd_config)
    flat = input_mixes.reshape(-1, w).contiguous()
    pre, post, comb = torch_ops.mhc_pre_split_mixes_impl(flat, scale, base, *args, encode_config(config))
    lead, m = input_mixes.shape[:-1], mhc_mult
    return pre.view(*lead, m, 1), post.view(*lead, m, 1), comb.view(*lead, m, m)


def mhc_pre_split_mixes_bwd(pre_layer_mix_grad: torch.Tensor, post_layer_mix_grad: torch.Tensor,
                            comb_res_mix_grad: torch.Tensor, input_mixes: torch.Tensor, mhc_scale: torch.Tensor,
                            mhc_base: torch.Tensor, mhc_mult: int, mhc_post_mult_value: float, *,
                            config=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mhc_pre_split_mixes' gradients given the three outputs' gradients (their shapes, float32):
    (input_mixes_grad, mhc_scale_grad (3,), mhc_base_grad (2m + m*m,)), float32."""
    fn = "mhc_pre_split_mixes_bwd"
    w = check_pre_split_mixes(fn, input_mixes, mhc_scale, mhc_base, mhc_mult)
    lead, m = tuple(input_mixes.shape[:-1]), mhc_mult
    grads = []
    for name, g, shape in (("pre_layer_mix_grad", pre_layer_mix_grad, (*lead, m, 1)),
                           ("post_layer_mix_grad", post_layer_mix_grad, (*lead, m, 1)),
                           ("comb_res_mix_grad", comb_res_mix_grad, (*lead, m, m))):
        _mhc_tensor(fn, name, g, 1, torch.float32, f"of shape {shape}")
        if tuple(g.shape) != shape:
            raise TensorError(f"{fn}: {name} must have shape {shape}, got {tuple(g.shape)}")
        grads.append(g.reshape(-1, shape[-2] * shape[-1]).contiguous())
    tensors = (*grads, input_mixes.reshape(-1, w).contiguous(), mhc_scale.contiguous(), mhc_base.contiguous())
    if is_eager(*tensors):
        g, gs, gb = torch_ops.mhc_pre_split_mixes_bwd_impl(*tensors, float(mhc_post_mult_value), encode_config(config))
    else:
        g, gs, gb = torch.ops.tkjit.mhc_pre_split_mixes_bwd.default(*tensors, float(mhc_post_mult_value),
                                                                   encode_config(config))
    return g.view(input_mixes.shape), gs, gb


# -- swiglu_forward_and_per_token_cast ----------------------------------------------------------------

def swiglu_forward_and_per_token_cast(
    x: torch.Tensor, group: int = 128, *, pos_to_token_topk: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None, pos_to_expert: torch.Tensor | None = None,
    swiglu_clamp_value: float | None = None, clamped_count: torch.Tensor | None = None, round_scale: bool = False,
    col_major_scales: bool = False, packed_ue8m0: bool = False, sf_clamp_min: float | None = None, config=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (num_tokens, 2 * hidden) bf16/f32 -> silu(gate) * up, then per_token_cast's FP8 e4m3 cast with one
    float32 scale per token and `group` channels (16, 32, 64, 128 or hidden, dividing hidden); TileKernels'
    `swiglu_forward_and_per_token_cast`. Optional: swiglu_clamp_value (> 0) clamps gate to <= it and up to
    [-it, it] first, and clamped_count ((3,) int64) is then added to in place; rows times
    topk_weights.flat[pos_to_token_topk] (out-of-range positions weigh 0); pos_to_expert < 0 rows are zero rows;
    sf_clamp_min replaces the 1e-4 amax clamp. Scales as `per_token_cast` returns them (row-major,
    col_major_scales, packed_ue8m0)."""
    if packed_ue8m0 and not col_major_scales:
        raise ShapeError("swiglu_forward_and_per_token_cast: packed_ue8m0 needs col_major_scales=True (the packed "
                         "layout is column-major)")
    if clamped_count is not None and swiglu_clamp_value is None:
        raise ShapeError("swiglu_forward_and_per_token_cast: clamped_count needs swiglu_clamp_value")
    clamp = 0.0 if swiglu_clamp_value is None else float(swiglu_clamp_value)
    if swiglu_clamp_value is not None and not clamp > 0:
        raise ShapeError(f"swiglu_forward_and_per_token_cast: swiglu_clamp_value must be > 0, got "
                         f"{swiglu_clamp_value!r}")
    amin = 1e-4 if sf_clamp_min is None else float(sf_clamp_min)
    args = (x, pos_to_token_topk, topk_weights, pos_to_expert, clamped_count, group, round_scale, col_major_scales,
            clamp, amin, encode_config(config))
    tensors = [t for t in args[:5] if t is not None]
    if is_eager(*tensors):
        q, sf = torch_ops.swiglu_forward_and_per_token_cast_impl(*args)
    else:
        q, sf = torch.ops.tkjit.swiglu_forward_and_per_token_cast.default(*args)
    if not col_major_scales:
        return q, sf
    if packed_ue8m0:
        sf = pack_ue8m0(sf)
    return q, sf[:, : x.shape[0]].T


# -- swiglu_backward_and_per_token_cast --------------------------------------------------------------

def swiglu_backward_and_per_token_cast(x: torch.Tensor, x_sf: torch.Tensor, grad_out: torch.Tensor,
                                       weight: torch.Tensor, pos_to_token_topk: torch.Tensor,
                                       token_topk_to_pos: torch.Tensor, num_per_channels: int = 128, *,
                                       round_scale: bool = False, swiglu_clamp_value: float | None = None,
                                       config=None) -> tuple[torch.Tensor, ...]:
    """SwiGLU backward of FP8 MoE rows x (E, 2 * hidden) float8_e4m3fn with scales x_sf (E, 2 * hidden /
    num_per_channels) float32, given grad_out (E, hidden) bf16 of out = silu(a) * b * w, the routing weights
    weight (num_tokens, num_topk) float32 and the maps pos_to_token_topk (E,) / token_topk_to_pos (num_tokens,
    num_topk) int32 (-1: padding / not sent): (out (E, hidden) bf16, x_grad_fp8 (E, 2 * hidden) fp8 e4m3,
    x_grad_sf (E, 2 * hidden / num_per_channels) float32, x_grad (E, 2 * hidden) bf16, weight_grad float32);
    TileKernels' `swiglu_backward_and_per_token_cast` (round_scale: its round_sf)."""
    clamp = None if swiglu_clamp_value is None else float(swiglu_clamp_value)
    args = (x, x_sf, grad_out, weight, pos_to_token_topk, token_topk_to_pos, num_per_channels, round_scale, clamp,
            encode_config(config))
    if is_eager(x, x_sf, grad_out, weight, pos_to_token_topk, token_topk_to_pos):
        return torch_ops.swiglu_backward_and_per_token_cast_impl(*args)
    return torch.ops.tkjit.swiglu_backward_and_per_token_cast.default(*args)


# -- swiglu_forward_and_per_channel_cast(_and_transpose) ---------------------------------------------

def _swiglu_channel(name, x, num_per_tokens, round_scale, swiglu_clamp_value, config):
    clamp = None if swiglu_clamp_value is None else float(swiglu_clamp_value)
    args = (x, num_per_tokens, round_scale, clamp, encode_config(config))
    if is_eager(x):
        return getattr(torch_ops, f"{name}_impl")(*args)
    return getattr(torch.ops.tkjit, name).default(*args)


def swiglu_forward_and_per_channel_cast_and_transpose(
        x: torch.Tensor, num_per_tokens: int = 128, *, round_scale: bool = False,
        swiglu_clamp_value: float | None = None, config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """x = [gate | up] (num_tokens, 2 * hidden) bf16/f32, contiguous -> per_channel_cast_and_transpose of the
    SwiGLU activations gate / (1 + exp(-gate)) * up (float32, rounded to x's dtype; with swiglu_clamp_value c:
    gate <= c and |up| <= c first): (fp8 e4m3 values (hidden, num_tokens), float32 scales (num_tokens /
    num_per_tokens, hidden)); TileKernels' `swiglu_forward_and_per_channel_cast_and_transpose`."""
    return _swiglu_channel("swiglu_forward_and_per_channel_cast_and_transpose", x, num_per_tokens, round_scale,
                           swiglu_clamp_value, config)


def swiglu_forward_and_per_channel_cast(
        x: torch.Tensor, num_per_tokens: int = 128, *, round_scale: bool = False,
        swiglu_clamp_value: float | None = None, config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same, values not transposed: (fp8 e4m3 (num_tokens, hidden), float32 scales); TileKernels'
    `swiglu_forward_and_per_channel_cast_and_transpose(..., without_transpose=True)`."""
    return _swiglu_channel("swiglu_forward_and_per_channel_cast", x, num_per_tokens, round_scale,
                           swiglu_clamp_value, config)


# -- engram_gate_bwd / grad_w_reduce -------------------------------------------------------------------

def engram_gate_bwd(grad_out: torch.Tensor, hidden_states: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    weight_fused: torch.Tensor, dot: torch.Tensor, gate_score: torch.Tensor, rstd_x: torch.Tensor,
                    rstd_k: torch.Tensor, clamp_value: float, *, num_partials: int = torch_ops.ENGRAM_PARTIALS,
                    config=None) -> tuple[torch.Tensor, ...]:
    """TileKernels' `engram.engram_gate_bwd` on the flattened tokens: grad_out (num_tokens, hc_mult,
    hidden_size) bf16, engram_gate_fwd's inputs and saved values -> (grad_x, grad_k (num_tokens, hc_mult,
    hidden_size), grad_v (num_tokens, hidden_size) bf16, grad_w_partial (num_partials, hc_mult, hidden_size)
    float32: weight_fused's gradient summed per persistent block; `grad_w_reduce` finishes it)."""
    tensors = (grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k)
    args = (float(clamp_value), int(num_partials), encode_config(config))
    if is_eager(*tensors):
        return torch_ops.engram_gate_bwd_impl(*tensors, *args)
    return torch.ops.tkjit.engram_gate_bwd.default(*tensors, *args)


def grad_w_reduce(grad_w_partial: torch.Tensor, weight_hidden: torch.Tensor, weight_embed: torch.Tensor,
                  grad_weight_hidden: torch.Tensor, grad_weight_embed: torch.Tensor, *, config=None) -> None:
    """TileKernels' `engram.grad_w_reduce`: g = grad_w_partial (num_partials, hc_mult, hidden_size) float32
    summed over its rows, then in place grad_weight_hidden += g * weight_embed and grad_weight_embed += g *
    weight_hidden ((hc_mult, hidden_size): bf16 weights, float32 gradients, contiguous)."""
    tensors = (grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed)
    if is_eager(*tensors):
        torch_ops.grad_w_reduce_impl(*tensors, encode_config(config))
    else:
        torch.ops.tkjit.grad_w_reduce.default(*tensors, encode_config(config))


def engram_gate(hidden_states: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight_hidden: torch.Tensor,
                weight_embed: torch.Tensor, clamp_value: float, eps: float) -> torch.Tensor:
    """Differentiable fused Engram gate over any leading dims (TileKernels' `modeling.engram.engram_gate`):
    hidden_states, k (..., hc_mult, hidden_size), v (..., hidden_size), weights (hc_mult, hidden_size) bf16
    -> (..., hc_mult, hidden_size) bf16; the gradients run engram_gate_bwd and grad_w_reduce (a weight's
    `main_grad`, when it has one, takes its gradient in place)."""
    from tkjit.autograd import engram_gate as _engram_gate

    return _engram_gate(hidden_states, k, v, weight_hidden, weight_embed, clamp_value, eps)


# -- mhc_pre_norm_fn ---------------------------------------------------------------------------------

def check_pre_norm_fn(fn: str, residual, mhc_fn, mhc_norm_weight) -> tuple[int, int]:
    """TensorError / ShapeError naming the bad argument of mhc_pre_norm_fn: residual (..., mhc_mult, hidden)
    bf16, mhc_fn (M, mhc_mult * hidden) float32 (M <= 80), mhc_norm_weight None or (mhc_mult * hidden,) float32,
    on residual's device. Returns (M, K)."""
    _mhc_tensor(fn, "residual", residual, 2, torch.bfloat16, "(..., mhc_mult, hidden)")
    k = residual.shape[-1] * residual.shape[-2]
    _mhc_tensor(fn, "mhc_fn", mhc_fn, 2, torch.float32, f"of shape (M, {k})")
    if mhc_fn.dim() != 2 or mhc_fn.shape[1] != k:
        raise TensorError(f"{fn}: mhc_fn must have shape (M, mhc_mult * hidden = {k}) (residual is "
                          f"{tuple(residual.shape)}), got {tuple(mhc_fn.shape)}")
    if mhc_fn.device != residual.device:
        raise TensorError(f"{fn}: mhc_fn is on {mhc_fn.device}, residual on {residual.device}")
    if not 1 <= mhc_fn.shape[0] <= 80:
        raise ShapeError(f"{fn}: mhc_fn must have 1 to 80 rows (mhc_mult * (mhc_mult + 2)), got {mhc_fn.shape[0]}")
    if k % 32:
        raise ShapeError(f"{fn}: mhc_mult * hidden = {k} must be a multiple of 32")
    if mhc_norm_weight is not None:
        _mix_param(fn, "mhc_norm_weight", mhc_norm_weight, (k,), residual.device)
    return mhc_fn.shape[0], k


def mhc_pre_norm_fn(residual: torch.Tensor, mhc_fn: torch.Tensor, mhc_norm_weight: torch.Tensor | None,
                    mhc_norm_eps: float, fuse_grad_acc: bool = True, *, config=None,
                    bwd_config=None) -> torch.Tensor:
    """residual (..., mhc_mult, hidden) bf16, mhc_fn (M, mhc_mult * hidden) float32 (times mhc_norm_weight when
    given) -> (..., M) float32 = (x @ tf32(fn)^T) * rsqrt(mean(x**2) + mhc_norm_eps), x the token's flattened
    residual (TileKernels' mhc_pre_norm_fn). Differentiable in residual, mhc_fn and mhc_norm_weight (the gradient
    runs mhc_pre_norm_fn_bwd); fuse_grad_acc: the residual's gradient goes into mhc_post's (see autograd)."""
    from tkjit.autograd import fn_normw_merge
    from tkjit.autograd import mhc_pre_norm_fn as differentiable

    m3, k = check_pre_norm_fn("mhc_pre_norm_fn", residual, mhc_fn, mhc_norm_weight)
    fn = mhc_fn if mhc_norm_weight is None else fn_normw_merge(mhc_fn, mhc_norm_weight)
    fn = fn.contiguous()
    if not is_eager(residual, fn):  # (the Function flattens the leading dims itself: one autograd node)
        return differentiable(residual, fn, mhc_norm_eps, fuse_grad_acc, config, bwd_config)
    x = residual.reshape(-1, k).contiguous()
    out = torch_ops.mhc_pre_norm_fn_impl(x, fn, float(mhc_norm_eps), encode_config(config))[0]
    return out.view(*residual.shape[:-2], m3)


# -- per_token_cast_e2m1 ------------------------------------------------------------------------------

def per_token_cast_e2m1(
    x: torch.Tensor, group: int = 128, *, round_scale: bool = False, col_major_scales: bool = False,
    packed_ue8m0: bool = False, config=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_tokens, hidden) bf16/f32 -> (FP4 e2m1 values, float32 scales per `group` channels), TileKernels'
    `per_token_cast(x, 'e2m1', group)`: the values as int8 (num_tokens, hidden / 2), two codes per byte, the
    even channel in the low nibble; one scale amax / 6 per token and group. group and the scales' layouts
    (col_major_scales, packed_ue8m0, round_scale) are `per_token_cast`'s."""
    if packed_ue8m0 and not col_major_scales:
        raise ShapeError("per_token_cast_e2m1: packed_ue8m0 needs col_major_scales=True (the packed layout is "
                         "column-major)")
    cfg = encode_config(config)
    eager = is_eager(x)
    if not col_major_scales:
        op = torch_ops.per_token_cast_e2m1_impl if eager else torch.ops.tkjit.per_token_cast_e2m1.default
        return op(x, group, round_scale, cfg)
    op = torch_ops.per_token_cast_e2m1_colmajor_impl if eager else torch.ops.tkjit.per_token_cast_e2m1_colmajor.default
    q, storage = op(x, group, round_scale, cfg)
    if packed_ue8m0:
        storage = pack_ue8m0(storage)
    return q, storage[:, : x.shape[0]].T


# -- mhc_multilayer_recompute -------------------------------------------------------------------------

def check_multilayer_recompute(fn: str, initial_residual, pre_mix, layer_output, post_mix, comb_mix) -> tuple:
    """TensorError / ShapeError naming the bad argument of the stacked mhc_multilayer_recompute; returns
    (num_tokens, mhc_mult, hidden, num_layers, num_post). Each tensor holds its layers' values contiguously:
    initial_residual (..., mhc_mult, hidden) bf16, pre_mix (num_layers, ..., mhc_mult[, 1]) float32,
    layer_output (num_post, ..., hidden) bf16, post_mix (num_post, ..., mhc_mult[, 1]) and comb_mix (num_post,
    ..., mhc_mult, mhc_mult) float32, the same tokens in each."""
    _mhc_tensor(fn, "initial_residual", initial_residual, 2, torch.bfloat16, "(..., mhc_mult, hidden)")
    m, h = initial_residual.shape[-2:]
    n = initial_residual.numel() // max(1, m * h)
    for name, t, dtype, per_token, what in (
            ("pre_mix", pre_mix, torch.float32, m, "(num_layers, ..., mhc_mult, 1)"),
            ("layer_output", layer_output, torch.bfloat16, h, "(num_post, ..., hidden)"),
            ("post_mix", post_mix, torch.float32, m, "(num_post, ..., mhc_mult, 1)"),
            ("comb_mix", comb_mix, torch.float32, m * m, "(num_post, ..., mhc_mult, mhc_mult)")):
        _mhc_tensor(fn, name, t, 1, dtype, what)
        if t.numel() != t.shape[0] * n * per_token:
            raise TensorError(f"{fn}: {name} must be {what}: {n} tokens of {per_token} values per layer "
                              f"(initial_residual {tuple(initial_residual.shape)}), got {tuple(t.shape)}")
        if t.device != initial_residual.device:
            raise TensorError(f"{fn}: {name} is on {t.device}, initial_residual on {initial_residual.device}")
    num_layers, num_post = pre_mix.shape[0], layer_output.shape[0]
    if num_layers < 1 or num_post not in (num_layers, num_layers - 1):
        raise ShapeError(f"{fn}: layer_output has {num_post} layers, pre_mix {num_layers}: num_post must be num_layers "
                         "or num_layers - 1 (num_layers >= 1)")
    for name, t in (("post_mix", post_mix), ("comb_mix", comb_mix)):
        if t.shape[0] != num_post:
            raise ShapeError(f"{fn}: {name} has {t.shape[0]} layers, layer_output {num_post}")
    return n, m, h, num_layers, num_post


def mhc_multilayer_recompute(initial_residual: torch.Tensor, pre_mix: torch.Tensor, layer_output: torch.Tensor,
                             post_mix: torch.Tensor, comb_mix: torch.Tensor, *,
                             out: tuple[torch.Tensor, torch.Tensor] | None = None,
                             config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """TileKernels' `mhc_multilayer_recompute` on stacked layers: per layer l, layer_input[l] =
    mhc_pre_apply_mix(res, pre_mix[l]) and, for l < num_post, res = residual[l] = mhc_post_fwd(layer_output[l],
    res, post_mix[l], comb_mix[l]), from res = initial_residual; one kernel, bit-identical to those ops.
    Shapes as `check_multilayer_recompute`; returns (layer_input (num_layers, ..., hidden), residual (num_post,
    ..., mhc_mult, hidden)) bf16, written into out = (layer_input, residual) when given (contiguous, those
    shapes). Not differentiable (a recomputation)."""
    fn = "mhc_multilayer_recompute"
    n, m, h, num_layers, num_post = check_multilayer_recompute(fn, initial_residual, pre_mix, layer_output, post_mix,
                                                               comb_mix)
    lead = tuple(initial_residual.shape[:-2])

    def flat(t, *shape):
        return t.reshape(shape).contiguous()

    tensors = (flat(initial_residual, n, m, h), flat(pre_mix, num_layers, n, m), flat(layer_output, num_post, n, h),
               flat(post_mix, num_post, n, m), flat(comb_mix, num_post, n, m, m))
    cfg = encode_config(config)
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TensorError(f"{fn}: out must be a (layer_input, residual) pair, got {type(out).__name__}")
        li, res = out
        _mhc_out(fn, li, (num_layers, *lead, h), initial_residual.device, "out[0] (layer_input)")
        _mhc_out(fn, res, (num_post, *lead, m, h), initial_residual.device, "out[1] (residual)")
        flat_out = (li.view(num_layers, n, h), res.view(num_post, n, m, h))
        if is_eager(*tensors, *flat_out):
            torch_ops.mhc_multilayer_recompute_impl(*tensors, cfg, out=flat_out)
        else:
            got = torch.ops.tkjit.mhc_multilayer_recompute.default(*tensors, cfg)
            for o, g in zip(flat_out, got):
                o.copy_(g)
        return li, res
    if is_eager(*tensors):
        li, res = torch_ops.mhc_multilayer_recompute_impl(*tensors, cfg)
    else:
        li, res = torch.ops.tkjit.mhc_multilayer_recompute.default(*tensors, cfg)
    return li.view(num_layers, *lead, h), res.view(num_post, *lead, m, h)


STACK_ALIGN = 16  # bytes: the widest vector access of the kernel


def is_storage_of(items: list[torch.Tensor], stacked: torch.Tensor) -> bool:
    """Whether `stacked` is the items' own storage (their consecutive slices), not a copy (traced, or fake
    tensors: never, as stacked_layers then always copies)."""
    if not plain(stacked):
        return False
    return bool(items) and stacked.data_ptr() == items[0].data_ptr() and stacked.untyped_storage().data_ptr() == \
        items[0].untyped_storage().data_ptr()


def stacked_layers(items: list[torch.Tensor], shape: tuple, dtype: torch.dtype, device: torch.device,
                   read: bool = True) -> torch.Tensor:
    """The items (each `shape`'s element count) as one contiguous (len(items), *shape) tensor: a view of their
    storage when they are consecutive contiguous slices of one buffer, starting on a 16-byte boundary;
    else a stacked copy (read) or a fresh buffer for the results (not read). Traced (torch.compile) or fake,
    tensors have no addresses: always the copy or the fresh buffer."""
    k, numel = len(items), 1
    for s in shape:
        numel *= s
    if k and all(plain(t) and t.is_contiguous() for t in items) and items[0].data_ptr() % STACK_ALIGN == 0:
        base, step = items[0].data_ptr(), numel * items[0].element_size()
        storage = items[0].untyped_storage().data_ptr()
        if all(t.data_ptr() == base + i * step and t.untyped_storage().data_ptr() == storage
               for i, t in enumerate(items)):
            strides, acc = [], 1
            for s in reversed((k, *shape)):
                strides.append(acc)
                acc *= s
            return items[0].as_strided((k, *shape), tuple(reversed(strides)), items[0].storage_offset())
    if read and k:
        return torch.stack([t.reshape(shape) for t in items])
    return torch.empty((k, *shape), dtype=dtype, device=device)


# -- per_block_cast_lossless -------------------------------------------------------------------------

def _row_major_scales(fn: str, sf: torch.Tensor, cols: int) -> torch.Tensor:
    """Scales as the lossless kernel reads them, float32 row-major: a row-major float32 sf as it is (any row
    stride); a column-major one (sf.stride(0) == 1, TileKernels' test) copied row-major; packed UE8M0 int32
    (rows, ceil(cols / 4)) unpacked to 2^(byte - 127) (byte 0 -> 0.0, refused by the kernel as lossy)."""
    need(sf, (2,), fn)
    if sf.dtype == torch.int32:
        from tkjit_kernels.quant.cast_back import unpack_ue8m0

        if sf.shape[1] != -(-cols // 4):
            raise TensorError(f"{fn}: packed UE8M0 sf has {sf.shape[1]} int32 columns, expected ceil({cols} / 4)")
        return unpack_ue8m0(sf, cols)
    if sf.dtype == torch.float32 and sf.stride(0) == 1:
        return torch.empty(sf.shape, dtype=torch.float32, device=sf.device).copy_(sf)
    return sf


def per_block_cast_lossless(
    x: torch.Tensor, sf: torch.Tensor, in_block_size: tuple[int, int] = (1, 32),
    out_block_size: tuple[int, int] = (128, 128), *, col_major_scales: bool = False, packed_ue8m0: bool = False,
    config=None,
):
    """FP4 e2m1 x (int8 (num_tokens, hidden / 2), two codes per byte, low nibble first) with power-of-two scales
    sf per in_block_size = (block_m, block_k) -> (fp8 e4m3 values (num_tokens, hidden), float32 scales per
    out_block_size block), exactly: values * scales equal x's values. sf is float32 (ceil(num_tokens / block_m),
    ceil(hidden / block_k)), row-major (any row stride) or column-major (stride(0) == 1), or packed UE8M0 int32
    (.., ceil(cols / 4)), column-major. A cast that would lose values (a scale not a positive power of two, or
    more than 2^11 below its output block's largest) raises TensorError naming the block (a device sync).
    col_major_scales / packed_ue8m0 lay the output scales out as per_block_cast's."""
    fn = "per_block_cast_lossless"
    if packed_ue8m0 and not col_major_scales:
        raise ShapeError(f"{fn}: packed_ue8m0 needs col_major_scales=True (the packed layout is column-major)")
    for what, b in (("in_block_size", in_block_size), ("out_block_size", out_block_size)):
        if not isinstance(b, (tuple, list)) or len(b) != 2:
            raise ShapeError(f"{fn}: {what} must be (block_m, block_k), got {b!r}")
    (bmi, bki), (bmo, bko) = in_block_size, out_block_size
    need(x, (2,), fn)
    sf = _row_major_scales(fn, sf, -(-int(x.shape[1]) * 2 // bki) if isinstance(bki, int) and bki > 0 else 1)
    args = (x, sf, bmi, bki, bmo, bko, encode_config(config))
    eager = is_eager(x, sf)
    if not col_major_scales:
        return (torch_ops.per_block_cast_lossless_impl if eager else _ops.per_block_cast_lossless.default)(*args)
    op = torch_ops.per_block_cast_lossless_colmajor_impl if eager else _ops.per_block_cast_lossless_colmajor.default
    q, storage = op(*args)
    if packed_ue8m0:
        storage = pack_ue8m0(storage)
    return q, storage[:, : (x.shape[0] + bmo - 1) // bmo].T


# -- mhc_pre_big_fuse --------------------------------------------------------------------------------

def check_pre_big_fuse(fn: str, residual, mhc_fn, mhc_scale, mhc_base) -> tuple[int, int]:
    """TensorError / ShapeError naming the bad argument of mhc_pre_big_fuse: residual (..., mhc_mult, hidden)
    bf16, mhc_fn (mhc_mult * (mhc_mult + 2), mhc_mult * hidden) float32, mhc_scale (3,), mhc_base
    (mhc_mult * (mhc_mult + 2),) float32, all on residual's device. Returns (mhc_mult, hidden)."""
    _mhc_tensor(fn, "residual", residual, 2, torch.bfloat16, "(..., mhc_mult, hidden)")
    m, h = residual.shape[-2], residual.shape[-1]
    w = 2 * m + m * m
    if not 1 <= m <= 8:
        raise ShapeError(f"{fn}: mhc_mult (residual.shape[-2]) must be 1 to 8 (the GEMM's mhc_mult * (mhc_mult + 2) "
                         f"<= 80 rows), got {m}")
    _mhc_tensor(fn, "fn", mhc_fn, 2, torch.float32, f"of shape ({w}, {m * h})")
    if tuple(mhc_fn.shape) != (w, m * h):
        raise TensorError(f"{fn}: fn must have shape (mhc_mult * (mhc_mult + 2), mhc_mult * hidden) = {(w, m * h)} "
                          f"(residual is {tuple(residual.shape)}), got {tuple(mhc_fn.shape)}")
    if mhc_fn.device != residual.device:
        raise TensorError(f"{fn}: fn is on {mhc_fn.device}, residual on {residual.device}")
    if (m * h) % 32:
        raise ShapeError(f"{fn}: mhc_mult * hidden = {m * h} must be a multiple of 32")
    _mix_param(fn, "mhc_scale", mhc_scale, (3,), residual.device)
    _mix_param(fn, "mhc_base", mhc_base, (w,), residual.device)
    return m, h


def mhc_pre_big_fuse(residual: torch.Tensor, fn: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor,
                     rms_eps: float, mhc_pre_eps: float, mhc_sinkhorn_eps: float, mhc_post_mult_value: float,
                     sinkhorn_repeat: int, *, config=None,
                     gemm_config=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC's inference pre-processing, fused (TileKernels' mhc_pre_big_fuse): residual (..., mhc_mult, hidden)
    bf16, fn (mhc_mult * (mhc_mult + 2), mhc_mult * hidden) float32, mhc_scale (3,), mhc_base float32 ->
    (post_mix (..., mhc_mult, 1) float32, comb_mix (..., mhc_mult, mhc_mult) float32 (Sinkhorn-normalised),
    layer_input (..., hidden) bf16): mhc_pre_norm_fn without a norm weight, mhc_pre_split_mixes,
    sinkhorn_normalize and mhc_pre_apply_mix in two kernels (the GEMM, config gemm_config; the rest, config).
    Not differentiable (as TileKernels'): its outputs never require grad."""
    m, h = check_pre_big_fuse("mhc_pre_big_fuse", residual, fn, mhc_scale, mhc_base)
    outer = residual.shape[:-2]
    x = residual.reshape(-1, m, h).contiguous()
    args = (x, fn.contiguous(), mhc_scale.contiguous(), mhc_base.contiguous(), float(rms_eps), float(mhc_pre_eps),
            float(mhc_sinkhorn_eps), float(mhc_post_mult_value), int(sinkhorn_repeat), encode_config(config),
            encode_config(gemm_config))
    if not _is_compiling() and all(type(t) is torch.Tensor and not t.is_meta for t in args[:4]):
        with torch.no_grad():
            post, comb, li = torch_ops.mhc_pre_big_fuse_impl(*args)
    else:
        post, comb, li = _ops.mhc_pre_big_fuse.default(*args)
    return post.view(*outer, m, 1), comb.view(*outer, m, m), li.view(*outer, h)
