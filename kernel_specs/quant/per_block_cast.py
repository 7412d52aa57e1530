"""per_block_cast: x (num_tokens, hidden) bf16/f32 -> FP8 e4m3 (or FP4 e2m1) values + one float32 scale per
(block_m x block_k) tile of x.

For every tile of block_m tokens and block_k channels (the last row and column of tiles may be partial):
    amax  = max(|x|) over the tile's real elements, clamped to >= 1e-4
    scale = amax / 448                      (IEEE division; the dequantisation factor, stored)
    round_scale: scale = 2^ceil(log2(scale)) (UE8M0: exponent rounded up), inv = 1 / scale
    else:        inv = 448 / amax
    out   = fp8_e4m3(clamp(x * inv, -448, 448))   (round to nearest even)
Scales are (ceil(num_tokens / block_m), ceil(hidden / block_k)). Semantics follow TileKernels'
`per_block_cast` (e4m3) and its torch reference `cast(x, 'e4m3', (block_m, block_k))`: a partial tile's
amax is over its real elements only (the reference masks the padding out). The kernels are bit-exact
against the references below for finite inputs (inf/NaN inputs are not supported: the clamp turns a NaN
product into 448 where torch keeps NaN).

fmt='e2m1' (a static param; TileKernels' `per_block_cast(x, 'e2m1', ...)` and `cast(x, 'e2m1', block)`): the same
tiles and scale layouts, with e2m1's constants and encoding (`_e2m1`):
    amax  clamped to >= 6 * 2^-126 (TileKernels' e2m1 clamp: the smallest scale 2^-126)
    scale = amax / 6, round_scale as above, inv = 6 / amax (or 1 / scale)
    out   = e2m1(x * inv)                   (nearest, ties to even, saturating at 6, the sign kept: no clamp)
stored as TileKernels stores FP4: int8 (num_tokens, hidden / 2), channel 2j in the low nibble of byte j. The
kernel's store scales a chunk's vec values, encodes them with integer work on their float32 bits
(`_e2m1.chunk_codes_macro`, as per_token_cast_e2m1) and writes vec / 2 bytes, one vector store.

Three specs share this file and one builder:
  per_block_cast           scales (ceil(T / block_m), ceil(hidden / block_k)) float32, row-major.
  per_block_cast_colmajor  the scales stored column-major and TMA-aligned, the layout DeepGEMM reads
                           (TileKernels' `use_tma_aligned_col_major_sf`): storage (num_blocks_k, M4),
                           M4 = align(ceil(T / block_m), 4); scale (i, j) lives at j * M4 + i. Padding
                           entries are written 0.0 (deterministic, compared bit-exact; TileKernels leaves
                           them unwritten). Callers want storage[:, :ceil(T / block_m)].T, which is what
                           `tkjit.ops.per_block_cast(..., col_major_scales=True)` returns, as TileKernels
                           does; packed UE8M0 scales are `tkjit.scales.pack_ue8m0` of this storage.
  per_block_cast_with_sf   the cast with given scales (TileKernels' `per_block_cast_with_precomputed_sf`):
                           x and float32 sf (ceil(T / block_m), ceil(hidden / block_k)), row-major, any row
                           stride -> out = fp8_e4m3(clamp(x * (1 / sf), -448, 448)) (e2m1: e2m1(x * (1 / sf))).
Why three specs: the column-major layout puts the runtime axis of the scales second, which a TensorArg's
fixed dims tuple cannot switch on a static param (as for per_token_cast_colmajor); the given-scales cast
takes another input and has one output. A scales-only variant is not a spec: the compat layer drops the
values of per_block_cast (one more byte per element written than TileKernels' sf_only kernel).

The scale rows are `CeilDiv("num_tokens", "block_m")`: ceil(num_tokens / block_m), the launcher's check
and allocation use it, and the builder declares the same expression (T.ceildiv), so TileLang's own
shape check agrees.

Tiling: one CTA per tile of block_m rows x tile_k columns (tile_k a multiple of block_k: tile_k / block_k
scale blocks side by side). Thread t loads chunk t % cpr (cpr = tile_k / vec chunks per row) of rows
t // cpr + i * rpp (rpp = threads / cpr rows per pass), so neighbouring threads read neighbouring chunks
of one row and every thread's elements lie in one scale block. The block max is a register max, a warp
butterfly over the lane bits that stay inside the block (the chunk-in-block bits and the row bits), and,
when several warps share a block, one shared-memory step. x is read once and kept in registers until it
is cast. Partial tiles: a row past num_tokens loads the last row instead (the same tile's block, so the
max is unchanged) and stores nothing; a chunk past hidden (only when tile_k does not divide hidden) loads
the row's last chunk (hidden and the block starts are multiples of 16, so it is in the same block when
that block is real) and stores nothing. The clamps and guards are a min and a compare per chunk, left in
(one code path) rather than specialised away where tile_k divides hidden.
"""

