"""per_token_cast_e5m6: x (num_tokens, hidden) bf16/f32 -> 12-bit e5m6 values + one float32 scale per token.

TileKernels' `per_token_cast(x, 'e5m6', num_per_channels)` (`per_token_cast_to_e5m6`; num_per_channels must
be hidden there, so one scale per token) and its torch reference `cast_to_e5m6`, bit-exact for finite inputs:
    amax  = max(|x|) over the token, clamped to >= 1e-4
    scale = amax / 65024                        (IEEE division; the dequantisation factor, stored)
    round_scale: scale = 2^ceil(log2(scale)), inv = 2^-ceil(log2(scale)) (0 past the float32 range)
    else:        inv = 65024 / amax
    out   = e5m6(x * inv), packed eight values to three 32-bit words (`_e5m6`: rounding and layout)
hidden is a multiple of 8 (eight values fill three words); a row of out is hidden * 3 / 8 int32 words, which
the ops hand out as TileKernels' uint8 (num_tokens, hidden * 3 / 2) view.

Two specs share this file and one builder, as per_token_cast's do (same reason: the scale tensor's axis
order): per_token_cast_e5m6 stores the scales (num_tokens, 1); per_token_cast_e5m6_colmajor stores them
column-major and TMA-aligned, (1, align(num_tokens, 4)) with the padding written 0.0, whose
storage[:, :num_tokens].T view TileKernels' `use_tma_aligned_col_major_sf` returns (packed UE8M0 is
`tkjit.scales.pack_ue8m0` of it, as for per_token_cast).

x may be a row-strided view (rows starting on a chunk's bytes, `x_align`); out and scales are contiguous.
A token is owned by `group_threads` consecutive threads; thread t loads chunks i * group_threads + t of `vec`
consecutive channels (vec / 8 words of output each), so a warp's loads and stores are contiguous spans.
hidden / vec need not be a multiple of group_threads: the chunk slots every thread fills are loaded and
stored unguarded, the last one only where the chunk lies in the row (a missing one counts as zeros in the
amax). The amax is a register max, a shuffle butterfly, and for tokens wider than a warp a shared-memory
step, as in per_token_cast; x is read once and kept in registers until it is cast. The encoding is integer
work on the float32 bits (`_e5m6.truncate_tl`, `round_tl`), which also runs where float16 conversions round otherwise.
"""

import itertools

import torch

from tkjit.scales import TMA_ALIGN, tma_aligned
from tkjit.spec import Runtime, Static, TensorArg, Tolerance, cuda_only, plain_threads, stride_name
from tkjit_kernels.quant import _e5m6
from tkjit_kernels.quant._group_amax import group_amax_macro
from tkjit_kernels.quant._layouts import register_scale_layouts
from tkjit_kernels.quant._scale import token_scale_store_macro
from tkjit_kernels.quant.per_token_cast import MAX_ELEMS_PER_THREAD

SPACE = {
    "vec": (8, 16, 32),  # channels per chunk: vec / 8 groups of eight values, 3 * vec / 8 output words
    "group_threads": (1, 2, 4, 8, 16, 32, 64, 128, 256, 512),  # threads sharing one token
    "threads": (128, 256, 512),
    "iters": (1, 4),  # tokens each thread group handles in turn
}
MAX_CHUNK_BYTES = 64  # a chunk's x: at most four 16-byte loads
ELEMS_TARGET = 32  # the default's x elements per thread: enough loads in flight, few registers


def _elem_bytes(shape):
    return 2 if shape["in_dtype"] == "bfloat16" else 4


def _chunks(shape, c):
    return shape["hidden"] // c["vec"]


