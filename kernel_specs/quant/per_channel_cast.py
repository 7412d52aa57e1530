"""per_channel_cast: x (num_tokens, hidden) bf16/f32 -> FP8 e4m3 values (num_tokens, hidden) + one float32
scale per channel and block of num_per_tokens tokens, scales (num_tokens / num_per_tokens, hidden).

The maths, the scale layout and why the kernel sees x as (token_blocks, num_per_tokens, hidden):
`_per_channel.py`. Semantics follow TileKernels' `per_channel_cast` (e4m3, num_per_tokens 128; tkjit
also takes 32) and its torch reference `cast(x, 'e4m3', block_size=(num_per_tokens, 1))`; bit-exact
for finite inputs.

Layout, stage="regs" (one thread block per token block x block_ch channels, block_ch = vec * ch_threads):
  thread t owns `vec` consecutive channels (tc = t % ch_threads) of the tokens tr, tr + tok_threads, ...
  (tr = t // ch_threads, tok_threads = threads / ch_threads): neighbouring lanes load neighbouring
  16-byte vectors, so a warp reads whole lines. x stays in registers from load to cast (read once from
  DRAM). Each thread's per-channel max goes to shared memory, one barrier, and every thread then folds
  the tok_threads partial maxima of its own channels (a few vector reads of shared memory), so no second
  barrier and no broadcast step are needed; the tr == 0 threads store the scales.
stage="smem" (the default; TileKernels' layout, see the comment above SPACE): the same block and reduction,
but a thread's rows are consecutive and each vector passes through a shared tile instead of staying in registers.
The grid is 1-D over (token block, channel tile), channel tiles of one token block consecutive.
A channel tile past hidden (hidden % block_ch != 0) checks each vector (hidden is a multiple of 16, so a
vector is wholly inside or outside); the check is generated only for such shapes.
"""

from tkjit.registry import register
from tkjit.spec import KernelSpec, TensorArg
from tkjit_kernels.quant._per_channel import (
    COMMON,
    SCALES,
    STAGED_SPACE,
    Prologue,
    block_fold,
    check_hidden,
    min_blocks,
    reference_blocks,
    scale_blocks,
    smem_constraint,
    staged_default,
    tile_constraint,
    tile_of,
    valid_tiles,
)

# -- why the space has two ways of staging x ---------------------------------------------------------------
# H200 (untuned default, L2 flushed; copy floor in brackets): the register tile {vec 8, ch_threads 32,
# threads 256} took 41.6 us at 4096 x 7168 (20.9) and 280.4 us at 32768 x 7168 (167.5), TileKernels 27.8 and
# 187.9. Its generated CUDA holds the thread's whole tile in registers, `bfloat16_t xs[128]` (16 unrolled
# 16-byte loads, then the reduction, then 16 stores) under TileLang's `__launch_bounds__(256, 1)`: ptxas
# gives it 167 registers, so ONE block (8 warps, 12.5% occupancy) per SM. The block's loads, its barrier,
# its scale divisions and its stores then run one after the other with nothing else on the SM to overlap
# them, and each SM waits out every block's DRAM latency. Coalescing is not the problem (a warp reads 512
# contiguous bytes of a row, writes 256; 16-byte loads, 8-byte stores, no bank conflicts).
# TileKernels' kernel (quant/per_channel_cast_fused_kernel.py, reached from per_channel_cast): a block of
# 128 tokens x 128 channels, 256 threads, 32 along the channels (4 channels a thread: 8-byte loads of bf16,
# a warp reads 256 contiguous bytes of a row) and 8 along the tokens, thread rows consecutive (16 a
# thread); each vector goes to a shared tile (32 KiB) and a running max, partial maxima through shared
# memory, 128 threads fold them, a second barrier broadcasts the factors, the values are read back from
# shared memory and stored (4-byte FP8 stores); grid (tokens / 128, hidden / 128). Few registers and 36 KiB
# of shared memory let several blocks share an SM, which hides the latency the register tile exposes.
# So the space has stage="smem": that layout (TileKernels' block, threads, rows and vectors), with this
# spec's one-barrier reduction (every thread folds its own channels' partial maxima) and the loads of a
# thread unrolled (16 in flight a thread where TileKernels' serial loop may wait on each; ptxas: 51
# registers, 56 allocated, so 4 blocks of 256 threads an SM). {vec 4, ch_threads 32, threads 256, "smem"} is
# TileKernels' design and the default; the register tile stays in the space (stage="regs") for the tuner (at 4096 x 2048
# it beat TileKernels: 14.8 vs 17.7 us).
SPACE = STAGED_SPACE


def constraint(shape, c):
    if c.get("stage", "regs") == "smem":
        return smem_constraint(shape, c)
    return tile_constraint(shape, c)


def _valid(shape):
    return valid_tiles(shape, constraint, SPACE)


