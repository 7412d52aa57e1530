"""TileKernels' `quant`: FP8/FP4 casts. tkjit serves `per_token_cast` and `per_token_cast_with_sf_only`
for fmt='e4m3' (its per_token_cast kernels), `per_channel_cast` and `per_channel_cast_and_transpose` for
fmt='e4m3' (its kernels of the same names) and `unpack_from_e2m1fn_x2` (torch); every other function
or option raises NotImplementedError naming it.

per_token_cast(x, 'e4m3', num_per_channels, ...) returns what TileKernels returns:
    values  (num_tokens, hidden) torch.float8_e4m3fn, contiguous
    scales  (num_tokens, ceil(hidden / num_per_channels)) torch.float32, the dequantisation factors;
            row-major (strides (num_groups, 1)), or with use_tma_aligned_col_major_sf=True the
            column-major view of a (num_groups, align(num_tokens, 4)) buffer: strides
            (1, align(num_tokens, 4)), the layout DeepGEMM reads; with use_packed_ue8m0=True as well,
            torch.int32 (num_tokens, ceil(num_groups / 4)): each scale's exponent byte, four groups per
            int32, the column-major view of a (ceil(num_groups / 4), align(num_tokens, 4)) buffer
            (`tkjit.scales.pack_ue8m0`), as TileKernels' reference packs it.
round_sf rounds each scale up to a power of two. num_per_channels is 16, 32, 64, 128, or hidden (one
scale per token, hidden a multiple of 64); a partial last group is allowed where tkjit's kernel takes it.

per_channel_cast(x, 'e4m3', num_per_tokens) and per_channel_cast_and_transpose (tkjit's kernels of the
same names) return
    values  (num_tokens, hidden) torch.float8_e4m3fn, resp. transposed (hidden, num_tokens); contiguous
    scales  (num_tokens / num_per_tokens, hidden) torch.float32, row-major: one per channel and block of
            num_per_tokens consecutive tokens
for x bf16 or float32 (TileKernels' transpose takes bf16 only) and num_per_tokens 32 or 128 (TileKernels'
per_channel_cast takes 128 only); num_tokens a multiple of num_per_tokens, hidden of 16 (TileKernels asks
for multiples of 128 and 64).
"""

from __future__ import annotations

import torch

from tkjit import ops
from tkjit.compat.tile_kernels._support import as_int, missing, require_kernel, rows_aligned, tensor
from tkjit.compat.tile_kernels.quant.types import QuantTensor
from tkjit.errors import ShapeError, TensorError

FAMILY = "quant"
FORMATS = ("e5m6", "e4m3", "e2m1")  # TileKernels' formats; tkjit casts to e4m3
GROUPS = (16, 32, 64, 128)  # TileKernels' per-token group sizes, besides num_per_channels == hidden
PER_CHANNEL_TOKENS = (32, 128)  # tokens per scale of the per-channel casts
__all__ = [
    "swiglu_forward_and_per_channel_cast_and_transpose", "per_channel_cast", "per_channel_cast_fused",
    "per_channel_cast_and_transpose", "swiglu_forward_and_per_token_cast", "swiglu_backward_and_per_token_cast",
    "unpack_from_e2m1fn_x2", "per_token_cast", "per_token_cast_with_precomputed_sf", "per_token_cast_with_sf_only",
    "per_block_cast", "per_block_cast_with_precomputed_sf", "per_block_cast_with_sf_only", "cast_back",
    "per_token_cast_back", "per_block_cast_lossless",
]


def _per_token_cast(
    fn: str, x, fmt, num_per_channels, x_block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0
) -> tuple[torch.Tensor, torch.Tensor]:
    """TileKernels' per_token_cast_impl checks, then tkjit's kernel: (values, scales)."""
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ShapeError(f"tile_kernels.{fn}: fmt must be one of {list(FORMATS)}, got {fmt!r}")
    if fmt != "e4m3":
        raise missing(fn, FAMILY, f"fmt={fmt!r} (tkjit casts to 'e4m3' only)")
    if x_block_size is not None or isinstance(x, tuple):
        raise missing(fn, FAMILY, f"x_block_size={x_block_size!r} (re-casting a quantised (values, scales) input)")
    if use_packed_ue8m0 and not use_tma_aligned_col_major_sf:
        # TileKernels lays packed UE8M0 out column-major only (its reference has no other form).
        raise ShapeError(f"tile_kernels.{fn}: use_packed_ue8m0=True needs use_tma_aligned_col_major_sf=True")
    tensor(fn, "x", x, (2,), (torch.bfloat16, torch.float32))
    hidden = x.shape[1]
    group = as_int(fn, "num_per_channels", num_per_channels)
    if group not in GROUPS and not (group == hidden and hidden % 64 == 0):
        raise ShapeError(
            f"tile_kernels.{fn}: num_per_channels={group} must be one of {list(GROUPS)}, or equal to hidden "
            f"({hidden}) when hidden is a multiple of 64"
        )
    round_scale = bool(round_sf)
    in_dtype = "bfloat16" if x.dtype == torch.bfloat16 else "float32"
    require_kernel(fn, FAMILY, "per_token_cast",
                   {"hidden": hidden, "group": group, "in_dtype": in_dtype, "round_scale": round_scale},
                   {"hidden": "hidden (x.shape[1])", "group": "num_per_channels", "in_dtype": "x.dtype"},
                   {"num_tokens": max(1, x.shape[0])})
    q, sf = ops.per_token_cast(rows_aligned(x), group, round_scale=round_scale,
                               col_major_scales=bool(use_tma_aligned_col_major_sf),
                               packed_ue8m0=bool(use_packed_ue8m0))
    return q, sf


