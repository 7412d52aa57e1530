"""mhc_pre_norm_fn_bwd: the GEMM half of mhc_pre_norm_fn's backward (TileKernels' MHCPreNormFn.backward).

mul_grad (num_tokens, M) float32 = dL/d out_mul, sqrsum_grad (num_tokens,) float32 = dL/d sqrsum, x
(num_tokens, K) bf16, fn (M, K) float32, x_grad (num_tokens, K) bf16 (in place) ->
  x_grad              bf16(x_grad + mul_grad @ fn + 2 * x * sqrsum_grad)     (updated in place)
  fn_grad_partial     (num_partials, M, K) float32: per token range p, sum of mul_grad^T x over it
The op (`tkjit.torch_ops.mhc_pre_norm_fn_bwd_impl`) computes the two per-token gradients from out's gradient
and the saved out_mul, sqrsum (TileKernels' norm backward: mul_grad = tf32(out_grad * rms), sqrsum_grad =
<out_grad, out_mul> * rms / (sqrsum + eps * K) / -2, M + 1 values a token), passes fn rounded to TF32 (as the
forward), zeros or mhc_post's residual gradient as x_grad (TileKernels' fuse_grad_acc), and sums the
partials in float32. Token range p is [p * ceil(N / P), (p + 1) * ceil(N / P)) in both layouts: the ranges do
not depend on the config, so the reference computes the same partials.

Two layouts (`layout`). "lanes": grid (K / (threads * vec), num_partials); a thread owns vec
columns of the row, keeps fn's M * vec values and M * vec fn_grad sums in registers, and walks its token
range; the block stages `tile` tokens' M + 1 gradients in shared memory (read by every thread: broadcasts).
Per token it reads x and x_grad (coalesced vectors) and writes x_grad: the traffic TileKernels' kernel has,
with P times more blocks. Its two GEMMs are 2 * M FMAs an element on the CUDA cores (48 at mhc_mult 4): for
8192 tokens x 28672 about 0.34 ms at the H200's FMA rate, as long as moving its 1.4 GB (0.33 ms at the copy
ceiling), predicted; measured on an H100: 2.26 ms, 21% of its copy ceiling (the mma default: 0.96 ms).
"mma": TileKernels' approach, both GEMMs on TF32 tensor cores over block_tokens x block_k tiles (see
_build_mma); mhc_mult3 <= 32 (mhc_mult up to 4): the default where it applies (see MMA_DEFAULT). The tuner,
behind its correctness gate, picks between them.

Precision: the op's mul_grad and fn are TF32 already and bf16 x is exact in TF32, so a TF32 product is
exact in float32 and the layouts differ only in the order of float32 sums (make_inputs draws TF32 values
for the same reason). fn_grad_partial is then within ~1e-6 of the float64 reference; x_grad is rounded
to bf16 once, and any float32 evaluation flips the last bit of a fraction of its elements (those within the
float32 error of a rounding midpoint): about 1.2e-5 relative L2 error (CPU emulation at 4K-8K tokens), hence
rtol 5e-5, still 2-10x below what a missing 2 * x * sqrsum_grad term costs at K <= 16384. CUDA only.
"""

from tkjit.registry import register
from tkjit.spec import KernelSpec, Static, TensorArg, Tolerance
from tkjit_kernels.mhc.pre_norm_fn import COMMON, RUNTIME, random_inputs

# float32 accumulator values a thread, x_grad's tile and fn_grad's: 160 (128 x 128 tiles at 4 warps) take 252
# registers without spilling (ptxas -v, sm_90a), the most a thread has; more would spill.
REG_BOUND = 160
PARTIALS = 16  # the op's num_partials: token ranges of fn's gradient (16 * 64 column blocks at K = 16384)

