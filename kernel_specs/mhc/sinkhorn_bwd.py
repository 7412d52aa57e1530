"""sinkhorn_bwd: gradient of sinkhorn_fwd w.r.t. its input, recomputing the forward in the kernel.

Inputs grad_out (dL/dy) and x, both (num_tokens, n, n) float32; output grad_x = dL/dx.
Nothing per token is kept in global memory between the passes: the kernel re-runs the forward.

The forward is P = softmax(x); A = P + eps; then 2*repeat - 1 normalisation steps, alternately
column, row, column, ... each A <- A / (sum + eps). For one step Y = X / d (d = sum of X + eps
along the normalised axis, broadcast along the other):

    dL/dX = (G - sum(G * Y)) / d        (the sum along the same axis as d)

and softmax gives dL/dx = (G - rowsum(G * P)) * P. So the backward needs every step's output Y
and its denominators d. Keeping 2*repeat matrices per token would be 16*(2*repeat) floats; instead
the kernel keeps only the denominators (n per step) and P, and walks the steps backwards
*inverting* them: X = Y * d recovers each step's input (= the previous step's output) from its
output, to within a few ulps. Per token that is n*n (P) + n*n (Y) + n*n (G) + (2*repeat-1)*n
floats (124 for n = 4, repeat = 10); nvcc reports 144 registers, 124 with keep_p=False.

Layouts (tunable):
  thread  one token per thread (T.Parallel over the block's tokens), everything in that thread's
          registers / local memory; loads and stores of a token are 16-byte vectors.
  smem    grad_out and x tiles staged through shared memory with coalesced T.copy, then as thread.
The step loop is unrolled (denominators at static indices: registers) while they can fit.
min_threads_per_sm asks nvcc for that occupancy (__launch_bounds__ min blocks: fewer registers,
maybe spills). recip keeps 1/d per row/column and multiplies instead of dividing every element.
keep_p=False drops P from the registers (n*n fewer live values, higher occupancy) and recovers it
by inverting step 0 as well: P = A - eps (absolute error ~ ulp(A), harmless in dL/dx = ... * P).
"""

from __future__ import annotations

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec
from tkjit_kernels.mhc._common import COMMON, SMEM_LIMIT, mat_bytes, mats, random_mats, token_blocks
from tkjit_kernels.mhc._common import reference as sinkhorn_reference

LAYOUTS = ("thread", "smem")


def _unrolled(shape):
    # Unrolled steps give the denominators static indices, so they can live in registers. Once
    # they cannot fit anyway ((2*repeat-1)*n > 128 floats) a serial loop keeps the code small.
    return (2 * shape["repeat"] - 1) * shape["n"] <= 128


def default(shape):
    n = shape["n"]
    # One token per thread in 64-thread blocks. At n = 4, repeat = 10 dropping P (keep_p=False)
    # brings a thread to ~124 registers without spills, so the occupancy hint of 8 blocks (16 warps)
    # per SM is free; when the denominators and matrices do not fit in ~110 registers, no hint.
    small = n <= 4
    fits = _unrolled(shape) and (2 * shape["repeat"] - 1) * n + 2 * n * n <= 110
    return {"layout": "thread", "block_tokens": 64 if small else 32, "threads": 64 if small else 32,
            "recip": True, "keep_p": False, "fast_math": False, "min_threads_per_sm": 512 if fits else 0}


def constraint(shape, c):
    n, bt, th = shape["n"], c["block_tokens"], c["threads"]
    if bt < th or bt % th:
        return "block_tokens must be a multiple of threads (one token per thread per pass)"
    if bt // th > 4:
        return "more than 4 tokens per thread: use more threads"
    if c["layout"] == "smem" and 2 * bt * n * n * 4 > SMEM_LIMIT:
        return f"two tiles of {bt * n * n * 4} bytes exceed {SMEM_LIMIT} bytes of shared memory"
    m = c["min_threads_per_sm"]
    if m and (m < th or m % th):
        return "min_threads_per_sm must be 0 or a multiple of threads"
    return None


