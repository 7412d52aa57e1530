"""grad_w_reduce: the Engram gate's weight gradients from engram_gate_bwd's partials, accumulated in place
(TileKernels' `engram.grad_w_reduce`).

grad_w_partial (num_partials, hc_mult, hidden_size) float32 (engram_gate_bwd's per-block sums of
weight_fused's gradient), weight_hidden and weight_embed (hc_mult, hidden_size) bfloat16; grad_weight_hidden
and grad_weight_embed (hc_mult, hidden_size) float32 are updated in place (a training loop's `main_grad`
buffers, or zeros):

    g = sum over p of grad_w_partial[p]        (float32, p = 0, 1, ... in order from 0, as TileKernels)
    grad_weight_hidden += g * weight_embed     (weight_fused = weight_hidden * weight_embed)
    grad_weight_embed  += g * weight_hidden

The reference is this in float64, rounded once; the kernel's sum is float32 (TileKernels' order), so
the two agree to float32 rounding.

Layout: one block row per weight row (blockIdx.y), `block_elems` consecutive elements per block; each
thread takes `vec` consecutive elements per step (16-byte float32 vectors at vec = 4) and walks the
num_partials rows, `unroll` loads at a time in flight (the sum's order stays 0, 1, ...). Memory-bound:
the partials are read once (15 MB at 132 x 4 x 7168), the rest is small.
bf16 weights: CUDA targets only.
"""

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Static, TensorArg, Tolerance, cuda_only
from tkjit_kernels.engram._gate import MAX_HC, MAX_HIDDEN, PARTIALS, partials_check, pass_configs


def default(shape):
    # 16-byte float32 vectors where the row allows; 64 threads of one step a block, so that 4 x 7168 is
    # 112 blocks over the 132 SMs; 8 partial rows in flight a thread.
    h = shape["hidden_size"]
    vec = next(v for v in (4, 2, 1) if h % v == 0)
    return {"block_elems": 64 * vec, "threads": 64, "vec": vec, "unroll": 8}


def constraint(shape, c):
    hidden, block, threads, vec = shape["hidden_size"], c["block_elems"], c["threads"], c["vec"]
    if hidden % vec:
        return f"vec={vec} accesses need hidden_size={hidden} to be a multiple of {vec}"
    if block % (threads * vec):
        return "block_elems must be a multiple of threads * vec"
    if block // (threads * vec) > 8:
        return "more than 8 vector steps per thread"
    if c["unroll"] > shape["num_partials"]:
        return f"unroll={c['unroll']} is more than the num_partials={shape['num_partials']} rows"
    return None


arch_constraint = cuda_only("reads bfloat16 weights, which TileLang's C target does not lower")