PARAMS = (
    RUNTIME,
    Static("mhc_mult3", lo=1, hi=80, default=24, doc="rows of fn: mhc_mult * (mhc_mult + 2)"),
    Static("mhc_hidden", lo=32, hi=1 << 20, default=16384, doc="K: a token's flattened residual, mhc_mult * hidden"),
    Static("num_partials", lo=1, hi=1024, default=PARTIALS,
           doc="token ranges: rows of partial sums of fn's gradient (the op sums them)"),
)
MMA_N = 32  # the mma layout's GEMM width: mul_grad's columns and fn's rows padded with zeros (M <= 32)
SPACE = {"layout": ("lanes", "mma"), "threads": (32, 64, 128, 256), "vec": (1, 2, 4), "tile": (8, 16, 32, 64),
         "warps": (4, 8), "block_tokens": (32, 64, 128), "block_k": (64, 128)}
LANES_ONLY = {"threads": 128, "vec": 1, "tile": 32}  # the mma layout's value of what it does not use
MMA_ONLY = {"warps": 4, "block_tokens": 64, "block_k": 64}  # the lanes layout's value likewise


# The tensor-core default: TileKernels' design (fn's tile in shared memory, both GEMMs in TF32, a block walking
# tokens), in 64-token steps so three blocks share an SM (72 KB of shared memory each), over 16 token ranges for
# more blocks than TileKernels' one per 128 columns. The lanes layout (the default of before) took 2.2 ms at 8192
# tokens x 28672 on an H100, 21% of its copy ceiling, where TileKernels' kernel of this design took 1.0 ms
# (benchmarks/h200/2026-12-07_s24_h100_run{3,4}_*). This config, same H100 model: 962 us there (TileKernels
# 1047), 0.56-1.0x TileKernels' time at 4096-8192 tokens and 1024 x 16384, but 221 against 147 us at 1024 x 28672,
# where each token range is one 64-token step (benchmarks/h200/2026-12-07_s25_h100_run1_bench.txt); it won
# every study at mhc_mult3 24 (30 configs each).
MMA_DEFAULT = {"layout": "mma", **LANES_ONLY, "warps": 4, "block_tokens": 64, "block_k": 128}


def default(shape):
    for bk in (128, 64):
        c = {**MMA_DEFAULT, "block_k": bk}
        if constraint(shape, c) is None:
            return c
    # Else (mhc_mult3 > 32, or 64 does not divide mhc_hidden) the lanes layout.
    k = shape["mhc_hidden"]
    for threads, v in ((128, 2), (64, 2), (128, 1), (64, 1), (32, 1)):
        if k % (threads * v) == 0:
            return {"layout": "lanes", "threads": threads, "vec": v if shape["mhc_mult3"] <= 40 else 1, "tile": 32,
                    **MMA_ONLY}
    return {"layout": "lanes", "threads": 32, "vec": 1, "tile": 32, **MMA_ONLY}


def constraint(shape, c):
    k, m, v = shape["mhc_hidden"], shape["mhc_mult3"], c["vec"]
    if c["layout"] == "mma":
        if any(c[key] != val for key, val in LANES_ONLY.items()):
            return "layout=mma: threads=128, vec=1, tile=32 only (it does not use them; other values duplicate it)"
        if m > MMA_N:
            return f"layout=mma: mhc_mult3={m} > {MMA_N}, the GEMM's padded width"
        if k % c["block_k"]:
            return f"layout=mma: mhc_hidden={k} is not a multiple of block_k={c['block_k']}"
        if c["block_tokens"] < 8 * c["warps"]:
            return "layout=mma: block_tokens >= 8 * warps (each warp's rows of the x_grad GEMM)"
        if (c["block_tokens"] + MMA_N) * c["block_k"] // (32 * c["warps"]) > REG_BOUND:
            return (f"layout=mma: (block_tokens + {MMA_N}) * block_k / threads float32 accumulators a thread "
                    f"exceed {REG_BOUND}: the fragments spill registers")
        if _smem_bytes(c) > 160 * 1024:
            return f"layout=mma: {_smem_bytes(c) // 1024} KB of shared memory (fn, staged x and gradients) > 160 KB"
        return None
    if any(c[key] != val for key, val in MMA_ONLY.items()):
        return "layout=lanes: warps=4, block_tokens=64, block_k=64 only (it does not use them)"
    if k % (c["threads"] * v):
        return f"threads * vec = {c['threads'] * v} does not divide mhc_hidden={k}"
    if 2 * m * v > 160:
        return f"vec={v} keeps {2 * m * v} float32 values a thread at mhc_mult3={m}: too many registers"
    return None