def build(shape, c):
    from tilelang import language as T
    from tilelang.language.annotations import annotate_min_blocks_per_sm

    n, repeat, eps = shape["n"], shape["repeat"], shape["eps"]
    bt, threads, layout, recip = c["block_tokens"], c["threads"], c["layout"], c["recip"]
    steps = 2 * repeat - 1  # normalisation steps after the softmax: col, (row, col) * (repeat - 1)
    loop = T.unroll if _unrolled(shape) else T.serial
    min_blocks = c["min_threads_per_sm"] // threads
    keep_p = c["keep_p"]
    num_tokens = T.dynamic("num_tokens")
    f32 = T.float32
    load, store, load_tile, store_tile, exp_rows, row_sums = token_blocks(n, eps, recip)

    # -- forward recompute: P (softmax), m (running matrix), den[k, :] (step k's denominators) --
    @T.macro
    def normalise(m, den, k, rows):
        # rows: scale each row i by 1 / (rowsum + eps); else each column j by 1 / (colsum + eps).
        # den[k, a] keeps the reciprocal (recip) or the denominator itself.
        for a in T.unroll(n):
            den[k, a] = eps
            for b in T.unroll(n):
                if rows:
                    den[k, a] += m[a, b]
                else:
                    den[k, a] += m[b, a]
            if recip:
                den[k, a] = 1.0 / den[k, a]
        for i in T.unroll(n):
            for j in T.unroll(n):
                if recip:
                    m[i, j] = m[i, j] * (den[k, i] if rows else den[k, j])
                else:
                    m[i, j] = m[i, j] / (den[k, i] if rows else den[k, j])

    @T.macro
    def forward(m, p, den, s):
        exp_rows(m, s)
        row_sums(m, s, False)
        for i in T.unroll(n):
            for j in T.unroll(n):
                if keep_p:
                    if recip:
                        p[i, j] = m[i, j] * s[i]
                    else:
                        p[i, j] = m[i, j] / s[i]
                    m[i, j] = p[i, j] + eps
                elif recip:
                    m[i, j] = m[i, j] * s[i] + eps
                else:
                    m[i, j] = m[i, j] / s[i] + eps
        normalise(m, den, 0, False)
        for r in loop(repeat - 1):
            normalise(m, den, 2 * r + 1, True)
            normalise(m, den, 2 * r + 2, False)

    # -- backward through one step: g <- (g - sum(g * m)) / d; then m <- m * d (the step's input) --
    @T.macro
    def step_back(g, m, den, s, k, rows, invert):
        # With recip, den holds 1/d: g *= den, and the inversion m *= d takes one reciprocal per
        # row/column (not the forward's d: keeping both alive would cost 2*(2*repeat-1)*n registers).
        for a in T.unroll(n):
            s[a] = 0.0
            for b in T.unroll(n):
                if rows:
                    s[a] += g[a, b] * m[a, b]
                else:
                    s[a] += g[b, a] * m[b, a]
            d = den[k, a]
            for b in T.unroll(n):
                if rows:
                    g[a, b] = (g[a, b] - s[a]) * d if recip else (g[a, b] - s[a]) / d
                else:
                    g[b, a] = (g[b, a] - s[a]) * d if recip else (g[b, a] - s[a]) / d
            if invert:
                if recip:
                    s[a] = 1.0 / d
                for b in T.unroll(n):
                    if rows:
                        m[a, b] = m[a, b] * (s[a] if recip else d)
                    else:
                        m[b, a] = m[b, a] * (s[a] if recip else d)

    @T.macro
    def backward(g, m, p, den, s):
        for r in loop(repeat - 1):
            kc = steps - 1 - 2 * r  # a column step, then the row step before it
            step_back(g, m, den, s, kc, False, True)
            step_back(g, m, den, s, kc - 1, True, True)
        # Softmax: dL/dx = (G - rowsum(G * P)) * P, P kept or recovered as (inverted step 0) - eps.
        step_back(g, m, den, s, 0, False, not keep_p)
        if not keep_p:
            for i in T.unroll(n):
                for j in T.unroll(n):
                    p[i, j] = m[i, j] - eps
        for i in T.unroll(n):
            s[i] = 0.0
            for j in T.unroll(n):
                s[i] += g[i, j] * p[i, j]
        for i in T.unroll(n):
            for j in T.unroll(n):
                g[i, j] = (g[i, j] - s[i]) * p[i, j]

    if layout == "thread":
        @T.prim_func
        def sinkhorn_bwd_thread(
            grad_out: T.Tensor[(num_tokens, n, n), f32],
            x: T.Tensor[(num_tokens, n, n), f32],
            grad_x: T.Tensor[(num_tokens, n, n), f32],
        ):
            with T.Kernel(T.ceildiv(num_tokens, bt), threads=threads) as bx:
                if min_blocks > 1:
                    annotate_min_blocks_per_sm(min_blocks)
                m = T.alloc_local((n, n), f32)
                p = T.alloc_local((n, n), f32)
                g = T.alloc_local((n, n), f32)
                den = T.alloc_local((steps, n), f32)
                s = T.alloc_local((n,), f32)
                for t in T.Parallel(bt):
                    tok = bx * bt + t
                    if tok < num_tokens:
                        load(m, x, tok)
                        forward(m, p, den, s)
                        load(g, grad_out, tok)
                        backward(g, m, p, den, s)
                        store(grad_x, tok, g)

        return sinkhorn_bwd_thread

    @T.prim_func
    def sinkhorn_bwd_smem(
        grad_out: T.Tensor[(num_tokens, n, n), f32],
        x: T.Tensor[(num_tokens, n, n), f32],
        grad_x: T.Tensor[(num_tokens, n, n), f32],
    ):
        with T.Kernel(T.ceildiv(num_tokens, bt), threads=threads) as bx:
            if min_blocks > 1:
                annotate_min_blocks_per_sm(min_blocks)
            xt = T.alloc_shared((bt, n, n), f32)
            gt = T.alloc_shared((bt, n, n), f32)
            m = T.alloc_local((n, n), f32)
            p = T.alloc_local((n, n), f32)
            g = T.alloc_local((n, n), f32)
            den = T.alloc_local((steps, n), f32)
            s = T.alloc_local((n,), f32)
            T.copy(x[bx * bt, 0, 0], xt)
            T.copy(grad_out[bx * bt, 0, 0], gt)
            for t in T.Parallel(bt):
                load_tile(m, xt, t)
                forward(m, p, den, s)
                load_tile(g, gt, t)
                backward(g, m, p, den, s)
                store_tile(gt, t, g)
            T.copy(gt, grad_x[bx * bt, 0, 0])

    return sinkhorn_bwd_smem


