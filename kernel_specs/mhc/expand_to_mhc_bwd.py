"""expand_to_mhc_bwd: the gradient of expand_to_mhc, each token's streams summed back to one row.

out_grad (num_tokens, mhc_mult, hidden) bf16 -> hidden_grad (num_tokens, hidden) bf16:
hidden_grad[t] = bf16(((+0.0 + out_grad[t, 0]) + out_grad[t, 1]) + ...), the float32 sum over the
streams in order, rounded once (TileKernels' `ExpandToMHCFn.backward` kernel, bit for bit; torch's
autograd of the expand sums the same values, in an order of its own).

Layout `_streams`: a lane keeps unroll * vec float32 sums and reads each stream's vectors in turn.
"""

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, TensorArg
from tkjit_kernels.mhc._streams import COMMON, geometry, random_streams, stream_bytes


def build(shape, c):
    from tilelang import language as T

    M, H = shape["mhc_mult"], shape["hidden"]
    vec, hv, lanes, chunk, chunks, guard = geometry(shape, c)
    R, U, threads = c["rows"], c["unroll"], c["threads"]
    num_tokens = T.dynamic("num_tokens")
    bf16, f32 = T.bfloat16, T.float32

    @T.prim_func
    def expand_to_mhc_bwd(
        out_grad: T.Tensor[(num_tokens, M, H), bf16],
        hidden_grad: T.Tensor[(num_tokens, H), bf16],
    ):
        with T.Kernel(T.ceildiv(num_tokens, R), chunks, threads=threads) as (bx, by):
            tx = T.get_thread_binding()
            acc = T.alloc_local((U * vec,), f32)
            gs = T.alloc_local((U * vec,), bf16)
            ys = T.alloc_local((U * vec,), bf16)
            row = bx * R + tx // lanes
            first = by * chunk + tx % lanes  # this lane's first vector; then every `lanes` vectors
            if row < num_tokens:
                for e in T.unroll(U * vec):
                    acc[e] = T.float32(0)
                for m in T.unroll(M):
                    for u in T.unroll(U):
                        if (not guard) or first + u * lanes < hv:
                            for v in T.vectorized(vec):
                                gs[u * vec + v] = out_grad[T.cast(row, "int64"), m, (first + u * lanes) * vec + v]
                    for e in T.unroll(U * vec):
                        acc[e] = acc[e] + T.cast(gs[e], f32)
                for e in T.unroll(U * vec):
                    ys[e] = T.cast(acc[e], bf16)
                for u in T.unroll(U):
                    if (not guard) or first + u * lanes < hv:
                        for v in T.vectorized(vec):
                            hidden_grad[T.cast(row, "int64"), (first + u * lanes) * vec + v] = ys[u * vec + v]

    return expand_to_mhc_bwd


def make_inputs(shape, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (random_streams(g, shape, shape["mhc_mult"], seed).to(device),)


def reference(shape, out_grad):
    """The float32 sum over the streams in order from +0.0 (each add exact to float32 rounding, as the
    kernel's), rounded once to bfloat16."""
    acc = torch.zeros(out_grad.shape[0], out_grad.shape[-1], dtype=torch.float32, device=out_grad.device)
    for m in range(shape["mhc_mult"]):
        acc = acc + out_grad[:, m].float()
    return acc.to(torch.bfloat16)


SPEC = register(
    KernelSpec(
        name="expand_to_mhc_bwd",
        doc="gradient of expand_to_mhc: each token's mhc_mult bf16 streams summed (float32, in order) to one row",
        build=build,
        inputs=(TensorArg("out_grad", "bfloat16", ("num_tokens", "mhc_mult", "hidden"),
                          align=lambda s, c: c["vec_bytes"]),),
        outputs=(TensorArg("hidden_grad", "bfloat16", ("num_tokens", "hidden"), align=lambda s, c: c["vec_bytes"]),),
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=lambda s: stream_bytes(s, 1 + s["mhc_mult"]),
        flops=lambda s: s["num_tokens"] * s["mhc_mult"] * s["hidden"],
        examples=(
            {"num_tokens": 4096, "mhc_mult": 4, "hidden": 7168},
            {"num_tokens": 8192, "mhc_mult": 4, "hidden": 2560},
            {"num_tokens": 1024, "mhc_mult": 8, "hidden": 1280},
        ),
        **COMMON,
    )
)
