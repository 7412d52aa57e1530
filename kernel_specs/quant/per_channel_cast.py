"""per_channel_cast: x (num_tokens, hidden) bf16/f32 -> FP8 e4m3 values (num_tokens, hidden) + one float32
scale per channel and block of num_per_tokens tokens, scales (num_tokens / num_per_tokens, hidden).

The maths, the scale layout and why the kernel sees x as (token_blocks, num_per_tokens, hidden):
`_per_channel.py`. Semantics follow TileKernels' `per_channel_cast` (e4m3, num_per_tokens 128; tkjit
also takes 32) and its torch reference `cast(x, 'e4m3', block_size=(num_per_tokens, 1))`; bit-exact
for finite inputs.

Layout (one thread block per token block x block_ch channels, block_ch = vec * ch_threads):
  thread t owns `vec` consecutive channels (tc = t % ch_threads) of the tokens tr, tr + tok_threads, ...
  (tr = t // ch_threads, tok_threads = threads / ch_threads): neighbouring lanes load neighbouring
  16-byte vectors, so a warp reads whole lines. x stays in registers from load to cast (read once from
  DRAM). Each thread's per-channel max goes to shared memory, one barrier, and every thread then folds
  the tok_threads partial maxima of its own channels (a few vector reads of shared memory), so no second
  barrier and no broadcast step are needed; the tr == 0 threads store the scales.
The grid is 1-D over (token block, channel tile), channel tiles of one token block consecutive.
A channel tile past hidden (hidden % block_ch != 0) checks each vector (hidden is a multiple of 16, so a
vector is wholly inside or outside); the check is generated only for such shapes.
"""

from tkjit.registry import register
from tkjit.spec import KernelSpec, TensorArg
from tkjit_kernels.quant._per_channel import (
    COMMON,
    SCALES,
    TILE_SPACE,
    Prologue,
    check_hidden,
    reference_blocks,
    scale_blocks,
    tile_constraint,
    tile_default,
    valid_tiles,
)

SPACE = TILE_SPACE


def constraint(shape, c):
    return tile_constraint(shape, c)


def _valid(shape):
    return valid_tiles(shape, constraint)


def check_shape(shape):
    return check_hidden(shape, _valid)


def default(shape):
    return tile_default(shape, constraint)


def build(shape, c, prologue: Prologue | None = None):
    """prologue: values made from x by a fused producer (`_per_channel.Prologue`), not loaded."""
    from tilelang import language as T

    H, npt, in_dtype = shape["hidden"], shape["num_per_tokens"], shape["in_dtype"]
    vec, cht, threads = c["vec"], c["ch_threads"], c["threads"]
    tok_threads = threads // cht
    tpt = npt // tok_threads  # tokens per thread
    block_ch = vec * cht
    ch_tiles = -(-H // block_ch)
    ch_tail = H % block_ch != 0
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
            # Every thread folds the partial maxima of its own channels: one barrier, no broadcast.
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
