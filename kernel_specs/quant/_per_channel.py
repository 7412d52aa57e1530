"""What the per-channel FP8 casts share: shapes, tensors, reference, inputs, traffic, the scale maths,
and the register-tile space of per_channel_cast and per_channel_cast_fused.

per_channel_cast and per_channel_cast_and_transpose cast x (num_tokens, hidden) bf16/f32 to FP8 e4m3
with one float32 scale per channel and block of `num_per_tokens` consecutive tokens (TileKernels'
block (num_per_tokens, 1)):
    amax  = max(|x[t, c]|) over the block's tokens t, clamped to >= 1e-4
    scale = amax / 448                      (IEEE division; the dequantisation factor, stored)
    round_scale: scale = 2^ceil(log2(scale)) (UE8M0: exponent rounded up), inv = 1 / scale
    else:        inv = 448 / amax
    out   = fp8_e4m3(clamp(x * inv, -448, 448))   (round to nearest even; the kernels' conversion saturates to
                                               +-448 by itself, so they spend no clamp: the same values for
                                               finite and infinite products, and NaN stays NaN as in torch)
scales is (num_tokens / num_per_tokens, hidden) float32, row-major, as TileKernels returns it; the
values are (num_tokens, hidden) (per_channel_cast) or transposed, (hidden, num_tokens)
(per_channel_cast_and_transpose). Bit-exact with TileKernels' torch reference `cast(x, 'e4m3',
block_size=(num_per_tokens, 1))` for finite inputs (the same operations in the same order: a max,
two IEEE divisions or a power-of-two reciprocal, one multiply, a clamp, one rounding).

Why the kernels see x as (token_blocks, num_per_tokens, hidden): the scales' leading size is
num_tokens / num_per_tokens, and a tensor dim is a runtime size or a number from static params, never
a quotient of a runtime size. Making the runtime size the block count keeps every tensor fully checked
by the launcher: x and the values are 3-D views of the (num_tokens, hidden) / (hidden, num_tokens)
tensors ((hidden, num_tokens) contiguous is (hidden, token_blocks, num_per_tokens) contiguous), the
scales (token_blocks, hidden). num_tokens must therefore be a multiple of num_per_tokens (TileKernels
asks for a multiple of 128); `tkjit.ops` makes the views and refuses other token counts.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tkjit.spec import Runtime, Static, TensorArg, Tolerance, cuda_only
from tkjit_kernels.quant._scale import scale_macro, ue8m0_ceil, unrounded_scale

FP8_MAX = 448.0
AMAX_MIN = 1e-4
TOKENS_PER_SCALE = (32, 128)  # TileKernels' num_per_tokens (per_channel_cast_and_transpose takes both)
ELEM_BYTES = {"bfloat16": 2, "float32": 4}
FP8_IN = "float8_e4m3fn"  # per_channel_cast_fused's other input: FP8 values with per-token scales
IN_BYTES = {**ELEM_BYTES, FP8_IN: 1}
MAX_ELEMS_PER_THREAD = 128  # registers per thread for staged x

PARAMS = (
    # hi: the 1-D grids (blocks x channel tiles) stay under 2^31.
    Runtime("token_blocks", hi=1 << 18, doc="num_tokens / num_per_tokens; runtime, tuned per power-of-two bucket"),
    Static("hidden", lo=16, hi=65536, default=7168, doc="channels; a multiple of 16"),
    Static("num_per_tokens", values=TOKENS_PER_SCALE, default=128, doc="tokens per scale (TileKernels' block)"),
    Static("in_dtype", type=str, values=tuple(ELEM_BYTES), default="bfloat16"),
    Static("round_scale", type=bool, default=False, doc="round scales up to powers of two (UE8M0)"),
)


def elem_bytes(shape) -> int:
    return IN_BYTES[shape["in_dtype"]]


def num_tokens(shape) -> int:
    return shape["token_blocks"] * shape["num_per_tokens"]


def check_hidden(shape, valid) -> str | None:
    """check_shape of both specs: hidden a multiple of 16 (whole 16-byte vectors per row, whatever the
    config), and at least one config of the space (`valid(shape)`) builds."""
    if shape["hidden"] % 16:
        return f"hidden={shape['hidden']} must be a multiple of 16 (vector loads and stores)"
    if not valid(shape):
        return "no config of the space fits this shape"
    return None


arch_constraint = cuda_only("needs warp-level code and FP8 conversions")


def pass_configs(c):
    # Bounds are checked by hand (whole vectors on the tail tiles); TileLang's automatic per-element
    # guards would block vectorisation.
    return {"tl.disable_safe_memory_legalize": True, "tl.disable_warp_specialized": True}


X = TensorArg("x", lambda s: s["in_dtype"], ("token_blocks", "num_per_tokens", "hidden"))
SCALES = TensorArg("scales", "float32", ("token_blocks", "hidden"))


def make_inputs(shape, device="cpu", seed=0):
    """x (token_blocks, num_per_tokens, hidden): channels spanning many magnitudes, some under the
    amax clamp, one all zero; one token block scaled far up (a block's scale must not leak into the
    next block's)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    nb, npt, h = shape["token_blocks"], shape["num_per_tokens"], shape["hidden"]
    x = torch.randn(nb, npt, h, generator=g, dtype=torch.float32)
    x = x * torch.exp(2 * torch.randn(1, 1, h, generator=g))
    x[:, :, 3::17] *= 1e-7
    if h > 5:
        x[:, :, 5] = 0
    if nb > 1:
        x[1] *= 64.0
    return (x.to(getattr(torch, shape["in_dtype"])).to(device),)


def reference_blocks(shape, x):
    """(values (token_blocks, num_per_tokens, hidden) fp8, scales (token_blocks, hidden) float32)."""
    xf = x.float()
    amax = xf.abs().amax(1, keepdim=True).clamp(min=AMAX_MIN)
    full = torch.full_like(amax, FP8_MAX)
    sf = amax / full
    if shape["round_scale"]:
        sf = ue8m0_ceil(sf)
        inv = torch.ones_like(sf) / sf
    else:
        inv = full / amax
    q = (xf * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, sf.squeeze(1)


def bytes_moved(s) -> int:
    """x read once, the FP8 values written once, the scales written once."""
    n, h = num_tokens(s), s["hidden"]
    return n * h * (elem_bytes(s) + 1) + s["token_blocks"] * h * 4


EXAMPLES = (
    {"token_blocks": 32, "hidden": 7168},  # 4096 tokens, 128 per scale
    {"token_blocks": 256, "hidden": 7168},  # 32768 tokens
    {"token_blocks": 128, "hidden": 4096, "num_per_tokens": 32, "round_scale": True},
    {"token_blocks": 63, "hidden": 2048, "in_dtype": "float32"},
)

COMMON = dict(
    family="quant",
    params=PARAMS,
    arch_constraint=arch_constraint,
    pass_configs=pass_configs,
    inputs=(X,),
    make_inputs=make_inputs,
    bytes_moved=bytes_moved,
    tolerance=Tolerance(exact=True),
    examples=EXAMPLES,
)


def scale_blocks(round_scale: bool):
    """TileLang pieces over local float32 buffers:

    scale_and_inv(amax, sf, inv, e)  amax[e] (the block's max |x|) -> clamped; sf[e] the stored scale,
                                     inv[e] the factor the values are multiplied by (IEEE divisions)
    quantise(v, inv_e)               the FP8 value of v (any float type) times inv_e, saturated to +-448
    """
    from tilelang import language as T

    f32 = T.float32
    group_scale = scale_macro(T, max_value=FP8_MAX, round_scale=round_scale)

    @T.macro
    def scale_and_inv(amax, sf, inv, e):
        amax[e] = T.max(amax[e], f32(AMAX_MIN))
        group_scale(amax, sf, inv, e)

    def quantise(v, inv_e):
        # No clamp to +-448 first: the e4m3 conversion (cvt.rn.satfinite) saturates by itself, two instructions an
        # element fewer, which the SwiGLU casts (compute-bound) feel.
        return T.cast(T.cast(v, f32) * inv_e, T.float8_e4m3fn)

    return scale_and_inv, quantise


# -- the register tile of per_channel_cast and per_channel_cast_fused ---------------------------------------
# One thread block per token block x block_ch channels; a thread holds `vec` channels of num_per_tokens /
# (threads / ch_threads) token rows in registers (per_channel_cast.py draws it).

TILE_SPACE = {
    "vec": (4, 8, 16),  # channels per thread (one or two 16-byte loads)
    "ch_threads": (4, 8, 16, 32, 64),  # threads along the channels of a tile
    "threads": (128, 256, 512),
}


class Tile(NamedTuple):
    """A config's block of the per-channel casts: threads // ch_threads threads along the tokens, each with
    num_per_tokens / that many rows; vec * ch_threads channels a block, ceil(hidden / that) tiles a row, the
    last one past hidden (its vectors checked) when it does not divide."""

    tok_threads: int
    tpt: int
    block_ch: int
    ch_tiles: int
    ch_tail: bool


def tile_of(shape, c) -> Tile:
    tok_threads = c["threads"] // c["ch_threads"]
    block_ch = c["vec"] * c["ch_threads"]
    h = shape["hidden"]
    return Tile(tok_threads, shape["num_per_tokens"] // tok_threads, block_ch, -(-h // block_ch), h % block_ch != 0)


def block_fold(vec: int, tok_threads: int, scale_and_inv: Callable, round_scale: bool, factors: str = "thread"):
    """The reduction every per-channel cast block ends with: each thread's partial maxima of its vec channels
    (from channel cc of the tile) to shared memory, one barrier, then every thread folds the tok_threads partial
    maxima of its own channels. Then the factors (`factors`, a tunable of the staged layout):
      "thread"  every thread makes its own channels' factors (no second barrier, no broadcast); the scales too
                where they are the factors' source (round_scale), else only in the threads that store them
                (tr == 0);
      "shared"  only the tr == 0 threads make scales and factors, and pass the factors to the others through
                shared memory (a second barrier): TileKernels' way. Each factor is an IEEE division, which the
                SwiGLU casts (one division an element already, compute-bound) feel: "thread" spends vec more a
                thread (36 against 32 at 8 rows x 4 channels).
      "channel" one thread a channel (thread t: channels t, t + threads, ...) folds its channel's partial maxima,
                makes its scale and factor and passes both through shared memory (a second barrier): the other
                threads fold nothing. Every thread of "thread" folds tok_threads x vec maxima and divides vec times,
                which at 16 rows x 4 channels is 64 shared-memory maxima and 4-8 divisions a thread, against 32
                elements' SwiGLU: TileKernels' SwiGLU cast folds this way. With it, per_channel_cast's bf16 staged
                tile also keeps its running maxima on packed pairs, as TileKernels does (per_channel_cast.py)."""
    from tilelang import language as T

    scale_of, inv_of = unrounded_scale(T, max_value=FP8_MAX)

    @T.macro
    def gather(red, amax, tr, cc):
        for v in T.vectorized(vec):
            red[tr, cc + v] = amax[v]
        T.sync_threads()
        for r in T.unroll(tok_threads):
            for v in T.unroll(vec):
                amax[v] = T.max(amax[v], red[r, cc + v])

    if factors == "shared":

        @T.macro
        def fold(red, amax, sf, inv, tr, cc):
            fac = T.alloc_shared((red.shape[1],), T.float32)  # the block's factors, one a channel
            gather(red, amax, tr, cc)
            if tr == 0:
                for v in T.unroll(vec):
                    scale_and_inv(amax, sf, inv, v)
                for v in T.vectorized(vec):
                    fac[cc + v] = inv[v]
            T.sync_threads()
            for v in T.vectorized(vec):
                inv[v] = fac[cc + v]

        return fold

    if factors == "channel":

        @T.macro
        def fold(red, amax, sf, inv, tr, cc):
            block_ch = red.shape[1]
            threads = tok_threads * (block_ch // vec)
            fac = T.alloc_shared((2, block_ch), T.float32)  # each channel's scale, then its factor
            m = T.alloc_local((1,), T.float32)
            s = T.alloc_local((1,), T.float32)
            f = T.alloc_local((1,), T.float32)
            for v in T.vectorized(vec):
                red[tr, cc + v] = amax[v]
            T.sync_threads()
            t = tr * (block_ch // vec) + cc // vec  # the thread's index
            for i in T.serial(-(-block_ch // threads)):
                ch = i * threads + t
                if ch < block_ch:
                    m[0] = red[0, ch]
                    for r in T.unroll(1, tok_threads):
                        m[0] = T.max(m[0], red[r, ch])
                    scale_and_inv(m, s, f, 0)
                    fac[0, ch] = s[0]
                    fac[1, ch] = f[0]
            T.sync_threads()
            for v in T.vectorized(vec):
                inv[v] = fac[1, cc + v]
            if tr == 0:
                for v in T.vectorized(vec):
                    sf[v] = fac[0, cc + v]

        return fold

    @T.macro
    def fold(red, amax, sf, inv, tr, cc):
        gather(red, amax, tr, cc)
        if round_scale:  # the factor is 1 / the rounded scale: every thread needs both
            for v in T.unroll(vec):
                scale_and_inv(amax, sf, inv, v)
        else:  # the factor is 448 / amax; only the threads that store the scales (tr == 0) divide for them
            for v in T.unroll(vec):
                amax[v] = T.max(amax[v], T.float32(AMAX_MIN))
                inv[v] = inv_of(amax[v])
            if tr == 0:
                for v in T.unroll(vec):
                    sf[v] = scale_of(amax[v])

    return fold


def block_problem(shape, c) -> str | None:
    """What both stages refuse: vectors over 32 bytes, more channel threads than threads, token rows a block's
    threads do not divide."""
    npt, cht, threads = shape["num_per_tokens"], c["ch_threads"], c["threads"]
    if c["vec"] * elem_bytes(shape) > 32:
        return "a thread's vector is at most 32 bytes (two 16-byte loads)"
    if cht > threads:
        return "ch_threads cannot exceed threads"
    if npt % (threads // cht):
        return f"threads/ch_threads={threads // cht} token rows do not divide num_per_tokens={npt}"
    return None


def tile_constraint(shape, c, row_regs: int = 0) -> str | None:
    """Why config c cannot hold its tile in registers, else None. row_regs: registers the kernel keeps per
    token row beside the values (per_channel_cast_fused: the gathered row index, the row's input scale)."""
    why = block_problem(shape, c) or occupancy_problem(c, 0)
    if why:
        return why
    npt, h = shape["num_per_tokens"], shape["hidden"]
    vec, cht, threads = c["vec"], c["ch_threads"], c["threads"]
    tok_threads = threads // cht
    tpt = npt // tok_threads
    elems = tpt * vec
    if elems > MAX_ELEMS_PER_THREAD:
        return f"{elems} elements per thread would spill (max {MAX_ELEMS_PER_THREAD})"
    # Registers: the staged x, amax/sf/inv per channel, ~24 for addresses; an SM has 64K for the block.
    regs = elems * elem_bytes(shape) // 4 + 3 * vec + 24 + row_regs * tpt
    if regs > min(255, 65536 // threads):
        return f"~{regs} registers per thread would spill at {threads} threads"
    if vec * cht >= 2 * h and cht > TILE_SPACE["ch_threads"][0]:
        return f"a tile of {vec * cht} channels leaves more than half its threads idle at hidden={h} (fewer ch_threads)"
    return None


def valid_tiles(shape, constraint, space: dict | None = None) -> list[dict]:
    space = TILE_SPACE if space is None else space
    keys = list(space)
    combos = (dict(zip(keys, vals)) for vals in itertools.product(*space.values()))
    return [c for c in combos if constraint(shape, c) is None]


def tile_default(shape, constraint) -> dict:
    """16-byte loads, a warp along 32 vectors of one token row (512 contiguous bytes of bf16), 256
    threads: 8 token rows, so a thread holds num_per_tokens / 8 vectors (16 loads in flight at 128
    tokens per scale, ~100 registers, two blocks per SM); 512 threads where 256 would hold too much
    (FP8 input: 16 channels a vector). Narrow hidden: fewer threads along channels."""
    vec = 16 // elem_bytes(shape)
    cht = 32
    while vec * cht >= 2 * shape["hidden"] and cht > 4:
        cht //= 2
    for threads in (256, 512, 128):
        cfg = {"vec": vec, "ch_threads": cht, "threads": threads}
        if constraint(shape, cfg) is None:
            return cfg
    return min(valid_tiles(shape, constraint),
               key=lambda c: (c["vec"] != vec, -c["vec"] * c["ch_threads"], c["threads"]))


# -- the shared-memory staged tile (stage="smem") of per_channel_cast and per_channel_cast_fused ----------------
# TileKernels' layout (per_channel_cast.py says why it is the default): the register tile's block, threads and
# reduction, but a thread's token rows are consecutive and each vector passes through a shared tile (in_dtype,
# num_per_tokens x block_ch) instead of staying in registers, so a thread holds one vector and many blocks fit
# an SM. The builders are the specs' own (per_channel_cast's _build_smem; per_channel_cast_fused's gathers).

STAGES = ("regs", "smem")
# min_threads_per_sm (stage="smem" only): 0 leaves TileLang's __launch_bounds__(threads, 1), under which ptxas
# lets the unrolled loads of a thread's rows take 56-68 registers (4-7 blocks an SM); a value puts
# __launch_bounds__(threads, value / threads) on the kernel, so ptxas fits that many blocks (e.g. 8 x 256 threads:
# 32 registers, no spills at vec 4, 16 channel threads), the occupancy TileKernels' SwiGLU + cast kernel runs at
# (33 registers). Whether the extra warps beat the loads in flight they cost is the tuner's to measure.
# factors (stage="smem" only): where each channel's factor is made, `block_fold` says.
STAGED_SPACE = {**TILE_SPACE, "stage": STAGES, "min_threads_per_sm": (0, 1024, 1536, 2048),
                "factors": ("thread", "shared", "channel")}
FACTOR_ROWS = {"thread": 0, "shared": 1, "channel": 2}  # float32 rows of a block's channels the factors pass through
SMEM_MAX = 96 * 1024  # shared bytes a block: two blocks an SM at least
SM_SMEM = 228 * 1024  # shared bytes an SM (sm_90): the blocks the hint asks for must fit, 1 KiB each reserved
BANK_BYTES = 128  # a shared-memory wavefront: 32 banks x 4 bytes


def min_blocks(c) -> int:
    """Blocks an SM the config's occupancy hint asks ptxas to fit (1: no hint)."""
    return max(1, c.get("min_threads_per_sm", 0) // c["threads"])


def occupancy_problem(c, shared: int) -> str | None:
    """Why config c's options of the staged layout (the occupancy hint min_threads_per_sm, shared factors) do not
    apply to it, else None. shared: the block's shared bytes (0 for the register tile)."""
    if c.get("factors", "thread") != "thread" and c.get("stage", "regs") != "smem":
        return f"factors={c['factors']!r} is for stage='smem' (the register tile makes every factor in its threads)"
    want = c.get("min_threads_per_sm", 0)
    if not want:
        return None
    if c.get("stage", "regs") != "smem":
        return "min_threads_per_sm is for stage='smem' (the register tile needs its registers)"
    if want % c["threads"] or want // c["threads"] < 2:
        return f"min_threads_per_sm={want} must be a multiple of threads={c['threads']}, at least two blocks"
    if min_blocks(c) * (shared + 1024) > SM_SMEM:
        return f"{min_blocks(c)} blocks of {shared} bytes of shared memory do not fit an SM ({SM_SMEM})"
    return None


def smem_constraint(shape, c) -> str | None:
    """Why config c cannot run stage="smem", else None."""
    why = block_problem(shape, c)
    if why:
        return why
    npt, h, eb = shape["num_per_tokens"], shape["hidden"], elem_bytes(shape)
    vec, cht, threads = c["vec"], c["ch_threads"], c["threads"]
    tok_threads = threads // cht
    # A warp's lanes along one row must fill whole 128-byte wavefronts (16-byte accesses are served a quarter
    # warp at a time, narrower ones half a warp): lanes of different rows would hit the same banks.
    if min(cht, 32) * min(vec * eb, 16) < BANK_BYTES:
        return f"{cht} threads x {vec * eb} bytes along a row leave shared-memory bank conflicts (< 128 bytes)"
    shared = (npt * eb + tok_threads * 4 + FACTOR_ROWS[c.get("factors", "thread")] * 4) * vec * cht
    if shared > SMEM_MAX:
        return f"{shared} bytes of shared memory a block (max {SMEM_MAX})"
    if vec * cht >= 2 * h and cht > TILE_SPACE["ch_threads"][0]:
        return f"a tile of {vec * cht} channels leaves more than half its threads idle at hidden={h} (fewer ch_threads)"
    return occupancy_problem(c, shared)


def staged_default(shape, constraint, regs_constraint) -> dict:
    """TileKernels' block: 8-byte vectors (4 channels of bf16, 8 of FP8; 16 bytes of float32: the space's
    narrowest vector), 32 threads along a row, 256 threads; narrow hidden: fewer threads along the channels;
    where no staged tile fits (very narrow hidden), the register tile's default (regs_constraint: its
    constraint)."""
    vec = max(TILE_SPACE["vec"][0], 8 // elem_bytes(shape))
    cht = 32
    while vec * cht >= 2 * shape["hidden"] and cht > 4:
        cht //= 2
    for threads in (256, 512, 128):
        cfg = {"vec": vec, "ch_threads": cht, "threads": threads, "stage": "smem", "min_threads_per_sm": 0,
               "factors": "thread"}
        if constraint(shape, cfg) is None:
            return cfg
    return {**tile_default(shape, regs_constraint), "stage": "regs", "min_threads_per_sm": 0, "factors": "thread"}


# -- a producer fused before the cast ---------------------------------------------------------------------
# swiglu_forward_and_per_channel_cast(_and_transpose) cast values computed from a wider x (SwiGLU of its two
# halves). The builders of per_channel_cast and per_channel_cast_and_transpose take one as `prologue`: x then
# has x_cols(hidden) columns and each vector of `n` channels is made by prologue.loader(n) instead of loaded.


@dataclass(frozen=True)
class Prologue:
    """x_cols(hidden): x's columns. loader(n): a TileLang macro load(dst, off, x, b, row, col) that writes the
    in_dtype values of channels col .. col + n - 1 of x's row (b, row) to dst[off .. off + n - 1]."""

    x_cols: Callable[[int], int]
    loader: Callable[[int], Any]
