"""mask_indices_by_tp: expert indices kept only where the expert lives on this TP rank, renumbered locally.

indices (num_tokens, num_topk) int32 or int64 -> same dtype and shape (TileKernels' `mask_indices_by_tp`).
With per_gpu experts per GPU (n // num_ep_ranks) and num_tp_ranks TP ranks, global expert x >= 0 sits
on GPU g = x // per_gpu at offset r = x % per_gpu; GPU g belongs to TP rank g % num_tp_ranks and
DP group q = g // num_tp_ranks. The output is

    q * per_gpu + r   where x >= 0 and g % num_tp_ranks == tp_rank
    -1                elsewhere (negative indices, experts of other TP ranks)

which is TileKernels' `value - tp_rank * per_gpu - dp_rank * (per_dp - per_gpu)` with
per_dp = num_tp_ranks * per_gpu, never negative for a kept index. Indices >= n follow the same
formula (as in TileKernels; no memory is indexed by them). The three ints are run-time scalars
(one binary for every rank and expert count); a call with per_gpu <= 0 or num_tp_ranks <= 0 writes -1
everywhere instead of dividing by zero (the ops refuse such values before launching), and a tp_rank
outside [0, num_tp_ranks) keeps nothing (as the formula says).

Layout: the (num_tokens, num_topk) tensor as one flat array. A block owns `block_elems` consecutive
elements, each thread `vec` consecutive ones per step (16-byte accesses at vec * itemsize = 16;
num_topk % vec == 0, so a vector never crosses a row and the last one ends at the tensor's end).
Everything is elementwise: the same code lowers on TileLang's C target.
"""

from __future__ import annotations

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Runtime, ScalarArg, Static, TensorArg, Tolerance

DTYPES = ("int32", "int64")
INT31_MAX = (1 << 31) - 1
ITEMSIZE = {"int32": 4, "int64": 8}


