"""per_channel_cast_and_transpose: x (num_tokens, hidden) bf16/f32 -> FP8 e4m3 values transposed,
(hidden, num_tokens), + one float32 scale per channel and block of num_per_tokens tokens, scales
(num_tokens / num_per_tokens, hidden) (not transposed), as TileKernels returns them.

The maths, the scale layout and why the kernel sees x as (token_blocks, num_per_tokens, hidden) and
writes the values as (hidden, token_blocks, num_per_tokens): `_per_channel.py`. Semantics follow
TileKernels' `per_channel_cast_and_transpose` (e4m3, num_per_tokens 32 or 128; TileKernels takes bf16
only, tkjit also float32) and its torch reference `cast(x, 'e4m3', block_size=(num_per_tokens, 1))`
transposed; bit-exact for finite inputs.

Layout (one thread block per block_tokens x block_ch tile of x; block_tokens a multiple of
num_per_tokens, so a tile holds whole scale blocks), the tiled transpose of `transpose.py`:
  1. Each thread loads k x k micro-tiles (k = vec_bytes / element size): k token rows of x, one
     vec_bytes-wide vector each, so a warp reads whole 128-byte lines.
  2. It transposes the micro-tile in registers and writes k vectors into a shared tile already in
     the output's layout (block_ch rows of block_tokens elements), swizzled as in transpose.py:
     vector chunk q of shared row `row` lives at chunk q ^ ((row / k) % (128 / vec_bytes)), so the
     stores of step 2 and the loads of step 3 are both conflict-free. swizzle=False: the plain layout.
  3. After the barrier each thread reads out_vec consecutive tokens of one channel row, the
     num_per_tokens / out_vec neighbouring lanes that hold one scale block fold their maxima with
     warp shuffles (a block's lanes are aligned within a warp), compute the scale, and each lane
     stores its out_vec FP8 bytes (8 or 16 bytes per lane, whole lines per block row); the block's
     first lane stores the scale.
The grid is 1-D over tiles; consecutive blocks take neighbouring channel tiles of the same tokens.
Tails: tiles wholly inside x take the unchecked path; the last token tile (token_blocks not a
multiple of block_tokens / num_per_tokens) and the last channel tile (hidden % block_ch != 0) check
whole scale blocks and whole vectors (hidden is a multiple of 16). Step 3's shuffles run on every
lane, inside the tensor or not (their lanes read in-tile shared memory); only the stores are checked.
"""

import itertools

from tkjit.registry import register
from tkjit.spec import KernelSpec, TensorArg
from tkjit_kernels.quant._per_channel import (
    COMMON,
    SCALES,
    Prologue,
    check_hidden,
    elem_bytes,
    reference_blocks,
    scale_blocks,
)

SMEM_LIMIT = 48 * 1024  # the default (static) shared memory cap per block
MAX_TILES_PER_THREAD = 8  # micro-tiles each thread moves (unrolled), as in transpose.py

SPACE = {
    "block_tokens": (32, 64, 128, 256),  # x rows per tile (the output's contiguous axis)
    "block_ch": (32, 64, 128, 256),  # x columns (channels) per tile
    "threads": (128, 256),
    "vec_bytes": (8, 16),  # load and shared vector width of steps 1-2
    "out_vec": (8, 16),  # tokens per thread in step 3: FP8 bytes per store
    "swizzle": (True, False),
}


def _k(shape, c):
    return c["vec_bytes"] // elem_bytes(shape)  # micro-tile side


