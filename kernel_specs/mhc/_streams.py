"""What expand_to_mhc, pre_apply_mix and their backwards share: the mHC residual streams.

A token's residual is mhc_mult streams of `hidden` bfloat16 values, (num_tokens, mhc_mult, hidden);
the layer sees one (num_tokens, hidden) row. The four kernels move rows of hidden bf16 values, so
they take the row layout of the MoE copies (`tkjit_kernels.moe._fused_rows`): a block handles `rows`
tokens at once with threads // rows lanes each, a lane moves vec_bytes-wide vectors (u * lanes + lane,
u < unroll: a warp's accesses are consecutive), and the grid's second axis runs over a row's chunks
of lanes * unroll vectors (the backward of pre_apply_mix reduces over the whole row, so its block walks
all of a row's chunks instead). The tunables: tokens per block (`rows`), vector width (`vec_bytes`),
`threads`, and `unroll` (vectors in flight per lane). All are memory-bound on the H200: the default
takes the widest vectors and the layout with the fewest idle vector slots (`_fused_rows.default`).

  PARAMS, COMMON          shape params and the KernelSpec fields every kernel here shares
  geometry(shape, c)      the row layout of one config (vectors, lanes, chunks, whether to guard)
  fma32                   float32 fma rounded once, exactly, in torch (the references' arithmetic)
  random_streams          make_inputs: seeded bf16 streams, float32 mixes, signed zeros on odd seeds
  mix_chunk               TileLang macro: a lane's vectors of one token's weighted stream sum (the layer input)

TileKernels' kernels (and so these) round the way their float32 loops do: sums run over the streams
in order from +0.0, a weighted one as fused multiply-adds (nvcc contracts `acc += w * x`), rounded
once to bfloat16 at the end. The references replay that order exactly (fma32), so the element-wise
outputs are bit-exact; only pre_apply_mix_bwd's mix gradient, a sum over hidden, is compared with
a tolerance.
"""

from __future__ import annotations

from collections import namedtuple

import torch

from tkjit.spec import Runtime, Static, Tolerance, ieee_plain_threads
from tkjit_kernels.moe._fused_rows import SPACE
from tkjit_kernels.moe._fused_rows import constraint as row_constraint
from tkjit_kernels.moe._fused_rows import default as row_default
from tkjit_kernels.moe._fused_rows import geometry as row_geometry
from tkjit_kernels.moe.reduce_fused import fma32

__all__ = ["COMMON", "PARAMS", "ELEM", "fma32", "geometry", "mix_chunk", "random_streams", "stream_bytes"]

ELEM = 2  # bytes of a bfloat16: every row these kernels move is bf16

PARAMS = (
    Runtime("num_tokens", hi=1 << 26, doc="tokens (TileKernels' n0 * n1); runtime size, tuned per power-of-two bucket"),
    Static("mhc_mult", lo=1, hi=16, default=4, doc="residual streams per token (mHC expansion rate)"),
    Static("hidden", lo=1, hi=1 << 16, default=7168, doc="hidden size: bf16 elements per stream"),
)


def default(shape):
    return row_default(shape["hidden"], ELEM)


def constraint(shape, c):
    return row_constraint(shape["hidden"], ELEM, c)


def arch_constraint(arch, c, shape):
    if arch == "cpu":
        return "bfloat16 rows with thread-indexed vector accesses: TileLang's C target has neither (CUDA only)"
    return None


# IEEE arithmetic (no fast math): the fused multiply-adds and the final rounding are the results.
pass_configs = ieee_plain_threads


COMMON = dict(
    family="mhc",
    params=PARAMS,
    space=dict(SPACE),
    default=default,
    constraint=constraint,
    arch_constraint=arch_constraint,
    pass_configs=pass_configs,
    tolerance=Tolerance(exact=True),
)

Geometry = namedtuple("Geometry", "vec hv lanes chunk chunks guard")


def geometry(shape, c):
    """The row layout: elements per vector, vectors per row, lanes per token, vectors per chunk,
    chunks per row, and whether the last chunk runs past the row (its vectors then guarded)."""
    vec, hv, lanes, chunk, chunks = row_geometry(shape["hidden"], ELEM, c)
    return Geometry(vec, hv, lanes, chunk, chunks, hv % chunk != 0)


def stream_bytes(s, streams=1):
    """Bytes of `streams` bf16 (num_tokens, hidden) rows."""
    return s["num_tokens"] * streams * s["hidden"] * ELEM


def random_streams(g, shape, streams, seed, scale=1.0):
    """(num_tokens, streams, hidden) bf16 from generator g, rows of many magnitudes; odd seeds put
    signed zeros in (the +0.0 start of a sum turns a -0 sum into +0, as the kernels' loops do)."""
    n, h = shape["num_tokens"], shape["hidden"]
    x = torch.randn(n, streams, h, generator=g) * torch.exp(torch.randn(n, streams, 1, generator=g)) * scale
    if seed % 2 == 1 and x.numel():
        x[..., ::7] = 0.0
        x[..., 3::7] = -0.0
    return x.to(torch.bfloat16)


def mix_chunk(M, g, unroll):
    """TileLang macro mix(x, out, row, first, w, w_row, acc, xs, ys, wl): one lane's vectors of a chunk of
    token `row`'s layer input (pre_apply_mix and mhc_pre_big_fuse): out[row] = bf16(sum_m fma(w[w_row, m],
    x[row, m], acc)) from acc = +0.0, stream by stream in order, over the vectors first + u * lanes
    (u < unroll; guarded past the row's end). acc, xs, ys (unroll * vec) and wl (1) are the lane's registers;
    w is global (num_tokens, M) or shared memory."""
    from tilelang import language as T

    vec, hv, lanes, guard = g.vec, g.hv, g.lanes, g.guard
    U = unroll
    f32, bf16 = T.float32, T.bfloat16

    @T.macro
    def mix(x, out, row, first, w, w_row, acc, xs, ys, wl):
        for e in T.unroll(U * vec):
            acc[e] = T.float32(0)
        for m in T.unroll(M):
            wl[0] = w[w_row, m]
            for u in T.unroll(U):
                if (not guard) or first + u * lanes < hv:
                    for v in T.vectorized(vec):
                        xs[u * vec + v] = x[row, m, (first + u * lanes) * vec + v]
            for e in T.unroll(U * vec):
                acc[e] = T.call_extern("float32", "__fmaf_rn", wl[0], T.cast(xs[e], f32), acc[e])
        for e in T.unroll(U * vec):
            ys[e] = T.cast(acc[e], bf16)
        for u in T.unroll(U):
            if (not guard) or first + u * lanes < hv:
                for v in T.vectorized(vec):
                    out[row, (first + u * lanes) * vec + v] = ys[u * vec + v]

    return mix
