"""The e5m6 format both e5m6 specs share (per_token_cast_e5m6 writes it, cast_back_e5m6 reads it).

e5m6 is the top 12 bits of an IEEE float16 (sign, 5 exponent bits, 6 mantissa bits; bias 15, so 65024 =
2^15 * (1 + 63/64) is the largest finite value and 2^-20 the smallest subnormal). TileKernels' encoding of a
float32 v (its kernel and its torch reference `tile_kernels.torch.cast_e5m6` agree on finite inputs):
    h    = float16 bits of v rounded toward zero (|v| >= 65536: infinity, 0x7C00)
    code = h >> 4, plus one when (code & 1) + (v's float32 bits & 0x1FFFF) > 0x10000, masked to 12 bits
i.e. round to nearest even on the 17 float32 bits below the kept mantissa. Those are the dropped bits for
normal float16 values; for float16 subnormals they are not (TileKernels rounds them so: we follow it, bit
for bit). Eight codes c0..c7 pack big-end first into three 32-bit words:
    w0 = c0 << 20 | c1 << 8 | c2 >> 4
    w1 = c2 << 28 | c3 << 16 | c4 << 4 | c5 >> 8
    w2 = c5 << 24 | c6 << 12 | c7
stored little-endian, so a row of hidden values is hidden * 3 / 2 bytes (TileKernels returns them as uint8).
The kernels see the words as int32 (same bits; torch has no bit operations on CUDA uint32); the ops view them
as uint8. Decoding puts a code back in the top 12 bits of a float16 (exact in float32).
"""

from __future__ import annotations

import torch

E5M6_MAX = 65024.0  # 2^15 * (1 + 63 / 64): the scale maps a token's amax here
AMAX_MIN = 1e-4  # TileKernels clamps the amax from below with this (float32)
SUBNORMAL_MIN = 2.0**-20
SUBNORMAL_MAX = 2.0**-14 * 63 / 64
NORMAL_MIN = 2.0**-14


# -- torch (the references) -------------------------------------------------------------------------------

def _u32(v: torch.Tensor) -> torch.Tensor:
    """float32 -> its bit pattern as non-negative int64."""
    return v.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def encode(v: torch.Tensor) -> torch.Tensor:
    """float32 tensor -> int64 tensor of 12-bit e5m6 codes (TileKernels' rounding, see the module doc)."""
    u = _u32(v.float())
    sign = (u >> 16) & 0x8000
    e = (u >> 23) & 0xFF
    m = u & 0x7FFFFF
    normal = ((e - 112) << 10) | (m >> 13)
    sub = (m | 0x800000) >> (126 - e).clamp(0, 63)
    mag = torch.where(e > 142, torch.where((e == 255) & (m != 0), 0x7FFF, 0x7C00),
                      torch.where(e >= 113, normal, torch.where(e >= 103, sub, 0)))
    code = (sign | mag) >> 4
    return (code + (((code & 1) + (u & 0x1FFFF)) > 0x10000).to(torch.int64)) & 0xFFF