import itertools

import torch

from tkjit.registry import register
from tkjit.scales import TMA_ALIGN, tma_aligned
from tkjit.spec import CeilDiv, KernelSpec, Runtime, Static, TensorArg, Tolerance, cuda_only, plain_threads, stride_name
from tkjit_kernels.quant import _e2m1
from tkjit_kernels.quant._scale import scale_macro, ue8m0_ceil

BLOCKS_M = (1, 32, 64, 128)  # TileKernels' per_block_cast takes 32 and 128; 1 and 64 come free
BLOCKS_K = (16, 32, 64, 128)  # TileKernels' per_block_cast takes 32 and 128; 16 serves precomputed-scale groups of 16
FP8_MAX = 448.0
AMAX_MIN = 1e-4
MAX_ELEMS_PER_THREAD = 128  # registers per thread for the staged x
FORMATS = ("e4m3", "e2m1")  # FP8, or FP4 stored two codes per int8 byte (TileKernels' e2m1 storage)
OUT_DTYPES = {"e4m3": "float8_e4m3fn", "e2m1": "int8"}
SPACE = {
    "vec": (4, 8, 16),  # elements per chunk (one or two 16-byte loads)
    "tile_k": (32, 64, 128, 256, 512, 1024, 2048),  # columns per CTA: a multiple of block_k
    "threads": (128, 256, 512),
}


def _elem_bytes(shape):
    return 2 if shape["in_dtype"] == "bfloat16" else 4


def is_fp4(shape) -> bool:
    """Whether the values are e2m1 (a shape without fmt, as some callers of the references give, is e4m3)."""
    return shape.get("fmt", "e4m3") == "e2m1"


def out_width(shape) -> int:
    """The values' row length: hidden elements, or hidden / 2 bytes of packed e2m1 pairs."""
    return shape["hidden"] // 2 if is_fp4(shape) else shape["hidden"]


def format_limits(shape) -> tuple[float, float]:
    """(the value a block's amax maps to, the amax's lower clamp) of the output format."""
    return (_e2m1.E2M1_MAX, _e2m1.AMAX_MIN) if is_fp4(shape) else (FP8_MAX, AMAX_MIN)


