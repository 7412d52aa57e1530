"""mhc_pre_big_fuse: mHC's whole inference pre-processing after the GEMM, one kernel (TileKernels'
`modeling.mhc.ops.mhc_pre_big_fuse`, its `_mhc_pre_big_fuse` kernel).

out_mul (num_tokens, M) float32 and sqrsum (num_tokens,) float32, the outputs of mhc_pre_norm_fn's GEMM
(x @ tf32(fn)^T and the rows' square sums, M = 2m + m*m), mhc_scale (3,), mhc_base (M,) float32 and
residual (num_tokens, m, hidden) bfloat16 ->
  post_mix    (num_tokens, m)        sigmoid(z[:, m:2m]) * mhc_post_mult_value
  comb_mix    (num_tokens, m, m)     sinkhorn(z[:, 2m:])  (softmax rows + eps, columns, then repeat - 1 rounds)
  layer_input (num_tokens, hidden)   bf16(sum_j pre[:, j] * residual[:, j]),  pre = sigmoid(z[:, :m]) + mhc_pre_eps
with z = mixes * mhc_scale[k] + mhc_base and mixes = out_mul * rsqrt(sqrsum / (m * hidden) + rms_eps): the
unfused chain mhc_pre_norm_fn (without a norm weight) -> mhc_pre_split_mixes -> sinkhorn_normalize ->
mhc_pre_apply_mix, which TileKernels' big_fuse computes in the same float32 operations (its rms as its
norm kernel's, its mixes as its split kernel's, ...).

Why the GEMM stays a kernel of its own: tkjit's mhc_pre_norm_fn kernel already writes out_mul and sqrsum
(its backward's saved tensors) beside the normed mixes, so the op runs it and hands its two GEMM outputs
to this kernel, as TileKernels hands its `_mhc_pre_norm_fn_fwd_mul` outputs to its big_fuse kernel (with
n_splits = 1 there too). The extra M floats a token it writes are < 0.1% of the residual this kernel reads.

Layout: a block takes `rows` tokens, `threads` threads stream the residual (pre_apply_mix's row layout,
`_streams.mix_chunk`: rows tokens, threads // rows lanes each, vec_bytes vectors, unroll a lane) and the mixes
run beside them, in one of two ways (`mix_warp`):
- True: one more warp, whose first `rows` threads run a token's norm, post mix and Sinkhorn each
  (`_mixes.forward_blocks`, `_common.sinkhorn_block` with `recip` tunable as in sinkhorn_fwd) and store
  post_mix and comb_mix; every streaming lane computes its own row's pre weights (m sigmoids of the normed
  GEMM outputs, the same float32 operations) in registers. No barrier: the residual's loads start at once,
  and the Sinkhorn's latency chain runs while the other warps move the row.
- False: the first `rows` threads run all of their token's mixes and leave the pre weights in shared memory;
  after one barrier every thread streams. The Sinkhorn's latency is paid before any residual moves.
The residual dominates the traffic (8 * hidden bytes a token at mhc_mult 4): once the latency is hidden the
kernel runs at memory speed. TileKernels' kernel splits its warps the same way (one for the mixes, two
streaming, a token a block).

Rounding: the norm, sigmoid and Sinkhorn run in IEEE float32 (no fast math, as TileKernels' kernel; `recip`
is tunable, TKJIT_EXACT_MATH=1 turns it off), the layer input is pre_apply_mix's fma chain, so the outputs
are bit-identical to tkjit's unfused kernels run with the same Sinkhorn settings (sinkhorn_fwd's default
adds fast math: within its rtol 1e-5). The reference is
float64 rounded once per stage (the references of those specs composed), compared at rtol 1e-4: the bf16
layer input flips a last bit where the kernel's float32 rsqrt/sigmoid move a weight by an ulp (~2e-5
relative L2 at 8 x 4096 elements). CUDA only.
"""

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Static, TensorArg, Tolerance, cuda_only, ieee_plain_threads
from tkjit_kernels.mhc import _common
from tkjit_kernels.mhc._mixes import MHC, RUNTIME, forward_blocks, reference_forward, split_segments, vec_of
from tkjit_kernels.mhc._streams import ELEM, geometry, mix_chunk, random_streams
from tkjit_kernels.mhc._streams import constraint as row_constraint
from tkjit_kernels.mhc._streams import default as row_default
from tkjit_kernels.mhc.pre_apply_mix import mix_streams
from tkjit_kernels.mhc.pre_norm_fn import reference_parts
from tkjit_kernels.moe._fused_rows import SPACE as ROW_SPACE

