"""engram_gate_fwd: the Engram gate's forward (TileKernels' `engram.engram_gate_fwd`).

hidden_states, k (num_tokens, hc_mult, hidden_size) and v (num_tokens, hidden_size) bf16 (k and v may
be row-strided views: TileKernels takes slices of wider projections), weight_fused (hc_mult,
hidden_size) float32 -> out (num_tokens, hc_mult, hidden_size) bf16 = x + gate * v, and the values its
backward needs, (num_tokens, hc_mult) float32: dot (unscaled), gate_score, rstd_x, rstd_k (the maths:
`_gate.py`). TileKernels' save_for_backward=False skips those four stores; tkjit always writes them
(16 bytes a head against 6 * hidden_size) and the compat entry drops them.

Layout: a block takes `block_tokens` tokens of one head one after another; its threads
split the row into `vec`-channel chunks (thread tx: chunks tx, tx + threads, ...). Pass 1 loads x, k
and weight_fused's chunk and accumulates the three sums (x*x, k*k, x*w*k) in float32 registers, then
the block reduces them (warp shuffle trees, the warps' partials in shared memory: every thread adds
them, in the same order, so all hold the same totals); pass 2 reads x again (an L1/L2 hit: the same
thread's addresses) with v's chunk and stores x + gate * v rounded once to bf16. The sums' order is
not TileKernels' (one warp per head there), so dot and the rstds agree to float32 rounding, not bit
for bit. Memory-bound: every element is read once from DRAM, out written once.
`grid`: "heads_inner" (the default) numbers the blocks token-block major, head minor, so the hc_mult blocks
of a token run side by side and v, which they share, is read from DRAM once and from L2 by the others;
"heads_outer" (the layout before the tunable, `added`) runs every token of head 0 first, then head 1, ...:
at 4096 x 7168 a head's pass over v (58 MB) outgrows the 50 MB L2, so v came from DRAM hc_mult times
(+23% of the traffic; 0.88-0.91x TileKernels' time on an H100, whose grid puts the heads innermost too).
bf16 and warp shuffles: CUDA targets only.
"""

from tkjit.registry import register
from tkjit.spec import KernelSpec
from tkjit_kernels.engram._gate import (
    COMMON,
    EXAMPLES,
    PARAMS,
    SAVED,
    forward64,
    gate_dims,
    gate_inputs,
    heads_arg,
    row_bytes,
    saved_arg,
    saved_bytes,
    v_arg,
    vec_constraint,
    weight_arg,
    widest_vec,
)
from tkjit_kernels.mhc._post import UNROLL_STEPS, idle_threads_problem, row_threads


def default(shape):
    # 16-byte vectors, enough threads that each takes <= 8 chunks of a row (7168 channels: 896 chunks,
    # 7 per thread at 128), fewer for narrow rows. One token per block: the per-token reduction does not
    # amortise over tokens, and num_tokens * hc_mult blocks fill the GPU at any realistic size.
    h = shape["hidden_size"]
    vec = widest_vec(h)
    cpr = h // vec
    return {"block_tokens": 1, "vec": vec, "threads": row_threads(cpr), "grid": "heads_inner"}


