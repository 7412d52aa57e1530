"""mhc_post_bwd: the gradients of mhc_post_fwd (TileKernels' `mhc_post_bwd`).

Given grad_out = dL/d out (num_tokens, mhc, hidden) bf16 and the forward's inputs:

    grad_x[t, h]                    = bf16(sum_n post_layer_mix[t, n] * grad_out[t, n, h])
    grad_residual[t, m, h]          = bf16(sum_n comb_res_mix[t, m, n] * grad_out[t, n, h])
    grad_post_layer_mix[t, n]       = sum_h x[t, h] * grad_out[t, n, h]                 float32
    grad_comb_res_mix[t, m, n]      = sum_h residual[t, m, h] * grad_out[t, n, h]       float32

The bf16 gradients are float32 fused multiply-add chains over n = 0, 1, ... from 0 (TileKernels' order),
rounded once. The float32 ones are reductions over hidden: each thread sums its chunks, then a warp
shuffle tree and the warps' partials in shared memory; their order is not TileKernels' (its reducer
replicates per thread), so they agree to float32 rounding, not bit for bit. The reference is these sums
in float64, rounded once to each gradient's dtype (= torch autograd through the float64 forward).

Layout: a block takes `block_tokens` tokens one after another; for each, its threads split the row into
chunks of `vec` channels (thread tx: chunks tx, tx + threads, ...), load grad_out's, x's and residual's
chunk (2 * mhc + 1 vector loads), store grad_x's and grad_residual's (mhc + 1 vector stores), and
accumulate the token's mhc + mhc**2 partial sums in registers; then the block reduces them (one
barrier pair per token). Every element is read or written once: memory-bound, like the forward.
bf16, warp shuffles and the thread index: CUDA targets only.
"""

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec
from tkjit_kernels.mhc._post import (
    COMMON,
    UNROLL_STEPS,
    comb_arg,
    idle_threads_problem,
    mix_bytes,
    post_arg,
    random_inputs,
    row_bytes,
    row_threads,
    rows_arg,
    vec_constraint,
    widest_vec,
    x_arg,
)


def default(shape):
    # 16-byte vectors; at mhc 8 8-byte ones (a thread holds 3 * mhc * vec bf16 values and mhc**2 + mhc
    # partials: vec 8 would spill). Enough threads that each takes <= 8 chunks of a row (7168 channels:
    # 896 chunks, 7 per thread at 128), fewer for narrow rows (1280: 160 chunks, 64 threads take 3).
    # One token per block: the per-token reduction does not amortise over tokens.
    m, h = shape["mhc"], shape["hidden"]
    vec = widest_vec(h, 8 if m <= 4 else 4)
    cpr = h // vec
    return {"block_tokens": 1, "vec": vec, "threads": row_threads(cpr)}