def pack(codes: torch.Tensor) -> torch.Tensor:
    """(n, h) 12-bit codes (h a multiple of 8) -> (n, h * 3 / 8) int32 words (the module doc's layout)."""
    n, h = codes.shape
    c = codes.to(torch.int64).view(n, h // 8, 8).unbind(-1)
    w0 = (c[0] << 20) | (c[1] << 8) | (c[2] >> 4)
    w1 = (c[2] << 28) | (c[3] << 16) | (c[4] << 4) | (c[5] >> 8)
    w2 = (c[5] << 24) | (c[6] << 12) | c[7]
    w = torch.stack([w0, w1, w2], -1) & 0xFFFFFFFF
    return (w - ((w >> 31) << 32)).to(torch.int32).view(n, h // 8 * 3)


def unpack(words: torch.Tensor) -> torch.Tensor:
    """(n, h * 3 / 8) int32 words -> (n, h) int64 12-bit codes."""
    n, width = words.shape
    w = (words.to(torch.int64) & 0xFFFFFFFF).view(n, width // 3, 3).unbind(-1)
    c = ((w[0] >> 20), (w[0] >> 8), (w[0] << 4) | (w[1] >> 28), (w[1] >> 16), (w[1] >> 4), (w[1] << 8) | (w[2] >> 24),
         (w[2] >> 12), w[2])
    return (torch.stack(c, -1) & 0xFFF).view(n, width // 3 * 8)


def decode(codes: torch.Tensor) -> torch.Tensor:
    """12-bit codes -> float32 values: the code as the top 12 bits of a float16 (exact)."""
    bits = (codes.to(torch.int32) << 4) & 0xFFFF
    return (bits - ((bits >> 15) << 16)).to(torch.int16).view(torch.float16).float()


def as_bytes(words: torch.Tensor) -> torch.Tensor:
    """int32 words (n, w) -> TileKernels' uint8 form (n, 4 * w), same memory."""
    return words.view(torch.uint8)


# -- TileLang (the kernels) -------------------------------------------------------------------------------

def truncate_tl(T, u):
    """uint32 bit pattern of a float32 (a buffer load: it is read many times) -> its float16 bits rounded
    toward zero, shifted right by 4: the e5m6 code before rounding (`encode`'s first steps)."""
    u32 = T.uint32
    e = (u >> u32(23)) & u32(0xFF)
    m = u & u32(0x7FFFFF)
    normal = ((e - u32(112)) << u32(10)) | (m >> u32(13))
    # Used for 103 <= e <= 112 only (shifts 14..23); clamped so that no shift ever reaches 32.
    sub = (m | u32(0x800000)) >> T.min(u32(126) - T.min(e, u32(126)), u32(31))
    big = T.if_then_else(e == u32(255), T.if_then_else(m != u32(0), u32(0x7FFF), u32(0x7C00)), u32(0x7C00))
    mag = T.if_then_else(
        e > u32(142), big, T.if_then_else(e >= u32(113), normal, T.if_then_else(e >= u32(103), sub, u32(0)))
    )
    return (((u >> u32(16)) & u32(0x8000)) | mag) >> u32(4)


def round_tl(T, code, u):
    """truncate_tl's code (a buffer load) and the float32 bits u -> the rounded 12-bit code (`encode`'s last
    step): up by one when (code & 1) + the 17 low bits of u > 0x10000."""
    u32 = T.uint32
    up = T.if_then_else((code & u32(1)) + (u & u32(0x1FFFF)) > u32(0x10000), u32(1), u32(0))
    return (code + up) & u32(0xFFF)


def pack_tl(T, c, q):
    """Word q (a Python int, 0..2) of eight uint32 codes c (a buffer), as int32 (the module doc's layout)."""
    u32 = T.uint32
    if q == 0:
        w = (c[0] << u32(20)) | (c[1] << u32(8)) | (c[2] >> u32(4))
    elif q == 1:
        w = (c[2] << u32(28)) | (c[3] << u32(16)) | (c[4] << u32(4)) | (c[5] >> u32(8))
    else:
        w = (c[5] << u32(24)) | (c[6] << u32(12)) | c[7]
    return T.reinterpret(w, T.int32)


def decode_tl(T, w, k):
    """Code k (a Python int, 0..7) of the three uint32 words w (a buffer) -> its float32 value (via float16,
    exact). k indexes a Python tuple: the caller writes the eight calls out, not a TIR loop."""
    u32 = T.uint32
    hi = (
        w[0] >> u32(16),
        w[0] >> u32(4),
        (w[0] << u32(8)) | (w[1] >> u32(24)),
        w[1] >> u32(12),
        w[1],
        (w[1] << u32(12)) | (w[2] >> u32(20)),
        w[2] >> u32(8),
        w[2] << u32(4),
    )[k] & u32(0xFFF0)
    return T.cast(T.reinterpret(T.cast(hi, "uint16"), T.float16), T.float32)
