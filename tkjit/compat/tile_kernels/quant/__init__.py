"""TileKernels' `quant`: FP8/FP4 casts. tkjit serves `per_token_cast` (fmt 'e4m3': its per_token_cast
kernels; 'e2m1': its per_token_cast_e2m1 kernels; 'e5m6': its per_token_cast_e5m6 kernels) and
`per_token_cast_with_sf_only` (e4m3, e2m1), `per_token_cast_with_precomputed_sf` (e4m3, e2m1: the
per_block_cast_with_sf kernels with one-token blocks),
`per_block_cast`, `per_block_cast_with_sf_only` and `per_block_cast_with_precomputed_sf` for fmt 'e4m3' and 'e2m1'
(its per_block_cast kernels), `per_channel_cast`, `per_channel_cast_and_transpose`, `per_channel_cast_fused` and
`swiglu_forward_and_per_channel_cast_and_transpose` for fmt='e4m3' (its kernels of the same names), `cast_back`
and `per_token_cast_back` (its cast_back kernels; x_special_fmt='e5m6': its cast_back_e5m6 kernels),
`swiglu_forward_and_per_token_cast` (fmt 'e4m3', every option; its kernels of the same name),
`swiglu_backward_and_per_token_cast` (its kernel of the same name),
`per_block_cast_lossless` (its per_block_cast_lossless kernels) and
`unpack_from_e2m1fn_x2` (torch); every other function or option raises NotImplementedError naming it.

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
x may also be TileKernels' quantised (values, scales) pair with x_block_size (its (num_per_tokens,
num_per_channels)), in any form cast_back takes (below): it is dequantised to float32 by the cast_back kernel and
that is cast (two kernels; bit-exact with TileKernels' torch reference, which dequantises in float32 the same way;
TileKernels' kernel folds the input scale into the quantisation factor instead, which may round differently).
fmt='e2m1' returns the same scales (amax / 6, the amax clamped to >= 6 * 2^-126), in the same layouts, with
    values  (num_tokens, hidden / 2) torch.int8: two FP4 e2m1 codes per byte, the even channel in the low nibble
            (round to nearest even, saturating at 6), bit-exact with TileKernels' torch reference; cast_back
            with x_block_size (1, num_per_channels) dequantises them.

cast_back(x, fmt, x_block_size) and per_token_cast_back(x, fmt, num_per_channels) (= x_block_size
(1, num_per_channels)) dequantise x = (values, scales) to fmt 'bf16' / 'fp32', bit-exact with TileKernels:
    values  (num_tokens, hidden) torch.float8_e4m3fn, or torch.int8 (num_tokens, hidden / 2) holding two FP4
            e2m1 codes per byte (TileKernels' e2m1 storage); hidden a multiple of 64
    scales  (ceil(num_tokens / num_per_tokens), ceil(hidden / num_per_channels)) torch.float32, row-major
            (any row stride) or column-major (stride(0) == 1: per_token_cast's TMA-aligned view), or the
            column-major packed UE8M0 torch.int32 (.., ceil(num_groups / 4)) form per_token_cast returns.
Any positive x_block_size whose num_per_channels is a multiple of 8 or divides 8 is served. uint8 values
without x_special_fmt='e5m6' raise NotImplementedError.

per_token_cast(x, 'e5m6', num_per_channels, ...) (num_per_channels == hidden, a multiple of 8, x_block_size
None, as TileKernels asserts; its per_token_cast_to_e5m6 kernel) returns
    values  (num_tokens, hidden * 3 / 2) torch.uint8: eight 12-bit e5m6 values (the top 12 bits of a float16,
            rounded to nearest even) per three little-endian 32-bit words, bit-exact with TileKernels
    scales  (num_tokens, 1) torch.float32, amax / 65024 (round_sf: up to a power of two); column-major (strides
            (1, align(num_tokens, 4))) and packed UE8M0 int32 as for e4m3.
cast_back / per_token_cast_back with x_special_fmt='e5m6' dequantise those uint8 values (hidden a multiple of 8
and of num_per_channels, as TileKernels asserts) with the same scale forms and block sizes as e4m3.

per_block_cast(x, 'e4m3', (block_m, block_k), ...) (block_m and block_k 32 or 128, x contiguous, hidden a
multiple of 64, as TileKernels asserts) returns (values, scales) laid out as per_token_cast's with
ceil(num_tokens / block_m) scale rows and ceil(hidden / block_k) columns: row-major, TMA-aligned
column-major, or packed UE8M0 int32 (four column blocks per int32). `_with_sf_only` returns the scales
(tkjit's kernel writes the values too; they are dropped); `_with_precomputed_sf` takes float32 row-major
scales (any row stride; not column-major nor packed, as TileKernels asserts) and returns the values.
fmt='e2m1' is the same with per_token_cast's e2m1 values and scales: int8 (num_tokens, hidden / 2) of two FP4
codes per byte, scales amax / 6 (the amax clamped to >= 6 * 2^-126), bit-exact with TileKernels' torch reference;
with precomputed scales the codes of x * (1 / sf) (saturating at 6).

per_channel_cast(x, 'e4m3', num_per_tokens) and per_channel_cast_and_transpose (tkjit's kernels of the
same names) return
    values  (num_tokens, hidden) torch.float8_e4m3fn, resp. transposed (hidden, num_tokens); contiguous
    scales  (num_tokens / num_per_tokens, hidden) torch.float32, row-major: one per channel and block of
            num_per_tokens consecutive tokens
for x bf16 or float32 (TileKernels' transpose takes bf16 only) and num_per_tokens 32 or 128 (TileKernels'
per_channel_cast takes 128 only); num_tokens a multiple of num_per_tokens, hidden of 16 (TileKernels asks
for multiples of 128 and 64).

per_channel_cast_fused(x, 'e4m3', num_per_tokens, round_sf, num_per_channels, pos_to_token) casts x's rows
gathered through pos_to_token ((num_tokens_out,) int32, a multiple of 16 long; -1 gives a zero row, as does
any position outside [0, num_tokens), where TileKernels reads out of bounds) and returns per_channel_cast's
layout with num_tokens_out rows: values (num_tokens_out, hidden), scales (ceil(num_tokens_out /
num_per_tokens), hidden) float32 row-major, the last block's scales over its rows only. x is bf16/f32
(num_per_channels None) or TileKernels' QuantTensor (values float8_e4m3fn, scales float32 (num_tokens,
hidden / 128) row-major contiguous) with num_per_channels=128, dequantised on the fly (values times scale, then
times the quantisation factor: two roundings, as TileKernels). Without pos_to_token num_tokens is a multiple of
num_per_tokens; num_per_tokens 32 or 128 (TileKernels: 128), hidden a multiple of 16 (128 with FP8 input).
Column-major or packed UE8M0 input scales are refused, as TileKernels' kernel refuses them.

swiglu_forward_and_per_token_cast(x, 'e4m3', num_per_channels, ...) takes x (num_tokens, 2 * hidden) bf16/f32
contiguous, hidden a multiple of 128, num_per_channels 128 or hidden (TileKernels' asserts), and returns
per_token_cast's (values, scales) of silu(gate) * up in TileKernels' reference's float32 order: gate clamped to
<= swiglu_clamp_value and up to [-it, it] first (a finite value > 0; others raise NotImplementedError), each row
times topk_weights.flat[pos_to_token_topk[row]] (a negative or out-of-range position weighs 0, as TileKernels'
reference for -1), rows with pos_to_expert < 0 given as zero rows (TileKernels' kernel leaves them unwritten),
clamped_count ((3,) int64) added to in place (gate > clamp, up > clamp, up < -clamp, over the rows read), the
amax clamped to sf_clamp_min (1e-4 by default; at least 448 * 2^-126).


swiglu_backward_and_per_token_cast(x, grad_out, weight, pos_to_token_topk, token_topk_to_pos, num_per_channels,
round_sf, swiglu_clamp_value) takes x = (values (E, 2 * hidden) float8_e4m3fn (or (.., .., 2 * hidden)), scales
(E, 2 * hidden / num_per_channels) float32 row-major), num_per_channels 32 or 128, and returns TileKernels' tuple:
out (E, hidden) bf16, (x_grad_fp8 (E, 2 * hidden) float8_e4m3fn, its scales (E, 2 * hidden / num_per_channels)
float32), x_grad (E, 2 * hidden) bf16, weight_grad (num_tokens, num_topk) float32; bit-exact with TileKernels'
torch reference except weight_grad (a float32 row sum in another order). A map entry outside its range counts as
padding (-1), where TileKernels reads out of bounds.


swiglu_forward_and_per_channel_cast_and_transpose(x, 'e4m3', num_per_tokens, round_sf, without_transpose,
swiglu_clamp_value) (tkjit's swiglu_forward_and_per_channel_cast(_and_transpose) kernels) casts the SwiGLU
activations gate / (1 + exp(-gate)) * up of x = [gate | up] (num_tokens, 2 * hidden) (float32; with
swiglu_clamp_value c: gate <= c, |up| <= c first), rounded to x's dtype as TileKernels' kernel stages them, and
returns per_channel_cast_and_transpose's layout (without_transpose=True: per_channel_cast's) for hidden channels.
x is bf16 (TileKernels) or float32; num_per_tokens 32 or 128; num_tokens a multiple of num_per_tokens, x.shape[1]
of 32 (TileKernels: 128 and 128); swiglu_clamp_value None or finite and >= 0.

per_block_cast_lossless(x, 'e4m3', x_block_size, out_block_size, ...) re-quantises x = (values int8 (num_tokens,
hidden / 2), two FP4 e2m1 codes per byte, contiguous; scales per x_block_size in cast_back's forms: float32
row-major or column-major, or packed UE8M0 int32) to FP8 e4m3 with one power-of-two scale per out_block_size
block (the largest input scale of the block / 2^6), exactly: it returns per_block_cast's layouts (row-major,
use_tma_aligned_col_major_sf, use_packed_ue8m0) with ceil(num_tokens / out_block_size[0]) scale rows. Bit-exact
with TileKernels where the cast is lossless; where it is not (an input scale not a positive normal power of two,
an output scale under float32's range, or an input scale more than 2^11 below its output block's largest)
tkjit raises TensorError naming the first such block, after the kernel (one device sync; not checked during
CUDA graph capture), where TileKernels device-asserts or loses values silently. num_per_channels are powers of
two (8 .. 1024 served), out_block_size a multiple of x_block_size both ways, hidden a multiple of 32.
"""

