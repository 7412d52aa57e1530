"""normalize_weight: each token's top-k routing weights divided by their sum (TileKernels' `normalize_weight`).

topk_weights (num_tokens, num_topk) float32 -> denominator (num_tokens,) float32 and normalized
(num_tokens, num_topk) float32, bit-identical to TileKernels' torch reference:

    denominator = 1e-20 (float32), then += topk_weights[:, j] for j = 0 .. num_topk - 1, in float32, in order
    normalized  = topk_weights / denominator[:, None]                       (IEEE division, round to nearest)

The order of the additions is part of the result (float addition is not associative), so the sum is
a serial chain in registers, never a tree; the division is a true IEEE divide (no fast math, no
reciprocal multiply: `x * (1 / s)` rounds twice and differs in the last bit).

Layout: one thread per token row. A block owns `block_rows` consecutive rows, `block_rows / threads`
per thread, strided by `threads` so that a warp's loads cover consecutive rows (contiguous memory).
A row's num_topk weights are read and written as `vec`-wide vectors (vec=4: 16-byte accesses; needs
num_topk % vec == 0 so every vector stays inside its row and aligned). Rows past num_tokens are
skipped; the kernel touches no other memory. The same code lowers on TileLang's C target (the
`T.Parallel` row loop), where it runs for real on a CPU host.
"""

from __future__ import annotations

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Runtime, Static, TensorArg, Tolerance, ieee_plain_threads

MAX_TOPK = 256
EPS = 1e-20  # TileKernels' starting value of the sum (keeps an all-zero row finite: 0 / 1e-20 = 0)


def default(shape):
    k, tokens = shape["num_topk"], shape.get("num_tokens", 8192)
    vec = 4 if k % 4 == 0 else (2 if k % 2 == 0 else 1)
    # A row is tiny (k * 4 bytes): 128 threads x 2 rows per block keeps ~0.5 KiB of loads in flight per
    # warp, while small batches still get enough blocks to reach every SM.
    rows = 256 if tokens > 32768 else 128
    return {"block_rows": rows, "threads": 128, "vec": vec}


def constraint(shape, c):
    k, rows, threads, vec = shape["num_topk"], c["block_rows"], c["threads"], c["vec"]
    if rows < threads or rows % threads:
        return "block_rows must be a multiple of threads (each thread owns block_rows / threads rows)"
    if rows // threads > 8:
        return "more than 8 rows per thread"
    if k % vec:
        return f"vec={vec} accesses need num_topk={k} to be a multiple of {vec}"
    return None


def arch_constraint(arch, c, shape):
    # The C target runs the T.Parallel row loop serially; one config per block size is enough there.
    if arch == "cpu" and c["vec"] != 1:
        return "the C target takes scalar accesses (vec=1)"
    return None


# Bit-exactness needs IEEE division: never fast math.
pass_configs = ieee_plain_threads


def build(shape, c):
    from tilelang import language as T

    k = shape["num_topk"]
    rows, threads, vec = c["block_rows"], c["threads"], c["vec"]
    num_tokens = T.dynamic("num_tokens")
    f32 = T.float32

    @T.prim_func
    def normalize_weight(
        topk_weights: T.Tensor[(num_tokens, k), f32],
        denominator: T.Tensor[(num_tokens,), f32],
        normalized: T.Tensor[(num_tokens, k), f32],
    ):
        with T.Kernel(T.ceildiv(num_tokens, rows), threads=threads) as bx:
            w = T.alloc_local((k,), f32)
            s = T.alloc_local((1,), f32)
            for t in T.Parallel(rows):
                row = bx * rows + t
                if row < num_tokens:
                    for j in T.unroll(k // vec):
                        for v in T.vectorized(vec):
                            w[j * vec + v] = topk_weights[row, j * vec + v]
                    s[0] = T.float32(EPS)
                    for j in T.unroll(k):
                        s[0] = s[0] + w[j]  # in order: the reference's rounding
                    denominator[row] = s[0]
                    for j in T.unroll(k // vec):
                        for v in T.vectorized(vec):
                            normalized[row, j * vec + v] = w[j * vec + v] / s[0]

    return normalize_weight


def make_inputs(shape, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    n, k = shape["num_tokens"], shape["num_topk"]
    w = torch.rand(n, k, generator=g, dtype=torch.float32)  # TileKernels' test data: U[0, 1)
    if seed % 2 == 1:
        # Odd seeds: many magnitudes (sums that round at every step), exact zeros, an all-zero row
        # (denominator 1e-20) and subnormal weights (no flush to zero allowed).
        w = w * torch.exp2(torch.randint(-30, 30, (n, 1), generator=g).float())
        w[torch.rand(n, k, generator=g) < 0.1] = 0.0
        w[0] = 0.0
        if n > 1:
            w[1] = torch.rand(k, generator=g) * 1e-40
    return (w.to(device),)


def reference(shape, topk_weights):
    # The sum as TileKernels' reference adds it: float32, from 1e-20, one weight at a time.
    denominator = torch.full((topk_weights.shape[0],), EPS, dtype=torch.float32, device=topk_weights.device)
    for j in range(topk_weights.shape[1]):
        denominator = denominator + topk_weights[:, j]
    return denominator, topk_weights / denominator[:, None]


def _bytes(s):
    return s["num_tokens"] * (2 * s["num_topk"] + 1) * 4


SPEC = register(
    KernelSpec(
        name="normalize_weight",
        family="moe",
        doc="top-k routing weights over their in-order float32 sum (from 1e-20), and that sum",
        params=(
            Runtime("num_tokens", hi=1 << 26, doc="tokens; runtime size, tuned per power-of-two bucket"),
            Static("num_topk", lo=1, hi=MAX_TOPK, default=8, doc="weights per token"),
        ),
        space={
            "block_rows": (32, 64, 128, 256, 512, 1024),
            "threads": (32, 64, 128, 256),
            "vec": (1, 2, 4),
        },
        default=default,
        constraint=constraint,
        arch_constraint=arch_constraint,
        build=build,
        pass_configs=pass_configs,
        inputs=(TensorArg("topk_weights", "float32", ("num_tokens", "num_topk"), align=lambda s, c: 4 * c["vec"]),),
        outputs=(
            TensorArg("denominator", "float32", ("num_tokens",), align=4),
            TensorArg("normalized", "float32", ("num_tokens", "num_topk"), align=lambda s, c: 4 * c["vec"]),
        ),
        make_inputs=make_inputs,
        reference=reference,
        tolerance=Tolerance(exact=True),
        bytes_moved=_bytes,
        flops=lambda s: 2 * s["num_tokens"] * s["num_topk"],
        examples=(
            {"num_tokens": 8192, "num_topk": 8},
            {"num_tokens": 65536, "num_topk": 8},
            {"num_tokens": 4096, "num_topk": 6},
        ),
    )
)
