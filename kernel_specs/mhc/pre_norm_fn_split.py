"""mhc_pre_norm_fn_split: mhc_pre_norm_fn's sums split over K ranges, for token counts too small to fill the GPU.

x (num_tokens, K) bfloat16, fn (M, K) float32 (TF32 values, as the op passes them) ->
  partial (k_splits, num_tokens, M + 1) float32: for K range s (columns [s * K / k_splits, (s + 1) * K /
  k_splits)), x @ fn^T over those columns (M values a token), then the same columns' square sum.
Summed over s these are mhc_pre_norm_fn's out_mul and sqrsum (out follows from them: out_mul * rsqrt(sqrsum / K
+ eps)).

Why: mhc_pre_norm_fn's grid is a block per 32 tokens (TileKernels' too), 32 blocks at 1024 tokens and 128 at 4096
on a GPU of 132 SMs; it streams a token's whole row (K = 28672 at hidden 7168) through one block. On an H100 it
took 81.1 us at 1024 tokens x 16384 (TileKernels 73.2; 15% of the copy ceiling) and 137.4 at 4096 x 28672
(TileKernels 127.0). Split over k_splits ranges the same tokens make k_splits times more blocks, each a
k_splits-th of the row. The blocks run mhc_pre_norm_fn's tensor-core sums (`mma_sums`, the same tiles and
pipeline) over their range, so a config means the same here as there.

Not yet measured on a GPU: the op does not call it. CUDA only; mhc_mult3 <= 32 (the tensor-core layout's width).
"""

from tkjit.registry import register
from tkjit.spec import KernelSpec, Static, TensorArg
from tkjit_kernels.mhc.pre_norm_fn import (
    COMMON,
    MMA_DEFAULT,
    MMA_N,
    RUNTIME,
    make_inputs,
    mma_sums,
    mma_tile_problem,
    reference_parts,
)

PARAMS = (
    RUNTIME,
    Static("mhc_mult3", lo=1, hi=MMA_N, default=24, doc="rows of fn: mhc_mult * (mhc_mult + 2), at most 32"),
    Static("mhc_hidden", lo=64, hi=1 << 20, default=16384, doc="K: a token's flattened residual, mhc_mult * hidden"),
    Static("k_splits", lo=2, hi=64, default=8, doc="K ranges: blocks a token tile is split over"),
)
SPACE = {"warps": (4, 8), "block_tokens": (32, 64), "block_k": (64, 128, 256), "stages": (1, 2, 3),
         "swizzle": (False, True)}
_SUMS_DEFAULT = {k: MMA_DEFAULT[k] for k in ("warps", "block_tokens", "stages", "swizzle")}


def check_shape(shape):
    k, s = shape["mhc_hidden"], shape["k_splits"]
    if k % (64 * s):
        return f"mhc_hidden={k} must be a multiple of 64 * k_splits = {64 * s} (whole 64-column steps a range)"
    return None


def _range(shape):
    return shape["mhc_hidden"] // shape["k_splits"]


def default(shape):
    # mhc_pre_norm_fn's tensor-core default (TileKernels' tile), its widest step that divides a range (64 always
    # does: check_shape).
    return next(c for c in ({**_SUMS_DEFAULT, "block_k": bk} for bk in (256, 128, 64)) if constraint(shape, c) is None)


def constraint(shape, c):
    if _range(shape) % c["block_k"]:
        return f"block_k={c['block_k']} does not divide a K range of {_range(shape)} columns"
    return mma_tile_problem(c)  # mhc_pre_norm_fn's tile limits


def build(shape, c):
    from tilelang import language as T

    M, K, S = shape["mhc_mult3"], shape["mhc_hidden"], shape["k_splits"]
    bm, threads, span = c["block_tokens"], 32 * c["warps"], _range(shape)
    num_tokens = T.dynamic("num_tokens")
    f32, bf16 = T.float32, T.bfloat16
    sums = mma_sums(c, span)

    @T.prim_func
    def mhc_pre_norm_fn_split(
        x: T.Tensor[(num_tokens, K), bf16],
        fn: T.Tensor[(M, K), f32],
        partial: T.Tensor[(S, num_tokens, M + 1), f32],
    ):
        with T.Kernel(T.ceildiv(num_tokens, bm), S, threads=threads) as (bx, by):
            acc = T.alloc_fragment((bm, MMA_N), f32)
            sq = T.alloc_fragment((bm,), f32)
            sums(x, fn, acc, sq, bx * bm, by * span)
            for i, m in T.Parallel(bm, MMA_N):
                if m < M and bx * bm + i < num_tokens:
                    partial[by, bx * bm + i, m] = acc[i, m]
            for i in T.Parallel(bm):
                if bx * bm + i < num_tokens:
                    partial[by, bx * bm + i, M] = sq[i]

    return mhc_pre_norm_fn_split


def reference(shape, x, fn):
    """Each K range's (x @ fn^T, square sums) in float64, rounded once."""
    import torch

    span = _range(shape)
    parts = [torch.cat([mul, sq.unsqueeze(-1)], -1)
             for mul, sq in (reference_parts(x[:, s * span:(s + 1) * span], fn[:, s * span:(s + 1) * span])
                             for s in range(shape["k_splits"]))]
    return torch.stack(parts).float()


def _m1(s):
    return s["mhc_mult3"] + 1


SPEC = register(
    KernelSpec(
        name="mhc_pre_norm_fn_split",
        doc="mhc_pre_norm_fn's mixes GEMM and square sums over k_splits K ranges (partial sums a range)",
        params=PARAMS,
        space=dict(SPACE),
        default=default,
        constraint=constraint,
        build=build,
        inputs=(
            TensorArg("x", "bfloat16", ("num_tokens", "mhc_hidden"), align=16),
            TensorArg("fn", "float32", (lambda s: s["mhc_mult3"], "mhc_hidden"), align=16),
        ),
        outputs=(
            TensorArg("partial", "float32", ("k_splits", "num_tokens", _m1), align=4),
        ),
        make_inputs=make_inputs,
        reference=reference,
        # x once; fn once a token tile (mostly from L2); the partial sums
        bytes_moved=lambda s: 2 * s["num_tokens"] * s["mhc_hidden"] + 4 * s["mhc_mult3"] * s["mhc_hidden"]
        + 4 * s["k_splits"] * s["num_tokens"] * _m1(s),
        flops=lambda s: s["num_tokens"] * s["mhc_hidden"] * (2 * s["mhc_mult3"] + 2),
        examples=(
            {"num_tokens": 1024, "mhc_mult3": 24, "mhc_hidden": 16384, "k_splits": 8},
            {"num_tokens": 4096, "mhc_mult3": 24, "mhc_hidden": 28672, "k_splits": 2},
        ),
        **{**COMMON, "check_shape": check_shape},
    )
)
