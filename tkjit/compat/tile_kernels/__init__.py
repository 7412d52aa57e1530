"""TileKernels' public API, served by tkjit's kernels: a drop-in for the ops tkjit has.

    import tkjit.compat.tile_kernels as tile_kernels

    idx = tile_kernels.moe.topk_gate(scores, 8)
    q, sf = tile_kernels.quant.per_token_cast(x, "e4m3", 128, use_tma_aligned_col_major_sf=True)
    y = tile_kernels.transpose.transpose(x)
    z = tile_kernels.modeling.mhc.ops.sinkhorn_normalize(comb, repeat=20)

Module paths, names, argument names and defaults are TileKernels 1.0.0's (checked against
tests/data/tile_kernels_signatures.json, extracted from its source by tools/tile_kernels_signatures.py),
and so are return types, dtypes, shapes and strides. What tkjit serves:

    moe.topk_gate                                   topk_gate kernel
    quant.per_token_cast, per_token_cast_with_sf_only  fmt='e4m3' (per_token_cast kernels; row-major
                                                    or TMA-aligned column-major float32 scales)
    quant.unpack_from_e2m1fn_x2                     torch (a decoding helper, no kernel)
    transpose.transpose, transpose.batched_transpose  transpose kernels
    modeling.mhc.ops.sinkhorn_normalize             sinkhorn_fwd/bwd kernels (differentiable)
    get_num_sms, set_num_sms, get_device_num_sms    process-wide, as TileKernels' (advisory here)

Every other function, and every option of a served one that tkjit has no kernel for (fmt='e2m1',
use_packed_ue8m0, a pre-quantised input, a size outside a kernel's shape params), raises
NotImplementedError naming the function, the option and the tkjit kernel family that will bring it.
TileKernels is never imported. `tile_kernels.torch` (its torch references) and `tile_kernels.testing`
(its test helpers) are not mirrored.
"""

from tkjit.compat.tile_kernels import config, engram, mhc, modeling, moe, quant, transpose
from tkjit.compat.tile_kernels.config import get_device_num_sms, get_num_sms, set_num_sms

__version__ = "1.0.0"  # the TileKernels API version mirrored

__all__ = [
    "config", "engram", "mhc", "modeling", "moe", "quant", "transpose",
    "get_num_sms", "get_device_num_sms", "set_num_sms",
]

_NOT_MIRRORED = {
    "torch": "TileKernels' torch reference implementations",
    "testing": "TileKernels' test helpers",
}


def __getattr__(name: str):
    if name in _NOT_MIRRORED:
        raise AttributeError(
            f"tkjit.compat.tile_kernels does not mirror tile_kernels.{name} ({_NOT_MIRRORED[name]}): "
            "only TileKernels' kernels are served"
        )
    raise AttributeError(f"module 'tkjit.compat.tile_kernels' has no attribute {name!r}")
