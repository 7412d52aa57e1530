"""Scale-factor layouts derived from the ones the cast kernels store.

Packed UE8M0 (TileKernels' `use_packed_ue8m0`, the scale layout DeepGEMM's SM100 path consumes): each
float32 scale keeps only its 8-bit exponent field (a UE8M0 number: the power of two 2^(e - 127), which
is the scale itself when it was rounded to a power of two), and four consecutive groups' exponents of one
token share an int32, group 4j + i in byte i (little-endian). The int32 storage is column-major and
TMA-aligned like the float32 one: (ceil(num_groups / 4), align(num_tokens, 4)); callers see the view
storage[:, :num_tokens].T. Groups past num_groups and tokens past num_tokens hold exponent 0.
"""

from __future__ import annotations

import torch

# Float32 scales per 16 bytes: a column-major scale buffer pads its token axis to a multiple of this (TileKernels'
# alloc_scaling_factors, the alignment TMA loads need), in every cast with TMA-aligned scales.
TMA_ALIGN = 4


def tma_aligned(n: int) -> int:
    """n rounded up to a multiple of TMA_ALIGN: the token axis of a column-major scale buffer."""
    return (n + TMA_ALIGN - 1) // TMA_ALIGN * TMA_ALIGN


def pack_ue8m0(storage: torch.Tensor) -> torch.Tensor:
    """float32 column-major scales (num_groups, align(num_tokens, 4)) -> packed UE8M0 int32 storage
    (ceil(num_groups / 4), align(num_tokens, 4)), bit-identical to TileKernels' torch reference.

    The exponent is the float's biased exponent field, taken as is: a scale not rounded to a power of two
    is truncated to the power below it (what TileKernels' reference does; pass round_sf for exact scales).
    Pure torch (a few small kernels on the scales only), so torch.compile traces it."""
    groups, cols = storage.shape
    # The exponent field as an int32 in 0..255 (sign bit 0: scales are > 0).
    exps = (storage.contiguous().view(torch.int32) >> 23) & 0xFF
    pad = (-groups) % 4
    if pad:
        exps = torch.cat([exps, exps.new_zeros((pad, cols))])
    # Groups 4w .. 4w + 3 become word w's bytes 0 .. 3 (little-endian). Shifts and ORs rather than a uint8 ->
    # int32 view of a transposed copy: inductor may lay that copy out strided, and a dtype view then fails.
    quads = exps.view((groups + pad) // 4, 4, cols)
    return quads[:, 0] | (quads[:, 1] << 8) | (quads[:, 2] << 16) | (quads[:, 3] << 24)