MIX_VEC = 4  # floats per access of a token's mixes row (vec_of narrows it to the row)

PARAMS = (
    RUNTIME,
    MHC,
    Static("hidden", lo=1, hi=1 << 16, default=7168, doc="hidden size: bf16 elements per stream"),
    Static("rms_eps", type=float, lo=0.0, hi=1.0, default=1e-6, doc="RMS norm epsilon"),
    Static("mhc_pre_eps", type=float, lo=0.0, hi=1.0, default=1e-6, doc="added to the pre-layer sigmoid"),
    Static("mhc_sinkhorn_eps", type=float, lo=0.0, hi=1.0, default=1e-6, doc="Sinkhorn epsilon"),
    Static("mhc_post_mult_value", type=float, lo=0.0, hi=1e4, default=1.0, doc="scale of the post-layer sigmoid"),
    Static("sinkhorn_repeat", lo=1, hi=100, default=10, doc="Sinkhorn row/column rounds"),
)


def width(s):
    return 2 * s["mhc_mult"] + s["mhc_mult"] ** 2


def default(shape):
    # pre_apply_mix's row layout (widest vectors, fewest idle slots), the mixes in a warp of their own. Measured on
    # an H100 (benchmarks/h200/2026-12-05_s15_h100_run2_sweep_mhc_*.json, 24-48 configs a shape, hidden 1280 / 4096
    # / 7168 at 1024, 4096 and 8192 tokens): within 1.5% of the fastest at 5 of those 9 shapes, 1.9-7.7% at the
    # others (hidden 1280 at 4096 and 8192 tokens, hidden 4096 at 1024 and 4096), where tuning takes over. The
    # same layout with the mixes in the streaming threads (mix_warp False) was 12-44% slower where measured.
    return {**row_default(shape), "recip": True, "mix_warp": True}


def constraint(shape, c):
    why = row_constraint(shape, c)
    if why:
        return why
    if c["rows"] > c["threads"]:
        return "rows > threads: a token's mixes need a thread"
    return None


SPACE = {**ROW_SPACE, "recip": (False, True), "mix_warp": (False, True)}


