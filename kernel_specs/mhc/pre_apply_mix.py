"""pre_apply_mix: the layer input of an mHC block, each token's streams mixed by its pre-layer weights.

x (num_tokens, mhc_mult, hidden) bf16, mix (num_tokens, mhc_mult) float32 ->
out (num_tokens, hidden) bf16, out[t] = bf16(sum_m mix[t, m] * x[t, m]) (TileKernels'
`modeling.mhc.ops.mhc_pre_apply_mix`, whose mix is (..., mhc_mult, 1); torch reference
`(x * mix).sum(-2).bfloat16()`).

The sum runs as TileKernels' kernel runs it, so the output is bit-identical to it: a float32
accumulator from +0.0, one fused multiply-add per stream in stream order (acc = fma(mix, x, acc),
what nvcc makes of its `ol += mixl * xl`), rounded once to bfloat16. (torch's reference rounds each
product and sums in an order of its own: it differs from both in the last bits of a few elements,
within TileKernels' test tolerance.)

Layout `_streams`: a lane keeps unroll * vec float32 accumulators; the token's weights are scalar
loads (one line per token, shared by its lanes through L1).
"""

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, TensorArg
from tkjit_kernels.mhc._streams import COMMON, fma32, geometry, mix_chunk, random_streams, stream_bytes


def build(shape, c):
    from tilelang import language as T

    M, H = shape["mhc_mult"], shape["hidden"]
    g = geometry(shape, c)
    vec, lanes, chunk, chunks = g.vec, g.lanes, g.chunk, g.chunks
    R, U, threads = c["rows"], c["unroll"], c["threads"]
    mix_lane = mix_chunk(M, g, U)
    num_tokens = T.dynamic("num_tokens")
    bf16, f32 = T.bfloat16, T.float32

    @T.prim_func
    def pre_apply_mix(
        x: T.Tensor[(num_tokens, M, H), bf16],
        mix: T.Tensor[(num_tokens, M), f32],
        out: T.Tensor[(num_tokens, H), bf16],
    ):
        with T.Kernel(T.ceildiv(num_tokens, R), chunks, threads=threads) as (bx, by):
            tx = T.get_thread_binding()
            acc = T.alloc_local((U * vec,), f32)
            xs = T.alloc_local((U * vec,), bf16)
            ys = T.alloc_local((U * vec,), bf16)
            w = T.alloc_local((1,), f32)
            row = bx * R + tx // lanes
            first = by * chunk + tx % lanes  # this lane's first vector; then every `lanes` vectors
            if row < num_tokens:
                row64 = T.cast(row, "int64")
                mix_lane(x, out, row64, first, mix, row64, acc, xs, ys, w)

    return pre_apply_mix


def random_mix(g, shape, seed):
    """(num_tokens, mhc_mult) float32: softmax weights (TileKernels' tests); odd seeds any sign and zeros."""
    n, m = shape["num_tokens"], shape["mhc_mult"]
    mix = torch.randn(n, m, generator=g)
    if seed % 2 == 0:
        return mix.softmax(-1)
    mix[:, :1] = 0.0
    return mix * 2


def make_inputs(shape, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = random_streams(g, shape, shape["mhc_mult"], seed)
    return x.to(device), random_mix(g, shape, seed).to(device)


def mix_streams(x, mix, acc=None):
    """fma(mix[:, m], x[:, m], acc) over the streams in order from acc (+0.0), float32, exactly."""
    w = mix.float().cpu()
    xf = x.float().cpu()
    if acc is None:
        acc = torch.zeros(xf.shape[0], xf.shape[-1], dtype=torch.float32)
    for m in range(xf.shape[1]):
        acc = fma32(w[:, m : m + 1].expand_as(acc), xf[:, m], acc)
    return acc


def reference(shape, x, mix):
    return mix_streams(x, mix).to(torch.bfloat16).to(x.device)


SPEC = register(
    KernelSpec(
        name="pre_apply_mix",
        doc="mHC layer input: each token's mhc_mult bf16 streams weighted by float32 mix and summed (fma, in order)",
        build=build,
        inputs=(
            TensorArg("x", "bfloat16", ("num_tokens", "mhc_mult", "hidden"), align=lambda s, c: c["vec_bytes"]),
            TensorArg("mix", "float32", ("num_tokens", "mhc_mult"), align=4),
        ),
        outputs=(TensorArg("out", "bfloat16", ("num_tokens", "hidden"), align=lambda s, c: c["vec_bytes"]),),
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=lambda s: stream_bytes(s, 1 + s["mhc_mult"]) + s["num_tokens"] * s["mhc_mult"] * 4,
        flops=lambda s: 2 * s["num_tokens"] * s["mhc_mult"] * s["hidden"],
        examples=(
            {"num_tokens": 4096, "mhc_mult": 4, "hidden": 7168},
            {"num_tokens": 8192, "mhc_mult": 4, "hidden": 2560},
            {"num_tokens": 1024, "mhc_mult": 8, "hidden": 1280},
        ),
        **COMMON,
    )
)