def make_inputs(shape, device="cpu", seed=0):
    return random_mats(shape, 2, device, seed)  # grad_out, x


def reference(shape, grad_out, x):
    """torch autograd through sinkhorn_fwd's float64 reference, rounded once to float32."""
    with torch.enable_grad():
        xd = x.detach().double().requires_grad_(True)
        y = sinkhorn_reference(shape, xd)
        (gx,) = torch.autograd.grad(y, xd, grad_out.detach().double())
    return gx.to(x.dtype)


SPEC = register(
    KernelSpec(
        name="sinkhorn_bwd",
        doc="Gradient of sinkhorn_fwd: grad_x from (grad_out, x), forward recomputed in-kernel",
        space={
            "layout": LAYOUTS,
            "block_tokens": (32, 64, 128, 256),
            "threads": (32, 64, 128),
            "recip": (True, False),
            "keep_p": (True, False),
            "fast_math": (False, True),
            "min_threads_per_sm": (0, 384, 512),  # occupancy hint: __launch_bounds__(threads, this / threads)
        },
        default=default,
        constraint=constraint,
        build=build,
        inputs=(mats("grad_out"), mats("x")),
        outputs=(mats("grad_x"),),
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=lambda s: 3 * mat_bytes(s),
        flops=lambda s: s["num_tokens"] * s["n"] * s["n"] * (8 + 12 * s["repeat"]),
        examples=({"num_tokens": 4096, "n": 4}, {"num_tokens": 1 << 20, "n": 4}, {"num_tokens": 4001, "n": 4}),
        **COMMON,
    )
)