def constraint(shape, c):
    problem = vec_constraint(shape, c)
    if problem:
        return problem
    return idle_threads_problem(shape["hidden_size"] // c["vec"], c["threads"])


def build(shape, c):
    from tilelang import language as T

    m, h = shape["hc_mult"], shape["hidden_size"]
    eps, clamp = shape["eps"], shape["clamp_value"]
    bt, vec, threads, heads_inner = c["block_tokens"], c["vec"], c["threads"], c["grid"] == "heads_inner"
    cpr = h // vec  # chunks per row
    steps = -(-cpr // threads)
    loop = T.unroll if steps <= UNROLL_STEPS else T.serial
    warps = threads // 32
    scalar = h**-0.5
    num_tokens, ks, vs = gate_dims(T)
    bf16, f32 = T.bfloat16, T.float32

    @T.prim_func
    def engram_gate_fwd(
        hidden_states: T.Tensor[(num_tokens, m, h), bf16],
        k: T.StridedTensor[(num_tokens, m, h), ks, bf16],
        v: T.StridedTensor[(num_tokens, h), vs, bf16],
        weight_fused: T.Tensor[(m, h), f32],
        out: T.Tensor[(num_tokens, m, h), bf16],
        dot: T.Tensor[(num_tokens, m), f32],
        gate_score: T.Tensor[(num_tokens, m), f32],
        rstd_x: T.Tensor[(num_tokens, m), f32],
        rstd_k: T.Tensor[(num_tokens, m), f32],
    ):
        # Rows start chunk-aligned (the launcher checks it, `_gate._align`): the strides written as
        # multiples of vec, so the index analysis proves the chunk loads aligned and emits vector loads.
        k = T.view(k, strides=((ks[0] // vec) * vec, (ks[1] // vec) * vec, 1))
        v = T.view(v, strides=((vs[0] // vec) * vec, 1))
        with T.Kernel(T.ceildiv(num_tokens, bt) * m if heads_inner else T.ceildiv(num_tokens, bt),
                      1 if heads_inner else m, threads=threads) as (bid, by):
            # heads_inner: one flat x axis (a y axis of num_tokens / bt blocks would pass CUDA's 65535)
            bx = bid // m if heads_inner else bid
            head = bid % m if heads_inner else by
            tx = T.get_thread_binding()
            xs = T.alloc_local((vec,), bf16)
            kv = T.alloc_local((vec,), bf16)
            ws = T.alloc_local((vec,), f32)
            ys = T.alloc_local((vec,), bf16)
            part = T.alloc_local((3,), f32)  # sum x*x, sum k*k, sum x*w*k
            tot = T.alloc_local((3,), f32)
            g = T.alloc_local((4,), f32)  # rstd_x, rstd_k, score, gate
            red = T.alloc_shared((warps, 3), f32)
            for t in T.serial(bt):
                tok = T.cast(bx, "int64") * bt + t
                if tok < num_tokens:  # the same for the whole block: its barriers stay uniform
                    for j in T.unroll(3):
                        part[j] = 0.0
                    for s in loop(steps):
                        q = s * threads + tx
                        col = q * vec
                        if q < cpr:
                            for e in T.vectorized(vec):
                                xs[e] = hidden_states[tok, head, col + e]
                            for e in T.vectorized(vec):
                                kv[e] = k[tok, head, col + e]
                            for e in T.vectorized(vec):
                                ws[e] = weight_fused[head, col + e]
                            for e in T.unroll(vec):
                                part[0] = part[0] + T.cast(xs[e], f32) * T.cast(xs[e], f32)
                                part[1] = part[1] + T.cast(kv[e], f32) * T.cast(kv[e], f32)
                                part[2] = part[2] + T.cast(xs[e], f32) * ws[e] * T.cast(kv[e], f32)
                    for j in T.unroll(3):
                        part[j] = T.warp_reduce_sum(part[j])
                    if warps > 1:
                        if tx % 32 == 0:
                            for j in T.unroll(3):
                                red[tx // 32, j] = part[j]
                        T.sync_threads()
                        for j in T.unroll(3):
                            tot[j] = red[0, j]
                            for w in T.unroll(1, warps):
                                tot[j] = tot[j] + red[w, j]
                    else:
                        for j in T.unroll(3):
                            tot[j] = part[j]
                    g[0] = T.rsqrt(tot[0] / h + eps)
                    g[1] = T.rsqrt(tot[1] / h + eps)
                    g[2] = tot[2] * g[0] * g[1] * scalar
                    g[3] = T.sigmoid(T.copysign(T.sqrt(T.max(T.abs(g[2]), clamp)), g[2]))
                    if tx == 0:
                        dot[tok, head] = tot[2]
                        gate_score[tok, head] = g[3]
                        rstd_x[tok, head] = g[0]
                        rstd_k[tok, head] = g[1]
                    for s in loop(steps):
                        q = s * threads + tx
                        col = q * vec
                        if q < cpr:
                            for e in T.vectorized(vec):
                                xs[e] = hidden_states[tok, head, col + e]
                            for e in T.vectorized(vec):
                                kv[e] = v[tok, col + e]
                            for e in T.unroll(vec):
                                ys[e] = T.cast(T.cast(xs[e], f32) + g[3] * T.cast(kv[e], f32), bf16)
                            for e in T.vectorized(vec):
                                out[tok, head, col + e] = ys[e]
                    if warps > 1:
                        T.sync_threads()  # red is reused by the next token

    return engram_gate_fwd


def make_inputs(shape, device="cpu", seed=0):
    return gate_inputs(shape, device, seed)  # hidden_states, k, v, weight_fused


def reference(shape, hidden_states, k, v, weight_fused):
    """out rounded once from float64 to bf16, the saved values rounded once to float32."""
    out, *saved = forward64(hidden_states, k, v, weight_fused, shape["eps"], shape["clamp_value"])
    return (out.to(hidden_states.dtype), *(t.float() for t in saved))


SPEC = register(
    KernelSpec(
        name="engram_gate_fwd",
        doc="Engram gate forward: x + sigmoid(signed sqrt(RMSNorm dot)) * v (bf16), and the saved values",
        params=PARAMS,
        space={
            "block_tokens": (1, 2, 4),
            "vec": (1, 2, 4, 8),
            "threads": (32, 64, 128, 256, 512),
            "grid": ("heads_inner", "heads_outer"),
        },
        default=default,
        added={"grid": "heads_outer"},  # configs tuned before the tunable: the grid they were built with
        constraint=constraint,
        build=build,
        inputs=(heads_arg("hidden_states"), heads_arg("k", strided=True), v_arg("v", strided=True),
                weight_arg("weight_fused")),
        outputs=(heads_arg("out"), *(saved_arg(n) for n in SAVED)),
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=lambda s: 3 * row_bytes(s) + s["num_tokens"] * s["hidden_size"] * 2
        + s["hc_mult"] * s["hidden_size"] * 4 + saved_bytes(s),
        flops=lambda s: 8 * s["num_tokens"] * s["hc_mult"] * s["hidden_size"],
        examples=EXAMPLES,
        **COMMON,
    )
)
