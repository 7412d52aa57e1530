"""per_channel_cast_fused: per_channel_cast of rows gathered through a routing map, from bf16/f32 x or from FP8
values dequantised on the fly.

    row(t)  = x[pos_to_token[t]]            (has_pos; a position outside [0, num_tokens) gives a zero row)
              x[t]                          (no map: num_tokens_out == num_tokens)
    value   = float32(row(t)[c])            (bf16 / f32 x)
              float32(x[p, c]) * x_sf[p, c // 128]   (FP8 x with per-token scales, one per 128 channels;
                                             a zero row has value 0 * 0)
then per_channel_cast's maths (`_per_channel.py`) on the values, per channel and block of num_per_tokens
output rows: out (num_tokens_out, hidden) float8_e4m3fn, scales (ceil(num_tokens_out / num_per_tokens),
hidden) float32, row-major. The last block may be partial (TileKernels asks for num_tokens_out a multiple of
16 with a map, of 128 without): its scales are the maxima over its rows only.
Semantics: TileKernels' `quant.per_channel_cast_fused` and its torch reference (`torch/per_channel_cast_fused.py`,
which gathers, then runs `cast(x, 'e4m3', (num_per_tokens, 1), x_block_size=(1, 128))`); bit-exact for finite
inputs: the FP8 path multiplies value by scale (one rounding), then by the quantisation factor (a second), as
both of TileKernels' implementations do. TileKernels treats -1 (any negative) as a zero row and reads out of
bounds for positions >= num_tokens; tkjit gives those a zero row too (TKJIT_CHECK_INDICES=1 refuses them).

Why x is 2-D here where per_channel_cast sees (token_blocks, num_per_tokens, hidden): the gathered rows come
from anywhere in x, and the output's row count is a runtime size of its own (pos_to_token's length), not a
multiple of num_per_tokens; the scales' rows are `CeilDiv("num_tokens_out", "num_per_tokens")`.
Without a map, num_tokens_out must equal num_tokens (check_shape; the op passes it); the kernel still never
reads a row past num_tokens.

Layout, stage="regs": per_channel_cast's register tile (its docstring; the space, constraints and default are
shared in `_per_channel.py`): one thread block per block of num_per_tokens output rows x block_ch channels, a thread
holding `vec` channels of num_per_tokens / tok_threads rows. Each thread reads the map entry of each of its rows
(the ch_threads lanes of a row read the same word: one broadcast), loads the gathered row's vector (and, FP8,
the row's scale: a vector never straddles a 128-channel group) or zeros, then the same one-barrier reduction
and stores as per_channel_cast; rows past num_tokens_out are zeros in the maxima and are not stored.
stage="smem" (the default; TileKernels' layout, see the comment above SPACE): a thread's rows are consecutive and
each gathered vector passes through a shared tile (`_build_smem`).
"""

import torch

from tkjit.registry import register
from tkjit.spec import CeilDiv, KernelSpec, Runtime, Static, TensorArg, Tolerance
from tkjit_kernels.quant._per_channel import (
    FP8_IN,
    IN_BYTES,
    STAGED_SPACE,
    TOKENS_PER_SCALE,
    arch_constraint,
    block_fold,
    check_hidden,
    elem_bytes,
    min_blocks,
    pass_configs,
    reference_blocks,
    scale_blocks,
    smem_constraint,
    staged_default,
    tile_constraint,
    tile_of,
    valid_tiles,
)

SF_GROUP = 128  # channels per input scale (TileKernels' num_per_channels: 128 only)

# -- why the space has two ways of staging x (per_channel_cast.py's comment above its SPACE has the story) ------
# The register tile alone had per_channel_cast's one-block-an-SM problem here too (ptxas, sm_90a, TileKernels'
# benchmark shapes): its default {vec 8, ch_threads 32, threads 256} on bf16 holds `bfloat16_t xs[128]` and
# `int64_t src[16]` under `__launch_bounds__(256, 1)`: 162-168 registers, one block (8 warps) an SM; FP8 input
# {vec 16, ch_threads 32, threads 512}: 108-110 registers, one block (16 warps). So the space has stage="smem",
# TileKernels' own layout for this op (quant/per_channel_cast_fused_kernel.py: 128 rows x 128 channels of
# bf16, 256 of FP8, 256 threads, 32 along a row with 8-byte vectors, 16 consecutive rows a thread through a
# shared tile; the FP8 row scales stay in registers), the default where it fits.
# `gather` (stage="smem"): how a thread reads its tpt source rows. "branch" (the kernel as first written) loads
# each row inside `if src >= 0` (else zeros): every load sits in its own branch, so nvcc issues them one after
# another, and the op ran 0.55-0.66x TileKernels' time on an H100 where per_channel_cast, the same tile with its
# loads unconditional, ties it. "select" loads every row unconditionally from a row that is always in x (row 0
# for a zero row: a launch has num_tokens >= 1) and selects zeros after, so the tpt loads are independent
# straight-line code, all in flight at once.
SPACE = {**STAGED_SPACE, "gather": ("select", "branch")}