def build(shape, c):
    from tilelang import language as T

    m, H = shape["mhc_mult"], shape["hidden"]
    K, W = m * H, width(shape)
    segs = split_segments(shape)
    g = geometry(shape, c)
    vec, lanes, chunk, chunks = g.vec, g.lanes, g.chunk, g.chunks
    R, U, threads, mw = c["rows"], c["unroll"], c["threads"], c["mix_warp"]
    rms_eps = shape["rms_eps"]
    _, mixes, stores = forward_blocks(segs, MIX_VEC, shape["mhc_pre_eps"], shape["mhc_post_mult_value"])
    sinkhorn = _common.sinkhorn_block(m, shape["sinkhorn_repeat"], shape["mhc_sinkhorn_eps"], c["recip"])
    store_mat = _common.token_blocks(m, shape["mhc_sinkhorn_eps"], c["recip"]).store
    mix_lane = mix_chunk(m, g, U)
    num_tokens = T.dynamic("num_tokens")
    f32, bf16 = T.float32, T.bfloat16

    @T.macro
    def normed(r, out_mul, sqrsum, t64, rms, n):
        """r[:n] = the token's first n GEMM outputs times its RMS norm (n = W: the whole row; m: the pre mixes)."""
        v = vec_of(n, MIX_VEC)
        for c in T.unroll(n // v):
            for e in T.vectorized(v):
                r[c * v + e] = out_mul[t64, c * v + e]
        rms[0] = T.rsqrt(sqrsum[t64] / T.float32(K) + T.float32(rms_eps))
        for j in T.unroll(n):
            r[j] = r[j] * rms[0]

    @T.macro
    def post_and_comb(r, mat, s, t64, mhc_scale, mhc_base, post_mix, comb_mix):
        mixes[1](r, mhc_scale, mhc_base)
        mixes[2](r, mhc_scale, mhc_base)
        stores[1](post_mix, t64, r)
        for i in T.unroll(m):
            for j in T.unroll(m):
                mat[i, j] = r[2 * m + i * m + j]
        sinkhorn(mat, s)
        store_mat(comb_mix, t64, mat)

    @T.macro
    def stream(lane, bx, residual, layer_input, pre, pre_row, acc, xs, ys, w):
        row = bx * R + lane // lanes
        if row < num_tokens:
            row64 = T.cast(row, "int64")
            for ch in T.serial(chunks):
                mix_lane(residual, layer_input, row64, ch * chunk + lane % lanes, pre, pre_row, acc, xs, ys, w)

    @T.prim_func
    def mhc_pre_big_fuse(
        out_mul: T.Tensor[(num_tokens, W), f32],
        sqrsum: T.Tensor[(num_tokens,), f32],
        mhc_scale: T.Tensor[(3,), f32],
        mhc_base: T.Tensor[(W,), f32],
        residual: T.Tensor[(num_tokens, m, H), bf16],
        post_mix: T.Tensor[(num_tokens, m), f32],
        comb_mix: T.Tensor[(num_tokens, m, m), f32],
        layer_input: T.Tensor[(num_tokens, H), bf16],
    ):
        with T.Kernel(T.ceildiv(num_tokens, R), threads=threads + (32 if mw else 0)) as bx:
            tx = T.get_thread_binding()
            r = T.alloc_local((W,), f32)
            mat = T.alloc_local((m, m), f32)
            s = T.alloc_local((m,), f32)
            rms = T.alloc_local((1,), f32)
            acc = T.alloc_local((U * vec,), f32)
            xs = T.alloc_local((U * vec,), bf16)
            ys = T.alloc_local((U * vec,), bf16)
            w = T.alloc_local((1,), f32)
            tok = bx * R + tx
            if mw:
                # No barrier: warp 0 runs its tokens' post and comb mixes (the Sinkhorn, the long latency
                # chain), while every other lane computes its own row's pre weights (m sigmoids, the same
                # float32 operations) in registers and streams the residual at once.
                if tx < 32:
                    if tx < R:
                        if tok < num_tokens:
                            t64 = T.cast(tok, "int64")
                            normed(r, out_mul, sqrsum, t64, rms, W)
                            post_and_comb(r, mat, s, t64, mhc_scale, mhc_base, post_mix, comb_mix)
                else:
                    prel = T.alloc_local((1, m), f32)
                    row = bx * R + (tx - 32) // lanes
                    if row < num_tokens:
                        normed(r, out_mul, sqrsum, T.cast(row, "int64"), rms, m)
                        mixes[0](r, mhc_scale, mhc_base)
                        for j in T.unroll(m):
                            prel[0, j] = r[j]
                        stream(tx - 32, bx, residual, layer_input, prel, 0, acc, xs, ys, w)
            else:
                # One thread per token runs all its mixes and leaves the pre weights in shared memory;
                # after one barrier every thread streams.
                pre = T.alloc_shared((R, m), f32)
                if tx < R:
                    if tok < num_tokens:
                        t64 = T.cast(tok, "int64")
                        normed(r, out_mul, sqrsum, t64, rms, W)
                        mixes[0](r, mhc_scale, mhc_base)
                        for j in T.unroll(m):
                            pre[tx, j] = r[j]
                        post_and_comb(r, mat, s, t64, mhc_scale, mhc_base, post_mix, comb_mix)
                T.sync_threads()
                stream(tx, bx, residual, layer_input, pre, tx // lanes, acc, xs, ys, w)

    return mhc_pre_big_fuse


def make_inputs(shape, device="cpu", seed=0):
    """out_mul, sqrsum of a real GEMM (float64 of bf16 residual streams and fn ~ N(0, 1 / K), rounded to
    float32), mhc_scale and mhc_base standard normal, and the residual; odd seeds: signed zeros in the
    streams and one all-zero token (rms 1 / sqrt(eps))."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n, m, h = shape["num_tokens"], shape["mhc_mult"], shape["hidden"]
    W, K = width(shape), m * h
    residual = random_streams(gen, shape, m, seed)
    if seed % 2 and n:
        residual[n // 2] = 0
    fn = torch.randn(W, K, generator=gen) / K ** 0.5
    scale = torch.randn(3, generator=gen)
    base = torch.randn(W, generator=gen)
    out_mul, sqrsum = (t.float() for t in reference_parts(residual.view(n, K), fn))
    return tuple(t.to(device) for t in (out_mul, sqrsum, scale, base, residual))


def normed_mixes(out_mul, sqrsum, k, eps):
    """mhc_pre_norm_fn's out from its GEMM outputs: out_mul * rsqrt(sqrsum / k + eps), float64 rounded once."""
    return (out_mul.double() * (sqrsum.double() / k + eps).rsqrt().unsqueeze(-1)).float()


def reference(shape, out_mul, sqrsum, mhc_scale, mhc_base, residual):
    """The unfused specs' references composed, each rounded once to float32 (bf16 for the layer input):
    pre_norm_fn's norm, pre_split_mixes, sinkhorn_fwd, pre_apply_mix."""
    m = shape["mhc_mult"]
    mixes = normed_mixes(out_mul, sqrsum, m * shape["hidden"], shape["rms_eps"])
    pre, post, comb = (t.float() for t in reference_forward(split_segments(shape), mixes, mhc_scale, mhc_base,
                                                             shape["mhc_pre_eps"], shape["mhc_post_mult_value"]))
    comb = _common.reference({"eps": shape["mhc_sinkhorn_eps"], "repeat": shape["sinkhorn_repeat"]},
                             comb.view(-1, m, m))
    layer_input = mix_streams(residual, pre).to(torch.bfloat16).to(residual.device)
    return post, comb, layer_input


def _m(s):
    return s["mhc_mult"]


def _align(dim):
    return lambda s, c: 4 * vec_of(dim(s), MIX_VEC)


SPEC = register(
    KernelSpec(
        name="mhc_pre_big_fuse",
        family="mhc",
        doc="mHC inference pre: RMS norm of the GEMM outputs, split mixes, Sinkhorn, pre mix applied to the "
            "bf16 residual, one kernel",
        params=PARAMS,
        space=dict(SPACE),
        default=default,
        constraint=constraint,
        arch_constraint=cuda_only("reads bfloat16 rows into shared memory by thread index, which TileLang's C "
                                  "target does not lower"),
        pass_configs=ieee_plain_threads,
        exact={"recip": False},
        tolerance=Tolerance(rtol=1e-4),
        build=build,
        inputs=(
            TensorArg("out_mul", "float32", ("num_tokens", width), align=_align(width)),
            TensorArg("sqrsum", "float32", ("num_tokens",), align=4),
            TensorArg("mhc_scale", "float32", (3,), align=4),
            TensorArg("mhc_base", "float32", (width,), align=4),
            TensorArg("residual", "bfloat16", ("num_tokens", "mhc_mult", "hidden"),
                      align=lambda s, c: c["vec_bytes"]),
        ),
        outputs=(
            TensorArg("post_mix", "float32", ("num_tokens", "mhc_mult"), align=_align(_m)),
            TensorArg("comb_mix", "float32", ("num_tokens", "mhc_mult", "mhc_mult"), align=_align(_m)),
            TensorArg("layer_input", "bfloat16", ("num_tokens", "hidden"), align=lambda s, c: c["vec_bytes"]),
        ),
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=lambda s: s["num_tokens"] * (ELEM * (s["mhc_mult"] + 1) * s["hidden"]
                                                 + 4 * (width(s) + 1 + s["mhc_mult"] + s["mhc_mult"] ** 2))
        + 4 * (3 + width(s)),
        flops=lambda s: s["num_tokens"] * (2 * s["mhc_mult"] * s["hidden"] + 4 * width(s)
                                           + s["mhc_mult"] ** 2 * (4 + 4 * s["sinkhorn_repeat"])),
        examples=(
            {"num_tokens": 4096, "mhc_mult": 4, "hidden": 7168},
            {"num_tokens": 8192, "mhc_mult": 4, "hidden": 4096},
            {"num_tokens": 1024, "mhc_mult": 4, "hidden": 1280},
        ),
    )
)