def build(shape, c):
    from tilelang import language as T

    m, h, P = shape["hc_mult"], shape["hidden_size"], shape["num_partials"]
    block, threads, vec, u = c["block_elems"], c["threads"], c["vec"], c["unroll"]
    bf16, f32 = T.bfloat16, T.float32

    @T.prim_func
    def grad_w_reduce(
        grad_w_partial: T.Tensor[(P, m, h), f32],
        weight_hidden: T.Tensor[(m, h), bf16],
        weight_embed: T.Tensor[(m, h), bf16],
        grad_weight_hidden: T.Tensor[(m, h), f32],
        grad_weight_embed: T.Tensor[(m, h), f32],
    ):
        with T.Kernel(T.ceildiv(h, block), m, threads=threads) as (bx, row):
            acc = T.alloc_local((vec,), f32)
            ld = T.alloc_local((u, vec), f32)
            wh = T.alloc_local((vec,), bf16)
            we = T.alloc_local((vec,), bf16)
            gh = T.alloc_local((vec,), f32)
            ge = T.alloc_local((vec,), f32)
            for t in T.Parallel(block // vec):
                base = bx * block + t * vec
                if base < h:
                    for e in T.vectorized(vec):
                        acc[e] = 0.0
                    for pb in T.serial(P // u):
                        for j in T.unroll(u):  # u independent loads in flight, then added in row order
                            for e in T.vectorized(vec):
                                ld[j, e] = grad_w_partial[pb * u + j, row, base + e]
                        for j in T.unroll(u):
                            for e in T.unroll(vec):
                                acc[e] = acc[e] + ld[j, e]
                    if P % u:
                        for j in T.unroll(P % u):
                            for e in T.vectorized(vec):
                                ld[j, e] = grad_w_partial[P // u * u + j, row, base + e]
                        for j in T.unroll(P % u):
                            for e in T.unroll(vec):
                                acc[e] = acc[e] + ld[j, e]
                    for e in T.vectorized(vec):
                        wh[e] = weight_hidden[row, base + e]
                    for e in T.vectorized(vec):
                        we[e] = weight_embed[row, base + e]
                    for e in T.vectorized(vec):
                        gh[e] = grad_weight_hidden[row, base + e]
                    for e in T.vectorized(vec):
                        ge[e] = grad_weight_embed[row, base + e]
                    for e in T.unroll(vec):
                        gh[e] = gh[e] + acc[e] * T.cast(we[e], f32)
                        ge[e] = ge[e] + acc[e] * T.cast(wh[e], f32)
                    for e in T.vectorized(vec):
                        grad_weight_hidden[row, base + e] = gh[e]
                    for e in T.vectorized(vec):
                        grad_weight_embed[row, base + e] = ge[e]

    return grad_w_reduce


def make_inputs(shape, device="cpu", seed=0):
    """Partials of dr * x * k sums (standard normal), RMSNorm weights around 1 (bf16), and gradient buffers
    already holding values (a main_grad mid-accumulation; zeros on odd seeds, a fresh gradient)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    P, m, h = shape["num_partials"], shape["hc_mult"], shape["hidden_size"]
    partial = torch.randn(P, m, h, generator=g)
    wh = (1.0 + 0.1 * torch.randn(m, h, generator=g)).bfloat16()
    we = (1.0 + 0.1 * torch.randn(m, h, generator=g)).bfloat16()
    gh = torch.randn(m, h, generator=g) * (seed % 2 == 0)
    ge = torch.randn(m, h, generator=g) * (seed % 2 == 0)
    return tuple(t.to(device) for t in (partial, wh, we, gh, ge))


def reference(shape, grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed):
    """The in-place results (grad_weight_hidden, grad_weight_embed): float64, rounded once to float32."""
    g = grad_w_partial.double().sum(0)
    return ((grad_weight_hidden.double() + g * weight_embed.double()).float(),
            (grad_weight_embed.double() + g * weight_hidden.double()).float())


def _rows(name, dtype, inout=False):
    return TensorArg(name, dtype, ("hc_mult", "hidden_size"), inout=inout,
                     align=lambda s, c: (2 if dtype == "bfloat16" else 4) * c["vec"])


SPEC = register(
    KernelSpec(
        name="grad_w_reduce",
        family="engram",
        doc="Engram gate weight gradients: sum engram_gate_bwd's partials, times the other weight, added in "
            "place into grad_weight_hidden / grad_weight_embed (float32)",
        params=(
            Static("hc_mult", lo=1, hi=MAX_HC, default=4, doc="mHC expansion rate: the weights' rows"),
            Static("hidden_size", lo=1, hi=MAX_HIDDEN, doc="the weights' columns"),
            PARTIALS,
        ),
        space={
            "block_elems": (64, 128, 256, 512, 1024, 2048),
            "threads": (32, 64, 128, 256),
            "vec": (1, 2, 4),
            "unroll": (1, 4, 8),
        },
        default=default,
        constraint=constraint,
        check_shape=partials_check,
        arch_constraint=arch_constraint,
        build=build,
        pass_configs=pass_configs,
        inputs=(
            TensorArg("grad_w_partial", "float32", ("num_partials", "hc_mult", "hidden_size"),
                      align=lambda s, c: 4 * c["vec"]),
            _rows("weight_hidden", "bfloat16"),
            _rows("weight_embed", "bfloat16"),
            _rows("grad_weight_hidden", "float32", inout=True),
            _rows("grad_weight_embed", "float32", inout=True),
        ),
        outputs=(),
        make_inputs=make_inputs,
        reference=reference,
        tolerance=Tolerance(rtol=1e-5),
        bytes_moved=lambda s: s["hc_mult"] * s["hidden_size"] * (4 * s["num_partials"] + 2 + 2 + 4 * 4),
        flops=lambda s: s["hc_mult"] * s["hidden_size"] * (s["num_partials"] + 4),
        examples=(
            {"hc_mult": 4, "hidden_size": 7168},
            {"hc_mult": 4, "hidden_size": 4096},
            {"hc_mult": 4, "hidden_size": 2560, "num_partials": 78},
        ),
    )
)
