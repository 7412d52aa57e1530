"""mhc_pre_norm_fn: mHC's RMS-normed mixes GEMM (the kernel half of TileKernels' `mhc_pre_norm_fn`).

x (num_tokens, K) bfloat16, a token's flattened residual (K = mhc_mult * hidden), fn (M, K) float32
(M = mhc_mult * (mhc_mult + 2) rows of mixes weights) ->
  out     (num_tokens, M)  out_mul * rsqrt(sqrsum / K + norm_eps)
  out_mul (num_tokens, M)  x @ fn^T                   (saved for the backward)
  sqrsum  (num_tokens,)    sum of x**2 over the row   (saved for the backward)
float32, TileKernels' torch reference `mhc_pre_norm_fn_ref` (one RMS group), whose kernel returns out and
saves the other two.

TileKernels runs the GEMM on TF32 tensor cores with fn rounded to TF32 first (`round_to_tf32`: +0x1000 on
the bits, the tensor core then drops the low 13: round half away from zero); bf16 x is exact in TF32 and a
bf16 * TF32 product is exact in float32, so its GEMM is exactly float32 sums of x * tf32(fn). The op
(`tkjit.torch_ops.mhc_pre_norm_fn_impl`) does that rounding; this kernel takes fn as given and sums
float32 products of it: the GEMM is 2 * M flops per bf16 element read (48 at mhc_mult 4). TileKernels'
n_splits (split-K) is a hint its own op ignores (it sets n_splits = 1); so does this one.

Two layouts (`layout`). "lanes" (the default where "mma" does not apply): one warp per `tokens_per_warp`
tokens: a lane walks the row's columns lane * vec + 32 * vec * i, keeps M + 1 float32 sums per token (the mixes
and the square sum), and the warp adds its lanes' sums with shuffles. A block holds `warps` warps; fn is read
from global memory (L1/L2: 1.5 MB at mhc_mult 4, hidden 4096), once per warp for its tokens_per_warp tokens:
3 GB from L2 at 4096 x 16384 by that count; this layout measured 1.4-3.9x slower than "mma" on an H100. "mma":
TileKernels' approach, a TF32 tensor-core GEMM over tiles of block_tokens tokens (see _build_mma);
mhc_mult3 <= 32, the default there. The tuner, behind its correctness gate, picks between them.
float64 reference rounded once; rtol 1e-4 (TileKernels' test allows 1e-3): tensor cores add float32 in their
own order and rounding (published measurements find truncation), and the mma layout measured 1.08e-5 at
1024 tokens x 5120 on an H100. CUDA only.
"""

from tkjit.registry import register
from tkjit.spec import KernelSpec, Runtime, Static, TensorArg, Tolerance, ieee_plain_threads

MAX_M = 80  # rows of fn (M = 24 at mhc_mult 4, 80 at mhc_mult 8)

RUNTIME = Runtime("num_tokens", hi=1 << 26,
                  doc="tokens (TileKernels' n0 * n1); runtime size, tuned per power-of-two bucket")
PARAMS = (
    RUNTIME,
    Static("mhc_mult3", lo=1, hi=MAX_M, default=24, doc="rows of fn: mhc_mult * (mhc_mult + 2)"),
    Static("mhc_hidden", lo=32, hi=1 << 20, default=16384, doc="K: a token's flattened residual, mhc_mult * hidden"),
    Static("norm_eps", type=float, lo=0.0, hi=1.0, default=1e-6, doc="RMS norm epsilon"),
)
VECS = (1, 2, 4, 8)


def arch_constraint(arch, c, shape):
    if arch == "cpu":
        return "bfloat16 rows, warp shuffles and the thread index: TileLang's C target has none (CUDA only)"
    return None


# IEEE float32 maths (TileKernels' kernels do not use fast math either).
pass_configs = ieee_plain_threads


def check_shape(shape):
    if shape["mhc_hidden"] % 32:
        return f"mhc_hidden={shape['mhc_hidden']} must be a multiple of 32 (a warp's lanes split each row evenly)"
    return None


