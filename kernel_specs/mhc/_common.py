"""What every mHC Sinkhorn kernel shares: shapes, tensors, target rules, reference, TileLang blocks.

The kernels of this family work on num_tokens independent n x n float32 matrices, one token per
thread in the per-thread layouts. A kernel file keeps only its own maths (the steps it runs on a
token, its layouts, its tunable space and default) and takes the rest from here:

  PARAMS, mats(name), mat_bytes   the shape params and the (num_tokens, n, n) float32 tensors
  COMMON                          KernelSpec fields that are the same for every kernel of the family
  reference                       the forward's maths in torch (float64): the backward differentiates it
  random_mats                     make_inputs: normal matrices from one seeded CPU generator
  token_blocks                    TileLang macros over one token's matrix: load/store, softmax start
  sinkhorn_block                  TileLang macro: the forward normalisation of one token's matrix in registers

The backward's normalisation steps are not shared with the forward's: they sum from eps up and keep
every step's denominators, so they round differently from the forward's (sum + eps).
"""

from __future__ import annotations

from collections import namedtuple

import torch

from tkjit.spec import Runtime, Static, TensorArg, Tolerance

SMEM_LIMIT = 48 * 1024  # stay under the default dynamic shared memory cap

PARAMS = (
    Runtime("num_tokens", hi=1 << 26, doc="tokens; runtime size, tuned per power-of-two bucket"),
    Static("n", lo=1, hi=16, default=4, doc="matrix size (mHC expansion rate)"),
    Static("repeat", lo=1, hi=100, default=10, doc="row/column normalisation rounds"),
    Static("eps", type=float, lo=0.0, hi=1.0, default=1e-6),
)


def mats(name):
    """A (num_tokens, n, n) float32 tensor argument."""
    return TensorArg(name, "float32", ("num_tokens", "n", "n"))


def mat_bytes(s):
    """Bytes of one (num_tokens, n, n) float32 tensor."""
    return s["num_tokens"] * s["n"] * s["n"] * 4


def arch_constraint(arch, c, shape):
    # TileLang's C target has no threads or fragments: only the per-thread layout lowers there.
    if arch == "cpu" and (c["layout"] != "thread" or c["fast_math"]):
        return "the C target runs the thread layout without fast math only"
    return None


def pass_configs(c):
    return {"tl.enable_fast_math": bool(c["fast_math"]), "tl.disable_warp_specialized": True}


COMMON = dict(
    family="mhc",
    params=PARAMS,
    arch_constraint=arch_constraint,
    pass_configs=pass_configs,
    tolerance=Tolerance(rtol=1e-5),
    # TKJIT_EXACT_MATH=1: IEEE exp and true divisions (the fast defaults differ from float32 torch in the
    # last bits, within the rtol 1e-5 gate).
    exact={"fast_math": False, "recip": False},
)


def random_mats(shape, count, device="cpu", seed=0):
    """`count` standard-normal (num_tokens, n, n) float32 tensors, drawn in order from one generator."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    t, n = shape["num_tokens"], shape["n"]
    return tuple(torch.randn(t, n, n, generator=g, dtype=torch.float32).to(device) for _ in range(count))


def reference(shape, x, dtype=torch.float64):
    """TileKernels' sinkhorn_normalize_ref, evaluated in float64 (or `dtype`) and rounded once."""
    eps, repeat = shape["eps"], shape["repeat"]
    y = x.to(dtype).softmax(-1) + eps
    y = y / (y.sum(-2, keepdim=True) + eps)
    for _ in range(repeat - 1):
        y = y / (y.sum(-1, keepdim=True) + eps)
        y = y / (y.sum(-2, keepdim=True) + eps)
    return y.to(x.dtype)


TokenBlocks = namedtuple("TokenBlocks", "load store load_tile store_tile exp_rows row_sums")


def token_blocks(n, eps, recip):
    """TileLang macros over one token's matrix m (n x n, the thread's registers) and s (n scratch).

    load/store          m <-> a (num_tokens, n, n) global tensor at token tok, n-wide vectors
    load_tile/store_tile m <-> row t of a shared (block_tokens, n, n) tile, element by element
    exp_rows            s <- row maxima; m <- exp(m - s): the softmax numerator, overflow-free
    row_sums            s <- row sums (+ eps with add_eps); with recip, their reciprocals
    """
    from tilelang import language as T

    @T.macro
    def load(m, src, tok):
        for i in T.unroll(n):
            for j in T.vectorized(n):
                m[i, j] = src[tok, i, j]

    @T.macro
    def store(dst, tok, m):
        for i in T.unroll(n):
            for j in T.vectorized(n):
                dst[tok, i, j] = m[i, j]

    @T.macro
    def load_tile(m, tile, t):
        for i in T.unroll(n):
            for j in T.unroll(n):
                m[i, j] = tile[t, i, j]

    @T.macro
    def store_tile(tile, t, m):
        for i in T.unroll(n):
            for j in T.unroll(n):
                tile[t, i, j] = m[i, j]

    @T.macro
    def exp_rows(m, s):
        for i in T.unroll(n):
            s[i] = m[i, 0]
            for j in T.unroll(1, n):
                s[i] = T.max(s[i], m[i, j])
        for i in T.unroll(n):
            for j in T.unroll(n):
                m[i, j] = T.exp(m[i, j] - s[i])

    @T.macro
    def row_sums(m, s, add_eps):
        for i in T.unroll(n):
            s[i] = 0.0
            for j in T.unroll(n):
                s[i] += m[i, j]
            if recip:
                s[i] = 1.0 / (s[i] + eps) if add_eps else 1.0 / s[i]

    return TokenBlocks(load, store, load_tile, store_tile, exp_rows, row_sums)


def sinkhorn_block(n, repeat, eps, recip):
    """TileLang macro sinkhorn(m, s): the whole forward normalisation of one token's matrix m (n x n, the
    thread's registers; s n scratch registers), in place: softmax rows, + eps, then columns, rows, ...
    (sinkhorn_fwd's per-thread layouts and mhc_pre_big_fuse). With recip, each step multiplies by the
    reciprocals of its n sums (n divisions, not n * n); without, it divides as the reference does."""
    from tilelang import language as T

    blocks = token_blocks(n, eps, recip)
    exp_rows, row_sums = blocks.exp_rows, blocks.row_sums

    @T.macro
    def normalise_rows(m, s, add_eps):
        row_sums(m, s, add_eps)
        for i in T.unroll(n):
            for j in T.unroll(n):
                if recip:
                    m[i, j] = m[i, j] * s[i]
                else:
                    m[i, j] = m[i, j] / (s[i] + eps) if add_eps else m[i, j] / s[i]

    @T.macro
    def normalise_cols(m, s):
        for j in T.unroll(n):
            s[j] = 0.0
            for i in T.unroll(n):
                s[j] += m[i, j]
            if recip:
                s[j] = 1.0 / (s[j] + eps)
        for i in T.unroll(n):
            for j in T.unroll(n):
                if recip:
                    m[i, j] = m[i, j] * s[j]
                else:
                    m[i, j] = m[i, j] / (s[j] + eps)

    @T.macro
    def sinkhorn(m, s):
        exp_rows(m, s)
        normalise_rows(m, s, False)
        for i in T.unroll(n):
            for j in T.unroll(n):
                m[i, j] = m[i, j] + eps
        normalise_cols(m, s)
        for _ in T.serial(repeat - 1):
            normalise_rows(m, s, True)
            normalise_cols(m, s)

    return sinkhorn