def _one(value: int) -> int:
    return 1  # x's rows add no tuning bucket: the work is num_tokens_out rows


PARAMS = (
    Runtime("num_tokens_out", hi=1 << 24, doc="output rows (pos_to_token's length); tuned per power-of-two bucket"),
    Runtime("num_tokens", hi=1 << 24, bucket=_one, doc="x's rows (= num_tokens_out without a map)"),
    Static("hidden", lo=16, hi=65536, default=7168, doc="channels; a multiple of 16 (of 128 with FP8 input)"),
    Static("num_per_tokens", values=TOKENS_PER_SCALE, default=128, doc="output rows per scale (TileKernels' block)"),
    Static("in_dtype", type=str, values=tuple(IN_BYTES), default="bfloat16",
           doc="x's dtype; float8_e4m3fn comes with its per-token scales x_sf"),
    Static("round_scale", type=bool, default=False, doc="round scales up to powers of two (UE8M0)"),
    Static("has_x_sf", type=bool, default=False, doc="x is FP8 with float32 scales x_sf (num_tokens, hidden / 128)"),
    Static("has_pos", type=bool, default=False, doc="rows gathered through pos_to_token (num_tokens_out,) int32"),
)


def constraint(shape, c):
    if c.get("stage", "regs") != "smem" and c.get("gather", "branch") != "branch":
        return "gather=select is the staged tile's (stage=smem); the register tile takes gather=branch"
    if c.get("stage", "regs") == "smem":
        # (a thread keeps one register a row beside its vector, the FP8 row's scale: at most 64 at 128 threads)
        return smem_constraint(shape, c)
    # Registers kept per token row beside its values: the gathered row index, the FP8 row's scale.
    return tile_constraint(shape, c, row_regs=2 * shape["has_pos"] + shape["has_x_sf"])


def _regs_constraint(shape, c):
    return constraint(shape, {**c, "stage": "regs"})


def _valid(shape):
    return valid_tiles(shape, constraint, SPACE)


def check_shape(shape):
    if shape["has_x_sf"] != (shape["in_dtype"] == FP8_IN):
        return f"in_dtype={shape['in_dtype']!r} with has_x_sf={shape['has_x_sf']}: FP8 input ({FP8_IN}) and its " \
               "scales x_sf come together"
    if shape["has_x_sf"] and shape["hidden"] % SF_GROUP:
        return f"hidden={shape['hidden']} must be a multiple of {SF_GROUP} with FP8 input (one scale per 128 channels)"
    problem = check_hidden(shape, _valid)
    if problem:
        return problem
    if not shape["has_pos"] and "num_tokens" in shape and "num_tokens_out" in shape:
        if shape["num_tokens"] != shape["num_tokens_out"]:
            return (f"num_tokens_out={shape['num_tokens_out']} must equal num_tokens={shape['num_tokens']} "
                    "without a map (has_pos=False)")
    return None


def default(shape):
    """TileKernels' block (`_per_channel.staged_default`): 8-byte vectors (4 channels of bf16, 8 of FP8), 32
    threads along a row, 256 threads, stage="smem"; the register tile's default where no staged tile fits."""
    cfg = staged_default(shape, constraint, _regs_constraint)
    return {**cfg, "gather": "select" if cfg["stage"] == "smem" else "branch"}


