"""What mhc_head_compute_mix, mhc_pre_split_mixes and their backwards share: the mix segments.

Both ops turn each token's raw mixes (a float32 row of W values, the output of mHC's norm_fn GEMM)
into the weights the layer uses, column by column, z = x * mhc_scale[k] + mhc_base[j] and then:

  head_compute_mix   W = m            pre:  sigmoid(z) + mhc_pre_eps        (k = 0)
  pre_split_mixes    W = 2m + m*m     pre:  sigmoid(z) + mhc_pre_eps        columns [0, m),    k = 0
                                      post: sigmoid(z) * mhc_post_mult_value columns [m, 2m),   k = 1
                                      comb: z                               columns [2m, W),   k = 2

A segment list (`Segment(kind, start, width, k)`) describes a row, so one pair of builders serves both:

  forward_blocks      TileLang macro over one token's row (load in vectors, the maths, store per segment)
  backward_builder    the backward kernel: per-token gradients, block partials of the parameters' grads
  reference_forward   the forward in float64 (the backward's reference differentiates it with autograd)
  random_inputs       TileKernels' test data (standard normal), odd seeds wider in scale, with zeros

Rows are tiny (8 to 80 floats) and the ops run at 1K-8K tokens: the kernels are latency- and
launch-bound. The forward is element-wise, one token per thread (`T.Parallel` over the block's tokens, so
that it also lowers on TileLang's C target). The backward also sums over tokens (mhc_scale's and
mhc_base's gradients): a grid of `num_partials` blocks, block b taking the contiguous token range
[b * ceil(N / P), (b + 1) * ceil(N / P)) and writing one row of partial sums (warp shuffles, then the
warps' partials in order through shared memory), which the op sums in float32 (TileKernels' scheme, its
num_sms partials; here the range of a block does not depend on the config, so the reference computes the
same partials). The sigmoid is 1 / (1 + exp(-z)) with IEEE exp; the spec references are float64 rounded
once, compared at rtol 1e-5 (relative L2), tighter than TileKernels' own tests (rtol 1e-4 / 1e-5).
"""

import math
from collections import namedtuple

import torch

from tkjit.spec import Runtime, Static, Tolerance, ieee_plain_threads

Segment = namedtuple("Segment", "kind start width k")  # kind: "pre", "post" or "comb"
VECS = (1, 2, 4)  # floats per vector access: 4..16 bytes
NUM_SMS = 132  # H200: the backward's default block count (TileKernels takes the GPU's SM count)
MAX_MHC = 16

RUNTIME = Runtime("num_tokens", hi=1 << 26,
                  doc="tokens (TileKernels' n0 * n1); runtime size, tuned per power-of-two bucket")
MHC = Static("mhc_mult", lo=1, hi=MAX_MHC, default=4, doc="mHC expansion rate: residual streams per token")
PRE_EPS = Static("mhc_pre_eps", type=float, lo=0.0, hi=1.0, default=1e-2, doc="added to the pre-layer sigmoid")
POST_MULT = Static("mhc_post_mult_value", type=float, lo=0.0, hi=1e4, default=2.0,
                   doc="scale of the post-layer sigmoid")
PARTIALS = Static("num_partials", lo=1, hi=4096, default=NUM_SMS,
                  doc="backward blocks: rows of partial sums of the parameter gradients (the op sums them)")


def head_segments(shape):
    return (Segment("pre", 0, shape["mhc_mult"], 0),)


def split_segments(shape):
    m = shape["mhc_mult"]
    return (Segment("pre", 0, m, 0), Segment("post", m, m, 1), Segment("comb", 2 * m, m * m, 2))


def row_width(segments) -> int:
    return sum(s.width for s in segments)


def num_scales(segments) -> int:
    return 1 + max(s.k for s in segments)


def vec_of(width: int, vec: int) -> int:
    """The widest vector, at most vec floats, that tiles a row of `width` floats."""
    return math.gcd(width, vec)


def arch_constraint_fwd(arch, c, shape):
    return None  # float32 T.Parallel loops: CUDA and TileLang's C target


def arch_constraint_bwd(arch, c, shape):
    if arch == "cpu":
        return "warp shuffles and the thread index: TileLang's C target does not lower them (CUDA only)"
    return None


# IEEE float32 maths (TileKernels' kernels do not use fast math either).
pass_configs = ieee_plain_threads


COMMON = dict(family="mhc", pass_configs=pass_configs, tolerance=Tolerance(rtol=1e-5))


# -- the forward -------------------------------------------------------------------------------------

