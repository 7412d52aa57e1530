"""The FP4 e2m1 format the e2m1 specs share (per_token_cast_e2m1 and per_block_cast write it, cast_back reads it).

e2m1 is a 4-bit code: sign (bit 3), 2 exponent bits, 1 mantissa bit, bias 1, no infinities or NaNs:
    codes 0..7  ->  0, 0.5, 1, 1.5, 2, 3, 4, 6     (8..15: the same, negative; code 8 is -0.0)
TileKernels stores two codes per byte of an int8 tensor, the even channel in the low nibble, so a row of hidden
values is hidden / 2 bytes. Its encoding of a float32 v (its kernel's float4 conversion and its torch reference
`convert_to_e2m1_bits`): round |v| to the nearest of the eight magnitudes, ties to the even code (the one whose
mantissa bit is 0), magnitudes past 6 (infinity and NaN included) saturating to 6; the sign kept, also for a
value that rounds to 0 (-0.0, -0.1: code 8). Computed here on the float32 bits a = bits(|v|), integer only:
    a <  bits(1.0):  code = (a > bits(0.25)) + (a >= bits(0.75))        the half steps: 0 (0.25 ties down), 0.5,
                                                                        1 (0.75 ties up to code 2)
    a >= bits(1.0):  code = min(((a + 0x1FFFFF + bit 22 of a) >> 22) - 252, 7)
the second being round-to-nearest-even of the float32 to one mantissa bit (the carry runs into the exponent), whose
exponent and mantissa bit are the code's once the float32 bias (127, one bit left: 254) is traded for e2m1's.
"""

from __future__ import annotations

import torch

# Codes 0..15 as values, as TileKernels' unpack_from_e2m1fn_x2 decodes them.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0  # the scale maps a group's amax here
AMAX_MIN = 6.0 * 2.0**-126  # TileKernels clamps the amax from below with this: the smallest scale is 2^-126
AMAX_MIN_BITS = 0x01C00000  # its float32 bits (a kernel reinterprets them: no decimal literal to round)
ONE, QUARTER, THREE_QUARTERS = 0x3F800000, 0x3E800000, 0x3F400000  # float32 bits of 1, 0.25, 0.75
# Sixteen values whose codes are known at scale 1 (amax 6), for the casts' inputs: the seven ties between neighbouring
# magnitudes (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), both zeros, values near ties, 6.
TIES = (0.25, -0.75, 1.25, -1.75, 2.5, -3.5, 5.0, -6.0, 0.0, -0.0, 0.1, -0.3, 6.0, 4.5, 2.75, 0.5)


# -- torch (the references) -------------------------------------------------------------------------------

def encode(v: torch.Tensor) -> torch.Tensor:
    """float32 tensor -> int64 tensor of e2m1 codes 0..15 (the module doc's rounding)."""
    u = v.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    a = u & 0x7FFFFFFF
    low = (a > QUARTER).to(torch.int64) + (a >= THREE_QUARTERS).to(torch.int64)
    high = (((a + 0x1FFFFF + ((a >> 22) & 1)) >> 22) - 252).clamp(max=7)
    return torch.where(a < ONE, low, high) | ((u >> 28) & 8)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """(n, h) codes, h even -> (n, h / 2) int8: channel 2j in the low nibble of byte j, 2j + 1 in the high one."""
    c = codes.to(torch.int64)
    b = c[:, 0::2] | (c[:, 1::2] << 4)
    return (b - ((b >> 7) << 8)).to(torch.int8)


def unpack(x: torch.Tensor) -> torch.Tensor:
    """(n, h / 2) int8 -> (n, h) int64 codes."""
    b = x.view(torch.uint8).to(torch.int64)
    return torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(x.shape[0], x.shape[1] * 2)


def decode(codes: torch.Tensor) -> torch.Tensor:
    """Codes -> their float32 values (exact)."""
    return torch.tensor(E2M1, dtype=torch.float32, device=codes.device)[codes.to(torch.int64)]


# -- TileLang (the kernels) -------------------------------------------------------------------------------

def encode_tl(T, u):
    """float32 bit pattern u (uint32; a buffer load or a variable: it is read several times) -> its e2m1 code
    (uint32 in [0, 16)), `encode`'s rounding. The high branch wraps below 1.0, where it is not selected."""
    u32 = T.uint32
    a = u & u32(0x7FFFFFFF)
    low = T.if_then_else(a > u32(QUARTER), u32(1), u32(0)) + T.if_then_else(a >= u32(THREE_QUARTERS), u32(1), u32(0))
    high = T.min(((a + u32(0x1FFFFF) + ((a >> u32(22)) & u32(1))) >> u32(22)) - u32(252), u32(7))
    return T.if_then_else(a < u32(ONE), low, high) | ((u >> u32(28)) & u32(8))


def decode_bits_tl(T, code):
    """float32 bit pattern of e2m1 `code` (uint32 in [0, 16)): exact, integer-only.

    Magnitude m = code & 7 is (exponent e, mantissa bit) = (m >> 1, m & 1). For e >= 1 the value is
    2^(e - 1) * (1 + mantissa / 2): float32 exponent field e + 126, top mantissa bit the mantissa bit, i.e.
    (m << 22) + (126 << 23). e == 0 is 0 (m = 0) or 0.5 (m = 1, the pattern 126 << 23): m * (126 << 23).
    The sign bit moves from bit 3 to bit 31 (code 8 is -0.0, as TileKernels' decode gives)."""
    m = code & T.uint32(7)
    mag = T.if_then_else(m >= T.uint32(2), (m << T.uint32(22)) + T.uint32(126 << 23), m * T.uint32(126 << 23))
    return mag | ((code & T.uint32(8)) << T.uint32(28))


def chunk_codes_macro(T, *, vec: int):
    """A T.macro encode_chunk(xs, i, inv, bits, ob): the vec values xs[i * vec + v] of chunk slot i, times inv[0]
    in float32, encoded (`encode_tl`) and packed two codes per byte, the even value in the low nibble, into the
    int8 ob[0 : vec / 2], ready for one vector store; bits is a uint32 scratch of vec entries. Buffers and
    variables as arguments, expressions built inside: an expression argument would become a let binding and
    change the TIR of the inline code it replaces."""
    f32, u32, i8 = T.float32, T.uint32, T.int8

    @T.macro
    def encode_chunk(xs, i, inv, bits, ob):
        for v in T.unroll(vec):
            bits[v] = T.reinterpret(T.cast(xs[i * vec + v], f32) * inv[0], u32)
        for v in T.unroll(vec // 2):
            ob[v] = T.cast(encode_tl(T, bits[2 * v]) | (encode_tl(T, bits[2 * v + 1]) << u32(4)), i8)

    return encode_chunk