def per_token_cast(
    x: torch.Tensor,
    fmt: str,
    num_per_channels: int,
    x_block_size: tuple[int, int] | None = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> QuantTensor:
    """Cast x (num_tokens, hidden) bf16/f32 to FP8 e4m3 with one float32 scale per token and group of
    num_per_channels channels: (values, scales), laid out as the module doc says."""
    return _per_token_cast("quant.per_token_cast", x, fmt, num_per_channels, x_block_size,
                           use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)


def per_token_cast_with_sf_only(
    x: torch.Tensor,
    fmt: str,
    num_per_channels: int,
    x_block_size: tuple[int, int] | None = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """per_token_cast's scales only (same values and layout). tkjit's kernel writes the FP8 values too;
    they are dropped."""
    fn = "quant.per_token_cast_with_sf_only"
    if fmt == "e5m6":  # TileKernels' e5m6 cast has no scales-only form (an assert there)
        raise ShapeError(f"tile_kernels.{fn}: fmt='e5m6' has no scales-only form")
    return _per_token_cast(fn, x, fmt, num_per_channels, x_block_size, use_tma_aligned_col_major_sf, round_sf,
                           use_packed_ue8m0)[1]


# FP4 e2m1 codes 0..15 (sign, 2 exponent bits, 1 mantissa bit): +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def unpack_from_e2m1fn_x2(x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode int8/uint8 bytes of two packed FP4 e2m1 values each (low nibble first) to out_dtype:
    (..., K) -> (..., 2 * K). A debugging helper (torch, no kernel), as in TileKernels."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int8, torch.uint8):
        raise TensorError(f"tile_kernels.quant.unpack_from_e2m1fn_x2: x must be an int8 or uint8 tensor, "
                          f"got {getattr(x, 'dtype', type(x).__name__)}")
    if x.ndim == 0:
        raise ValueError("x must have at least 1 dimension so the last dim can be doubled")
    table = torch.tensor(_E2M1, dtype=torch.float32, device=x.device)
    b = x.view(torch.uint8).to(torch.int64)
    pairs = torch.stack([table[b & 0x0F], table[b >> 4]], dim=-1)
    return pairs.reshape(*x.shape[:-1], x.shape[-1] * 2).to(out_dtype)


def swiglu_forward_and_per_channel_cast_and_transpose(
    x: torch.Tensor,
    fmt: str,
    num_per_tokens: int,
    round_sf: bool = False,
    without_transpose: bool = False,
    swiglu_clamp_value: float | None = None,
) -> QuantTensor:
    raise missing("quant.swiglu_forward_and_per_channel_cast_and_transpose", FAMILY)


def _per_channel_cast(
    fn: str, x, fmt, num_per_tokens, round_sf, transposed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """TileKernels' per_channel_cast(_and_transpose) checks, then tkjit's kernel: (values, scales)."""
    if not isinstance(fmt, str) or fmt != "e4m3":  # TileKernels asserts fmt == 'e4m3' here, whatever it casts to
        raise ShapeError(f"tile_kernels.{fn}: fmt must be 'e4m3', got {fmt!r}")
    tensor(fn, "x", x, (2,), (torch.bfloat16, torch.float32))
    if not x.is_contiguous():
        raise TensorError(f"tile_kernels.{fn}: x must be contiguous, got strides {x.stride()} for shape "
                          f"{tuple(x.shape)}")
    npt = as_int(fn, "num_per_tokens", num_per_tokens)
    if npt not in PER_CHANNEL_TOKENS:
        raise ShapeError(f"tile_kernels.{fn}: num_per_tokens must be one of {list(PER_CHANNEL_TOKENS)}, got {npt}")
    n, hidden = x.shape
    if hidden % 16:  # (TileKernels asks for a multiple of 64)
        raise ShapeError(f"tile_kernels.{fn}: hidden (x.shape[1] = {hidden}) must be a multiple of 16")
    if n % npt:
        raise ShapeError(f"tile_kernels.{fn}: num_tokens (x.shape[0] = {n}) must be a multiple of num_per_tokens "
                         f"({npt})")
    round_scale = bool(round_sf)
    name = "per_channel_cast_and_transpose" if transposed else "per_channel_cast"
    in_dtype = "bfloat16" if x.dtype == torch.bfloat16 else "float32"
    require_kernel(fn, FAMILY, name,
                   {"hidden": hidden, "num_per_tokens": npt, "in_dtype": in_dtype, "round_scale": round_scale},
                   {"hidden": "hidden (x.shape[1])", "in_dtype": "x.dtype"},
                   {"token_blocks": max(1, n // npt)})
    op = ops.per_channel_cast_and_transpose if transposed else ops.per_channel_cast
    return op(x, npt, round_scale=round_scale)


def per_channel_cast(x: torch.Tensor, fmt: str, num_per_tokens: int, round_sf: bool = False) -> QuantTensor:
    """Cast x (num_tokens, hidden) bf16/f32 to FP8 e4m3 with one float32 scale per channel and block of
    num_per_tokens tokens: (values (num_tokens, hidden), scales (num_tokens / num_per_tokens, hidden))."""
    return _per_channel_cast("quant.per_channel_cast", x, fmt, num_per_tokens, round_sf, transposed=False)


def per_channel_cast_fused(
    x: torch.Tensor | QuantTensor,
    fmt: str,
    num_per_tokens: int,
    round_sf: bool = False,
    num_per_channels: int | None = None,
    pos_to_token: torch.Tensor | None = None,
) -> QuantTensor:
    raise missing("quant.per_channel_cast_fused", FAMILY)


def per_channel_cast_and_transpose(
    x: torch.Tensor,
    fmt: str,
    num_per_tokens: int,
    round_sf: bool = False,
) -> QuantTensor:
    """per_channel_cast with the values transposed: (values (hidden, num_tokens), scales
    (num_tokens / num_per_tokens, hidden))."""
    return _per_channel_cast("quant.per_channel_cast_and_transpose", x, fmt, num_per_tokens, round_sf,
                             transposed=True)


def swiglu_forward_and_per_token_cast(
    x: torch.Tensor,
    fmt: str,
    num_per_channels: int,
    pos_to_token_topk: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    pos_to_expert: torch.Tensor | None = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    swiglu_clamp_value: float | None = None,
    clamped_count: torch.Tensor | None = None,
    sf_clamp_min: float | None = None,
) -> QuantTensor:
    raise missing("quant.swiglu_forward_and_per_token_cast", FAMILY)


def swiglu_backward_and_per_token_cast(
    x: QuantTensor,
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    pos_to_token_topk: torch.Tensor,
    token_topk_to_pos: torch.Tensor,
    num_per_channels: int,
    round_sf: bool = False,
    swiglu_clamp_value: float | None = None,
) -> tuple[torch.Tensor, QuantTensor, torch.Tensor, torch.Tensor]:
    raise missing("quant.swiglu_backward_and_per_token_cast", FAMILY)


def per_token_cast_with_precomputed_sf(
    x: torch.Tensor,
    fmt: str,
    num_per_channels: int,
    sf: torch.Tensor,
    x_block_size: tuple[int, int] | None = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    raise missing("quant.per_token_cast_with_precomputed_sf", FAMILY)


def per_block_cast(
    x: torch.Tensor,
    fmt: str,
    block_size: tuple[int, int],
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> QuantTensor:
    raise missing("quant.per_block_cast", FAMILY)


def per_block_cast_with_precomputed_sf(
    x: torch.Tensor,
    fmt: str,
    block_size: tuple[int, int],
    sf: torch.Tensor,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    raise missing("quant.per_block_cast_with_precomputed_sf", FAMILY)


def per_block_cast_with_sf_only(
    x: torch.Tensor,
    fmt: str,
    block_size: tuple[int, int],
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    raise missing("quant.per_block_cast_with_sf_only", FAMILY)


def cast_back(
    x: QuantTensor,
    fmt: str,
    x_block_size: tuple[int, int],
    x_special_fmt: str | None = None,
) -> torch.Tensor:
    raise missing("quant.cast_back", FAMILY)


def per_token_cast_back(
    x: QuantTensor,
    fmt: str,
    num_per_channels: int,
    x_special_fmt: str | None = None,
) -> torch.Tensor:
    raise missing("quant.per_token_cast_back", FAMILY)


def per_block_cast_lossless(
    x: QuantTensor,
    fmt: str,
    x_block_size: tuple[int, int],
    out_block_size: tuple[int, int],
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> QuantTensor:
    raise missing("quant.per_block_cast_lossless", FAMILY)