def fwd_default(shape, segments):
    # One token per thread. Up to 16K tokens (TileKernels' 1K-8K): 64-token blocks, so that 8K tokens are
    # 128 blocks over the 132 SMs; more tokens: 128-token blocks. Widest vectors that tile the row.
    small = shape.get("num_tokens", 8192) <= 16384
    t = 64 if small else 128
    return {"block_tokens": t, "threads": t, "vec": vec_of(row_width(segments), 4)}


def fwd_constraint(shape, c, segments):
    bt, th = c["block_tokens"], c["threads"]
    if bt < th or bt % th:
        return "block_tokens must be a multiple of threads (one token per thread per pass)"
    if bt // th > 8:
        return "more than 8 tokens per thread: use more threads"
    if c["vec"] > 1 and vec_of(row_width(segments), c["vec"]) < c["vec"]:
        return f"vec={c['vec']} does not tile a row of {row_width(segments)} floats (the same as a narrower vec)"
    return None


FWD_SPACE = {"block_tokens": (32, 64, 128, 256, 512, 1024), "threads": (32, 64, 128, 256), "vec": VECS}


def forward_blocks(segments, vec, pre_eps, post_mult):
    """TileLang macros over one token's row r (W float32 registers): load(r, x, tok) in vectors, then per
    segment i mixes[i](r, scale, base) (its maths, in place) and stores[i](out, tok, r) (its columns into
    its (num_tokens, width) output)."""
    from tilelang import language as T

    W = row_width(segments)
    v = vec_of(W, vec)

    @T.macro
    def load(r, x, tok):
        for c in T.unroll(W // v):
            for e in T.vectorized(v):
                r[c * v + e] = x[tok, c * v + e]

    def mix_of(s):
        @T.macro
        def mix(r, scale, base):
            for j in T.unroll(s.width):
                r[s.start + j] = r[s.start + j] * scale[s.k] + base[s.start + j]
                if s.kind == "pre":
                    r[s.start + j] = T.float32(1) / (T.float32(1) + T.exp(-r[s.start + j])) + T.float32(pre_eps)
                elif s.kind == "post":
                    r[s.start + j] = T.float32(1) / (T.float32(1) + T.exp(-r[s.start + j])) * T.float32(post_mult)

        return mix

    def store_of(s):
        sv = vec_of(s.width, vec)

        @T.macro
        def store(out, tok, r):
            for c in T.unroll(s.width // sv):
                for e in T.vectorized(sv):
                    out[tok, c * sv + e] = r[s.start + c * sv + e]

        return store

    return load, [mix_of(s) for s in segments], [store_of(s) for s in segments]


# -- the backward ------------------------------------------------------------------------------------

def bwd_default(shape, segments):
    # num_partials blocks; each takes ceil(N / P) tokens, one per thread: 8K tokens over 132 blocks are 63
    # each (64 threads). Wider vectors where they tile the rows.
    per_block = -(-shape.get("num_tokens", 8192) // shape["num_partials"])
    threads = next((t for t in (32, 64, 128) if per_block <= t), 256)
    return {"threads": threads, "vec": vec_of(row_width(segments), 4)}


def bwd_constraint(shape, c, segments):
    if c["vec"] > 1 and vec_of(row_width(segments), c["vec"]) < c["vec"]:
        return f"vec={c['vec']} does not tile a row of {row_width(segments)} floats (the same as a narrower vec)"
    return None


BWD_SPACE = {"threads": (32, 64, 128, 256, 512), "vec": VECS}


def backward_builder(segments, shape, c):
    """The backward's prim_func: inputs the output gradients (one (num_tokens, width) tensor per segment,
    named as TileKernels names them), input (num_tokens, W), mhc_scale (K,), mhc_base (W,); outputs input_grad
    (num_tokens, W), scale_partial (P, K), base_partial (P, W)."""
    from tilelang import language as T

    W, K, P = row_width(segments), num_scales(segments), shape["num_partials"]
    post_mult = shape.get("mhc_post_mult_value", 1.0)
    threads, vec = c["threads"], c["vec"]
    v = vec_of(W, vec)  # the row's vectors; each gradient input's are vec_of(its width, vec)
    warps = threads // 32
    acc_n = K + W  # partial sums per thread: the K scale gradients, then the W base gradients
    num_tokens = T.dynamic("num_tokens")
    f32 = T.float32

    def load_grad_of(s):
        sv = vec_of(s.width, vec)

        @T.macro
        def load_grad(g, go, t64):
            for cc in T.unroll(s.width // sv):
                for e in T.vectorized(sv):
                    g[s.start + cc * sv + e] = go[t64, cc * sv + e]

        return load_grad

    def grad_of(s):
        # r <- dL/dx = dL/dz * scale; acc <- += dL/dz * x (scale k), dL/dz (base columns)
        @T.macro
        def grad(r, g, xs, acc, scale, base):
            for j in T.unroll(s.width):
                if s.kind != "comb":
                    r[s.start + j] = T.float32(1) / (
                        T.float32(1) + T.exp(-(xs[s.start + j] * scale[s.k] + base[s.start + j])))
                    if s.kind == "post":
                        g[s.start + j] = g[s.start + j] * T.float32(post_mult) * (
                            r[s.start + j] * (T.float32(1) - r[s.start + j]))
                    else:
                        g[s.start + j] = g[s.start + j] * (r[s.start + j] * (T.float32(1) - r[s.start + j]))
                acc[s.k] = acc[s.k] + g[s.start + j] * xs[s.start + j]
                acc[K + s.start + j] = acc[K + s.start + j] + g[s.start + j]
                r[s.start + j] = g[s.start + j] * scale[s.k]

        return grad

    loads = [load_grad_of(s) for s in segments]
    grads_ = [grad_of(s) for s in segments]

    @T.macro
    def token(x, t64, r, g, xs, acc, scale, base, x_grad):
        for cc in T.unroll(W // v):
            for e in T.vectorized(v):
                xs[cc * v + e] = x[t64, cc * v + e]
        grads_[0](r, g, xs, acc, scale, base)
        if len(segments) > 1:
            grads_[1](r, g, xs, acc, scale, base)
            grads_[2](r, g, xs, acc, scale, base)
        for cc in T.unroll(W // v):
            for e in T.vectorized(v):
                x_grad[t64, cc * v + e] = r[cc * v + e]

    @T.macro
    def body(go0, go1, go2, x, scale, base, x_grad, scale_partial, base_partial):
        with T.Kernel(P, threads=threads) as bx:
            tx = T.get_thread_binding()
            r = T.alloc_local((W,), f32)
            g = T.alloc_local((W,), f32)
            xs = T.alloc_local((W,), f32)
            acc = T.alloc_local((acc_n,), f32)
            tot = T.alloc_local((1,), f32)
            red = T.alloc_shared((warps, acc_n), f32)
            for k in T.unroll(acc_n):
                acc[k] = T.float32(0)
            per_block = T.ceildiv(num_tokens, P)
            for it in T.serial(T.ceildiv(per_block, threads)):
                i = it * threads + tx
                tok = bx * per_block + i
                if (i < per_block) & (tok < num_tokens):
                    t64 = T.cast(tok, "int64")
                    loads[0](g, go0, t64)
                    if len(segments) > 1:
                        loads[1](g, go1, t64)
                        loads[2](g, go2, t64)
                    token(x, t64, r, g, xs, acc, scale, base, x_grad)
            # the block's sums: warp trees, then the warps' partials in order through shared memory
            for k in T.unroll(acc_n):
                acc[k] = T.warp_reduce_sum(acc[k])
            if tx % 32 == 0:
                for k in T.unroll(acc_n):
                    red[tx // 32, k] = acc[k]
            T.sync_threads()
            for jj in T.serial(-(-acc_n // threads)):
                k = jj * threads + tx
                if k < acc_n:
                    tot[0] = red[0, k]
                    for w in T.unroll(1, warps):
                        tot[0] = tot[0] + red[w, k]
                    if k < K:
                        scale_partial[bx, k] = tot[0]
                    else:
                        base_partial[bx, k - K] = tot[0]

    widths = [s.width for s in segments]
    if len(segments) == 1:
        @T.prim_func
        def mhc_head_compute_mix_bwd(
            output_mix_grad: T.Tensor[(num_tokens, widths[0]), f32],
            input_mix: T.Tensor[(num_tokens, W), f32],
            mhc_scale: T.Tensor[(K,), f32],
            mhc_base: T.Tensor[(W,), f32],
            input_mix_grad: T.Tensor[(num_tokens, W), f32],
            mhc_scale_grad_partial: T.Tensor[(P, K), f32],
            mhc_base_grad_partial: T.Tensor[(P, W), f32],
        ):
            body(output_mix_grad, output_mix_grad, output_mix_grad, input_mix, mhc_scale, mhc_base, input_mix_grad,
                 mhc_scale_grad_partial, mhc_base_grad_partial)

        return mhc_head_compute_mix_bwd

    @T.prim_func
    def mhc_pre_split_mixes_bwd(
        pre_layer_mix_grad: T.Tensor[(num_tokens, widths[0]), f32],
        post_layer_mix_grad: T.Tensor[(num_tokens, widths[1]), f32],
        comb_res_mix_grad: T.Tensor[(num_tokens, widths[2]), f32],
        input_mixes: T.Tensor[(num_tokens, W), f32],
        mhc_scale: T.Tensor[(K,), f32],
        mhc_base: T.Tensor[(W,), f32],
        input_mixes_grad: T.Tensor[(num_tokens, W), f32],
        mhc_scale_grad_partial: T.Tensor[(P, K), f32],
        mhc_base_grad_partial: T.Tensor[(P, W), f32],
    ):
        body(pre_layer_mix_grad, post_layer_mix_grad, comb_res_mix_grad, input_mixes, mhc_scale, mhc_base,
             input_mixes_grad, mhc_scale_grad_partial, mhc_base_grad_partial)

    return mhc_pre_split_mixes_bwd


# -- references and inputs ---------------------------------------------------------------------------

def reference_forward(segments, x, scale, base, pre_eps, post_mult, dtype=torch.float64):
    """The segments' outputs in `dtype` (TileKernels' mhc_head_compute_mix_ref / mhc_pre_split_mixes_ref
    maths: z = x * scale[k] + base, then sigmoid + eps, sigmoid * mult, or z), each (..., width)."""
    xd, sd, bd = x.to(dtype), scale.to(dtype), base.to(dtype)
    outs = []
    for s in segments:
        z = xd[..., s.start:s.start + s.width] * sd[s.k] + bd[s.start:s.start + s.width]
        if s.kind == "pre":
            outs.append(torch.sigmoid(z) + pre_eps)
        elif s.kind == "post":
            outs.append(torch.sigmoid(z) * post_mult)
        else:
            outs.append(z)
    return outs


def reference_backward(segments, grads, x, scale, base, num_partials, post_mult):
    """(input_grad, scale_partial, base_partial), each rounded once to float32 from float64: dL/dz (z the
    affine pre-activation, `dl_dz`) times scale for the input, and the parameters' gradients summed over each
    block's token range (P rows, as the kernel splits the tokens). Written out rather than through
    torch.autograd, which the op tests' tracing modes do not run inside a kernel launch; the tests check it
    against float64 autograd of reference_forward."""
    n, W = x.shape
    K = num_scales(segments)
    ks = torch.zeros(W, dtype=torch.long)
    for s in segments:
        ks[s.start:s.start + s.width] = s.k
    gz = dl_dz(segments, grads, x, scale, base, post_mult).cpu()
    contrib = gz * x.double().cpu()
    per = max(1, -(-n // num_partials))
    scale_part = torch.zeros(num_partials, K, dtype=torch.float64)
    base_part = torch.zeros(num_partials, W, dtype=torch.float64)
    for b in range(min(num_partials, -(-n // per))):
        rows = slice(b * per, min(n, (b + 1) * per))
        base_part[b] = gz[rows].sum(0)
        for k in range(K):
            scale_part[b, k] = contrib[rows][:, ks == k].sum()
    input_grad = gz * scale.double().cpu()[ks]
    return tuple(t.float().to(x.device) for t in (input_grad, scale_part, base_part))


def dl_dz(segments, grads, x, scale, base, post_mult):
    """dL/dz (z the affine pre-activation), float64: what the parameters' gradients sum."""
    cols = []
    xd, sd, bd = x.double(), scale.double(), base.double()
    for s, g in zip(segments, grads):
        z = xd[:, s.start:s.start + s.width] * sd[s.k] + bd[s.start:s.start + s.width]
        sg = torch.sigmoid(z)
        if s.kind == "pre":
            cols.append(g.double() * sg * (1 - sg))
        elif s.kind == "post":
            cols.append(g.double() * post_mult * sg * (1 - sg))
        else:
            cols.append(g.double())
    return torch.cat(cols, -1)


def random_inputs(shape, segments, device="cpu", seed=0, grad=False):
    """(grads..., if grad) x (num_tokens, W), mhc_scale (K,), mhc_base (W,): standard normal as TileKernels'
    tests draw them. Odd seeds scale the tokens' rows by 2^k, k in [-6, 6] (saturated sigmoids, whose
    gradients underflow to tiny values) and zero a column of x and one of the grads."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n, W, K = shape["num_tokens"], row_width(segments), num_scales(segments)
    grads = [torch.randn(n, s.width, generator=gen) for s in segments] if grad else []
    x = torch.randn(n, W, generator=gen)
    scale = torch.randn(K, generator=gen)
    base = torch.randn(W, generator=gen)
    if seed % 2:
        x = x * torch.exp2(torch.randint(-6, 7, (n, 1), generator=gen).float())
        x[:, -1] = 0.0
        if grads:
            grads[0][:, 0] = 0.0
    return tuple(t.to(device) for t in (*grads, x, scale, base))