def constraint(shape, c):
    h, vec, tpg, threads = shape["hidden"], c["vec"], c["group_threads"], c["threads"]
    if vec * _elem_bytes(shape) > MAX_CHUNK_BYTES:
        return f"a chunk is at most {MAX_CHUNK_BYTES} bytes of x (four 16-byte loads)"
    if h % vec:
        return f"hidden={h} is not a multiple of vec={vec}"
    chunks = h // vec
    if tpg > chunks:
        return f"group_threads={tpg} is more than the {chunks} chunks of a token"
    if -(-chunks // tpg) * vec > MAX_ELEMS_PER_THREAD:
        return f"{-(-chunks // tpg) * vec} elements per thread would spill (max {MAX_ELEMS_PER_THREAD})"
    if tpg > threads:
        return "a token cannot span more than one block"
    return None


def _valid(shape):
    keys = list(SPACE)
    combos = (dict(zip(keys, vals)) for vals in itertools.product(*SPACE.values()))
    return [c for c in combos if constraint(shape, c) is None]


def check_shape(shape):
    h = shape["hidden"]
    if h % 8:
        return f"hidden={h} must be a multiple of 8 (eight e5m6 values fill three 32-bit words)"
    return None


def default(shape):
    # 8-channel chunks: a warp's loads one contiguous span (16 bytes a thread from bf16) and its three 4-byte
    # stores a thread together another (384 bytes a warp); TileKernels' layout. 16-channel chunks (two 16-byte loads
    # at a 32-byte stride between lanes, three 8-byte stores at a 24-byte one) ran 0.76-0.88x TileKernels' time
    # on an H100 (session 28). About ELEMS_TARGET elements per thread: the fewest threads per token (a power of
    # two) that keep it.
    h = shape["hidden"]
    vec = 8
    chunks = h // vec
    need = -(-h // ELEMS_TARGET)
    tpg = min(1 << max(0, need - 1).bit_length(), 512)
    while tpg > chunks:
        tpg //= 2
    cfg = {"vec": vec, "group_threads": tpg, "threads": max(256, tpg), "iters": 1}
    if constraint(shape, cfg) is None:
        return cfg
    return min(_valid(shape), key=lambda c: (-(-_chunks(shape, c) // c["group_threads"]) * c["vec"], -c["vec"]))


def x_align(shape, c):
    """Bytes of one 16-byte load (or of the whole chunk when smaller): where every row of x must start."""
    return min(16, c["vec"] * _elem_bytes(shape))


arch_constraint = cuda_only("needs warp shuffles")


pass_configs = plain_threads


def build(shape, c, col_major):
    from tilelang import language as T

    H, in_dtype, round_scale = shape["hidden"], shape["in_dtype"], shape["round_scale"]
    vec, tpg, threads, iters = c["vec"], c["group_threads"], c["threads"], c["iters"]
    C = H // vec  # chunks per token
    cpt = -(-C // tpg)  # chunk slots per thread
    whole = C // tpg  # slots every thread of a token fills: loaded and stored unguarded
    per_thread = cpt * vec
    wv = vec // 8  # words per third of a chunk: a chunk's 3 * wv words are stored as three wv-word vectors
    CW = 3 * wv
    OW = H * 3 // 8  # output words per token
    slots = threads // tpg  # tokens a block works on at once
    rpb = slots * iters  # tokens per block
    wpg = max(1, tpg // 32)  # warps per token
    group_amax = group_amax_macro(T, per_thread=per_thread, tpg=tpg)
    num_tokens = T.dynamic("num_tokens")
    f32, u32 = T.float32, T.uint32
    sf_shape = (1, T.ceildiv(num_tokens, TMA_ALIGN) * TMA_ALIGN) if col_major else (num_tokens, 1)
    store_scale = token_scale_store_macro(T, col_major=col_major, groups=None, tma_align=TMA_ALIGN,
                                          padded_tokens=sf_shape[1])
    x_stride = T.dynamic(stride_name("x", 0))
    xa = x_align(shape, c) // _elem_bytes(shape)  # elements per aligned load

    @T.macro
    def encode_store(out, xs, bits, codes, words, inv, row, i, t):
        # Slot i of thread t: vec values -> 3 * wv words, stored as three wv-word vectors.
        for j in T.unroll(wv):
            for k in T.unroll(8):
                bits[k] = T.reinterpret(T.cast(xs[i * vec + j * 8 + k], f32) * inv[0], u32)
            for k in T.unroll(8):
                codes[k] = _e5m6.truncate_tl(T, bits[k])
                codes[k] = _e5m6.round_tl(T, codes[k], bits[k])
            words[j * 3] = _e5m6.pack_tl(T, codes, 0)
            words[j * 3 + 1] = _e5m6.pack_tl(T, codes, 1)
            words[j * 3 + 2] = _e5m6.pack_tl(T, codes, 2)
        for p in T.unroll(3):
            for v in T.vectorized(wv):
                out[row, (i * tpg + t) * CW + p * wv + v] = words[p * wv + v]

    @T.prim_func
    def per_token_cast_e5m6(
        x: T.StridedTensor((num_tokens, H), (x_stride, 1), in_dtype),
        out: T.Tensor[(num_tokens, OW), T.int32],
        scales: T.Tensor[sf_shape, f32],
    ):
        # Rows start load-aligned (the launcher checks it, see x_align): the stride written as a multiple of
        # the load, so the index analysis proves the loads aligned and emits vector loads.
        x = T.view(x, strides=((x_stride // xa) * xa, 1))
        with T.Kernel(T.ceildiv(num_tokens, rpb), threads=threads) as bx:
            tx = T.get_thread_binding()
            xs = T.alloc_local((per_thread,), in_dtype)
            bits = T.alloc_local((8,), u32)
            codes = T.alloc_local((8,), u32)
            words = T.alloc_local((CW,), "int32")
            amax = T.alloc_local((1,), f32)
            sf = T.alloc_local((1,), f32)
            inv = T.alloc_local((1,), f32)
            eb = T.alloc_local((1,), u32)
            if wpg > 1:
                red = T.alloc_shared((threads // 32,), f32)
            t = tx % tpg
            for it in T.serial(iters):
                r = T.cast(bx, "int64") * rpb + it * slots + tx // tpg
                row = T.min(r, T.cast(num_tokens, "int64") - 1)  # tail threads redo the last token, store nothing
                for i in T.unroll(whole):
                    for v in T.vectorized(vec):
                        xs[i * vec + v] = x[row, (i * tpg + t) * vec + v]
                if cpt > whole:
                    # The last slot: only where the chunk lies in the row; a missing chunk counts as zeros.
                    for i in T.unroll(whole, cpt):
                        if i * tpg + t < C:
                            for v in T.vectorized(vec):
                                xs[i * vec + v] = x[row, (i * tpg + t) * vec + v]
                        else:
                            for v in T.vectorized(vec):
                                xs[i * vec + v] = T.cast(0, in_dtype)
                group_amax(xs, amax, red if wpg > 1 else None, tx)
                amax[0] = T.max(amax[0], T.float32(_e5m6.AMAX_MIN))
                sf[0] = T.ieee_fdiv(amax[0], T.float32(_e5m6.E5M6_MAX))
                if round_scale:
                    # The biased exponent of 2^ceil(log2(sf)) (sf > 0 and normal: amax >= 1e-4); its inverse
                    # is exact, 0 where 2^-ceil would leave the normal range (TileKernels' reference clamps so).
                    eb[0] = ((T.reinterpret(sf[0], u32) - u32(1)) >> u32(23)) + u32(1)
                    sf[0] = T.reinterpret(eb[0] << u32(23), f32)
                    inv[0] = T.reinterpret(
                        T.if_then_else(eb[0] < u32(254), (u32(254) - eb[0]) << u32(23), u32(0)), f32
                    )
                else:
                    inv[0] = T.ieee_fdiv(T.float32(_e5m6.E5M6_MAX), amax[0])
                if r < num_tokens:
                    for i in T.unroll(whole):
                        encode_store(out, xs, bits, codes, words, inv, row, i, t)
                    if cpt > whole:
                        for i in T.unroll(whole, cpt):
                            if i * tpg + t < C:
                                encode_store(out, xs, bits, codes, words, inv, row, i, t)
                    if t == 0:
                        store_scale(scales, sf, row, row, num_tokens)

    return per_token_cast_e5m6


def make_inputs(shape, device="cpu", seed=0):
    """Rows of many magnitudes, some under the amax clamp, one all zero, and TileKernels' special rows
    (`tile_kernels.testing.generate_e5m6_inputs`: the smallest subnormal, the largest subnormal and the
    smallest normal e5m6 value, with a last channel of 65024, so they land on the scale 1 exactly)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n, h = shape["num_tokens"], shape["hidden"]
    x = torch.randn(n, h, generator=g, dtype=torch.float32)
    x = x * torch.exp(2 * torch.randn(n, 1, generator=g))
    x[3::17] *= 1e-7
    if n > 5:
        x[5] = 0
    for row, value in zip((7, 9, 11), (_e5m6.SUBNORMAL_MIN, _e5m6.SUBNORMAL_MAX, _e5m6.NORMAL_MIN)):
        if n > row:
            x[row] = value
            x[row, -1] = _e5m6.E5M6_MAX
    return (x.to(getattr(torch, shape["in_dtype"])).to(device),)


def scales_of(shape, x):
    """(scale (n, 1), inv (n, 1)) float32 for x (n, hidden), TileKernels' formulas."""
    amax = x.float().abs().amax(-1, keepdim=True).clamp(min=_e5m6.AMAX_MIN)
    top = torch.full_like(amax, _e5m6.E5M6_MAX)
    sf = amax / top
    if shape["round_scale"]:
        eb = ((sf.view(torch.int32) - 1) >> 23) + 1  # biased exponent of 2^ceil(log2(sf))
        return (eb << 23).view(torch.float32), ((254 - eb).clamp(min=0) << 23).view(torch.float32)
    return sf, top / amax


def reference(shape, x):
    sf, inv = scales_of(shape, x)
    return _e5m6.pack(_e5m6.encode(x.float() * inv)), sf


def reference_colmajor(shape, x):
    """Same words; the scales as their (1, align(num_tokens, 4)) storage, padding 0.0."""
    words, sf = reference(shape, x)
    n = sf.shape[0]
    storage = torch.zeros(1, tma_aligned(n), dtype=torch.float32, device=sf.device)
    storage[:, :n] = sf.T
    return words, storage


def _bytes_moved(s, col_major=False):
    n, h = s["num_tokens"], s["hidden"]
    sf_rows = tma_aligned(n) if col_major else n
    return n * h * _elem_bytes(s) + n * h * 3 // 2 + sf_rows * 4


PARAMS = (
    Runtime("num_tokens", hi=1 << 24, doc="tokens; runtime size, tuned per power-of-two bucket"),
    Static("hidden", lo=8, hi=65536, default=7168, doc="channels per token, a multiple of 8"),
    Static("in_dtype", type=str, values=("bfloat16", "float32"), default="bfloat16"),
    Static("round_scale", type=bool, default=False, doc="round scales up to powers of two (UE8M0)"),
)
EXAMPLES = (
    {"num_tokens": 4096, "hidden": 7168},
    {"num_tokens": 32768, "hidden": 7168},
    {"num_tokens": 4096, "hidden": 4096, "round_scale": True},
    {"num_tokens": 4001, "hidden": 576, "in_dtype": "float32"},
)
COMMON = dict(
    family="quant",
    params=PARAMS,
    space=SPACE,
    default=default,
    constraint=constraint,
    arch_constraint=arch_constraint,
    check_shape=check_shape,
    pass_configs=pass_configs,
    inputs=(TensorArg("x", lambda s: s["in_dtype"], ("num_tokens", "hidden"), strided=True, align=x_align),),
    make_inputs=make_inputs,
    tolerance=Tolerance(exact=True),
)
_OUT = TensorArg("out", "int32", ("num_tokens", lambda s: s["hidden"] * 3 // 8))

SPEC, SPEC_COLMAJOR = register_scale_layouts(
    "per_token_cast_e5m6",
    "per-token cast to 12-bit e5m6 (three int32 words per eight values), float32 scales amax / 65024",
    out=_OUT, groups=1, build=build, reference=reference,
    reference_colmajor=reference_colmajor, bytes_moved=_bytes_moved, examples=EXAMPLES, **COMMON,
)