def constraint(shape, c):
    npt, eb = shape["num_per_tokens"], elem_bytes(shape)
    bt, bc, nt, ko = c["block_tokens"], c["block_ch"], c["threads"], c["out_vec"]
    k = _k(shape, c)
    if k < 2:
        return f"vec_bytes {c['vec_bytes']} holds fewer than two {shape['in_dtype']} elements"
    if bt % npt:
        return f"block_tokens={bt} must hold whole scale blocks of num_per_tokens={npt}"
    if ko % k:
        return f"out_vec={ko} must be a multiple of the micro-tile side {k}"
    if bc % k:
        return f"block_ch={bc} must be a multiple of the micro-tile side {k}"
    tiles = (bt // k) * (bc // k)
    if tiles % nt:
        return f"{tiles} micro-tiles of {k}x{k} do not divide over {nt} threads"
    if tiles // nt > MAX_TILES_PER_THREAD:
        return f"{tiles // nt} micro-tiles per thread (> {MAX_TILES_PER_THREAD}): use a smaller tile or more threads"
    if (bc * bt // ko) % nt:
        return f"{bc * bt // ko} output vectors do not divide over {nt} threads"
    if bt * bc * eb > SMEM_LIMIT:
        return f"tile of {bt * bc * eb} bytes exceeds {SMEM_LIMIT} bytes of shared memory"
    if c["swizzle"] and (bt // k) % (128 // c["vec_bytes"]):
        return f"the swizzle needs block_tokens * {eb} bytes to be a multiple of 128 ({bt // k} chunks per row)"
    if bc >= 2 * shape["hidden"] and bc > SPACE["block_ch"][0]:
        return f"block_ch={bc} leaves more than half the tile empty at hidden={shape['hidden']}"
    return None


def _valid(shape):
    keys = list(SPACE)
    combos = (dict(zip(keys, vals)) for vals in itertools.product(*SPACE.values()))
    return [c for c in combos if constraint(shape, c) is None]


def check_shape(shape):
    return check_hidden(shape, _valid)


def default(shape):
    """transpose.py's default tile: ~32 KB (128 x 128 bf16, 64 tokens x 128 channels for float32 but at
    least a scale block), 16-byte vectors, swizzled, 256 threads; 16-byte FP8 stores (16 tokens per
    lane: a 128-token scale block is 8 lanes, a 32-token one 2)."""
    eb, npt, h = elem_bytes(shape), shape["num_per_tokens"], shape["hidden"]
    bt = max(npt, 256 // eb)
    bc = 128
    while bc >= 2 * h and bc > 32:
        bc //= 2
    for b_t in (bt, bt * 2, 32, 64, 128, 256):
        for b_c in (bc, 64, 32, 128, 256):
            for nt in (256, 128):
                for sw in (True, False):
                    cfg = {
                        "block_tokens": b_t,
                        "block_ch": b_c,
                        "threads": nt,
                        "vec_bytes": 16,
                        "out_vec": 16,
                        "swizzle": sw,
                    }
                    if b_t in SPACE["block_tokens"] and b_c in SPACE["block_ch"] and not constraint(shape, cfg):
                        return cfg
    return min(_valid(shape), key=lambda c: (-c["vec_bytes"], -c["out_vec"], -c["block_tokens"] * c["block_ch"]))


def build(shape, c, prologue: Prologue | None = None):
    """prologue: values made from x by a fused producer (`_per_channel.Prologue`), not loaded."""
    from tilelang import language as T

    H, npt, in_dtype = shape["hidden"], shape["num_per_tokens"], shape["in_dtype"]
    bt, bc, nt, ko, swizzle = c["block_tokens"], c["block_ch"], c["threads"], c["out_vec"], c["swizzle"]
    k = _k(shape, c)
    groups = 128 // c["vec_bytes"]  # vector slots in one pass over the 32 banks
    bpt = bt // npt  # scale blocks per tile
    per_thread_in = (bt // k) * (bc // k) // nt  # micro-tiles per thread
    chunks_out = bt // ko  # step-3 vectors per shared row
    per_thread_out = bc * chunks_out // nt
    lanes = npt // ko  # lanes sharing one scale block in step 3
    log_lanes = lanes.bit_length() - 1
    ch_tiles = -(-H // bc)
    ch_tail = H % bc != 0
    token_blocks = T.dynamic("token_blocks")
    f32, fp8 = T.float32, T.float8_e4m3fn
    scale_and_inv, quantise = scale_blocks(shape["round_scale"])

    def swz(q, row):
        return q ^ ((row // k) % groups) if swizzle else q

    x_cols = H if prologue is None else prologue.x_cols(H)
    if prologue is None:

        @T.macro
        def load_tile(tmp, x, blk, c0, mi, mj):
            # Micro-tile rows mi*k .. mi*k + k - 1 of the tile: k | num_per_tokens, so all in scale block blk.
            for rr in T.unroll(k):
                for v in T.vectorized(k):
                    tmp[rr, v] = x[blk, (mi * k) % npt + rr, c0 + mj * k + v]

    else:
        make = prologue.loader(k)

        @T.macro
        def load_tile(tmp, x, blk, c0, mi, mj):
            row = T.alloc_local((k,), in_dtype)
            for rr in T.unroll(k):
                make(row, 0, x, blk, (mi * k) % npt + rr, c0 + mj * k)
                for v in T.unroll(k):
                    tmp[rr, v] = row[v]

    @T.prim_func
    def per_channel_cast_and_transpose(
        x: T.Tensor[(token_blocks, npt, x_cols), in_dtype],
        out: T.Tensor[(H, token_blocks, npt), fp8],
        scales: T.Tensor[(token_blocks, H), f32],
    ):
        with T.Kernel(T.ceildiv(token_blocks, bpt) * ch_tiles, threads=nt) as bid:
            tx = T.get_thread_binding()
            s = T.alloc_shared((bc, bt), in_dtype)
            tmp = T.alloc_local((k, k), in_dtype)
            tmpt = T.alloc_local((k, k), in_dtype)
            xs = T.alloc_local((ko,), in_dtype)
            amax = T.alloc_local((1,), f32)
            sf = T.alloc_local((1,), f32)
            inv = T.alloc_local((1,), f32)
            b0 = (bid // ch_tiles) * bpt  # first scale block of the tile
            c0 = (bid % ch_tiles) * bc
            # 1-2: micro-tiles of x -> registers -> transposed into the shared tile.
            for it in T.unroll(per_thread_in):
                m = it * nt + tx
                mi = m // (bc // k)  # token micro-row
                mj = m % (bc // k)  # channel micro-column
                blk = T.cast(b0 + (mi * k) // npt, "int64")  # int64: offsets pass 2^31 for large x
                if ch_tail:
                    if blk < token_blocks and c0 + mj * k < H:
                        load_tile(tmp, x, blk, c0, mi, mj)
                elif bpt > 1:
                    if blk < token_blocks:
                        load_tile(tmp, x, blk, c0, mi, mj)
                else:  # one scale block per tile: every tile lies inside x's tokens
                    load_tile(tmp, x, blk, c0, mi, mj)
                for v in T.unroll(k):
                    for w in T.unroll(k):
                        tmpt[v, w] = tmp[w, v]
                for v in T.unroll(k):
                    for w in T.vectorized(k):
                        s[mj * k + v, swz(mi, mj * k + v) * k + w] = tmpt[v, w]
            T.sync_threads()
            # 3: a channel row's scale block -> max |x| across its lanes -> scale, FP8 values.
            for it in T.unroll(per_thread_out):
                m = it * nt + tx
                q = m % chunks_out
                row = m // chunks_out
                for cc in T.unroll(ko // k):
                    for w in T.vectorized(k):
                        xs[cc * k + w] = s[row, swz(q * (ko // k) + cc, row) * k + w]
                amax[0] = T.float32(0)
                for e in T.unroll(ko):
                    amax[0] = T.max(amax[0], T.abs(T.cast(xs[e], f32)))
                for step in T.unroll(log_lanes):
                    amax[0] = T.max(amax[0], T.shfl_xor(amax[0], 1 << step))
                scale_and_inv(amax, sf, inv, 0)
                blk = T.cast(b0 + (q * ko) // npt, "int64")
                ch = T.cast(c0 + row, "int64")  # int64: ch * num_tokens passes 2^31 for large x
                if blk < token_blocks and c0 + row < H:
                    if q % lanes == 0:
                        scales[blk, ch] = sf[0]
                    for w in T.vectorized(ko):
                        out[ch, blk, (q * ko) % npt + w] = quantise(xs[w], inv[0])

    return per_channel_cast_and_transpose


def reference(shape, x):
    q, sf = reference_blocks(shape, x)
    nb, npt, h = q.shape
    return q.reshape(nb * npt, h).T.contiguous().view(h, nb, npt), sf


SPEC = register(
    KernelSpec(
        name="per_channel_cast_and_transpose",
        doc="per-channel FP8 e4m3 cast with transposed values (hidden, num_tokens), one float32 scale per "
        "channel and num_per_tokens tokens",
        space=SPACE,
        default=default,
        constraint=constraint,
        check_shape=check_shape,
        build=build,
        outputs=(TensorArg("out", "float8_e4m3fn", ("hidden", "token_blocks", "num_per_tokens")), SCALES),
        reference=reference,
        **COMMON,
    )
)