COMMON = dict(family="mhc", pass_configs=pass_configs, arch_constraint=arch_constraint, check_shape=check_shape,
              tolerance=Tolerance(rtol=1e-4))


def _widest_vec(k: int, cap: int = 8) -> int:
    return next(v for v in (8, 4, 2, 1) if v <= cap and k % (32 * v) == 0)


MMA_DEFAULT = {"layout": "mma", "warps": 4, "tokens_per_warp": 1, "vec": 8, "block_tokens": 32, "stages": 2,
               "swizzle": True}


def default(shape):
    # The tensor-core layout where it applies, TileKernels' tile (32 tokens, 256 columns, two stages, swizzled x):
    # the fastest (or within 3.4%) of 42 mma configs at 1024 and 4096 tokens x 16384 and 8192 x 28672 on an H100
    # (benchmarks/h200/2026-12-05_s15_h100_run3_sweep_pre_norm_fn_*, before fn's tile was pipelined too); then,
    # against the lanes layout: 1.4x at 1024 tokens, 3.1-3.9x from 4096 (2026-12-05_s15_h100_run4_bench.txt).
    for bk in (256, 128, 64):
        c = {**MMA_DEFAULT, "block_k": bk}
        if constraint(shape, c) is None:
            return c
    # Else lanes: 8 bf16 (16 bytes) per lane access where the row allows; 2 tokens per warp share each fn load;
    # 4 warps (8 tokens) a block: 8K tokens are 1024 blocks.
    tpw = 2 if shape["mhc_mult3"] <= 40 else 1
    return {"layout": "lanes", "warps": 4, "tokens_per_warp": tpw, "vec": _widest_vec(shape["mhc_hidden"]),
            **MMA_ONLY}


def constraint(shape, c):
    k, m, v, tpw = shape["mhc_hidden"], shape["mhc_mult3"], c["vec"], c["tokens_per_warp"]
    if c["layout"] == "mma":
        if any(c[key] != val for key, val in LANES_ONLY.items()) or v != 8:
            return "layout=mma: tokens_per_warp=1, vec=8 only (it does not use them; other values duplicate it)"
        if m > MMA_N:
            return f"layout=mma: mhc_mult3={m} > {MMA_N}, the GEMM's width"
        if k % c["block_k"]:
            return f"layout=mma: mhc_hidden={k} is not a multiple of block_k={c['block_k']}"
        problem = mma_tile_problem(c)
        return f"layout=mma: {problem}" if problem else None
    if any(c[key] != val for key, val in MMA_ONLY.items()):
        return "layout=lanes: block_tokens=32, block_k=64, stages=1, swizzle=False only (it does not use them)"
    if k % (32 * v):
        return f"vec={v}: mhc_hidden={k} is not a multiple of 32 * vec (one warp access of vec elements a lane)"
    if tpw * (m + 1) + tpw * v > 160:
        return f"tokens_per_warp={tpw} keeps {tpw * (m + 1)} float32 sums a lane at mhc_mult3={m}: too many registers"
    return None


def mma_tile_problem(c):
    """Why the mma layout's tiles (mma_sums) cannot take config c, or None."""
    if c["warps"] not in (4, 8) or c["block_tokens"] < 8 * c["warps"]:
        return "4 or 8 warps, and block_tokens >= 8 * warps (each warp's GEMM rows)"
    if c["block_tokens"] * c["block_k"] > 8192:
        # The widened x tile lives in registers: 64 x 256 spills (ptxas: 172-304 bytes at 4 or 8 warps).
        return "block_tokens * block_k > 8192 (the float32 x tile spills registers)"
    if (c["block_tokens"] * 2 + MMA_N * 4) * c["block_k"] * max(1, c["stages"]) > 160 * 1024:
        return "the pipelined x and fn tiles exceed 160 KB of shared memory"
    return None


