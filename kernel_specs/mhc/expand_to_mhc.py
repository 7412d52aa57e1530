"""expand_to_mhc: each token's hidden row copied to its mhc_mult residual streams, bit-exactly.

x (num_tokens, hidden) bf16 -> out (num_tokens, mhc_mult, hidden) bf16, out[t, m] = x[t]
(TileKernels' `modeling.mhc.ops.expand_to_mhc`, the embedding's entry into the mHC residual; its
torch reference is `hidden.unsqueeze(-2).expand(..., mhc_mult, hidden).contiguous()`).

A lane loads its vectors of the row once into registers and stores them to each stream: the traffic
is one read of the row and mhc_mult writes (TileKernels' kernel too; the layout is `_streams`).
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
    bf16 = T.bfloat16

    @T.prim_func
    def expand_to_mhc(
        x: T.Tensor[(num_tokens, H), bf16],
        out: T.Tensor[(num_tokens, M, H), bf16],
    ):
        with T.Kernel(T.ceildiv(num_tokens, R), chunks, threads=threads) as (bx, by):
            tx = T.get_thread_binding()
            xs = T.alloc_local((U * vec,), bf16)
            row = bx * R + tx // lanes
            first = by * chunk + tx % lanes  # this lane's first vector; then every `lanes` vectors
            if row < num_tokens:
                for u in T.unroll(U):
                    if (not guard) or first + u * lanes < hv:
                        for v in T.vectorized(vec):
                            xs[u * vec + v] = x[T.cast(row, "int64"), (first + u * lanes) * vec + v]
                for m in T.unroll(M):
                    for u in T.unroll(U):
                        if (not guard) or first + u * lanes < hv:
                            for v in T.vectorized(vec):
                                out[T.cast(row, "int64"), m, (first + u * lanes) * vec + v] = xs[u * vec + v]

    return expand_to_mhc


def make_inputs(shape, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (random_streams(g, shape, 1, seed)[:, 0].contiguous().to(device),)


def reference(shape, x):
    return x.unsqueeze(-2).expand(x.shape[0], shape["mhc_mult"], x.shape[-1]).contiguous()


SPEC = register(
    KernelSpec(
        name="expand_to_mhc",
        doc="copy each token's (hidden,) bf16 row to its mhc_mult residual streams (bit-exact)",
        build=build,
        inputs=(TensorArg("x", "bfloat16", ("num_tokens", "hidden"), align=lambda s, c: c["vec_bytes"]),),
        outputs=(TensorArg("out", "bfloat16", ("num_tokens", "mhc_mult", "hidden"),
                           align=lambda s, c: c["vec_bytes"]),),
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=lambda s: stream_bytes(s, 1 + s["mhc_mult"]),
        examples=(
            {"num_tokens": 4096, "mhc_mult": 4, "hidden": 7168},
            {"num_tokens": 8192, "mhc_mult": 4, "hidden": 2560},
            {"num_tokens": 1024, "mhc_mult": 8, "hidden": 1280},
        ),
        **COMMON,
    )
)