def build(shape, c):
    from tilelang import language as T

    if c.get("stage", "regs") == "smem":
        return _build_smem(shape, c)
    H, npt, in_dtype = shape["hidden"], shape["num_per_tokens"], shape["in_dtype"]
    has_sf, has_pos = shape["has_x_sf"], shape["has_pos"]
    vec, cht, threads = c["vec"], c["ch_threads"], c["threads"]
    tok_threads, tpt, block_ch, ch_tiles, ch_tail = tile_of(shape, c)
    num_tokens = T.dynamic("num_tokens")
    num_tokens_out = T.dynamic("num_tokens_out")
    f32, fp8 = T.float32, T.float8_e4m3fn
    scale_and_inv, quantise = scale_blocks(shape["round_scale"])

    def live(r, col):
        """Whether output row r (int64) of this thread's channels is inside out."""
        inside = r < T.cast(num_tokens_out, "int64")
        return inside & (col < H) if ch_tail else inside

    def value(xs, rs, j, v):
        """The float32 value of element (j, v) of the thread's tile: x, or FP8 x times its row's scale."""
        if has_sf:
            return T.cast(xs[j * vec + v], f32) * rs[j]
        return T.cast(xs[j * vec + v], f32)

    @T.macro
    def load(x, x_sf, pos_to_token, xs, rs, src, row0, col):
        for j in T.unroll(tpt):
            r = row0 + j * tok_threads
            src[j] = T.int64(-1)  # the x row read for this tile row; -1: a zero row
            if live(r, col):
                if has_pos:
                    src[j] = T.cast(pos_to_token[r], "int64")
                else:
                    src[j] = r
                if src[j] >= T.cast(num_tokens, "int64"):  # (negative map entries stay negative)
                    src[j] = T.int64(-1)
            if src[j] >= 0:
                for v in T.vectorized(vec):
                    xs[j * vec + v] = x[src[j], col + v]
                if has_sf:
                    rs[j] = x_sf[src[j], col // SF_GROUP]
            else:
                for v in T.vectorized(vec):
                    xs[j * vec + v] = T.cast(0, in_dtype)
                if has_sf:
                    rs[j] = T.float32(0)

    @T.macro
    def store(out, scales, xs, rs, sf, inv, b, row0, tr, col):
        if tr == 0:
            for v in T.vectorized(vec):
                scales[b, col + v] = sf[v]
        for j in T.unroll(tpt):
            r = row0 + j * tok_threads
            if r < T.cast(num_tokens_out, "int64"):
                for v in T.vectorized(vec):
                    out[r, col + v] = quantise(value(xs, rs, j, v), inv[v])

    def per_channel_cast_fused(
        x: T.Tensor[(num_tokens, H), in_dtype],
        x_sf: T.Tensor[(num_tokens, H // SF_GROUP), f32] = None,
        pos_to_token: T.Tensor[(num_tokens_out,), T.int32] = None,
        out: T.Tensor[(num_tokens_out, H), fp8] = None,
        scales: T.Tensor[(T.ceildiv(num_tokens_out, npt), H), f32] = None,
    ):
        with T.Kernel(T.ceildiv(num_tokens_out, npt) * ch_tiles, threads=threads) as bid:
            tx = T.get_thread_binding()
            xs = T.alloc_local((tpt * vec,), in_dtype)
            rs = T.alloc_local((tpt,), f32)
            src = T.alloc_local((tpt,), "int64")
            amax = T.alloc_local((vec,), f32)
            sf = T.alloc_local((vec,), f32)
            inv = T.alloc_local((vec,), f32)
            red = T.alloc_shared((tok_threads, block_ch), f32)
            b = T.cast(bid // ch_tiles, "int64")  # int64: row offsets pass 2^31 elements for large x
            tc = tx % cht
            tr = tx // cht
            row0 = b * npt + tr
            col = (bid % ch_tiles) * block_ch + tc * vec
            load(x, x_sf, pos_to_token, xs, rs, src, row0, col)
            for v in T.unroll(vec):
                amax[v] = T.float32(0)
            for j in T.unroll(tpt):
                for v in T.unroll(vec):
                    amax[v] = T.max(amax[v], T.abs(value(xs, rs, j, v)))
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
                    store(out, scales, xs, rs, sf, inv, b, row0, tr, col)
            else:
                store(out, scales, xs, rs, sf, inv, b, row0, tr, col)

    # The variant's parameters: an absent optional input is left out of the PrimFunc's signature.
    for name, present in (("x_sf", has_sf), ("pos_to_token", has_pos)):
        if not present:
            del per_channel_cast_fused.__annotations__[name]
    return T.prim_func(per_channel_cast_fused)


def _build_smem(shape, c):
    """stage="smem": TileKernels' layout. A thread's tpt output rows are consecutive (rows b * npt + tr * tpt ..);
    for each it resolves the source row (the map entry; -1 or past num_tokens: zeros), loads the vector (and, FP8,
    the row's scale, kept for the stores) into one register vector, writes it to the block's shared tile (only
    the thread itself reads it back) and folds it into the running max. The reduction, the scales, the values
    (FP8: value x row scale, then x the factor) and the tail checks are the register tile's."""
    from tilelang import language as T
    from tilelang.language.annotations import annotate_min_blocks_per_sm

    H, npt, in_dtype = shape["hidden"], shape["num_per_tokens"], shape["in_dtype"]
    has_sf, has_pos = shape["has_x_sf"], shape["has_pos"]
    vec, cht, threads = c["vec"], c["ch_threads"], c["threads"]
    tok_threads, tpt, block_ch, ch_tiles, ch_tail = tile_of(shape, c)
    num_tokens = T.dynamic("num_tokens")
    num_tokens_out = T.dynamic("num_tokens_out")
    f32, fp8 = T.float32, T.float8_e4m3fn
    scale_and_inv, quantise = scale_blocks(shape["round_scale"])
    fold = block_fold(vec, tok_threads, scale_and_inv, shape["round_scale"], c.get("factors", "thread"))

    def value(xv, rs, j, v):
        """The float32 value of element v of row j's vector: x, or FP8 x times its row's scale."""
        if has_sf:
            return T.cast(xv[v], f32) * rs[j]
        return T.cast(xv[v], f32)

    @T.macro
    def load_select(x, x_sf, pos_to_token, xv, rs, src, r0, j, col):
        # The x row read for output row r0 + j (the map entry read at a row clamped into the map), whether it is a
        # real one, and the row loaded either way: row 0 for a zero row (in x: num_tokens >= 1).
        if has_pos:
            p = T.cast(pos_to_token[T.min(r0 + j, T.cast(num_tokens_out, "int64") - 1)], "int64")
        else:
            p = r0 + j
        ok = (r0 + j < T.cast(num_tokens_out, "int64")) & (p >= 0) & (p < T.cast(num_tokens, "int64"))
        src[0] = T.if_then_else(ok, p, T.int64(0))
        for v in T.vectorized(vec):
            xv[v] = x[src[0], col + v]
        for v in T.unroll(vec):
            xv[v] = T.if_then_else(ok, xv[v], T.cast(0, in_dtype))
        if has_sf:
            rs[j] = T.if_then_else(ok, x_sf[src[0], col // SF_GROUP], T.float32(0))

    @T.macro
    def load_branch(x, x_sf, pos_to_token, xv, rs, src, r0, j, col):
        src[0] = T.int64(-1)  # the x row read for output row r0 + j; -1: a zero row
        if r0 + j < T.cast(num_tokens_out, "int64"):
            if has_pos:
                src[0] = T.cast(pos_to_token[r0 + j], "int64")
            else:
                src[0] = r0 + j
            if src[0] >= T.cast(num_tokens, "int64"):  # (negative map entries stay negative)
                src[0] = T.int64(-1)
        if src[0] >= 0:
            for v in T.vectorized(vec):
                xv[v] = x[src[0], col + v]
            if has_sf:
                rs[j] = x_sf[src[0], col // SF_GROUP]
        else:
            for v in T.vectorized(vec):
                xv[v] = T.cast(0, in_dtype)
            if has_sf:
                rs[j] = T.float32(0)

    load = load_select if c["gather"] == "select" else load_branch

    @T.macro
    def stage(x, x_sf, pos_to_token, tile, xv, rs, src, amax, r0, row0, cc, col):
        for j in T.unroll(tpt):
            load(x, x_sf, pos_to_token, xv, rs, src, r0, j, col)  # row r0 + j's vector (and FP8 scale) or zeros
            for v in T.vectorized(vec):
                tile[row0 + j, cc + v] = xv[v]
            for v in T.unroll(vec):
                amax[v] = T.max(amax[v], T.abs(value(xv, rs, j, v)))

    @T.macro
    def store(out, scales, tile, xv, rs, sf, inv, b, tr, r0, row0, cc, col):
        if tr == 0:
            for v in T.vectorized(vec):
                scales[b, col + v] = sf[v]
        for j in T.unroll(tpt):
            if r0 + j < T.cast(num_tokens_out, "int64"):
                for v in T.vectorized(vec):
                    xv[v] = tile[row0 + j, cc + v]
                for v in T.vectorized(vec):
                    out[r0 + j, col + v] = quantise(value(xv, rs, j, v), inv[v])

    def per_channel_cast_fused(
        x: T.Tensor[(num_tokens, H), in_dtype],
        x_sf: T.Tensor[(num_tokens, H // SF_GROUP), f32] = None,
        pos_to_token: T.Tensor[(num_tokens_out,), T.int32] = None,
        out: T.Tensor[(num_tokens_out, H), fp8] = None,
        scales: T.Tensor[(T.ceildiv(num_tokens_out, npt), H), f32] = None,
    ):
        with T.Kernel(T.ceildiv(num_tokens_out, npt) * ch_tiles, threads=threads) as bid:
            if min_blocks(c) > 1:  # the occupancy hint (_per_channel.STAGED_SPACE says why)
                annotate_min_blocks_per_sm(min_blocks(c))
            tx = T.get_thread_binding()
            tile = T.alloc_shared((npt, block_ch), in_dtype)
            red = T.alloc_shared((tok_threads, block_ch), f32)
            xv = T.alloc_local((vec,), in_dtype)
            rs = T.alloc_local((tpt,), f32)
            src = T.alloc_local((1,), "int64")
            amax = T.alloc_local((vec,), f32)
            sf = T.alloc_local((vec,), f32)
            inv = T.alloc_local((vec,), f32)
            b = T.cast(bid // ch_tiles, "int64")  # int64: row offsets pass 2^31 elements for large x
            tc = tx % cht
            tr = tx // cht
            row0 = tr * tpt
            r0 = b * npt + row0  # the thread's first output row
            cc = tc * vec
            col = (bid % ch_tiles) * block_ch + cc
            for v in T.unroll(vec):
                amax[v] = T.float32(0)
            if ch_tail:
                if col < H:  # a vector past hidden adds nothing to the maxima and is not stored
                    stage(x, x_sf, pos_to_token, tile, xv, rs, src, amax, r0, row0, cc, col)
            else:
                stage(x, x_sf, pos_to_token, tile, xv, rs, src, amax, r0, row0, cc, col)
            fold(red, amax, sf, inv, tr, cc)
            if ch_tail:
                if col < H:
                    store(out, scales, tile, xv, rs, sf, inv, b, tr, r0, row0, cc, col)
            else:
                store(out, scales, tile, xv, rs, sf, inv, b, tr, r0, row0, cc, col)

    # The variant's parameters: an absent optional input is left out of the PrimFunc's signature.
    for name, present in (("x_sf", has_sf), ("pos_to_token", has_pos)):
        if not present:
            del per_channel_cast_fused.__annotations__[name]
    return T.prim_func(per_channel_cast_fused)


def make_inputs(shape, device="cpu", seed=0):
    """x: bf16/f32 channels spanning many magnitudes, some under the amax clamp, one all zero, some rows scaled
    far up; or every finite FP8 byte with per-token scales of many magnitudes (powers of two and not).
    pos_to_token: rows of x in any order, repeated, about 1 in 8 entries -1; odd seeds add out-of-range entries
    (>= num_tokens, < -1), which give zero rows."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n, m, h = shape["num_tokens"], shape["num_tokens_out"], shape["hidden"]
    if shape["has_x_sf"]:
        b = torch.randint(0, 254, (n, h), generator=g, dtype=torch.int32)
        b = b + (b >= 0x7F).int()  # skip 0x7F (NaN); 0xFF is past the range
        x = b.to(torch.uint8).view(torch.float8_e4m3fn)
        s = torch.exp2(torch.randint(-16, 6, (n, h // SF_GROUP), generator=g).float())
        s[1::3] *= torch.rand(len(range(1, n, 3)), h // SF_GROUP, generator=g) + 0.5
        s[::11] *= 1e-9  # rows under the amax clamp
        inputs = [x, s]
    else:
        x = torch.randn(n, h, generator=g) * torch.exp(2 * torch.randn(1, h, generator=g))
        x[:, 3::17] *= 1e-7
        if h > 5:
            x[:, 5] = 0
        x[1::9] *= 64.0
        inputs = [x.to(getattr(torch, shape["in_dtype"]))]
    if shape["has_pos"]:
        pos = torch.randint(0, n, (m,), generator=g, dtype=torch.int32)
        pos[torch.rand(m, generator=g) < 0.125] = -1
        if seed % 2 == 1 and m:
            junk = torch.tensor([n, n + 7, 2**31 - 1, -2, -(2**31)], dtype=torch.int32)
            bad = torch.randperm(m, generator=g)[: max(1, m // 16)]
            pos[bad] = junk[torch.randint(0, junk.numel(), (bad.numel(),), generator=g)]
        inputs.append(pos)
    return tuple(t.to(device) for t in inputs)


def split_inputs(shape, args):
    """(x, x_sf, pos_to_token) from the variant's inputs, None for the absent ones."""
    args = list(args)
    x = args.pop(0)
    x_sf = args.pop(0) if shape["has_x_sf"] else None
    pos = args.pop(0) if shape["has_pos"] else None
    return x, x_sf, pos


def gathered(x, x_sf, pos_to_token):
    """The float32 rows the cast quantises: x (times its scale, one per row and 128 channels), gathered
    through pos_to_token (a position outside [0, num_tokens) gives +0.0)."""
    xf = x.float()
    if x_sf is not None:
        xf = xf * x_sf.float().repeat_interleave(SF_GROUP, 1)[:, : x.shape[1]]
    if pos_to_token is None:
        return xf
    n = x.shape[0]
    p = pos_to_token.long()
    ok = (p >= 0) & (p < n)
    if n == 0:
        return xf.new_zeros((p.shape[0], x.shape[1]))
    rows = xf[p.clamp(0, n - 1)]
    return torch.where(ok[:, None], rows, torch.zeros_like(rows))


def reference(shape, *inputs):
    """(out (num_tokens_out, hidden) fp8, scales (ceil(num_tokens_out / num_per_tokens), hidden) float32): the
    gathered rows padded with zero rows to whole blocks (zeros leave the maxima unchanged), per_channel_cast's
    reference on them, the padding dropped."""
    v = gathered(*split_inputs(shape, inputs))
    m, h = v.shape
    npt = shape["num_per_tokens"]
    nb = -(-m // npt)
    padded = v.new_zeros((nb * npt, h))
    padded[:m] = v
    q, sf = reference_blocks(shape, padded.view(nb, npt, h))
    return q.view(nb * npt, h)[:m], sf


def bytes_moved(s) -> int:
    """Each output row's source read once (values and, FP8, its scales), its map entry, the FP8 values and
    the scales written once."""
    m, h = s["num_tokens_out"], s["hidden"]
    per_row = h * (elem_bytes(s) + 1) + 4 * s["has_pos"] + 4 * (h // SF_GROUP) * s["has_x_sf"]
    return m * per_row + -(-m // s["num_per_tokens"]) * h * 4


EXAMPLES = (
    {"num_tokens": 4096, "num_tokens_out": 4096, "hidden": 7168},
    {"num_tokens": 8192, "num_tokens_out": 8192 * 8 + 256 * 16, "hidden": 7168, "has_pos": True},
    {"num_tokens": 8192, "num_tokens_out": 8192 * 8 + 256 * 16, "hidden": 7168, "in_dtype": FP8_IN,
     "has_x_sf": True, "has_pos": True, "round_scale": True},
    {"num_tokens": 4096, "num_tokens_out": 4096, "hidden": 4096, "in_dtype": FP8_IN, "has_x_sf": True},
    {"num_tokens": 1000, "num_tokens_out": 4000, "hidden": 2048, "in_dtype": "float32", "num_per_tokens": 32,
     "has_pos": True},
)

SPEC = register(
    KernelSpec(
        name="per_channel_cast_fused",
        family="quant",
        doc="per-channel FP8 e4m3 cast of rows gathered through pos_to_token, from bf16/f32 or FP8 + scales",
        params=PARAMS,
        space=SPACE,
        default=default,
        added={"gather": "branch"},  # configs tuned before the tunable: the loads they were built with
        constraint=constraint,
        arch_constraint=arch_constraint,
        check_shape=check_shape,
        pass_configs=pass_configs,
        build=build,
        inputs=(
            TensorArg("x", lambda s: s["in_dtype"], ("num_tokens", "hidden")),
            TensorArg("x_sf", "float32", ("num_tokens", lambda s: s["hidden"] // SF_GROUP), align=4,
                      optional="has_x_sf"),
            TensorArg("pos_to_token", "int32", ("num_tokens_out",), align=4, optional="has_pos"),
        ),
        outputs=(
            TensorArg("out", "float8_e4m3fn", ("num_tokens_out", "hidden")),
            TensorArg("scales", "float32", (CeilDiv("num_tokens_out", "num_per_tokens"), "hidden")),
        ),
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=bytes_moved,
        tolerance=Tolerance(exact=True),
        examples=EXAMPLES,
    )
)
