"""mhc_post_fwd: mix a layer's output back into the mHC residual streams (TileKernels' `mhc_post_fwd`).

    out[t, n, h] = bf16(post_layer_mix[t, n] * x[t, h] + sum_m comb_res_mix[t, m, n] * residual[t, m, h])

in float32, in the order nvcc compiles TileKernels' loop `acc = post * x; acc += comb[m] * res[m]` to
(sm_90a PTX): acc = fma(post, x, comb[0] * res[0]) (that product rounded), then one fused multiply-add
per stream m = 1, 2, ... (`_post.forward_fma32` replays it); rounded once to bf16 (nearest even). The
spec's reference is the float64 value rounded once (`_post.forward`); the two differ by one ulp on the rare
elements where float32's error crosses a bf16 rounding boundary, as TileKernels' kernel and its float32
torch reference do.

Layout: the block's `block_tokens` tokens are cut into chunks of `vec` channels (block_tokens * hidden /
vec of them); thread tx takes chunks tx, tx + threads, ... so a warp's accesses are contiguous spans of
a row. A chunk is one vector load of x, mhc of residual (one per stream), the token's mhc + mhc**2
mixes (4-byte loads that the chunks of one token share: L1 hits), and mhc vector stores of out. Each
element is read and written once: 2 * (2 * mhc + 1) * hidden bytes per token (12 * 7168 * 2 at mhc 4)
plus the mixes, so the kernel is memory-bound; the tunables trade bytes in flight per thread (vec)
against blocks (block_tokens, threads). Token offsets are int64 (num_tokens * mhc * hidden passes 2^31).
bf16 and the thread index: CUDA targets only.
"""

from tkjit.registry import register
from tkjit.spec import KernelSpec
from tkjit_kernels.mhc._post import (
    COMMON,
    NUM_SMS,
    UNROLL_STEPS,
    comb_arg,
    forward,
    mix_bytes,
    post_arg,
    random_inputs,
    row_bytes,
    rows_arg,
    vec_constraint,
    widest_vec,
    x_arg,
)


def default(shape):
    # 16-byte vectors, 128 threads. A block takes as many tokens as keep a thread at <= 8 chunks (more
    # bytes per block for the narrow rows: 1280 channels are 160 chunks, 4 tokens 640 = 5 per thread)
    # while leaving >= 4 blocks per SM (decode-sized batches take one token per block).
    vec = widest_vec(shape["hidden"])
    cpr = shape["hidden"] // vec
    tokens = shape.get("num_tokens", 4096)
    bt = 1
    for b in (2, 4, 8, 16):
        if b * cpr <= 128 * UNROLL_STEPS and -(-tokens // b) >= 4 * NUM_SMS:
            bt = b
    return {"block_tokens": bt, "vec": vec, "threads": 128 if bt * cpr >= 64 else 64}


def constraint(shape, c):
    problem = vec_constraint(shape, c)
    if problem:
        return problem
    if c["threads"] > 64 and c["block_tokens"] * shape["hidden"] // c["vec"] < c["threads"] // 2:
        return "fewer chunks per block than half its threads: use fewer threads"
    return None


def build(shape, c):
    from tilelang import language as T

    m, h = shape["mhc"], shape["hidden"]
    bt, vec, threads = c["block_tokens"], c["vec"], c["threads"]
    cpr = h // vec  # chunks per token
    per_block = bt * cpr
    steps = -(-per_block // threads)
    loop = T.unroll if steps <= UNROLL_STEPS else T.serial
    num_tokens = T.dynamic("num_tokens")
    bf16, f32 = T.bfloat16, T.float32

    @T.prim_func
    def mhc_post_fwd(
        x: T.Tensor[(num_tokens, h), bf16],
        residual: T.Tensor[(num_tokens, m, h), bf16],
        post_layer_mix: T.Tensor[(num_tokens, m), f32],
        comb_res_mix: T.Tensor[(num_tokens, m, m), f32],
        out: T.Tensor[(num_tokens, m, h), bf16],
    ):
        with T.Kernel(T.ceildiv(num_tokens, bt), threads=threads) as bx:
            tx = T.get_thread_binding()
            xs = T.alloc_local((vec,), bf16)
            rs = T.alloc_local((m, vec), bf16)
            pm = T.alloc_local((m,), f32)
            cm = T.alloc_local((m, m), f32)
            acc = T.alloc_local((vec,), f32)
            ys = T.alloc_local((vec,), bf16)
            for s in loop(steps):
                q = s * threads + tx
                tok = T.cast(bx, "int64") * bt + q // cpr
                col = (q % cpr) * vec
                if q < per_block:
                    if tok < num_tokens:
                        for v in T.vectorized(vec):
                            xs[v] = x[tok, col + v]
                        for i in T.unroll(m):
                            for v in T.vectorized(vec):
                                rs[i, v] = residual[tok, i, col + v]
                        for i in T.unroll(m):
                            pm[i] = post_layer_mix[tok, i]
                        for i in T.unroll(m):
                            for o in T.unroll(m):
                                cm[i, o] = comb_res_mix[tok, i, o]
                        for o in T.unroll(m):
                            for v in T.unroll(vec):
                                acc[v] = pm[o] * T.cast(xs[v], f32)
                                for i in T.unroll(m):
                                    acc[v] = acc[v] + cm[i, o] * T.cast(rs[i, v], f32)
                                ys[v] = T.cast(acc[v], bf16)
                            for v in T.vectorized(vec):
                                out[tok, o, col + v] = ys[v]

    return mhc_post_fwd


def make_inputs(shape, device="cpu", seed=0):
    return random_inputs(shape, device, seed)  # x, residual, post_layer_mix, comb_res_mix


def reference(shape, x, residual, post_layer_mix, comb_res_mix):
    """TileKernels' mhc_post_ref in float64, rounded once to bf16."""
    return forward(x, residual, post_layer_mix, comb_res_mix).to(x.dtype)


SPEC = register(
    KernelSpec(
        name="mhc_post_fwd",
        doc="mHC post mix: out = post_layer_mix * x + comb_res_mix^T @ residual per token, bf16 rows",
        space={
            "block_tokens": (1, 2, 4, 8, 16),
            "vec": (1, 2, 4, 8),
            "threads": (64, 128, 256, 512),
        },
        default=default,
        constraint=constraint,
        build=build,
        inputs=(x_arg("x"), rows_arg("residual"), post_arg("post_layer_mix"), comb_arg("comb_res_mix")),
        outputs=(rows_arg("out"),),
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=lambda s: 2 * row_bytes(s) + s["num_tokens"] * s["hidden"] * 2 + mix_bytes(s),
        flops=lambda s: 2 * s["num_tokens"] * s["mhc"] * s["hidden"] * (s["mhc"] + 1),
        examples=(
            {"num_tokens": 4096, "mhc": 4, "hidden": 7168},
            {"num_tokens": 8192, "mhc": 4, "hidden": 1280},
            {"num_tokens": 1024, "mhc": 2, "hidden": 2560},
            {"num_tokens": 4096, "mhc": 8, "hidden": 4096},
        ),
        **COMMON,
    )
)