def constraint(shape, c):
    problem = vec_constraint(shape, c)
    if problem:
        return problem
    return idle_threads_problem(shape["hidden"] // c["vec"], c["threads"])


def build(shape, c):
    from tilelang import language as T

    m, h = shape["mhc"], shape["hidden"]
    bt, vec, threads = c["block_tokens"], c["vec"], c["threads"]
    cpr = h // vec  # chunks per token
    steps = -(-cpr // threads)
    loop = T.unroll if steps <= UNROLL_STEPS else T.serial
    k_all = m * m + m  # partial sums per token: grad_comb_res_mix (m * m), then grad_post_layer_mix (m)
    warps = threads // 32
    num_tokens = T.dynamic("num_tokens")
    bf16, f32 = T.bfloat16, T.float32

    @T.prim_func
    def mhc_post_bwd(
        grad_out: T.Tensor[(num_tokens, m, h), bf16],
        x: T.Tensor[(num_tokens, h), bf16],
        residual: T.Tensor[(num_tokens, m, h), bf16],
        post_layer_mix: T.Tensor[(num_tokens, m), f32],
        comb_res_mix: T.Tensor[(num_tokens, m, m), f32],
        grad_x: T.Tensor[(num_tokens, h), bf16],
        grad_residual: T.Tensor[(num_tokens, m, h), bf16],
        grad_post_layer_mix: T.Tensor[(num_tokens, m), f32],
        grad_comb_res_mix: T.Tensor[(num_tokens, m, m), f32],
    ):
        with T.Kernel(T.ceildiv(num_tokens, bt), threads=threads) as bx:
            tx = T.get_thread_binding()
            gs = T.alloc_local((m, vec), bf16)
            xs = T.alloc_local((vec,), bf16)
            rs = T.alloc_local((m, vec), bf16)
            pm = T.alloc_local((m,), f32)
            cm = T.alloc_local((m, m), f32)
            acc = T.alloc_local((vec,), f32)
            ys = T.alloc_local((vec,), bf16)
            part = T.alloc_local((k_all,), f32)
            red = T.alloc_shared((warps, k_all), f32)
            for t in T.serial(bt):
                tok = T.cast(bx, "int64") * bt + t
                if tok < num_tokens:  # the same for the whole block: its barriers stay uniform
                    for i in T.unroll(m):
                        pm[i] = post_layer_mix[tok, i]
                    for i in T.unroll(m):
                        for o in T.unroll(m):
                            cm[i, o] = comb_res_mix[tok, i, o]
                    for k in T.unroll(k_all):
                        part[k] = 0.0
                    for s in loop(steps):
                        q = s * threads + tx
                        col = q * vec
                        if q < cpr:
                            for o in T.unroll(m):
                                for v in T.vectorized(vec):
                                    gs[o, v] = grad_out[tok, o, col + v]
                            for v in T.vectorized(vec):
                                xs[v] = x[tok, col + v]
                            for i in T.unroll(m):
                                for v in T.vectorized(vec):
                                    rs[i, v] = residual[tok, i, col + v]
                            # grad_residual[m] = sum_n comb[m, n] * grad_out[n]
                            for i in T.unroll(m):
                                for v in T.unroll(vec):
                                    acc[v] = 0.0
                                    for o in T.unroll(m):
                                        acc[v] = acc[v] + cm[i, o] * T.cast(gs[o, v], f32)
                                    ys[v] = T.cast(acc[v], bf16)
                                for v in T.vectorized(vec):
                                    grad_residual[tok, i, col + v] = ys[v]
                            # grad_x = sum_n post[n] * grad_out[n]
                            for v in T.unroll(vec):
                                acc[v] = 0.0
                                for o in T.unroll(m):
                                    acc[v] = acc[v] + pm[o] * T.cast(gs[o, v], f32)
                                ys[v] = T.cast(acc[v], bf16)
                            for v in T.vectorized(vec):
                                grad_x[tok, col + v] = ys[v]
                            # partial sums over this chunk's channels
                            for i in T.unroll(m):
                                for o in T.unroll(m):
                                    for v in T.unroll(vec):
                                        part[i * m + o] = part[i * m + o] + T.cast(rs[i, v], f32) * T.cast(
                                            gs[o, v], f32)
                            for o in T.unroll(m):
                                for v in T.unroll(vec):
                                    part[m * m + o] = part[m * m + o] + T.cast(xs[v], f32) * T.cast(gs[o, v], f32)
                    # block reduction: warp trees, then the warps' partials through shared memory
                    for k in T.unroll(k_all):
                        part[k] = T.warp_reduce_sum(part[k])
                    if tx % 32 == 0:
                        for k in T.unroll(k_all):
                            red[tx // 32, k] = part[k]
                    T.sync_threads()
                    for j in T.serial(-(-k_all // threads)):
                        k = j * threads + tx
                        if k < k_all:
                            acc[0] = red[0, k]
                            for w in T.unroll(1, warps):
                                acc[0] = acc[0] + red[w, k]
                            if k < m * m:
                                grad_comb_res_mix[tok, k // m, k % m] = acc[0]
                            else:
                                grad_post_layer_mix[tok, k - m * m] = acc[0]
                    T.sync_threads()  # red is reused by the next token

    return mhc_post_bwd


def make_inputs(shape, device="cpu", seed=0):
    return random_inputs(shape, device, seed, grad=True)  # grad_out, x, residual, post_layer_mix, comb_res_mix


def reference(shape, grad_out, x, residual, post_layer_mix, comb_res_mix):
    """The gradients of the float64 forward (`_post.forward`: linear in each input), each rounded once to
    its input's dtype. Written out rather than through torch.autograd, which the op tests' tracing modes
    (opcheck's aot dispatch) do not run inside a kernel launch; tests check it against autograd."""
    g, xd, rd = grad_out.double(), x.double(), residual.double()
    post, comb = post_layer_mix.double(), comb_res_mix.double()
    return (torch.einsum("tn,tnh->th", post, g).to(x.dtype),
            torch.einsum("tmn,tnh->tmh", comb, g).to(residual.dtype),
            torch.einsum("th,tnh->tn", xd, g).to(post_layer_mix.dtype),
            torch.einsum("tmh,tnh->tmn", rd, g).to(comb_res_mix.dtype))


SPEC = register(
    KernelSpec(
        name="mhc_post_bwd",
        doc="Gradients of mhc_post_fwd: grad_x, grad_residual (bf16), grad_post/comb mixes (float32)",
        space={
            "block_tokens": (1, 2, 4),
            "vec": (1, 2, 4, 8),
            "threads": (32, 64, 128, 256, 512),
        },
        default=default,
        constraint=constraint,
        build=build,
        inputs=(rows_arg("grad_out"), x_arg("x"), rows_arg("residual"), post_arg("post_layer_mix"),
                comb_arg("comb_res_mix")),
        outputs=(x_arg("grad_x"), rows_arg("grad_residual"), post_arg("grad_post_layer_mix"),
                 comb_arg("grad_comb_res_mix")),
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=lambda s: 4 * row_bytes(s) + 2 * s["num_tokens"] * s["hidden"] * 2 + 2 * mix_bytes(s),
        flops=lambda s: 4 * s["num_tokens"] * s["mhc"] * s["hidden"] * (s["mhc"] + 1),
        examples=(
            {"num_tokens": 4096, "mhc": 4, "hidden": 7168},
            {"num_tokens": 8192, "mhc": 4, "hidden": 1280},
            {"num_tokens": 1024, "mhc": 2, "hidden": 2560},
            {"num_tokens": 4096, "mhc": 8, "hidden": 4096},
        ),
        **COMMON,
    )
)
