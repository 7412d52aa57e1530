"""sinkhorn_fwd: Sinkhorn-Knopp normalisation of many small n x n matrices (mHC residual mixing).

y = softmax(x, -1) + eps; y /= colsum(y) + eps; then (repeat - 1) times: rowsum, colsum.
Semantics follow TileKernels' `sinkhorn_normalize_ref`.

Three layouts are tunable:
  thread    one token's n x n matrix lives in one thread's registers: no cross-thread reduction.
  smem      the block's tile is staged through shared memory with coalesced copies, then as `thread`.
  fragment  TileLang fragments reduced across threads (T.reduce_*), TileKernels' structure.
The arithmetic is tiny (~1.3 GFLOP at 1M tokens): the kernel should run at memory speed, which
the per-thread layouts reach because they issue no shuffles or barriers between the 2*repeat steps.
Shapes, tensors, the target rule, the reference and the per-token TileLang blocks (load/store, the
in-register normalisation) come from _common.py, shared with sinkhorn_bwd and mhc_pre_big_fuse.
"""

from __future__ import annotations

from tkjit.registry import register
from tkjit.spec import KernelSpec
from tkjit_kernels.mhc._common import (
    COMMON,
    SMEM_LIMIT,
    mat_bytes,
    mats,
    random_mats,
    reference,
    sinkhorn_block,
    token_blocks,
)

LAYOUTS = ("thread", "smem", "fragment")


def default(shape):
    n, tokens = shape["n"], shape.get("num_tokens", 1 << 20)
    # One token per thread, reciprocals instead of divides (4 per normalisation, not n*n). Small
    # batches need small blocks to spread over all 132 SMs; large ones amortise more per block.
    if tokens <= 16384 or n > 4:
        bt, th = 32, 32
    elif tokens <= 131072:
        bt, th = 128, 128
    else:
        bt, th = 256, 128
    # fast_math: every config of the space passed the rtol 1e-5 gate with it on the H200 at 1..1M tokens,
    # and it takes ~40% off (8.5 -> 5.2 us at 4096 tokens; benchmarks/h200).
    return {"layout": "thread", "block_tokens": bt, "threads": th, "fast_math": True, "recip": True}


def constraint(shape, c):
    n, bt, th = shape["n"], c["block_tokens"], c["threads"]
    if c["layout"] in ("thread", "smem"):
        if bt < th or bt % th:
            return "per-thread layouts need block_tokens to be a multiple of threads"
        if c["layout"] == "smem" and bt * n * n * 4 > SMEM_LIMIT:
            return f"tile of {bt * n * n * 4} bytes exceeds {SMEM_LIMIT} bytes of shared memory"
        if bt * n * n > 64 * 1024:
            return "block too large"
    else:
        if bt > 64 or th > 128:
            return "fragment layout is for block_tokens <= 64 and threads <= 128"
        if c["recip"]:
            return "fragment layout always divides (recip would duplicate configs)"
        if bt * n * n < th:
            return "fragment smaller than the thread block"
    return None


def build(shape, c):
    from tilelang import language as T

    n, repeat, eps = shape["n"], shape["repeat"], shape["eps"]
    bt, threads, layout, recip = c["block_tokens"], c["threads"], c["layout"], c["recip"]
    num_tokens = T.dynamic("num_tokens")
    f32 = T.float32

    if layout == "fragment":
        @T.prim_func
        def sinkhorn_fragment(
            x: T.Tensor[(num_tokens, n, n), f32], y: T.Tensor[(num_tokens, n, n), f32]
        ):
            with T.Kernel(T.ceildiv(num_tokens, bt), threads=threads) as bx:
                m = T.alloc_fragment((bt, n, n), f32)
                rs = T.alloc_fragment((bt, n), f32)
                cs = T.alloc_fragment((bt, n), f32)
                T.copy(x[bx * bt, 0, 0], m)
                T.reduce_max(m, rs, dim=2)
                for t, i, j in T.Parallel(bt, n, n):
                    m[t, i, j] = T.exp(m[t, i, j] - rs[t, i])
                T.reduce_sum(m, rs, dim=2)
                for t, i, j in T.Parallel(bt, n, n):
                    m[t, i, j] = m[t, i, j] / rs[t, i] + eps
                T.reduce_sum(m, cs, dim=1)
                for t, i, j in T.Parallel(bt, n, n):
                    m[t, i, j] = m[t, i, j] / (cs[t, j] + eps)
                for _ in T.serial(repeat - 1):
                    T.reduce_sum(m, rs, dim=2)
                    for t, i, j in T.Parallel(bt, n, n):
                        m[t, i, j] = m[t, i, j] / (rs[t, i] + eps)
                    T.reduce_sum(m, cs, dim=1)
                    for t, i, j in T.Parallel(bt, n, n):
                        m[t, i, j] = m[t, i, j] / (cs[t, j] + eps)
                T.copy(m, y[bx * bt, 0, 0])

        return sinkhorn_fragment

    # Per-thread layouts: m and s are registers of the thread that owns token t.
    load, store, load_tile, store_tile = token_blocks(n, eps, recip)[:4]
    sinkhorn_in_registers = sinkhorn_block(n, repeat, eps, recip)

    if layout == "thread":
        @T.prim_func
        def sinkhorn_thread(
            x: T.Tensor[(num_tokens, n, n), f32], y: T.Tensor[(num_tokens, n, n), f32]
        ):
            with T.Kernel(T.ceildiv(num_tokens, bt), threads=threads) as bx:
                m = T.alloc_local((n, n), f32)
                s = T.alloc_local((n,), f32)
                for t in T.Parallel(bt):
                    tok = bx * bt + t
                    if tok < num_tokens:
                        load(m, x, tok)
                        sinkhorn_in_registers(m, s)
                        store(y, tok, m)

        return sinkhorn_thread

    @T.prim_func
    def sinkhorn_smem(
        x: T.Tensor[(num_tokens, n, n), f32], y: T.Tensor[(num_tokens, n, n), f32]
    ):
        with T.Kernel(T.ceildiv(num_tokens, bt), threads=threads) as bx:
            tile = T.alloc_shared((bt, n, n), f32)
            m = T.alloc_local((n, n), f32)
            s = T.alloc_local((n,), f32)
            T.copy(x[bx * bt, 0, 0], tile)
            for t in T.Parallel(bt):
                load_tile(m, tile, t)
                sinkhorn_in_registers(m, s)
                store_tile(tile, t, m)
            T.copy(tile, y[bx * bt, 0, 0])

    return sinkhorn_smem


def make_inputs(shape, device="cpu", seed=0):
    return random_mats(shape, 1, device, seed)


SPEC = register(
    KernelSpec(
        name="sinkhorn_fwd",
        doc="Sinkhorn normalisation of (num_tokens, n, n) float32 mixing matrices",
        space={
            "layout": LAYOUTS,
            "block_tokens": (1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            "threads": (32, 64, 128, 256),
            "fast_math": (False, True),
            "recip": (False, True),
        },
        default=default,
        constraint=constraint,
        build=build,
        inputs=(mats("x"),),
        outputs=(mats("y"),),
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=lambda s: 2 * mat_bytes(s),
        flops=lambda s: s["num_tokens"] * s["n"] * s["n"] * (4 + 4 * s["repeat"]),
        examples=({"num_tokens": 4096, "n": 4}, {"num_tokens": 1 << 20, "n": 4}),
        **COMMON,
    )
)