def default(shape):
    k, dt = shape["num_topk"], shape["dtype"]
    vec = next(v for v in (16 // ITEMSIZE[dt], 2, 1) if k % v == 0)
    # Elementwise, tiny and latency-bound: one vector step per thread, so the grid has as many blocks as it
    # can (TileKernels: one element per thread). On the H200, 4 steps per thread (64 blocks at 8192 tokens,
    # top-8) took 8.2 us where TileKernels' 512 blocks took 4.6 us (session 7, run 1); not yet re-measured.
    return {"block_elems": 128 * vec, "threads": 128, "vec": vec}


def constraint(shape, c):
    k, dt, block, threads, vec = shape["num_topk"], shape["dtype"], c["block_elems"], c["threads"], c["vec"]
    if vec * ITEMSIZE[dt] > 16:
        return f"vec={vec} {dt} accesses exceed 16 bytes"
    if k % vec:
        return f"vec={vec} accesses need num_topk={k} to be a multiple of {vec}"
    if block % (threads * vec):
        return "block_elems must be a multiple of threads * vec"
    if block // (threads * vec) > 16:
        return "more than 16 vector steps per thread"
    return None


def build(shape, c):
    from tilelang import language as T

    k, dt = shape["num_topk"], shape["dtype"]
    block, threads, vec = c["block_elems"], c["threads"], c["vec"]
    num_tokens = T.dynamic("num_tokens")

    def masked_index(xv, t, per_gpu, tp_rank, num_tp_ranks):
        # Divisors clamped to >= 1: invalid scalars give -1 below, never a division by zero.
        pg = T.cast(T.max(per_gpu, 1), t)
        tps = T.cast(T.max(num_tp_ranks, 1), t)
        g = T.truncdiv(xv, pg)  # x >= 0 where it matters: trunc == floor
        q = T.truncdiv(g, tps)
        keep = (xv >= 0) & (g - q * tps == T.cast(tp_rank, t)) & (per_gpu > 0) & (num_tp_ranks > 0)
        return T.if_then_else(keep, q * pg + (xv - g * pg), T.cast(-1, t))

    @T.prim_func
    def mask_indices_by_tp(
        indices: T.Tensor[(num_tokens, k), dt],
        masked: T.Tensor[(num_tokens, k), dt],
        per_gpu: T.int32,
        tp_rank: T.int32,
        num_tp_ranks: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_tokens * k, block), threads=threads) as bx:
            x = T.alloc_local((vec,), dt)
            y = T.alloc_local((vec,), dt)
            for t in T.Parallel(block // vec):
                base = bx * block + t * vec
                if base < num_tokens * k:
                    row = base // k
                    col = base % k
                    for v in T.vectorized(vec):
                        x[v] = indices[row, col + v]
                    for v in T.unroll(vec):
                        if dt == "int64":
                            # int64 division is a long software sequence on the GPU (the kernel's cost at 64K
                            # tokens): an index that fits 31 bits, i.e. any real expert id, divides in int32;
                            # -1 needs no division; only a huge index takes the int64 path (same formula).
                            if x[v] < T.int64(0):
                                y[v] = T.int64(-1)
                            elif x[v] <= T.int64(INT31_MAX):
                                x32 = T.cast(x[v], T.int32)
                                y[v] = T.cast(masked_index(x32, T.int32, per_gpu, tp_rank, num_tp_ranks), dt)
                            else:
                                y[v] = masked_index(x[v], dt, per_gpu, tp_rank, num_tp_ranks)
                        else:
                            y[v] = masked_index(x[v], dt, per_gpu, tp_rank, num_tp_ranks)
                    for v in T.vectorized(vec):
                        masked[row, col + v] = y[v]

    return mask_indices_by_tp


def make_inputs(shape, device="cpu", seed=0):
    """Indices over 256 experts on 8 EP ranks (per_gpu 32) with 2 TP ranks, rank 1 (odd seeds: 72
    experts on 4 EP ranks, 3 TP ranks, rank 2), -1 entries and indices past n; then the scalars."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n_tok, k = shape["num_tokens"], shape["num_topk"]
    n, ep, tp, tps = (256, 8, 1, 2) if seed % 2 == 0 else (72, 4, 2, 3)
    x = torch.randint(-1, n + n // 4, (n_tok, k), generator=g, dtype=torch.int64)
    x[torch.rand(n_tok, k, generator=g) < 0.1] = -1
    return (x.to(getattr(torch, shape["dtype"])).to(device), n // ep, tp, tps)


def reference(shape, indices, per_gpu, tp_rank, num_tp_ranks):
    x = indices.long()
    gpu, offset = x.div(per_gpu, rounding_mode="floor"), x.remainder(per_gpu)
    keep = (x >= 0) & (gpu.remainder(num_tp_ranks) == tp_rank)
    local = gpu.div(num_tp_ranks, rounding_mode="floor") * per_gpu + offset
    return torch.where(keep, local, -1).to(indices.dtype)


SPEC = register(
    KernelSpec(
        name="mask_indices_by_tp",
        family="moe",
        doc="expert indices of this TP rank renumbered locally, -1 for the others (int32/int64)",
        params=(
            Runtime("num_tokens", hi=1 << 24, doc="tokens; runtime size, tuned per power-of-two bucket"),
            Static("num_topk", lo=1, hi=64, default=8, doc="indices per token"),
            Static("dtype", str, values=DTYPES, default="int64", doc="index dtype"),
        ),
        space={
            "block_elems": (128, 256, 512, 1024, 2048, 4096, 8192),
            "threads": (64, 128, 256),
            "vec": (1, 2, 4),
        },
        default=default,
        constraint=constraint,
        build=build,
        pass_configs=lambda c: {"tl.disable_warp_specialized": True},
        inputs=(TensorArg("indices", lambda s: s["dtype"], ("num_tokens", "num_topk"),
                          align=lambda s, c: c["vec"] * ITEMSIZE[s["dtype"]]),),
        outputs=(TensorArg("masked", lambda s: s["dtype"], ("num_tokens", "num_topk"),
                           align=lambda s, c: c["vec"] * ITEMSIZE[s["dtype"]]),),
        scalars=(ScalarArg("per_gpu", int), ScalarArg("tp_rank", int), ScalarArg("num_tp_ranks", int)),
        make_inputs=make_inputs,
        reference=reference,
        tolerance=Tolerance(exact=True),
        bytes_moved=lambda s: 2 * s["num_tokens"] * s["num_topk"] * ITEMSIZE[s["dtype"]],
        examples=(
            {"num_tokens": 8192, "num_topk": 8, "dtype": "int64"},
            {"num_tokens": 65536, "num_topk": 8, "dtype": "int64"},
            {"num_tokens": 8192, "num_topk": 8, "dtype": "int32"},
            {"num_tokens": 4096, "num_topk": 6, "dtype": "int64"},
        ),
    )
)