MMA_N = 32  # the mma layout's GEMM width: fn's rows padded with zeros (M <= 32: mhc_mult up to 4)
SPACE = {"layout": ("lanes", "mma"), "warps": (1, 2, 4, 8), "tokens_per_warp": (1, 2, 4, 8), "vec": VECS,
         "block_tokens": (32, 64), "block_k": (64, 128, 256), "stages": (1, 2, 3), "swizzle": (False, True)}
LANES_ONLY = {"tokens_per_warp": 1}  # the mma layout's value of what it does not use
MMA_ONLY = {"block_tokens": 32, "block_k": 64, "stages": 1, "swizzle": False}  # the lanes layout's value of what
# it does not use


def build(shape, c):
    return _build_mma(shape, c) if c["layout"] == "mma" else _build_lanes(shape, c)


def _build_mma(shape, c):
    """layout="mma": block_tokens tokens a block; each block_k-column step stages the tokens' x (bf16) and fn's
    rows (float32, zero rows up to MMA_N) in shared memory, widens x to float32 in registers and runs a TF32
    tensor-core GEMM into (block_tokens, MMA_N) float32 accumulators, pipelined over `stages` buffers. fn is
    read once a block (block_tokens tokens share it), where the lanes layout reads it once a warp; and the
    GEMM's 2 * M flops an element run on tensor cores, not the CUDA cores' FMA pipe (at mhc_mult 4 that pipe
    needs ~0.17 ms for 8192 x 28672 elements, more than reading them: 0.11 ms at the copy ceiling). The
    square sums come from the same float32 tile. fn is TF32 already (the op rounds it), bf16 x is exact in
    TF32 and their products exact in float32: only the order of the float32 sums differs from the lanes
    layout's. `swizzle` stores the x tile in TileKernels' swizzled shared layout, which spares the widening
    copy to registers its bank conflicts: 1.9x faster on an H100 at 4096 x 16384 (132.4 against 246.0 us)."""
    from tilelang import language as T

    M, K, eps = shape["mhc_mult3"], shape["mhc_hidden"], shape["norm_eps"]
    bm, threads = c["block_tokens"], 32 * c["warps"]
    num_tokens = T.dynamic("num_tokens")
    f32, bf16 = T.float32, T.bfloat16
    sums = mma_sums(c, K)

    @T.prim_func
    def mhc_pre_norm_fn(
        x: T.Tensor[(num_tokens, K), bf16],
        fn: T.Tensor[(M, K), f32],
        out: T.Tensor[(num_tokens, M), f32],
        out_mul: T.Tensor[(num_tokens, M), f32],
        sqrsum: T.Tensor[(num_tokens,), f32],
    ):
        with T.Kernel(T.ceildiv(num_tokens, bm), threads=threads) as bx:
            acc = T.alloc_fragment((bm, MMA_N), f32)
            sq = T.alloc_fragment((bm,), f32)
            sums(x, fn, acc, sq, bx * bm, 0)
            for i, m in T.Parallel(bm, MMA_N):
                if m < M and bx * bm + i < num_tokens:
                    out_mul[bx * bm + i, m] = acc[i, m]
                    out[bx * bm + i, m] = acc[i, m] * T.rsqrt(sq[i] / T.float32(K) + T.float32(eps))
            for i in T.Parallel(bm):
                if bx * bm + i < num_tokens:
                    sqrsum[bx * bm + i] = sq[i]

    return mhc_pre_norm_fn