from __future__ import annotations

import math

import torch

from tkjit import ops
from tkjit.compat.tile_kernels._support import as_float, as_int, missing, require_kernel, rows_aligned, tensor
from tkjit.compat.tile_kernels.quant.types import QuantTensor
from tkjit.errors import ShapeError, TensorError

FAMILY = "quant"
FORMATS = ("e5m6", "e4m3", "e2m1")  # TileKernels' formats
BLOCK_FORMATS = ("e4m3", "e2m1")  # those of tkjit's per_block_cast kernels
BACK_FORMATS = ("bf16", "fp32")  # cast_back's output formats
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
    if fmt == "e5m6":
        return _per_token_cast_e5m6(fn, x, num_per_channels, x_block_size, use_tma_aligned_col_major_sf, round_sf,
                                    use_packed_ue8m0)
    if isinstance(x, tuple):
        # A quantised (values, scales) input with x_block_size (TileKernels' get_cast_input_and_config): dequantised
        # to float32 by tkjit's cast_back kernel, then cast as a float32 x. Two kernels, bit-exact with TileKernels'
        # reference, which dequantises in float32 the same way (values * scale, one rounding) before its cast.
        if not isinstance(x_block_size, tuple):
            raise ShapeError(f"tile_kernels.{fn}: a (values, scales) x needs x_block_size, a (num_per_tokens, "
                             f"num_per_channels) tuple; got {x_block_size!r}")
        x = _cast_back(fn, x, "fp32", x_block_size, None)
    elif x_block_size is not None:
        raise ShapeError(f"tile_kernels.{fn}: x_block_size={x_block_size!r} is for a (values, scales) x only; pass "
                         "None with a plain tensor")
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
    e2m1 = fmt == "e2m1"  # FP4, two codes per int8 (tkjit's per_token_cast_e2m1 kernels); else FP8 e4m3
    require_kernel(fn, FAMILY, "per_token_cast_e2m1" if e2m1 else "per_token_cast",
                   {"hidden": hidden, "group": group, "in_dtype": in_dtype, "round_scale": round_scale},
                   {"hidden": "hidden (x.shape[1])", "group": "num_per_channels", "in_dtype": "x.dtype"},
                   {"num_tokens": max(1, x.shape[0])})
    op = ops.per_token_cast_e2m1 if e2m1 else ops.per_token_cast
    q, sf = op(rows_aligned(x), group, round_scale=round_scale, col_major_scales=bool(use_tma_aligned_col_major_sf),
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
    """Cast x (num_tokens, hidden) bf16/f32 to FP8 e4m3 (FP4 e2m1, two per int8; e5m6) with one float32 scale
    per token and group of num_per_channels channels: (values, scales), laid out as the module doc says."""
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
    """per_token_cast's scales only (same values and layout). tkjit's kernel writes the FP8 / FP4 values too;
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
    """per_channel_cast_and_transpose (without_transpose: per_channel_cast) of the SwiGLU activations of x = [gate
    | up] (num_tokens, 2 * hidden): (values (hidden, num_tokens) or (num_tokens, hidden), scales (num_tokens /
    num_per_tokens, hidden))."""
    fn = "quant.swiglu_forward_and_per_channel_cast_and_transpose"
    if not isinstance(fmt, str) or fmt != "e4m3":
        raise ShapeError(f"tile_kernels.{fn}: fmt must be 'e4m3', got {fmt!r}")
    tensor(fn, "x", x, (2,), (torch.bfloat16, torch.float32))
    if not x.is_contiguous():
        raise TensorError(f"tile_kernels.{fn}: x must be contiguous, got strides {x.stride()} for shape "
                          f"{tuple(x.shape)}")
    npt = as_int(fn, "num_per_tokens", num_per_tokens)
    if npt not in PER_CHANNEL_TOKENS:
        raise ShapeError(f"tile_kernels.{fn}: num_per_tokens must be one of {list(PER_CHANNEL_TOKENS)}, got {npt}")
    n, width = x.shape
    if width % 32:  # (TileKernels asks for a multiple of 128)
        raise ShapeError(f"tile_kernels.{fn}: x.shape[1] = {width} must be a multiple of 32 (two halves of hidden "
                         f"channels, hidden a multiple of 16)")
    if n % npt:
        raise ShapeError(f"tile_kernels.{fn}: num_tokens (x.shape[0] = {n}) must be a multiple of num_per_tokens "
                         f"({npt})")
    clamp = swiglu_clamp_value
    if clamp is not None:
        if isinstance(clamp, bool) or not isinstance(clamp, (int, float)):
            raise ShapeError(f"tile_kernels.{fn}: swiglu_clamp_value must be a float or None, got {clamp!r}")
        if not (math.isfinite(clamp) and clamp >= 0):
            raise ShapeError(f"tile_kernels.{fn}: swiglu_clamp_value must be finite and >= 0, got {clamp!r}")
        clamp = float(clamp)
    round_scale = bool(round_sf)
    name = "swiglu_forward_and_per_channel_cast" if without_transpose else \
        "swiglu_forward_and_per_channel_cast_and_transpose"
    require_kernel(fn, FAMILY, name,
                   {"hidden": width // 2, "num_per_tokens": npt, "in_dtype": "bfloat16" if x.dtype == torch.bfloat16
                    else "float32", "round_scale": round_scale, "use_clamp": clamp is not None,
                    "clamp_value": 0.0 if clamp is None else clamp},
                   {"hidden": "hidden (x.shape[1] / 2)", "in_dtype": "x.dtype", "clamp_value": "swiglu_clamp_value"},
                   {"token_blocks": max(1, n // npt)})
    op = ops.swiglu_forward_and_per_channel_cast if without_transpose else \
        ops.swiglu_forward_and_per_channel_cast_and_transpose
    return op(x, npt, round_scale=round_scale, swiglu_clamp_value=clamp)


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
    """per_channel_cast of x's rows gathered through pos_to_token (-1: a zero row), x bf16/f32 or a
    (values fp8 e4m3, scales float32 (num_tokens, hidden / 128)) pair with num_per_channels=128, dequantised on
    the fly: (values (num_tokens_out, hidden), scales (ceil(num_tokens_out / num_per_tokens), hidden))."""
    fn = "quant.per_channel_cast_fused"
    x_sf = None
    if isinstance(x, tuple):  # TileKernels' QuantTensor: (values, per-token scales)
        if len(x) != 2:
            raise TensorError(f"tile_kernels.{fn}: x must be a tensor or a (values, scales) pair, got a tuple of "
                              f"{len(x)}")
        x, x_sf = x
        if num_per_channels is None:
            raise ShapeError(f"tile_kernels.{fn}: num_per_channels must be given (128) when x is a (values, scales) "
                             "pair")
        if as_int(fn, "num_per_channels", num_per_channels) != 128:
            raise ShapeError(f"tile_kernels.{fn}: num_per_channels must be 128, got {num_per_channels}")
        tensor(fn, "x[0] (values)", x, (2,), (torch.float8_e4m3fn,))
        tensor(fn, "x[1] (scales)", x_sf, (2,), (torch.float32,))
    else:
        if num_per_channels is not None:
            raise ShapeError(f"tile_kernels.{fn}: num_per_channels={num_per_channels!r} is for a (values, scales) x "
                             "only; pass None with a plain tensor")
        tensor(fn, "x", x, (2,), (torch.bfloat16, torch.float32))
    if not isinstance(fmt, str) or fmt != "e4m3":
        raise ShapeError(f"tile_kernels.{fn}: fmt must be 'e4m3', got {fmt!r}")
    if not x.is_contiguous():
        raise TensorError(f"tile_kernels.{fn}: x must be contiguous, got strides {x.stride()} for shape "
                          f"{tuple(x.shape)}")
    npt = as_int(fn, "num_per_tokens", num_per_tokens)
    if npt not in PER_CHANNEL_TOKENS:
        raise ShapeError(f"tile_kernels.{fn}: num_per_tokens must be one of {list(PER_CHANNEL_TOKENS)}, got {npt}")
    n, hidden = x.shape
    if hidden % 16:  # (TileKernels' kernel tiles 128 channels)
        raise ShapeError(f"tile_kernels.{fn}: hidden (x.shape[1] = {hidden}) must be a multiple of 16")
    if x_sf is not None:
        if hidden % 128:
            raise ShapeError(f"tile_kernels.{fn}: hidden (x[0].shape[1] = {hidden}) must be a multiple of 128 with "
                             "num_per_channels=128")
        if tuple(x_sf.shape) != (n, hidden // 128) or not x_sf.is_contiguous():
            raise TensorError(f"tile_kernels.{fn}: x[1] (scales) must be contiguous (num_tokens, hidden / 128) = "
                              f"{(n, hidden // 128)} (row-major), got shape {tuple(x_sf.shape)} strides "
                              f"{x_sf.stride()}")
    m = n
    if pos_to_token is not None:
        tensor(fn, "pos_to_token", pos_to_token, (1,), (torch.int32,))
        if not pos_to_token.is_contiguous():
            raise TensorError(f"tile_kernels.{fn}: pos_to_token must be contiguous, got stride {pos_to_token.stride()}")
        m = pos_to_token.shape[0]
        if m % 16:
            raise ShapeError(f"tile_kernels.{fn}: num_tokens_out (pos_to_token.shape[0] = {m}) must be a multiple "
                             "of 16")
    elif n % npt:
        raise ShapeError(f"tile_kernels.{fn}: num_tokens (x.shape[0] = {n}) must be a multiple of num_per_tokens "
                         f"({npt})")
    round_scale = bool(round_sf)
    in_dtype = {torch.bfloat16: "bfloat16", torch.float32: "float32"}.get(x.dtype, "float8_e4m3fn")
    require_kernel(fn, FAMILY, "per_channel_cast_fused",
                   {"hidden": hidden, "num_per_tokens": npt, "in_dtype": in_dtype, "round_scale": round_scale,
                    "has_x_sf": x_sf is not None, "has_pos": pos_to_token is not None},
                   {"hidden": "hidden (x.shape[1])", "in_dtype": "x.dtype"},
                   {"num_tokens": max(1, n), "num_tokens_out": max(1, m)})
    return ops.per_channel_cast_fused(x, npt, x_sf=x_sf, pos_to_token=pos_to_token, round_scale=round_scale)


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
    """silu(x[:, :hidden]) * x[:, hidden:] (optionally clamped first, times routing weights), cast to FP8 e4m3 with
    one float32 scale per token and num_per_channels channels: (values, scales), laid out as per_token_cast's."""
    fn = "quant.swiglu_forward_and_per_token_cast"
    tensor(fn, "x", x, (2,), (torch.bfloat16, torch.float32))
    if not x.is_contiguous():
        raise TensorError(f"tile_kernels.{fn}: x must be contiguous, got strides {x.stride()} for shape "
                          f"{tuple(x.shape)}")
    n, hidden = x.shape[0], x.shape[1] // 2
    if x.shape[1] % 2 or hidden % 128:
        raise ShapeError(f"tile_kernels.{fn}: x.shape[1] = {x.shape[1]} must be 2 * hidden with hidden a multiple "
                         "of 128")
    if not isinstance(fmt, str) or fmt != "e4m3":  # TileKernels asserts fmt == 'e4m3' here
        raise ShapeError(f"tile_kernels.{fn}: fmt must be 'e4m3', got {fmt!r}")
    group = as_int(fn, "num_per_channels", num_per_channels)
    if group not in (128, hidden):
        raise ShapeError(f"tile_kernels.{fn}: num_per_channels={group} must be 128 or hidden ({hidden})")
    if use_tma_aligned_col_major_sf and group != 128:
        raise ShapeError(f"tile_kernels.{fn}: use_tma_aligned_col_major_sf=True needs num_per_channels=128")
    if use_packed_ue8m0 and not use_tma_aligned_col_major_sf:
        raise ShapeError(f"tile_kernels.{fn}: use_packed_ue8m0=True needs use_tma_aligned_col_major_sf=True")
    if pos_to_token_topk is not None:
        tensor(fn, "pos_to_token_topk", pos_to_token_topk, (1,), (torch.int32,))
        if pos_to_token_topk.shape[0] != n:
            raise TensorError(f"tile_kernels.{fn}: pos_to_token_topk must have x.shape[0] = {n} entries, got "
                              f"{pos_to_token_topk.shape[0]}")
        if topk_weights is None:
            raise ShapeError(f"tile_kernels.{fn}: topk_weights must be given with pos_to_token_topk")
        tensor(fn, "topk_weights", topk_weights, (2,), (torch.float32,))
    else:
        topk_weights = None  # TileKernels reads the weights only through pos_to_token_topk
    if pos_to_expert is not None:
        tensor(fn, "pos_to_expert", pos_to_expert, (1,), (torch.int32,))
        if pos_to_expert.shape[0] != n:
            raise TensorError(f"tile_kernels.{fn}: pos_to_expert must have x.shape[0] = {n} entries, got "
                              f"{pos_to_expert.shape[0]}")
    clamp = None
    if swiglu_clamp_value is not None:
        clamp = as_float(fn, "swiglu_clamp_value", swiglu_clamp_value)
        if not 0 < clamp < float("inf"):
            raise missing(fn, FAMILY, f"swiglu_clamp_value={swiglu_clamp_value!r} (tkjit clamps at finite values > 0)")
    if clamped_count is not None:
        if clamp is None:
            raise ShapeError(f"tile_kernels.{fn}: clamped_count needs swiglu_clamp_value")
        tensor(fn, "clamped_count", clamped_count, (1,), (torch.int64,))
        if clamped_count.shape[0] != 3 or not clamped_count.is_contiguous():
            raise TensorError(f"tile_kernels.{fn}: clamped_count must be a contiguous (3,) int64 tensor, got shape "
                              f"{tuple(clamped_count.shape)}")
    amin = 1e-4
    if sf_clamp_min is not None:
        amin = as_float(fn, "sf_clamp_min", sf_clamp_min)
    in_dtype = "bfloat16" if x.dtype == torch.bfloat16 else "float32"
    name = "swiglu_forward_and_per_token_cast" + ("_colmajor" if use_tma_aligned_col_major_sf else "")
    require_kernel(fn, FAMILY, name,
                   {"hidden": hidden, "group": group, "in_dtype": in_dtype, "round_scale": bool(round_sf),
                    "has_weights": pos_to_token_topk is not None, "has_expert": pos_to_expert is not None,
                    "swiglu_clamp_value": clamp or 0.0, "count_clamp": clamped_count is not None,
                    "sf_clamp_min": amin},
                   {"hidden": "hidden (x.shape[1] / 2)", "group": "num_per_channels", "in_dtype": "x.dtype"})
    return ops.swiglu_forward_and_per_token_cast(
        x, group, pos_to_token_topk=pos_to_token_topk, topk_weights=topk_weights, pos_to_expert=pos_to_expert,
        swiglu_clamp_value=clamp, clamped_count=clamped_count, round_scale=bool(round_sf),
        col_major_scales=bool(use_tma_aligned_col_major_sf), packed_ue8m0=bool(use_packed_ue8m0), sf_clamp_min=amin)


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
    """SwiGLU backward of x = (values (E, 2 * hidden) fp8 e4m3, scales (E, 2 * hidden / num_per_channels)
    float32) with the routing weights, its input gradient cast per token: (out (E, hidden) bf16, (x_grad_fp8,
    x_grad_fp8_sf_invs), x_grad (E, 2 * hidden) bf16, weight_grad (num_tokens, num_topk) float32)."""
    fn = "quant.swiglu_backward_and_per_token_cast"
    if not isinstance(x, tuple) or len(x) != 2:
        raise TensorError(f"tile_kernels.{fn}: x must be a (values, scales) pair, got {type(x).__name__}"
                          + (f" of {len(x)}" if isinstance(x, tuple) else ""))
    x, x_sf = x
    npc = as_int(fn, "num_per_channels", num_per_channels)
    if npc not in (32, 128):
        raise ShapeError(f"tile_kernels.{fn}: num_per_channels must be 32 or 128, got {npc}")
    tensor(fn, "x[0] (values)", x, (2, 3), (torch.float8_e4m3fn,))
    tensor(fn, "x[1] (scales)", x_sf, (2,), (torch.float32,))
    tensor(fn, "grad_out", grad_out, (1, 2, 3), (torch.bfloat16,))
    tensor(fn, "weight", weight, (2,), (torch.float32,))
    tensor(fn, "pos_to_token_topk", pos_to_token_topk, (1,), (torch.int32,))
    tensor(fn, "token_topk_to_pos", token_topk_to_pos, (2,), (torch.int32,))
    for name, t in (("x[0] (values)", x), ("x[1] (scales)", x_sf), ("weight", weight),
                    ("pos_to_token_topk", pos_to_token_topk), ("token_topk_to_pos", token_topk_to_pos)):
        if not t.is_contiguous():
            raise TensorError(f"tile_kernels.{fn}: {name} must be contiguous, got strides {t.stride()} for shape "
                              f"{tuple(t.shape)}")
    if x.shape[-1] % (2 * npc):
        raise ShapeError(f"tile_kernels.{fn}: x[0]'s last dim ({x.shape[-1]}) must be a multiple of "
                         f"2 * num_per_channels ({2 * npc})")
    hidden = x.shape[-1] // 2
    x = x.view(-1, 2 * hidden)
    e = x.shape[0]
    if grad_out.numel() != e * hidden:
        raise TensorError(f"tile_kernels.{fn}: grad_out must hold (num_expand_tokens, hidden) = {(e, hidden)} "
                          f"elements, got shape {tuple(grad_out.shape)}")
    grad_out = grad_out.reshape(e, hidden).contiguous()
    n, k = token_topk_to_pos.shape
    for name, t, want in (("x[1] (scales)", x_sf, (e, 2 * hidden // npc)), ("weight", weight, (n, k)),
                          ("pos_to_token_topk", pos_to_token_topk, (e,))):
        if tuple(t.shape) != want:
            raise TensorError(f"tile_kernels.{fn}: {name} must have shape {want}, got {tuple(t.shape)}")
    clamp = None
    if swiglu_clamp_value is not None:
        clamp = as_float(fn, "swiglu_clamp_value", swiglu_clamp_value)
    require_kernel(fn, FAMILY, "swiglu_backward_and_per_token_cast",
                   {"hidden": hidden, "num_per_channels": npc, "num_topk": k, "round_scale": bool(round_sf),
                    "use_clamp": clamp is not None},
                   {"hidden": "hidden (x[0].shape[-1] / 2)", "num_topk": "num_topk (token_topk_to_pos.shape[1])"},
                   {"num_expand_tokens": max(1, e), "num_tokens": max(1, n)})
    out, q, sf, x_grad, weight_grad = ops.swiglu_backward_and_per_token_cast(
        x, x_sf, grad_out, weight, pos_to_token_topk, token_topk_to_pos, npc, round_scale=bool(round_sf),
        swiglu_clamp_value=clamp)
    return out, (q, sf), x_grad, weight_grad


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
    """per_token_cast's values with the given scales sf: fp8 e4m3 of clamp(x * (1 / sf), -448, 448) (fmt 'e2m1':
    the FP4 codes of x * (1 / sf), two per int8) per token and group of num_per_channels (a multiple of 16; the last
    group may be partial) channels,
    as TileKernels' cast-only kernel. sf is in the layout
    per_token_cast returns for the same flags: float32 (num_tokens, ceil(hidden / num_per_channels)) row-major,
    its TMA-aligned column-major view, or (use_packed_ue8m0) the packed UE8M0 int32 view. round_sf is unused (the
    scales are given), as in TileKernels. Served by tkjit's per_block_cast_with_sf kernel with blocks of one
    token; column-major or packed scales are first made row-major float32 (a copy of the scales only)."""
    fn = "quant.per_token_cast_with_precomputed_sf"
    if fmt == "e5m6":  # TileKernels asserts sf is None for e5m6
        raise ShapeError(f"tile_kernels.{fn}: fmt='e5m6' takes no precomputed sf")
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ShapeError(f"tile_kernels.{fn}: fmt must be one of {list(FORMATS)}, got {fmt!r}")
    if isinstance(x, tuple):
        if not isinstance(x_block_size, tuple):
            raise ShapeError(f"tile_kernels.{fn}: a (values, scales) x needs x_block_size, got {x_block_size!r}")
        x = _cast_back(fn, x, "fp32", x_block_size, None)  # dequantised in float32, as in per_token_cast
    elif x_block_size is not None:
        raise ShapeError(f"tile_kernels.{fn}: x_block_size={x_block_size!r} is for a (values, scales) x only")
    if use_packed_ue8m0 and not use_tma_aligned_col_major_sf:
        raise ShapeError(f"tile_kernels.{fn}: use_packed_ue8m0=True needs use_tma_aligned_col_major_sf=True")
    tensor(fn, "x", x, (2,), (torch.bfloat16, torch.float32))
    group = as_int(fn, "num_per_channels", num_per_channels)
    num_tokens, hidden = x.shape
    groups = -(-hidden // group) if group > 0 else 0
    if group <= 0 or group % 16:
        raise missing(fn, FAMILY, f"num_per_channels={group} (with precomputed scales tkjit takes multiples of 16)")
    if use_packed_ue8m0:
        from tkjit_kernels.quant.cast_back import unpack_ue8m0

        tensor(fn, "sf", sf, (2,), (torch.int32,))
        if tuple(sf.shape) != (num_tokens, -(-groups // 4)):
            raise TensorError(f"tile_kernels.{fn}: packed sf must have shape {(num_tokens, -(-groups // 4))}, "
                              f"got {tuple(sf.shape)}")
        sf = unpack_ue8m0(sf, groups)
    else:
        tensor(fn, "sf", sf, (2,), (torch.float32,))
        if tuple(sf.shape) != (num_tokens, groups):
            raise TensorError(f"tile_kernels.{fn}: sf must have shape {(num_tokens, groups)} (num_tokens, "
                              f"ceil(hidden / num_per_channels)), got {tuple(sf.shape)}")
        if sf.stride(-1) != 1:  # the column-major view per_token_cast returns
            sf = sf.contiguous()
    block = next(b for b in (128, 64, 32, 16) if group % b == 0)
    if block != group:  # a wider group (hidden, say): each block of `block` channels takes its group's scale
        sf = sf[:, torch.arange(0, hidden, block, device=sf.device) // group]
    return ops.per_block_cast_with_sf(rows_aligned(x), sf, (1, block), fmt=fmt)


BLOCKS = (32, 128)  # TileKernels' per_block_cast block sizes, each way


def _per_block_args(fn: str, x, fmt, block_size, use_tma_aligned_col_major_sf, use_packed_ue8m0,
                    round_sf=None) -> tuple[int, int]:
    """TileKernels' per_block_cast_impl checks, and tkjit's spec's: (block_m, block_k)."""
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ShapeError(f"tile_kernels.{fn}: fmt must be one of {list(FORMATS)}, got {fmt!r}")
    if fmt not in BLOCK_FORMATS:
        raise missing(fn, FAMILY, f"fmt={fmt!r} (tkjit's block casts write {' and '.join(map(repr, BLOCK_FORMATS))})")
    if not isinstance(block_size, (tuple, list)) or len(block_size) != 2:
        raise ShapeError(f"tile_kernels.{fn}: block_size must be a (num_per_tokens, num_per_channels) pair, "
                         f"got {block_size!r}")
    bm, bk = (as_int(fn, "block_size", b) for b in block_size)
    if bm not in BLOCKS or bk not in BLOCKS:
        raise ShapeError(f"tile_kernels.{fn}: block_size={(bm, bk)} must be made of {list(BLOCKS)}")
    if use_packed_ue8m0 and not use_tma_aligned_col_major_sf:
        raise ShapeError(f"tile_kernels.{fn}: use_packed_ue8m0=True needs use_tma_aligned_col_major_sf=True")
    tensor(fn, "x", x, (2,), (torch.bfloat16, torch.float32))
    if not x.is_contiguous():
        raise TensorError(f"tile_kernels.{fn}: x must be contiguous, got strides {x.stride()} for shape "
                          f"{tuple(x.shape)}")
    hidden = x.shape[1]
    if hidden % 64:
        raise ShapeError(f"tile_kernels.{fn}: hidden (x.shape[1]) = {hidden} must be a multiple of 64")
    shape = {"hidden": hidden, "block_m": bm, "block_k": bk, "in_dtype": "bfloat16" if x.dtype == torch.bfloat16
             else "float32", "fmt": fmt}
    kernel = "per_block_cast_with_sf" if round_sf is None else "per_block_cast"
    if round_sf is not None:
        shape["round_scale"] = bool(round_sf)
    require_kernel(fn, FAMILY, kernel, shape, {"hidden": "hidden (x.shape[1])", "block_m": "block_size[0]",
                                               "block_k": "block_size[1]", "in_dtype": "x.dtype"},
                   {"num_tokens": max(1, x.shape[0])})
    return bm, bk


def _per_block_cast(fn: str, x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    block = _per_block_args(fn, x, fmt, block_size, use_tma_aligned_col_major_sf, use_packed_ue8m0, round_sf)
    return ops.per_block_cast(x, block, round_scale=bool(round_sf),
                              col_major_scales=bool(use_tma_aligned_col_major_sf),
                              packed_ue8m0=bool(use_packed_ue8m0), fmt=fmt)


def per_block_cast(
    x: torch.Tensor,
    fmt: str,
    block_size: tuple[int, int],
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> QuantTensor:
    """Cast x (num_tokens, hidden) bf16/f32 to FP8 e4m3 (or FP4 e2m1, two per int8) with one float32 scale per
    block_size tile: (values, scales), laid out as the module doc says."""
    return _per_block_cast("quant.per_block_cast", x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf,
                           use_packed_ue8m0)


def per_block_cast_with_precomputed_sf(
    x: torch.Tensor,
    fmt: str,
    block_size: tuple[int, int],
    sf: torch.Tensor,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """per_block_cast's values with the given float32 scales sf (ceil(num_tokens / block_m),
    ceil(hidden / block_k)), row-major: fp8 e4m3 of clamp(x * (1 / sf), -448, 448), or (fmt 'e2m1') the FP4 codes
    of x * (1 / sf), two per int8. round_sf is unused (the scales are given), as in TileKernels."""
    fn = "quant.per_block_cast_with_precomputed_sf"
    if use_tma_aligned_col_major_sf or use_packed_ue8m0:  # asserts in TileKernels
        raise ShapeError(f"tile_kernels.{fn}: precomputed sf must be row-major float32 "
                         "(use_tma_aligned_col_major_sf and use_packed_ue8m0 must be False)")
    block = _per_block_args(fn, x, fmt, block_size, False, False)
    tensor(fn, "sf", sf, (2,), (torch.float32,))
    return ops.per_block_cast_with_sf(x, sf, block, fmt=fmt)


def per_block_cast_with_sf_only(
    x: torch.Tensor,
    fmt: str,
    block_size: tuple[int, int],
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """per_block_cast's scales only (same values and layout). tkjit's kernel writes the values too;
    they are dropped."""
    return _per_block_cast("quant.per_block_cast_with_sf_only", x, fmt, block_size, use_tma_aligned_col_major_sf,
                           round_sf, use_packed_ue8m0)[1]


def _values_and_scales(fn: str, x, x_block_size, check_values) -> tuple:
    """cast_back's x = (values, scales) and x_block_size as TileKernels checks them: (values, scales, whether the
    scales are column-major, num_per_tokens, num_per_channels). check_values(fn, values): the format's checks."""
    if not isinstance(x, tuple) or len(x) != 2:
        raise TensorError(f"tile_kernels.{fn}: x must be a (values, scales) tuple, got {type(x).__name__}")
    data, sf = x
    check_values(fn, data)
    tensor(fn, "x[1] (scales)", sf, (2,), (torch.int32, torch.float32))
    col_major = sf.stride(0) == 1  # TileKernels reads the layout off the strides
    if not col_major and (sf.stride(1) != 1 or sf.dtype != torch.float32):
        raise TensorError(f"tile_kernels.{fn}: x[1] (scales) must be float32 with a contiguous last axis, or "
                          f"column-major (stride(0) == 1); got {sf.dtype} strides {sf.stride()}")
    if not isinstance(x_block_size, tuple) or len(x_block_size) != 2:
        raise ShapeError(f"tile_kernels.{fn}: x_block_size must be a (num_per_tokens, num_per_channels) tuple, "
                         f"got {x_block_size!r}")
    bt = as_int(fn, "x_block_size[0] (num_per_tokens)", x_block_size[0])
    bc = as_int(fn, "x_block_size[1] (num_per_channels)", x_block_size[1])
    if bt < 1 or bc < 1:
        raise ShapeError(f"tile_kernels.{fn}: x_block_size must be positive, got {x_block_size!r}")
    return data, sf, col_major, bt, bc


def _check_plain_values(fn: str, data) -> None:
    tensor(fn, "x[0] (values)", data, (2,))
    if data.dtype == torch.uint8:  # TileKernels' e5m6 packing; its plain kernel would read the bytes as integers
        raise missing(fn, FAMILY, "x[0].dtype=torch.uint8 without x_special_fmt='e5m6'")
    tensor(fn, "x[0] (values)", data, (2,), (torch.float8_e4m3fn, torch.int8))


def _cast_back(fn: str, x, fmt, x_block_size, x_special_fmt) -> torch.Tensor:
    """TileKernels' cast_back checks, then tkjit's kernel."""
    if not isinstance(fmt, str) or fmt not in BACK_FORMATS:
        raise ShapeError(f"tile_kernels.{fn}: fmt must be one of {list(BACK_FORMATS)}, got {fmt!r}")
    if x_special_fmt == "e5m6":
        return _cast_back_e5m6(fn, x, fmt, x_block_size)
    if x_special_fmt is not None:
        raise ShapeError(f"tile_kernels.{fn}: x_special_fmt must be None or 'e5m6', got {x_special_fmt!r}")
    data, sf, col_major, bt, bc = _values_and_scales(fn, x, x_block_size, _check_plain_values)
    num_tokens, hidden = data.shape[0], data.shape[1] * (2 if data.dtype == torch.int8 else 1)
    if hidden % 64:
        raise ShapeError(f"tile_kernels.{fn}: hidden ({hidden}) must be a multiple of 64")
    cols = -(-hidden // bc)
    want = (-(-num_tokens // bt), -(-cols // 4) if sf.dtype == torch.int32 else cols)
    if tuple(sf.shape) != want:
        raise TensorError(f"tile_kernels.{fn}: x[1] (scales) has shape {tuple(sf.shape)}, expected {want} for "
                          f"{num_tokens} tokens, hidden {hidden} and x_block_size {x_block_size}")
    sf_dtype = "int32" if sf.dtype == torch.int32 else "float32"
    out_dtype = "bfloat16" if fmt == "bf16" else "float32"
    require_kernel(fn, FAMILY, "cast_back_colmajor" if col_major else "cast_back",
                   {"hidden": hidden, "block_tokens": bt, "block_channels": bc,
                    "in_fmt": "e2m1" if data.dtype == torch.int8 else "e4m3", "out_dtype": out_dtype,
                    "sf_dtype": sf_dtype},
                   {"hidden": "hidden", "block_tokens": "num_per_tokens", "block_channels": "num_per_channels",
                    "in_fmt": "x[0].dtype", "out_dtype": "fmt", "sf_dtype": "x[1].dtype"},
                   {"num_tokens": max(1, num_tokens)})
    return ops.cast_back(rows_aligned(data), sf, (bt, bc),
                         out_dtype=torch.bfloat16 if fmt == "bf16" else torch.float32)


def cast_back(
    x: QuantTensor,
    fmt: str,
    x_block_size: tuple[int, int],
    x_special_fmt: str | None = None,
) -> torch.Tensor:
    """Dequantise (values, scales) to bf16 / fp32: values * the scale of their (num_per_tokens, num_per_channels)
    block, bit-exact with TileKernels; the values and scale forms are the module doc's."""
    return _cast_back("quant.cast_back", x, fmt, x_block_size, x_special_fmt)


def per_token_cast_back(
    x: QuantTensor,
    fmt: str,
    num_per_channels: int,
    x_special_fmt: str | None = None,
) -> torch.Tensor:
    """cast_back with x_block_size (1, num_per_channels)."""
    return _cast_back("quant.per_token_cast_back", x, fmt, (1, num_per_channels), x_special_fmt)


def per_block_cast_lossless(
    x: QuantTensor,
    fmt: str,
    x_block_size: tuple[int, int],
    out_block_size: tuple[int, int],
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> QuantTensor:
    """Re-quantise x = (e2m1 values, power-of-two scales per x_block_size) to FP8 e4m3 with scales per
    out_block_size, exactly, as the module doc says; a cast that would lose values raises TensorError naming
    the block (TileKernels: a device assert, or silently lost values). round_sf is unused (the output scales
    are powers of two), as in TileKernels."""
    fn = "quant.per_block_cast_lossless"
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ShapeError(f"tile_kernels.{fn}: fmt must be one of {list(FORMATS)}, got {fmt!r}")
    if fmt != "e4m3":  # an assert in TileKernels
        raise ShapeError(f"tile_kernels.{fn}: the lossless cast is e2m1 -> 'e4m3' only, got fmt={fmt!r}")
    if not isinstance(x, tuple) or len(x) != 2:
        raise TensorError(f"tile_kernels.{fn}: x must be a (values, scales) tuple, got {type(x).__name__}")
    data, sf = x
    tensor(fn, "x[0] (values)", data, (2,), (torch.int8,))
    tensor(fn, "x[1] (scales)", sf, (2,), (torch.int32, torch.float32))
    if not data.is_contiguous():
        raise TensorError(f"tile_kernels.{fn}: x[0] (values) must be contiguous, got strides {data.stride()}")
    col_major = sf.stride(0) == 1  # TileKernels reads the layout off the strides
    if not col_major and (sf.stride(1) != 1 or sf.dtype != torch.float32):
        raise TensorError(f"tile_kernels.{fn}: x[1] (scales) must be float32 with a contiguous last axis, or "
                          f"column-major (stride(0) == 1); got {sf.dtype} strides {sf.stride()}")
    blocks = []
    for what, b in (("x_block_size", x_block_size), ("out_block_size", out_block_size)):
        if not isinstance(b, (tuple, list)) or len(b) != 2:
            raise ShapeError(f"tile_kernels.{fn}: {what} must be a (num_per_tokens, num_per_channels) tuple, "
                             f"got {b!r}")
        bm, bk = as_int(fn, f"{what}[0]", b[0]), as_int(fn, f"{what}[1]", b[1])
        if bm < 1 or bk < 1 or bk & (bk - 1):
            raise ShapeError(f"tile_kernels.{fn}: {what} must be positive with a power-of-two num_per_channels, "
                             f"got {tuple(b)!r}")
        blocks.append((bm, bk))
    (bmi, bki), (bmo, bko) = blocks
    if bmo % bmi or bko % bki:
        raise ShapeError(f"tile_kernels.{fn}: out_block_size {(bmo, bko)} must be a multiple of x_block_size "
                         f"{(bmi, bki)} both ways")
    if use_packed_ue8m0 and not use_tma_aligned_col_major_sf:
        raise ShapeError(f"tile_kernels.{fn}: use_packed_ue8m0=True needs use_tma_aligned_col_major_sf=True")
    num_tokens, hidden = data.shape[0], data.shape[1] * 2
    if hidden % 32:
        raise ShapeError(f"tile_kernels.{fn}: hidden (2 * x[0].shape[1]) = {hidden} must be a multiple of 32")
    cols = -(-hidden // bki)
    want = (-(-num_tokens // bmi), -(-cols // 4) if sf.dtype == torch.int32 else cols)
    if tuple(sf.shape) != want:
        raise TensorError(f"tile_kernels.{fn}: x[1] (scales) has shape {tuple(sf.shape)}, expected {want} for "
                          f"{num_tokens} tokens, hidden {hidden} and x_block_size {(bmi, bki)}")
    require_kernel(fn, FAMILY, "per_block_cast_lossless",
                   {"hidden": hidden, "in_block_m": bmi, "in_block_k": bki, "out_block_m": bmo, "out_block_k": bko},
                   {"hidden": "hidden", "in_block_m": "x_block_size[0]", "in_block_k": "x_block_size[1]",
                    "out_block_m": "out_block_size[0]", "out_block_k": "out_block_size[1]"},
                   {"num_tokens": max(1, num_tokens)})
    return ops.per_block_cast_lossless(data, sf, (bmi, bki), (bmo, bko),
                                       col_major_scales=bool(use_tma_aligned_col_major_sf),
                                       packed_ue8m0=bool(use_packed_ue8m0))


# -- per_token_cast / cast_back, fmt e5m6 ----------------------------------------------------------------

def _per_token_cast_e5m6(fn: str, x, num_per_channels, x_block_size, use_tma_aligned_col_major_sf, round_sf,
                         use_packed_ue8m0) -> tuple[torch.Tensor, torch.Tensor]:
    """TileKernels' per_token_cast_to_e5m6 checks, then tkjit's kernel: (uint8 values, scales)."""
    if x_block_size is not None or isinstance(x, tuple):  # asserts in TileKernels
        raise ShapeError(f"tile_kernels.{fn}: fmt='e5m6' takes no x_block_size (a plain bf16 / fp32 x), "
                         f"got {x_block_size!r}")
    if use_packed_ue8m0 and not use_tma_aligned_col_major_sf:
        raise ShapeError(f"tile_kernels.{fn}: use_packed_ue8m0=True needs use_tma_aligned_col_major_sf=True")
    tensor(fn, "x", x, (2,), (torch.bfloat16, torch.float32))
    hidden = x.shape[1]
    group = as_int(fn, "num_per_channels", num_per_channels)
    if group != hidden:
        raise ShapeError(f"tile_kernels.{fn}: fmt='e5m6' needs num_per_channels == hidden ({hidden}), got {group}")
    if hidden % 8:
        raise ShapeError(f"tile_kernels.{fn}: fmt='e5m6' needs hidden (x.shape[1]) a multiple of 8, got {hidden}")
    round_scale = bool(round_sf)
    in_dtype = "bfloat16" if x.dtype == torch.bfloat16 else "float32"
    require_kernel(fn, FAMILY, "per_token_cast_e5m6", {"hidden": hidden, "in_dtype": in_dtype,
                                                       "round_scale": round_scale},
                   {"hidden": "hidden (x.shape[1])", "in_dtype": "x.dtype"}, {"num_tokens": max(1, x.shape[0])})
    return ops.per_token_cast_e5m6(rows_aligned(x), round_scale=round_scale,
                                   col_major_scales=bool(use_tma_aligned_col_major_sf),
                                   packed_ue8m0=bool(use_packed_ue8m0))


def _cast_back_e5m6(fn: str, x, fmt, x_block_size) -> torch.Tensor:
    """TileKernels' cast_back_e5m6 checks (fmt already checked), then tkjit's kernel."""
    data, sf, col_major, bt, bc = _values_and_scales(
        fn, x, x_block_size, lambda fn, data: tensor(fn, "x[0] (values)", data, (2,), (torch.uint8,))
    )
    num_tokens, width = data.shape
    if width % 12:
        raise ShapeError(f"tile_kernels.{fn}: x[0] (values) has {width} bytes per row; e5m6 packs 8 values in "
                         f"12 bytes (hidden * 3 / 2, hidden a multiple of 8)")
    hidden = width // 3 * 2
    if hidden % bc:
        raise ShapeError(f"tile_kernels.{fn}: hidden ({hidden}) must be a multiple of num_per_channels ({bc})")
    cols = hidden // bc
    want = (-(-num_tokens // bt), -(-cols // 4) if sf.dtype == torch.int32 else cols)
    if tuple(sf.shape) != want:
        raise TensorError(f"tile_kernels.{fn}: x[1] (scales) has shape {tuple(sf.shape)}, expected {want} for "
                          f"{num_tokens} tokens, hidden {hidden} and x_block_size {x_block_size}")
    out_dtype = "bfloat16" if fmt == "bf16" else "float32"
    require_kernel(fn, FAMILY, "cast_back_e5m6_colmajor" if col_major else "cast_back_e5m6",
                   {"hidden": hidden, "block_tokens": bt, "block_channels": bc, "out_dtype": out_dtype,
                    "sf_dtype": "int32" if sf.dtype == torch.int32 else "float32"},
                   {"hidden": "hidden", "block_tokens": "num_per_tokens", "block_channels": "num_per_channels",
                    "out_dtype": "fmt", "sf_dtype": "x[1].dtype"},
                   {"num_tokens": max(1, num_tokens)})
    return ops.cast_back_e5m6(rows_aligned(data), sf, (bt, bc),
                              out_dtype=torch.bfloat16 if fmt == "bf16" else torch.float32)
