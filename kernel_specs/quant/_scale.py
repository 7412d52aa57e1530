"""A group's scale, as the casts compute and store it: sf = amax / max_value (amax clamped from below by
the caller), or with round_scale sf rounded up to a power of two (UE8M0: add an all-ones mantissa, keep the
exponent; sf is positive and normal), and the inverse the values are multiplied by. The kernels' TileLang
form and the references' torch form, so a cast and its reference cannot drift apart.
"""

import torch


def ue8m0_ceil(sf: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(sf)) of positive normal float32 scales, bit for bit as the kernels round them."""
    return ((sf.view(torch.int32) + 0x007FFFFF) & 0x7F800000).view(torch.float32)


def unrounded_scale(T, *, max_value: float):
    """(sf, inv): the expressions of an unrounded scale and its factor from a (clamped) amax, amax / max_value
    and max_value / amax, IEEE divisions (the references divide). For a kernel that needs the factor in every
    thread but the scale only where it is stored."""
    f32 = T.float32
    return (lambda amax: T.ieee_fdiv(amax, f32(max_value))), (lambda amax: T.ieee_fdiv(f32(max_value), amax))


def scale_macro(T, *, max_value: float, round_scale: bool):
    """A T.macro group_scale(amax, sf, inv, e): sf[e] = amax[e] / max_value, rounded up to a power of two
    when round_scale; inv[e] the values' multiplier: 1 / sf[e] when rounded, else max_value / amax[e]
    (IEEE divisions: the references divide)."""
    f32, u32 = T.float32, T.uint32
    scale_of, inv_of = unrounded_scale(T, max_value=max_value)

    @T.macro
    def group_scale(amax, sf, inv, e):
        sf[e] = scale_of(amax[e])
        if round_scale:
            sf[e] = T.reinterpret((T.reinterpret(sf[e], u32) + u32(0x007FFFFF)) & u32(0x7F800000), f32)
            inv[e] = T.ieee_fdiv(f32(1.0), sf[e])
        else:
            inv[e] = inv_of(amax[e])

    return group_scale


def token_scale_store_macro(T, *, col_major: bool, groups: int | None, tma_align: int, padded_tokens):
    """A T.macro store_scale(scales, sf, pc, row, num_tokens): the scale sf[0] of group pc % groups of token
    row (groups None: a kernel without group index, group 0), row-major (num_tokens, groups) or column-major
    (groups, padded_tokens), where the last token's owner also zeroes its column's padding (padded_tokens:
    the buffer's second dim, the same expression). Buffers and variables as arguments, expressions built
    inside: an expression argument would become a let binding and change the TIR of the inline code."""

    def group(pc):
        return 0 if groups is None else pc % groups

    @T.macro
    def store_scale(scales, sf, pc, row, num_tokens):
        if col_major:
            scales[group(pc), row] = sf[0]
            if row == num_tokens - 1:  # the last token's owner zeroes its column's padding
                for j in T.unroll(1, tma_align):
                    if row + j < padded_tokens:
                        scales[group(pc), row + j] = T.float32(0)
        else:
            scales[row, group(pc)] = sf[0]

    return store_scale