def _smem_bytes(c):
    """fn's tile, the bf16 x tile, the padded gradients and the float32 x tile."""
    bm, bk = c["block_tokens"], c["block_k"]
    return MMA_N * bk * 4 + bm * bk * 2 + bm * (MMA_N + 1) * 4 + bm * bk * 4


def build(shape, c):
    return _build_mma(shape, c) if c["layout"] == "mma" else _build_lanes(shape, c)


def _build_mma(shape, c):
    """layout="mma" (TileKernels' approach): grid (K / block_k, num_partials); a block keeps fn's block_k
    columns (rows padded with zeros to MMA_N) in shared memory and a (MMA_N, block_k) float32 fn_grad
    accumulator in registers, and walks its partial's token range block_tokens tokens at a time: x (bf16,
    cp.async, `stages` buffers) and the tokens' gradients (mul_grad padded to MMA_N columns, sqrsum_grad) are
    staged in shared memory, x widened to a float32 tile, then two TF32 tensor-core GEMMs: x_grad's tile
    (started from the old x_grad) += G @ fn, and fn_grad += G^T @ x. Tokens past num_tokens or the range have
    zero G rows (they add nothing to fn_grad) and store nothing."""
    from tilelang import language as T

    M, K, P = shape["mhc_mult3"], shape["mhc_hidden"], shape["num_partials"]
    bm, bk, threads = c["block_tokens"], c["block_k"], 32 * c["warps"]
    num_tokens = T.dynamic("num_tokens")
    f32, bf16 = T.float32, T.bfloat16

    @T.prim_func
    def mhc_pre_norm_fn_bwd(
        mul_grad: T.Tensor[(num_tokens, M), f32],
        sqrsum_grad: T.Tensor[(num_tokens,), f32],
        x: T.Tensor[(num_tokens, K), bf16],
        fn: T.Tensor[(M, K), f32],
        x_grad: T.Tensor[(num_tokens, K), bf16],
        fn_grad_partial: T.Tensor[(P, M, K), f32],
    ):
        with T.Kernel(K // bk, P, threads=threads) as (bx, bp):
            fs = T.alloc_shared((MMA_N, bk), f32)
            xf = T.alloc_shared((bm, bk), f32)
            acc = T.alloc_fragment((MMA_N, bk), f32)
            xg = T.alloc_fragment((bm, bk), f32)
            for i, j in T.Parallel(MMA_N, bk):
                fs[i, j] = T.if_then_else(i < M, fn[T.min(i, M - 1), bx * bk + j], T.float32(0))
            T.clear(acc)
            per = T.ceildiv(num_tokens, P)
            t0 = bp * per
            # One stage: the next tile's cp.async overlaps this one's GEMMs. TileLang 0.1.15 fails to generate
            # code for num_stages >= 2 over this loop, whose trip count depends on num_tokens.
            for it in T.Pipelined(T.ceildiv(per, bm), num_stages=1):
                xs = T.alloc_shared((bm, bk), bf16)
                gs = T.alloc_shared((bm, MMA_N), f32)
                ss = T.alloc_shared((bm,), f32)
                T.copy(x[t0 + it * bm, bx * bk], xs)  # rows past num_tokens read as zeros
                for i, m in T.Parallel(bm, MMA_N):
                    gs[i, m] = T.if_then_else(
                        (m < M) & (it * bm + i < per) & (t0 + it * bm + i < num_tokens),
                        mul_grad[T.min(t0 + it * bm + i, num_tokens - 1), T.min(m, M - 1)], T.float32(0))
                for i in T.Parallel(bm):
                    ss[i] = sqrsum_grad[T.min(t0 + it * bm + i, num_tokens - 1)]
                T.copy(xs, xf)
                T.copy(x_grad[t0 + it * bm, bx * bk], xg)
                T.gemm(gs, fs, xg)
                T.gemm(gs, xf, acc, transpose_A=True)
                for i, j in T.Parallel(bm, bk):
                    if (it * bm + i < per) & (t0 + it * bm + i < num_tokens):
                        x_grad[t0 + it * bm + i, bx * bk + j] = T.cast(
                            xg[i, j] + T.float32(2) * xf[i, j] * ss[i], bf16)
            for m, j in T.Parallel(MMA_N, bk):
                if m < M:
                    fn_grad_partial[bp, m, bx * bk + j] = acc[m, j]

    return mhc_pre_norm_fn_bwd


def _build_lanes(shape, c):
    from tilelang import language as T

    M, K, P = shape["mhc_mult3"], shape["mhc_hidden"], shape["num_partials"]
    threads, v, tile = c["threads"], c["vec"], c["tile"]
    num_tokens = T.dynamic("num_tokens")
    f32, bf16 = T.float32, T.bfloat16
    S = M + 1

    @T.prim_func
    def mhc_pre_norm_fn_bwd(
        mul_grad: T.Tensor[(num_tokens, M), f32],
        sqrsum_grad: T.Tensor[(num_tokens,), f32],
        x: T.Tensor[(num_tokens, K), bf16],
        fn: T.Tensor[(M, K), f32],
        x_grad: T.Tensor[(num_tokens, K), bf16],
        fn_grad_partial: T.Tensor[(P, M, K), f32],
    ):
        with T.Kernel(K // (threads * v), P, threads=threads) as (bk, bp):
            tx = T.get_thread_binding()
            col = bk * (threads * v) + tx * v
            fr = T.alloc_local((M * v,), f32)
            acc = T.alloc_local((M * v,), f32)
            xb = T.alloc_local((v,), bf16)
            gb = T.alloc_local((v,), bf16)
            xs = T.alloc_local((v,), f32)
            xg = T.alloc_local((v,), f32)
            dot = T.alloc_local((1,), f32)
            gsh = T.alloc_shared((tile, S), f32)
            for m in T.unroll(M):
                for e in T.vectorized(v):
                    fr[m * v + e] = fn[m, col + e]
                for e in T.unroll(v):
                    acc[m * v + e] = T.float32(0)
            per = T.ceildiv(num_tokens, P)
            t0 = bp * per
            for it in T.serial(T.ceildiv(per, tile)):
                base = t0 + it * tile
                for j in T.serial(T.ceildiv(tile * S, threads)):
                    idx = j * threads + tx
                    if idx < tile * S:
                        r = idx // S
                        q = idx % S
                        tok = T.min(base + r, num_tokens - 1)
                        if q < M:
                            gsh[r, q] = mul_grad[tok, q]
                        else:
                            gsh[r, q] = sqrsum_grad[tok]
                T.sync_threads()
                for r in T.serial(tile):
                    if (it * tile + r < per) & (base + r < num_tokens):
                        tok = base + r
                        for e in T.vectorized(v):
                            xb[e] = x[tok, col + e]
                        for e in T.vectorized(v):
                            gb[e] = x_grad[tok, col + e]
                        for e in T.unroll(v):
                            xs[e] = T.cast(xb[e], f32)
                            dot[0] = T.float32(0)
                            for m in T.unroll(M):
                                dot[0] = dot[0] + gsh[r, m] * fr[m * v + e]
                                acc[m * v + e] = acc[m * v + e] + gsh[r, m] * xs[e]
                            xg[e] = T.cast(gb[e], f32) + dot[0] + T.float32(2) * xs[e] * gsh[r, M]
                        for e in T.vectorized(v):
                            gb[e] = T.cast(xg[e], bf16)
                        for e in T.vectorized(v):
                            x_grad[tok, col + e] = gb[e]
                T.sync_threads()
            for m in T.unroll(M):
                for e in T.vectorized(v):
                    fn_grad_partial[bp, m, col + e] = acc[m * v + e]

    return mhc_pre_norm_fn_bwd


def make_inputs(shape, device="cpu", seed=0):
    import torch

    from tkjit.torch_ops import tf32_round

    gen = torch.Generator(device="cpu").manual_seed(seed + 1000)
    x, fn = random_inputs(shape, "cpu", seed)
    n, m = shape["num_tokens"], shape["mhc_mult3"]
    # TF32 values, as the op passes them (tf32_round of mul_grad and fn): the mma layout's GEMMs keep every bit.
    mul_grad = tf32_round(torch.randn(n, m, generator=gen))
    fn = tf32_round(fn)
    sqrsum_grad = torch.randn(n, generator=gen) / shape["mhc_hidden"]
    x_grad = torch.randn(x.shape, generator=gen).to(torch.bfloat16)
    return tuple(t.to(device) for t in (mul_grad, sqrsum_grad, x, fn, x_grad))


def reference(shape, mul_grad, sqrsum_grad, x, fn, x_grad):
    """(x_grad after, fn_grad_partial), float64 rounded once."""
    import torch

    n, P = x.shape[0], shape["num_partials"]
    g, xd = mul_grad.double(), x.double()
    new_x_grad = x_grad.double() + g @ fn.double() + 2 * xd * sqrsum_grad.double().unsqueeze(-1)
    per = max(1, -(-n // P))
    parts = torch.zeros(P, *fn.shape, dtype=torch.float64, device=x.device)
    for p in range(min(P, -(-n // per))):
        rows = slice(p * per, min(n, (p + 1) * per))
        parts[p] = g[rows].T @ xd[rows]
    return new_x_grad.to(torch.bfloat16), parts.float()


def _m(s):
    return s["mhc_mult3"]


def _align(s, c):
    """x's and x_grad's data pointers: the mma layout copies 16-byte vectors of their rows (cp.async), the lanes
    layout vec bf16 at a time."""
    return 16 if c["layout"] == "mma" else 2 * c["vec"]


SPEC = register(
    KernelSpec(
        name="mhc_pre_norm_fn_bwd",
        doc="Gradients of mhc_pre_norm_fn's GEMM: x_grad (bf16, accumulated in place) and per-token-range partial "
            "sums of fn's gradient",
        params=PARAMS,
        space=dict(SPACE),
        default=default,
        constraint=constraint,
        build=build,
        inputs=(
            TensorArg("mul_grad", "float32", ("num_tokens", _m), align=4),
            TensorArg("sqrsum_grad", "float32", ("num_tokens",), align=4),
            TensorArg("x", "bfloat16", ("num_tokens", "mhc_hidden"), align=_align),
            TensorArg("fn", "float32", (_m, "mhc_hidden"), align=lambda s, c: 4 * c["vec"]),
            TensorArg("x_grad", "bfloat16", ("num_tokens", "mhc_hidden"), align=_align, inout=True),
        ),
        outputs=(
            TensorArg("fn_grad_partial", "float32", ("num_partials", _m, "mhc_hidden"),
                      align=lambda s, c: 4 * c["vec"]),
        ),
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=lambda s: s["num_tokens"] * (6 * s["mhc_hidden"] + 4 * (_m(s) + 1))
        + 4 * _m(s) * s["mhc_hidden"] * (1 + s["num_partials"]),
        flops=lambda s: s["num_tokens"] * s["mhc_hidden"] * (4 * _m(s) + 3),
        examples=(
            {"num_tokens": 4096, "mhc_mult3": 24, "mhc_hidden": 16384},
            {"num_tokens": 8192, "mhc_mult3": 24, "mhc_hidden": 28672},
            {"num_tokens": 1024, "mhc_mult3": 80, "mhc_hidden": 32768},
        ),
        **{**COMMON, "tolerance": Tolerance(rtol=5e-5)},  # x_grad's bf16 rounding: see the module docstring
    )
)