def check_shape(shape):
    return check_hidden(shape, _valid)


def default(shape):
    """TileKernels' block (its design, see above; `_per_channel.staged_default`): 4 channels a thread, 32
    threads along a row, 256 threads; the register tile's default where no staged tile fits."""
    return staged_default(shape, constraint, tile_constraint)


def build(shape, c, prologue: Prologue | None = None):
    """prologue: values made from x by a fused producer (`_per_channel.Prologue`), not loaded."""
    from tilelang import language as T

    if c.get("stage", "regs") == "smem":
        return _build_smem(shape, c, prologue)
    H, npt, in_dtype = shape["hidden"], shape["num_per_tokens"], shape["in_dtype"]
    vec, cht, threads = c["vec"], c["ch_threads"], c["threads"]
    tok_threads, tpt, block_ch, ch_tiles, ch_tail = tile_of(shape, c)
    token_blocks = T.dynamic("token_blocks")
    f32, fp8 = T.float32, T.float8_e4m3fn
    scale_and_inv, quantise = scale_blocks(shape["round_scale"])

    x_cols = H if prologue is None else prologue.x_cols(H)
    if prologue is None:

        @T.macro
        def load(xs, x, b, tr, col):
            for j in T.unroll(tpt):
                for v in T.vectorized(vec):
                    xs[j * vec + v] = x[b, tr + j * tok_threads, col + v]

    else:
        make = prologue.loader(vec)

        @T.macro
        def load(xs, x, b, tr, col):
            for j in T.unroll(tpt):
                make(xs, j * vec, x, b, tr + j * tok_threads, col)

    @T.macro
    def store(out, scales, xs, sf, inv, b, tr, col):
        if tr == 0:
            for v in T.vectorized(vec):
                scales[b, col + v] = sf[v]
        for j in T.unroll(tpt):
            for v in T.vectorized(vec):
                out[b, tr + j * tok_threads, col + v] = quantise(xs[j * vec + v], inv[v])

    @T.prim_func
    def per_channel_cast(
        x: T.Tensor[(token_blocks, npt, x_cols), in_dtype],
        out: T.Tensor[(token_blocks, npt, H), fp8],
        scales: T.Tensor[(token_blocks, H), f32],
    ):
        with T.Kernel(token_blocks * ch_tiles, threads=threads) as bid:
            tx = T.get_thread_binding()
            xs = T.alloc_local((tpt * vec,), in_dtype)
            amax = T.alloc_local((vec,), f32)
            sf = T.alloc_local((vec,), f32)
            inv = T.alloc_local((vec,), f32)
            red = T.alloc_shared((tok_threads, block_ch), f32)
            b = T.cast(bid // ch_tiles, "int64")  # int64: offsets pass 2^31 for large x
            tc = tx % cht
            tr = tx // cht
            col = (bid % ch_tiles) * block_ch + tc * vec
            if ch_tail:
                if col < H:
                    load(xs, x, b, tr, col)
                else:  # a vector past hidden: zeros, which leave the max of |x| unchanged
                    for e in T.unroll(tpt * vec):
                        xs[e] = T.cast(0, in_dtype)
            else:
                load(xs, x, b, tr, col)
            for v in T.unroll(vec):
                amax[v] = T.float32(0)
            for j in T.unroll(tpt):
                for v in T.unroll(vec):
                    amax[v] = T.max(amax[v], T.abs(T.cast(xs[j * vec + v], f32)))
            for v in T.vectorized(vec):
                red[tr, tc * vec + v] = amax[v]
            T.sync_threads()
            for r in T.unroll(tok_threads):
                for v in T.unroll(vec):
                    amax[v] = T.max(amax[v], red[r, tc * vec + v])
            for v in T.unroll(vec):
                scale_and_inv(amax, sf, inv, v)
            if ch_tail:
                if col < H:
                    store(out, scales, xs, sf, inv, b, tr, col)
            else:
                store(out, scales, xs, sf, inv, b, tr, col)

    return per_channel_cast


def _build_smem(shape, c, prologue: Prologue | None):
    """stage="smem": TileKernels' layout. A thread's tpt token rows are consecutive (rows tr * tpt ..); each
    vector goes from DRAM to a register, to the block's shared tile (only the thread itself reads it back) and
    into the thread's running max, so a thread holds one vector, not its whole tile, and many blocks fit an SM.
    The reduction, the scales and the tail checks are the register tile's."""
    from tilelang import language as T
    from tilelang.language.annotations import annotate_min_blocks_per_sm

    H, npt, in_dtype = shape["hidden"], shape["num_per_tokens"], shape["in_dtype"]
    vec, cht, threads = c["vec"], c["ch_threads"], c["threads"]
    tok_threads, tpt, block_ch, ch_tiles, ch_tail = tile_of(shape, c)
    token_blocks = T.dynamic("token_blocks")
    f32, fp8 = T.float32, T.float8_e4m3fn
    scale_and_inv, quantise = scale_blocks(shape["round_scale"])
    fold = block_fold(vec, tok_threads, scale_and_inv, shape["round_scale"], c.get("factors", "thread"))

    x_cols = H if prologue is None else prologue.x_cols(H)
    if prologue is None:

        @T.macro
        def load(xv, x, b, row, col):
            for v in T.vectorized(vec):
                xv[v] = x[b, row, col + v]

    else:
        make = prologue.loader(vec)

        @T.macro
        def load(xv, x, b, row, col):
            make(xv, 0, x, b, row, col)

    # factors="channel" on bf16 (TileKernels' SwiGLU cast's way): the running maxima on pairs of bf16 (one packed
    # max of two absolute values a pair; the max of exact values is exact in either width, and a NaN is dropped
    # by both, as by the float max), widened once at the end, instead of a widening and a float max an element.
    packed = c.get("factors") == "channel" and in_dtype == "bfloat16"

    @T.macro
    def stage(x, tile, amax, xv, b, row0, cc, col):
        if packed:
            pairs = T.alloc_local((vec // 2,), T.bfloat16x2)
        for j in T.unroll(tpt):
            load(xv, x, b, row0 + j, col)
            for v in T.vectorized(vec):
                tile[row0 + j, cc + v] = xv[v]
            if packed:
                for h in T.unroll(vec // 2):
                    if j == 0:
                        pairs[h] = T.abs2(T.bfloat16x2(xv[2 * h], xv[2 * h + 1]))
                    else:
                        pairs[h] = T.max2(T.abs2(T.bfloat16x2(xv[2 * h], xv[2 * h + 1])), pairs[h])
            else:
                for v in T.unroll(vec):
                    amax[v] = T.max(amax[v], T.abs(T.cast(xv[v], f32)))
        if packed:
            halves = T.view(pairs, (vec,), T.bfloat16)
            for v in T.unroll(vec):
                amax[v] = T.max(amax[v], T.cast(halves[v], f32))

    @T.macro
    def store(out, scales, tile, xv, sf, inv, b, tr, row0, cc, col):
        if tr == 0:
            for v in T.vectorized(vec):
                scales[b, col + v] = sf[v]
        for j in T.unroll(tpt):
            for v in T.vectorized(vec):
                xv[v] = tile[row0 + j, cc + v]
            for v in T.vectorized(vec):
                out[b, row0 + j, col + v] = quantise(xv[v], inv[v])

    @T.prim_func
    def per_channel_cast(
        x: T.Tensor[(token_blocks, npt, x_cols), in_dtype],
        out: T.Tensor[(token_blocks, npt, H), fp8],
        scales: T.Tensor[(token_blocks, H), f32],
    ):
        with T.Kernel(token_blocks * ch_tiles, threads=threads) as bid:
            if min_blocks(c) > 1:  # the occupancy hint (_per_channel.STAGED_SPACE says why)
                annotate_min_blocks_per_sm(min_blocks(c))
            tx = T.get_thread_binding()
            tile = T.alloc_shared((npt, block_ch), in_dtype)
            red = T.alloc_shared((tok_threads, block_ch), f32)
            xv = T.alloc_local((vec,), in_dtype)
            amax = T.alloc_local((vec,), f32)
            sf = T.alloc_local((vec,), f32)
            inv = T.alloc_local((vec,), f32)
            b = T.cast(bid // ch_tiles, "int64")  # int64: offsets pass 2^31 for large x
            tc = tx % cht
            tr = tx // cht
            row0 = tr * tpt
            cc = tc * vec
            col = (bid % ch_tiles) * block_ch + cc
            for v in T.unroll(vec):
                amax[v] = T.float32(0)
            if ch_tail:
                if col < H:  # a vector past hidden adds nothing to the maxima and is not stored
                    stage(x, tile, amax, xv, b, row0, cc, col)
            else:
                stage(x, tile, amax, xv, b, row0, cc, col)
            fold(red, amax, sf, inv, tr, cc)
            if ch_tail:
                if col < H:
                    store(out, scales, tile, xv, sf, inv, b, tr, row0, cc, col)
            else:
                store(out, scales, tile, xv, sf, inv, b, tr, row0, cc, col)

    return per_channel_cast


def reference(shape, x):
    return reference_blocks(shape, x)


SPEC = register(
    KernelSpec(
        name="per_channel_cast",
        doc="per-channel FP8 e4m3 cast, one float32 scale per channel and num_per_tokens tokens (amax / 448)",
        space=SPACE,
        default=default,
        constraint=constraint,
        check_shape=check_shape,
        build=build,
        outputs=(TensorArg("out", "float8_e4m3fn", ("token_blocks", "num_per_tokens", "hidden")), SCALES),
        reference=reference,
        **COMMON,
    )
)
