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
    exps = (storage.contiguous().view(torch.int32) >> 23).to(torch.uint8)  # sign bit 0: scales are > 0
    pad = (-groups) % 4
    if pad:
        exps = torch.cat([exps, exps.new_zeros((pad, cols))])
    # (G4, T4) -> (G4 / 4, T4, 4): the four groups of one word become its four consecutive bytes.
    words = (groups + pad) // 4
    if cols == 0:  # no tokens: an empty (words, 0) storage (a 0-byte row has no int32 view)
        return storage.new_zeros((words, 0), dtype=torch.int32)
    return exps.view(words, 4, cols).transpose(1, 2).contiguous().view(torch.int32).view(words, cols)