def mma_sums(c, k_len):
    """The mma layout's sums as a TileLang macro sums(x, fn, acc, sq, row0, col0): acc (block_tokens, MMA_N)
    float32 <- x[row0:, col0:col0 + k_len] @ fn[:, same]^T and sq (block_tokens,) <- the same columns' square
    sums, for block_tokens rows from row0 (rows past x's read as zeros), over k_len / block_k pipelined steps
    (see _build_mma). mhc_pre_norm_fn sums a row's whole K; mhc_pre_norm_fn_split one K range a block."""
    from tilelang import language as T
    from tilelang.layout import make_swizzled_layout

    bm, bk, stages = c["block_tokens"], c["block_k"], c["stages"]
    f32, bf16 = T.float32, T.bfloat16
    parts = 4  # square-sum partials a token, summed at the end

    @T.macro
    def sums(x, fn, acc, sq, row0, col0):
        sq_part = T.alloc_fragment((bm, parts), f32)
        T.clear(acc)
        T.clear(sq_part)
        for kk in T.Pipelined(k_len // bk, num_stages=stages):
            xs = T.alloc_shared((bm, bk), bf16)
            fs = T.alloc_shared((MMA_N, bk), f32)
            if c["swizzle"]:  # TileKernels' layout of the x tile (see _build_mma)
                T.annotate_layout({xs: make_swizzled_layout(xs)})
            T.copy(x[row0, col0 + kk * bk], xs)  # rows past num_tokens read as zeros, stored nowhere
            # fn's M rows and MMA_N - M more: the copy's bounds check leaves those rows zero (or any value:
            # they only meet GEMM columns >= M, which are never stored). A plain copy, so the pipeline
            # fetches it asynchronously with x; filled element-wise it was a synchronous load a step.
            T.copy(fn[0, col0 + kk * bk], fs)
            xh = T.alloc_fragment((bm, bk), bf16)
            T.copy(xs, xh)
            xf = T.alloc_fragment((bm, bk), f32)
            T.copy(xh, xf)
            for jj in T.serial(bk // parts):
                for i, j in T.Parallel(bm, parts):
                    sq_part[i, j] += xf[i, jj * parts + j] * xf[i, jj * parts + j]
            T.gemm(xf, fs, acc, transpose_B=True)
        T.reduce_sum(sq_part, sq, dim=1)

    return sums


def _build_lanes(shape, c):
    from tilelang import language as T

    M, K, eps = shape["mhc_mult3"], shape["mhc_hidden"], shape["norm_eps"]
    warps, tpw, v = c["warps"], c["tokens_per_warp"], c["vec"]
    threads, bt, chunk = 32 * warps, warps * tpw, 32 * v
    S = M + 1  # sums per token: the M mixes, then the square sum
    num_tokens = T.dynamic("num_tokens")
    f32, bf16 = T.float32, T.bfloat16

    @T.prim_func
    def mhc_pre_norm_fn(
        x: T.Tensor[(num_tokens, K), bf16],
        fn: T.Tensor[(M, K), f32],
        out: T.Tensor[(num_tokens, M), f32],
        out_mul: T.Tensor[(num_tokens, M), f32],
        sqrsum: T.Tensor[(num_tokens,), f32],
    ):
        with T.Kernel(T.ceildiv(num_tokens, bt), threads=threads) as bx:
            tx = T.get_thread_binding()
            lane = tx % 32
            first = bx * bt + (tx // 32) * tpw  # this warp's first token
            acc = T.alloc_local((tpw * S,), f32)
            xb = T.alloc_local((v,), bf16)
            xs = T.alloc_local((tpw * v,), f32)
            fs = T.alloc_local((v,), f32)
            rms = T.alloc_local((1,), f32)
            for i in T.unroll(tpw * S):
                acc[i] = T.float32(0)
            for ch in T.serial(K // chunk):
                col = ch * chunk + lane * v
                for t in T.unroll(tpw):
                    tok = T.min(first + t, num_tokens - 1)  # tail tokens: a valid row, nothing stored
                    for e in T.vectorized(v):
                        xb[e] = x[tok, col + e]
                    for e in T.unroll(v):
                        xs[t * v + e] = T.cast(xb[e], f32)
                        acc[t * S + M] = acc[t * S + M] + xs[t * v + e] * xs[t * v + e]
                for m in T.unroll(M):
                    for e in T.vectorized(v):
                        fs[e] = fn[m, col + e]
                    for t in T.unroll(tpw):
                        for e in T.unroll(v):
                            acc[t * S + m] = acc[t * S + m] + xs[t * v + e] * fs[e]
            for i in T.unroll(tpw * S):
                acc[i] = T.warp_reduce_sum(acc[i])
            if lane == 0:
                for t in T.unroll(tpw):
                    if first + t < num_tokens:
                        rms[0] = T.rsqrt(acc[t * S + M] / T.float32(K) + T.float32(eps))
                        sqrsum[first + t] = acc[t * S + M]
                        for m in T.unroll(M):
                            out_mul[first + t, m] = acc[t * S + m]
                            out[first + t, m] = acc[t * S + m] * rms[0]

    return mhc_pre_norm_fn


def random_inputs(shape, device="cpu", seed=0):
    """x (num_tokens, K) bf16 and fn (M, K) float32, standard normal as TileKernels' tests draw them (fn scaled
    by 1 / sqrt(K), so the mixes are O(1)). Odd seeds scale each token's row by 2^k, k in [-8, 8], and zero
    one token's row (its rms is 1 / sqrt(eps))."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    n, m, k = shape["num_tokens"], shape["mhc_mult3"], shape["mhc_hidden"]
    x = torch.randn(n, k, generator=gen)
    fn = torch.randn(m, k, generator=gen) / k ** 0.5
    if seed % 2:
        x = x * torch.exp2(torch.randint(-8, 9, (n, 1), generator=gen).float())
        x[n // 2] = 0.0
    return x.to(torch.bfloat16).to(device), fn.to(device)


def make_inputs(shape, device="cpu", seed=0):
    """random_inputs with fn rounded to TF32, as the op passes it: the mma layout's tensor cores then drop no
    bit of it, and both layouts compute the float32 sums the reference rounds once."""
    from tkjit.torch_ops import tf32_round

    x, fn = random_inputs(shape, device, seed)
    return x, tf32_round(fn)


def reference_parts(x, fn):
    """(out_mul, sqrsum) in float64: x @ fn^T and the rows' square sums."""
    xd = x.double()
    return xd @ fn.double().T, xd.square().sum(-1)


def reference(shape, x, fn):
    out_mul, sqrsum = reference_parts(x, fn)
    out = out_mul * (sqrsum / shape["mhc_hidden"] + shape["norm_eps"]).rsqrt().unsqueeze(-1)
    return out.float(), out_mul.float(), sqrsum.float()


def _m(s):
    return s["mhc_mult3"]


SPEC = register(
    KernelSpec(
        name="mhc_pre_norm_fn",
        doc="mHC pre norm_fn: RMS-normed x @ fn^T of each token's flattened bf16 residual, float32 mixes",
        params=PARAMS,
        space=dict(SPACE),
        default=default,
        constraint=constraint,
        build=build,
        inputs=(
            TensorArg("x", "bfloat16", ("num_tokens", "mhc_hidden"), align=lambda s, c: 2 * c["vec"]),
            TensorArg("fn", "float32", (_m, "mhc_hidden"), align=lambda s, c: 4 * c["vec"]),
        ),
        outputs=(
            TensorArg("out", "float32", ("num_tokens", _m), align=4),
            TensorArg("out_mul", "float32", ("num_tokens", _m), align=4),
            TensorArg("sqrsum", "float32", ("num_tokens",), align=4),
        ),
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=lambda s: s["num_tokens"] * (2 * s["mhc_hidden"] + 4 * (2 * _m(s) + 1))
        + 4 * _m(s) * s["mhc_hidden"],
        flops=lambda s: s["num_tokens"] * s["mhc_hidden"] * (2 * _m(s) + 2),
        examples=(
            {"num_tokens": 4096, "mhc_mult3": 24, "mhc_hidden": 16384},
            {"num_tokens": 8192, "mhc_mult3": 24, "mhc_hidden": 28672},
            {"num_tokens": 1024, "mhc_mult3": 80, "mhc_hidden": 32768},
        ),
        **COMMON,
    )
)
