"""mhc_pre_norm_fn_bwd: the GEMM half of mhc_pre_norm_fn's backward (TileKernels' MHCPreNormFn.backward).

mul_grad (num_tokens, M) float32 = dL/d out_mul, sqrsum_grad (num_tokens,) float32 = dL/d sqrsum, x
(num_tokens, K) bf16, fn (M, K) float32, x_grad (num_tokens, K) bf16 (in place) ->
  x_grad              bf16(x_grad + mul_grad @ fn + 2 * x * sqrsum_grad)     (updated in place)
  fn_grad_partial     (num_partials, M, K) float32: per token range p, sum of mul_grad^T x over it
The op (`tkjit.torch_ops.mhc_pre_norm_fn_bwd_impl`) computes the two per-token gradients from out's gradient
and the saved out_mul, sqrsum (TileKernels' norm backward: mul_grad = tf32(out_grad * rms), sqrsum_grad =
<out_grad, out_mul> * rms / (sqrsum + eps * K) / -2, M + 1 values a token), passes zeros or mhc_post's
residual gradient as x_grad (TileKernels' fuse_grad_acc), and sums the partials in float32.

Grid (K / (threads * vec), num_partials): a thread owns vec columns of the row, keeps fn's M * vec values and
M * vec fn_grad sums in registers, and walks its token range [p * ceil(N / P), (p + 1) * ceil(N / P)); the
block stages `tile` tokens' M + 1 gradients in shared memory (read by every thread: broadcasts). Per token it
reads x and x_grad (coalesced vectors) and writes x_grad: the traffic TileKernels' kernel has, with P times
more blocks. The partial ranges do not depend on the config, so the reference computes the same partials.
float64 reference rounded once; rtol 1e-5. CUDA only.
"""

from tkjit.registry import register
from tkjit.spec import KernelSpec, Static, TensorArg
from tkjit_kernels.mhc.pre_norm_fn import COMMON, RUNTIME, random_inputs

PARTIALS = 16  # the op's num_partials: token ranges of fn's gradient (16 * 64 column blocks at K = 16384)

PARAMS = (
    RUNTIME,
    Static("mhc_mult3", lo=1, hi=80, default=24, doc="rows of fn: mhc_mult * (mhc_mult + 2)"),
    Static("mhc_hidden", lo=32, hi=1 << 20, default=16384, doc="K: a token's flattened residual, mhc_mult * hidden"),
    Static("num_partials", lo=1, hi=1024, default=PARTIALS,
           doc="token ranges: rows of partial sums of fn's gradient (the op sums them)"),
)
SPACE = {"threads": (32, 64, 128, 256), "vec": (1, 2, 4), "tile": (8, 16, 32, 64)}


def default(shape):
    k = shape["mhc_hidden"]
    for threads, v in ((128, 2), (64, 2), (128, 1), (64, 1), (32, 1)):
        if k % (threads * v) == 0:
            return {"threads": threads, "vec": v if shape["mhc_mult3"] <= 40 else 1, "tile": 32}
    return {"threads": 32, "vec": 1, "tile": 32}


def constraint(shape, c):
    k, m, v = shape["mhc_hidden"], shape["mhc_mult3"], c["vec"]
    if k % (c["threads"] * v):
        return f"threads * vec = {c['threads'] * v} does not divide mhc_hidden={k}"
    if 2 * m * v > 160:
        return f"vec={v} keeps {2 * m * v} float32 values a thread at mhc_mult3={m}: too many registers"
    return None


def build(shape, c):
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

    gen = torch.Generator(device="cpu").manual_seed(seed + 1000)
    x, fn = random_inputs(shape, "cpu", seed)
    n, m = shape["num_tokens"], shape["mhc_mult3"]
    mul_grad = torch.randn(n, m, generator=gen)
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
            TensorArg("x", "bfloat16", ("num_tokens", "mhc_hidden"), align=lambda s, c: 2 * c["vec"]),
            TensorArg("fn", "float32", (_m, "mhc_hidden"), align=lambda s, c: 4 * c["vec"]),
            TensorArg("x_grad", "bfloat16", ("num_tokens", "mhc_hidden"), align=lambda s, c: 2 * c["vec"],
                      inout=True),
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
        **COMMON,
    )
)