def num_blocks_k(shape) -> int:
    """Scale columns: ceil(hidden / block_k); the last block is partial when block_k does not divide hidden."""
    return -(-shape["hidden"] // shape["block_k"])


def _layout(shape, c):
    """(chunks per tile row, rows per pass, rows per thread) of a config."""
    cpr = c["tile_k"] // c["vec"]
    rpp = max(1, c["threads"] // cpr)
    return cpr, rpp, shape["block_m"] // rpp


def default(shape):
    bm, bk, eb = shape["block_m"], shape["block_k"], _elem_bytes(shape)
    vec = 16 // eb  # one 16-byte load per chunk
    threads = 128 if bm == 1 else 256
    # About four chunks per thread (64 bytes in flight each) covers DRAM latency: a tile of
    # 4 * threads chunks, block_m rows high (TileKernels: 8192 bf16 elements per CTA of 256 threads).
    width = max(bk, (4 * threads * vec) // bm)
    width = min(width, threads * vec)  # at least one row per pass
    cfg = {"vec": vec, "tile_k": width, "threads": threads}
    if width <= max(bk, shape["hidden"]) and constraint(shape, cfg) is None:
        return cfg
    # A narrow hidden: the valid config with the fewest idle columns, then about four chunks per thread.
    return min(_valid(shape), key=lambda c: (_idle(shape, c), abs(_layout(shape, c)[2] - 4), -c["vec"], -c["threads"]))


def _idle(shape, c):
    """Columns of the last tile past hidden (loaded, not stored)."""
    return -shape["hidden"] % c["tile_k"]


def _valid(shape):
    keys = list(SPACE)
    combos = (dict(zip(keys, vals)) for vals in itertools.product(*SPACE.values()))
    return [c for c in combos if constraint(shape, c) is None]


def check_shape(shape):
    h = shape["hidden"]
    if h % 16:
        return f"hidden={h} must be a multiple of 16 (16-byte vector loads and stores)"
    if not _valid(shape):
        return f"no config of the space tiles hidden={h} with blocks ({shape['block_m']}, {shape['block_k']})"
    return None


def constraint(shape, c):
    bm, bk = shape["block_m"], shape["block_k"]
    vec, width, threads = c["vec"], c["tile_k"], c["threads"]
    if vec * _elem_bytes(shape) > 32:
        return "a chunk is at most 32 bytes (two 16-byte loads)"
    if width % bk:
        return f"tile_k={width} is not a multiple of block_k={bk}"
    if bk // vec > 32:
        return f"a block row of {bk // vec} chunks spans more than a warp (use a wider vec)"
    cpr = width // vec
    if cpr > threads:
        return f"tile_k / vec = {cpr} chunks per row exceed threads={threads}"
    rpp = threads // cpr
    if rpp > bm:
        return f"threads / (tile_k / vec) = {rpp} rows per pass exceed block_m={bm}"
    if (bm // rpp) * vec > MAX_ELEMS_PER_THREAD:
        return f"{(bm // rpp) * vec} elements per thread would spill (max {MAX_ELEMS_PER_THREAD})"
    if is_fp4(shape) and vec % 2:
        return f"vec={vec}: an e2m1 chunk must fill whole bytes (two codes each)"
    return None


def x_align(shape, c):
    """Bytes of one chunk (`vec` elements, one or two 16-byte vectors): where x must start."""
    return c["vec"] * _elem_bytes(shape)


arch_constraint = cuda_only("needs warp shuffles and FP8 conversions")


def build(shape, c):
    return _build(shape, c, "row")


def build_colmajor(shape, c):
    return _build(shape, c, "col")


def build_with_sf(shape, c):
    return _build(shape, c, "given")


def _build(shape, c, layout):
    from tilelang import language as T

    H, BM, BK = shape["hidden"], shape["block_m"], shape["block_k"]
    in_dtype, round_scale = shape["in_dtype"], shape.get("round_scale", False)
    fp4 = is_fp4(shape)
    vec, W, threads = c["vec"], c["tile_k"], c["threads"]
    cpr, rpp, rpt = _layout(shape, c)
    cb = BK // vec  # chunks per block row
    nbw = W // BK  # scale blocks side by side in a tile
    NBK = num_blocks_k(shape)
    NTK = -(-H // W)  # tiles per row of blocks
    HC = H // vec  # chunks per row of x
    # Lanes sharing a block: the chunk-in-block bits [0, LOG_CB) and, when a warp spans several rows, the
    # row bits [LOG_CPR, 5).
    LOG_CB, LOG_CPR = cb.bit_length() - 1, min(cpr.bit_length() - 1, 5)
    span = max(cpr, 32)  # threads per warp-row group: a warp, or the warps of one row
    nw = threads // span  # warps sharing one block (one per row pass when a row spans warps)
    per_thread = rpt * vec
    num_tokens = T.dynamic("num_tokens")
    f32, fp8, u32 = T.float32, T.float8_e4m3fn, T.uint32
    hv = vec // 2  # e2m1: bytes of a chunk's output
    out_shape, out_dtype = ((num_tokens, H // 2), T.int8) if fp4 else ((num_tokens, H), fp8)
    nbm = T.ceildiv(num_tokens, BM)  # the TensorArgs' CeilDiv("num_tokens", "block_m"): same expression
    if layout == "col":
        sf_shape = (NBK, T.ceildiv(nbm, TMA_ALIGN) * TMA_ALIGN)
    else:
        sf_shape = (nbm, NBK)
    group_scale = scale_macro(T, max_value=format_limits(shape)[0], round_scale=round_scale)
    encode_chunk = _e2m1.chunk_codes_macro(T, vec=vec) if fp4 else None

    @T.macro
    def body(x, out, scales):
        with T.Kernel(nbm * NTK, threads=threads) as bx:
            tx = T.get_thread_binding()
            xs = T.alloc_local((per_thread,), in_dtype)
            amax = T.alloc_local((1,), f32)
            sf = T.alloc_local((1,), f32)
            inv = T.alloc_local((1,), f32)
            if layout != "given" and nw > 1:
                red = T.alloc_shared((nw * nbw,), f32)
            if fp4:
                bits = T.alloc_local((vec,), u32)
                ob = T.alloc_local((hv,), T.int8)
            rb = bx // NTK  # block row
            tk = bx % NTK  # tile of the row
            cc = tx % cpr
            j = cc // cb  # block of the tile
            chunk = tk * cpr + cc  # chunk of the row; past hidden (HC chunks) only when tile_k does not divide it
            lchunk = T.min(chunk, HC - 1)  # a chunk past hidden loads the row's last one
            row0 = T.cast(rb, "int64") * BM + tx // cpr
            last = T.cast(num_tokens, "int64") - 1
            for i in T.unroll(rpt):
                row = T.min(row0 + i * rpp, last)  # a row past num_tokens loads the last (same block)
                for v in T.vectorized(vec):
                    xs[i * vec + v] = x[row, lchunk * vec + v]
            jb = tk * nbw + j  # block column
            if layout == "given":
                inv[0] = T.ieee_fdiv(T.float32(1.0), scales[rb, T.min(jb, NBK - 1)])
            else:
                amax[0] = T.float32(0)
                for e in T.unroll(per_thread):
                    amax[0] = T.max(amax[0], T.abs(T.cast(xs[e], f32)))
                for b in T.unroll(LOG_CB):
                    amax[0] = T.max(amax[0], T.shfl_xor(amax[0], 1 << b))
                for b in T.unroll(LOG_CPR, 5):
                    amax[0] = T.max(amax[0], T.shfl_xor(amax[0], 1 << b))
                if nw > 1:
                    if cc % cb == 0 and tx % 32 < cpr:  # one lane per (warp, block)
                        red[(tx // span) * nbw + j] = amax[0]
                    T.sync_threads()
                    for w in T.unroll(nw):
                        amax[0] = T.max(amax[0], red[w * nbw + j])
                if fp4:  # the clamp as its bits: 6 * 2^-126 exactly, whatever decimal a literal would print
                    amax[0] = T.max(amax[0], T.reinterpret(u32(_e2m1.AMAX_MIN_BITS), f32))
                else:
                    amax[0] = T.max(amax[0], T.float32(AMAX_MIN))
                group_scale(amax, sf, inv, 0)
                if tx < cpr and cc % cb == 0 and chunk < HC:  # the block's first chunk, in a real block
                    if layout == "col":
                        scales[jb, rb] = sf[0]
                        if rb == nbm - 1:  # the last block row zeroes its column's padding
                            for q in T.unroll(1, TMA_ALIGN):
                                if rb + q < sf_shape[1]:
                                    scales[jb, rb + q] = T.float32(0)
                    else:
                        scales[rb, jb] = sf[0]
            for i in T.unroll(rpt):
                row = row0 + i * rpp
                if row <= last and chunk < HC:
                    if fp4:  # no clamp: the encoding saturates at 6
                        encode_chunk(xs, i, inv, bits, ob)
                        for v in T.vectorized(hv):
                            out[row, chunk * hv + v] = ob[v]
                    else:
                        for v in T.vectorized(vec):
                            out[row, chunk * vec + v] = T.cast(
                                T.max(T.min(T.cast(xs[i * vec + v], f32) * inv[0], T.float32(FP8_MAX)),
                                      T.float32(-FP8_MAX)),
                                fp8,
                            )

    if layout == "given":
        sf_stride = T.dynamic(stride_name("sf", 0))  # sf may be a row-strided view (TileKernels takes one)

        @T.prim_func
        def per_block_cast_with_sf(
            x: T.Tensor[(num_tokens, H), in_dtype],
            sf: T.StridedTensor(sf_shape, (sf_stride, 1), f32),
            out: T.Tensor[out_shape, out_dtype],
        ):
            body(x, out, sf)

        return per_block_cast_with_sf

    @T.prim_func
    def per_block_cast(
        x: T.Tensor[(num_tokens, H), in_dtype],
        out: T.Tensor[out_shape, out_dtype],
        scales: T.Tensor[sf_shape, f32],
    ):
        body(x, out, scales)

    return per_block_cast


# -- references ------------------------------------------------------------------------------------
def _tiles(shape, x):
    """x as float32 (num_blocks_m, block_m, num_blocks_k, block_k), zero-padded: |0| never raises a max of
    |x| >= 0, so a partial tile's amax is over its real elements (TileKernels' reference masks them)."""
    n, h, bm, bk = x.shape[0], shape["hidden"], shape["block_m"], shape["block_k"]
    nbm, nbk = -(-n // bm), num_blocks_k(shape)
    xf = torch.nn.functional.pad(x.float(), (0, nbk * bk - h, 0, nbm * bm - n))
    return xf.view(nbm, bm, nbk, bk)


def _cast(shape, x, inv):
    """fp8(clamp(x * inv)) with inv (num_blocks_m, 1, num_blocks_k, 1), cropped back to x's shape; for e2m1 the
    codes of x * inv, packed two per byte (int8 (num_tokens, hidden / 2))."""
    n, h = x.shape
    y = _tiles(shape, x) * inv
    if is_fp4(shape):
        return _e2m1.pack(_e2m1.encode(y).view(y.shape[0] * y.shape[1], -1)[:n, :h])
    q = y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(q.shape[0] * q.shape[1], -1)[:n, :h].contiguous()


def scales_and_inverses(shape, x):
    """(scales (num_blocks_m, 1, num_blocks_k, 1), their inverses), as TileKernels' reference computes them."""
    top, floor = format_limits(shape)
    amax = _tiles(shape, x).abs().amax(dim=(1, 3), keepdim=True).clamp(min=floor)
    full = torch.full_like(amax, top)
    sf = amax / full
    if shape["round_scale"]:
        sf = ue8m0_ceil(sf)
        return sf, torch.ones_like(sf) / sf
    return sf, full / amax


def reference(shape, x):
    sf, inv = scales_and_inverses(shape, x)
    return _cast(shape, x, inv), sf[:, 0, :, 0].contiguous()


def reference_colmajor(shape, x):
    """Same values as `reference`; scales as (num_blocks_k, align(num_blocks_m, 4)), padding 0.0."""
    q, sf = reference(shape, x)
    nbm, nbk = sf.shape
    storage = torch.zeros(nbk, tma_aligned(nbm), dtype=torch.float32)
    storage[:, :nbm] = sf.T
    return q, storage


def reference_with_sf(shape, x, sf):
    """TileKernels' reference with given scales: x * sf.reciprocal(), clamped and cast (e2m1: encoded, saturating)."""
    return _cast(shape, x, sf.cpu().float().reciprocal()[:, None, :, None])


def make_inputs(shape, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    n, h = shape["num_tokens"], shape["hidden"]
    x = torch.randn(n, h, generator=g, dtype=torch.float32)
    # Rows and columns spanning many magnitudes, some blocks under the amax clamp, one all-zero row.
    x = x * torch.exp(2 * torch.randn(n, 1, generator=g)) * torch.exp(torch.randn(1, h, generator=g))
    x[3::17] *= 1e-7
    x[:, 5::23] *= 1e-7
    if n > 5:
        x[5] = 0
    if n > 40:
        x[32:40, :32] = 1e-6 * torch.randn(8, min(h, 32), generator=g)  # a tiny 8 x 32 corner
    if is_fp4(shape):
        _put_ties(shape, x)
    return (x.to(getattr(torch, shape["in_dtype"])).to(device),)


# Per block column, cycling: scale 1 (amax 6), 2^-100 (an exact inverse 2^100), 3 (an inexact inverse) and 2^-130
# (float32 subnormals under the e2m1 clamp: inverse 2^126).
TIE_FACTORS = (1.0, 2.0**-100, 3.0, 2.0**-130)


def _put_ties(shape, x):
    """e2m1: the last block row (when there are two or more) made of `_e2m1.TIES` rows, whose codes are known at
    scale 1 (every 16 channels hold 6, so every block's amax is 6 times its block column's TIE_FACTORS entry)."""
    n, h, bm, bk = x.shape[0], shape["hidden"], shape["block_m"], shape["block_k"]
    first = (-(-n // bm) - 1) * bm
    if first == 0:
        return
    ties = torch.tensor(_e2m1.TIES, dtype=torch.float32).repeat(h // 16)
    factors = torch.tensor(TIE_FACTORS, dtype=torch.float32)[(torch.arange(h) // bk) % len(TIE_FACTORS)]
    x[first:] = ties * factors


def make_inputs_with_sf(shape, device="cpu", seed=0):
    """x as per_block_cast's, and scales near its own (times 2^[-2, 2) and some other factors), so that
    some products pass 448 (e2m1: 6) and are clamped (saturate); a few scales are exact powers of two."""
    (x,) = make_inputs(shape, "cpu", seed)
    g = torch.Generator(device="cpu").manual_seed(seed + 1000)
    sf, _ = scales_and_inverses({**shape, "round_scale": False}, x)
    sf = sf[:, 0, :, 0] * torch.exp2(4 * torch.rand(sf.shape[0], sf.shape[2], generator=g) - 2)
    sf.view(-1)[::7] = torch.exp2(torch.randint(-20, 10, (sf.view(-1)[::7].numel(),), generator=g).float())
    return x.to(device), sf.contiguous().to(device)


pass_configs = plain_threads


def _num_blocks_m(s) -> int:
    return -(-s["num_tokens"] // s["block_m"])


def _bytes_moved(s, sf_cols=None):
    n, h = s["num_tokens"], s["hidden"]
    return n * (h * _elem_bytes(s) + out_width(s)) + num_blocks_k(s) * (sf_cols or _num_blocks_m(s)) * 4


PARAMS = (
    Runtime("num_tokens", hi=1 << 24, doc="tokens; runtime size, tuned per power-of-two bucket"),
    Static("hidden", lo=16, hi=65536, default=7168, doc="channels per token, a multiple of 16"),
    Static("block_m", values=BLOCKS_M, default=128, doc="tokens per scale block"),
    Static("block_k", values=BLOCKS_K, default=128, doc="channels per scale block"),
    Static("in_dtype", type=str, values=("bfloat16", "float32"), default="bfloat16"),
    Static("fmt", type=str, values=FORMATS, default="e4m3",
           doc="values: e4m3 (float8_e4m3fn) or e2m1 (int8, two FP4 codes per byte)"),
    Static("round_scale", type=bool, default=False, doc="round scales up to powers of two (UE8M0)"),
)
EXAMPLES = (
    {"num_tokens": 4096, "hidden": 7168},
    {"num_tokens": 32768, "hidden": 7168},
    {"num_tokens": 4096, "hidden": 7168, "block_m": 32, "block_k": 32},
    {"num_tokens": 7168, "hidden": 2048, "round_scale": True},
    {"num_tokens": 4096, "hidden": 4096, "in_dtype": "float32"},
    {"num_tokens": 4096, "hidden": 7168, "fmt": "e2m1"},
    {"num_tokens": 4096, "hidden": 7168, "block_m": 32, "block_k": 32, "fmt": "e2m1", "round_scale": True},
)
COMMON = dict(
    family="quant",
    space=SPACE,
    default=default,
    constraint=constraint,
    arch_constraint=arch_constraint,
    check_shape=check_shape,
    pass_configs=pass_configs,
    tolerance=Tolerance(exact=True),
)
_X = TensorArg("x", lambda s: s["in_dtype"], ("num_tokens", "hidden"), align=x_align)
_OUT = TensorArg("out", lambda s: OUT_DTYPES[s["fmt"]], ("num_tokens", out_width))
_ROWS = CeilDiv("num_tokens", "block_m")

SPEC = register(
    KernelSpec(
        name="per_block_cast",
        doc="per-(block_m x block_k) FP8 e4m3 / FP4 e2m1 cast with float32 scales (amax / 448 or 6), row-major",
        params=PARAMS,
        build=build,
        inputs=(_X,),
        outputs=(_OUT, TensorArg("scales", "float32", (_ROWS, num_blocks_k))),
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=_bytes_moved,
        examples=EXAMPLES,
        **COMMON,
    )
)

SPEC_COLMAJOR = register(
    KernelSpec(
        name="per_block_cast_colmajor",
        doc="per_block_cast with TMA-aligned column-major scales (num_blocks_k, align(num_blocks_m, 4)), padding 0",
        params=PARAMS,
        build=build_colmajor,
        inputs=(_X,),
        outputs=(
            _OUT,
            TensorArg("scales", "float32", (num_blocks_k, CeilDiv("num_tokens", "block_m", TMA_ALIGN))),
        ),
        make_inputs=make_inputs,
        reference=reference_colmajor,
        bytes_moved=lambda s: _bytes_moved(s, tma_aligned(_num_blocks_m(s))),
        examples=EXAMPLES,
        **COMMON,
    )
)

SPEC_WITH_SF = register(
    KernelSpec(
        name="per_block_cast_with_sf",
        doc="per_block_cast's values with given float32 scales (x / sf per block, clamped, e4m3; or e2m1)",
        params=PARAMS[:-1],  # no round_scale: the scales are given
        build=build_with_sf,
        inputs=(_X, TensorArg("sf", "float32", (_ROWS, num_blocks_k), strided=True, align=4)),
        outputs=(_OUT,),
        make_inputs=make_inputs_with_sf,
        reference=reference_with_sf,
        bytes_moved=_bytes_moved,
        examples=tuple(e for e in EXAMPLES if "round_scale" not in e),
        **COMMON,
    )
)
