"""per_block_cast_lossless: FP4 e2m1 values with power-of-two block scales -> FP8 e4m3 values re-blocked to
larger (out_block_m x out_block_k) scale blocks, exactly (TileKernels' `per_block_cast_lossless`).

x is TileKernels' e2m1 storage: int8 (num_tokens, hidden / 2), two codes per byte, low nibble first; its scales
sf are float32 (ceil(num_tokens / in_block_m), ceil(hidden / in_block_k)), row-major at any row stride, each a
power of two (a UE8M0 number). An output block holds whole input blocks (TileKernels: out sizes multiples of in
sizes, the channel sizes powers of two). With e(s) the float32 exponent field of scale s:

    m        = max e(sf[r, c]) over the output block's real input blocks
    e_out    = m - 6                      the output scale is 2^(e_out - 127): the largest input scale / 2^6
    out[t,c] = e4m3(e2m1(x[t, c]) * 2^(e(sf of its input block) - e_out))

e2m1 magnitudes are {0, 0.5, 1, 1.5, 2, 3, 4, 6}; times 2^6 they stay <= 384 < 448 and times 2^-5 >= 2^-6, the
smallest normal e4m3: every product is an e4m3 number, so the cast is exact and out * 2^(e_out - 127) is
x's value. That holds when, for every real input block, (TileKernels' device assert)

    e(sf) + 5 >= e_out         (its scale is at most 2^11 below the output block's largest)

and tkjit asks for more, where TileKernels silently loses values: every input scale is a positive normal power
of two (TileKernels drops a scale's mantissa bits and reads a sign or a NaN as a huge exponent) and m >= 7 (else
TileKernels' saturating e_out = 0 makes the output scale 0.0). The kernel checks each input block as it uses it
and sets `lossy` (one int32, zero on entry) when any fails; the op raises a TensorError naming the first failing
block (`problem`), so a lossy input never comes back as values. Bit-exact with TileKernels' kernel on the
inputs both accept: the products are exact, so only the order of nothing is left to differ.

Two specs share this file and one builder (per_block_cast's reason: the column-major scale storage puts the
runtime axis second):
  per_block_cast_lossless           scales (ceil(T / out_block_m), ceil(hidden / out_block_k)) float32 row-major
  per_block_cast_lossless_colmajor  their TMA-aligned column-major storage (num_blocks_k, align(rows, 4)), padding
                                    0.0; `tkjit.ops` returns storage[:, :rows].T, or its packed UE8M0 form
                                    (`tkjit.scales.pack_ue8m0`, exact: the scales are powers of two).
Input scales given column-major or packed are made row-major float32 by the op (a small torch copy of the
scales, 1/16 of x's bytes or less) so that one input layout serves all.

Tiling: one CTA per tile of tile_m = out_block_m * row_blocks rows and tile_k columns (whole output blocks).
Each thread first issues its chunks' loads (vec codes, vec / 2 bytes each; x stays in registers), then
the CTA gathers its tile's input-scale exponents into shared memory, each warp takes output blocks in turn
and reduces their exponents (lanes over the input blocks, a butterfly), lane 0 writing the block's e_out to
shared memory and its scale to global memory; after a barrier every chunk decodes, scales and stores 16-byte
pieces. A chunk lies in one input block (vec divides in_block_k), so it has one factor. Rows and columns past
the tensor load a clamped in-bounds chunk and store nothing; input blocks past the scales count as exponent 0
(never the max, as in TileKernels).
"""

import itertools

import torch

from tkjit.registry import register
from tkjit.scales import TMA_ALIGN, tma_aligned
from tkjit.spec import CeilDiv, KernelSpec, Runtime, Static, TensorArg, Tolerance, cuda_only, plain_threads, stride_name
from tkjit_kernels.quant._e2m1 import decode_bits_tl as _e2m1_bits
from tkjit_kernels.quant._layouts import layout_builders

BLOCKS_K = (8, 16, 32, 64, 128, 256, 512, 1024)  # channel block sizes: powers of two (TileKernels asserts it)
HEADROOM = 6  # e_out = max exponent - 6: e2m1's 6 * 2^6 = 384 fits e4m3 (max 448)
FLOOR = 5  # an input scale at most 2^(6 + 5) below the max: 0.5 * 2^-5 = 2^-6, e4m3's smallest normal
MAX_X_BYTES_PER_THREAD = 64  # x staged in registers: 16 chunks of 4 bytes, 8 of 8, 4 of 16
MAX_TILE_ROWS = 256
MAX_SCALES_PER_TILE = 8192  # input-scale exponents staged in shared memory (32 KiB)
SPACE = {
    "vec": (8, 16, 32),  # codes per chunk: 4, 8 or 16 bytes loaded, 8, 16 or 32 bytes stored
    "tile_k": (64, 128, 256, 512, 1024, 2048),  # columns per CTA: a multiple of out_block_k
    "row_blocks": (1, 2, 4, 8, 16, 32),  # output block rows per CTA
    "threads": (128, 256, 512),
}


def num_blocks_k(shape, which="out") -> int:
    return -(-shape["hidden"] // shape[f"{which}_block_k"])


def _in_cols(shape) -> int:
    return num_blocks_k(shape, "in")


def _chunks_per_thread(shape, c) -> float:
    return shape["out_block_m"] * c["row_blocks"] * c["tile_k"] / c["vec"] / c["threads"]


def check_shape(shape):
    h, bmi, bki, bmo, bko = (shape[k] for k in ("hidden", "in_block_m", "in_block_k", "out_block_m", "out_block_k"))
    if h % 32:
        return f"hidden={h} must be a multiple of 32 (TileKernels' e2m1 rows)"
    if bmo % bmi:
        return f"out_block_m={bmo} must be a multiple of in_block_m={bmi} (output blocks hold whole input blocks)"
    if bko % bki:
        return f"out_block_k={bko} must be a multiple of in_block_k={bki} (output blocks hold whole input blocks)"
    if not _valid(shape):
        return f"no config of the space tiles blocks ({bmi}, {bki}) -> ({bmo}, {bko}) at hidden={h}"
    return None


def constraint(shape, c):
    bmi, bki, bmo, bko = (shape[k] for k in ("in_block_m", "in_block_k", "out_block_m", "out_block_k"))
    vec, tk, rb, threads = c["vec"], c["tile_k"], c["row_blocks"], c["threads"]
    tm = bmo * rb
    if bki % vec:
        return f"vec={vec} must divide in_block_k={bki} (a chunk lies in one input block)"
    if tk % bko:
        return f"tile_k={tk} is not a multiple of out_block_k={bko}"
    if tm > MAX_TILE_ROWS:
        return f"out_block_m * row_blocks = {tm} rows per tile exceed {MAX_TILE_ROWS}"
    cpt = _chunks_per_thread(shape, c)
    if cpt != int(cpt) or cpt < 1:
        return f"{tm} x {tk} / vec = {tm * tk // vec} chunks per tile is not a multiple of threads={threads}"
    if cpt * vec // 2 > MAX_X_BYTES_PER_THREAD:
        return f"{int(cpt)} chunks per thread hold {int(cpt) * vec // 2} bytes of x (max {MAX_X_BYTES_PER_THREAD})"
    if -(-tm // bmi) * (tk // bki) > MAX_SCALES_PER_TILE:
        return f"{-(-tm // bmi) * (tk // bki)} input scales per tile exceed {MAX_SCALES_PER_TILE} (shared memory)"
    return None


def _valid(shape):
    keys = list(SPACE)
    combos = (dict(zip(keys, vals)) for vals in itertools.product(*SPACE.values()))
    return [c for c in combos if constraint(shape, c) is None]


def default(shape):
    # TileKernels' tile: 8192+ codes per CTA of 256 threads. Few idle columns first (tile_k past hidden), then a
    # tile near 16384 codes (two 16-byte loads per thread), the widest chunk, 256 threads.
    h = shape["hidden"]

    def cost(c):
        elems = shape["out_block_m"] * c["row_blocks"] * c["tile_k"]
        idle = -h % c["tile_k"] / max(h, c["tile_k"])
        return (round(idle, 2), abs(elems.bit_length() - 15), -c["vec"], abs(c["threads"] - 256), c["tile_k"])

    return min(_valid(shape), key=cost)


def x_align(shape, c):
    return c["vec"] // 2


arch_constraint = cuda_only("needs warp shuffles and FP8 conversions")


pass_configs = plain_threads


def _build(shape, c, col_major):
    from tilelang import language as T

    H = shape["hidden"]
    BMI, BKI, BMO, BKO = (shape[k] for k in ("in_block_m", "in_block_k", "out_block_m", "out_block_k"))
    vec, TK, rb, threads = c["vec"], c["tile_k"], c["row_blocks"], c["threads"]
    TM = BMO * rb
    xv = vec // 2  # bytes per chunk
    CPR = TK // vec  # chunks per tile row
    CPT = TM * TK // vec // threads  # chunks per thread
    NKI, NKO = _in_cols(shape), num_blocks_k(shape)
    TRI, TCI = TM // BMI, TK // BKI  # input blocks per tile, each way
    TRO, TCO = TM // BMO, TK // BKO  # output blocks per tile, each way
    GM, GK = BMO // BMI, BKO // BKI  # input blocks per output block, each way
    G, NOB, NIN = GM * GK, TRO * TCO, TRI * TCI
    NW = threads // 32
    NTK = -(-H // TK)
    sw = min(vec, 16)  # bytes per store
    f32, u32, i32, fp8 = T.float32, T.uint32, T.int32, T.float8_e4m3fn
    num_tokens = T.dynamic("num_tokens")
    sf_stride = T.dynamic(stride_name("sf", 0))
    rows_in = T.ceildiv(num_tokens, BMI)
    rows_out = T.ceildiv(num_tokens, BMO)
    scales_shape = (NKO, T.ceildiv(rows_out, TMA_ALIGN) * TMA_ALIGN) if col_major else (rows_out, NKO)

    @T.prim_func
    def per_block_cast_lossless(
        x: T.Tensor[(num_tokens, H // 2), T.int8],
        sf: T.StridedTensor((rows_in, NKI), (sf_stride, 1), f32),
        out: T.Tensor[(num_tokens, H), fp8],
        scales: T.Tensor[scales_shape, f32],
        lossy: T.Tensor[(1,), i32],
    ):
        with T.Kernel(T.ceildiv(num_tokens, TM) * NTK, threads=threads) as bx:
            tx = T.get_thread_binding()
            xs = T.alloc_local((CPT * xv,), T.int8)
            res = T.alloc_local((vec,), fp8)
            mx = T.alloc_local((1,), i32)
            ev = T.alloc_local((1,), i32)
            es = T.alloc_shared((NIN,), i32)
            eo = T.alloc_shared((NOB,), i32)
            tr = bx // NTK
            tc = bx % NTK
            row0 = T.cast(tr, "int64") * TM  # the tile's first row
            col0 = tc * TK
            last = T.cast(num_tokens, "int64") - 1
            # x first: its loads are in flight while the scales are reduced.
            for i in T.unroll(CPT):
                q = i * threads + tx
                row = T.min(row0 + q // CPR, last)
                col = T.min(col0 + (q % CPR) * vec, H - vec)
                for v in T.vectorized(xv):
                    xs[i * xv + v] = x[row, col // 2 + v]
            # The tile's input-scale exponents; blocks past the scales are 0.
            for i in T.unroll(-(-NIN // threads)):
                idx = i * threads + tx
                if idx < NIN:
                    r = T.cast(tr, "int64") * TRI + idx // TCI
                    k = tc * TCI + idx % TCI
                    ev[0] = 0  # one shared store per entry (a second would make TileLang sync inside this if)
                    if r < T.cast(rows_in, "int64") and k < NKI:
                        bits = T.reinterpret(sf[r, k], u32)
                        ev[0] = T.cast(bits >> u32(23), i32)
                        if (bits & u32(0x7FFFFF)) != u32(0) or ev[0] < 1 or ev[0] > 254:
                            lossy[0] = 1  # not a positive normal power of two
                    es[idx] = ev[0]
            T.sync_threads()
            # Each warp takes output blocks in turn: lanes over its input blocks, then a butterfly.
            w = tx // 32
            lane = tx % 32
            for i in T.unroll(-(-NOB // NW)):
                ob = i * NW + w
                mx[0] = 0
                for g in T.unroll(-(-G // 32)):
                    gi = g * 32 + lane
                    if ob < NOB and gi < G:
                        mx[0] = T.max(mx[0], es[((ob // TCO) * GM + gi // GK) * TCI + (ob % TCO) * GK + gi % GK])
                for b in T.unroll(5):
                    mx[0] = T.max(mx[0], T.shfl_xor(mx[0], 1 << b))
                if ob < NOB and lane == 0:
                    eo[ob] = T.max(mx[0] - HEADROOM, 0)
                    ro = T.cast(tr, "int64") * TRO + ob // TCO
                    ko = tc * TCO + ob % TCO
                    if ro < T.cast(rows_out, "int64") and ko < NKO:
                        if mx[0] < HEADROOM + 1:
                            lossy[0] = 1  # the output scale would be 0
                        s = T.reinterpret(T.cast(T.max(mx[0] - HEADROOM, 0), u32) << u32(23), f32)
                        if col_major:
                            scales[ko, ro] = s
                            if ro == T.cast(rows_out, "int64") - 1:  # the last block row zeroes the padding
                                for p in T.unroll(1, TMA_ALIGN):
                                    if ro + p < T.cast(scales_shape[1], "int64"):
                                        scales[ko, ro + p] = T.float32(0)
                        else:
                            scales[ro, ko] = s
            T.sync_threads()
            for i in T.unroll(CPT):
                q = i * threads + tx
                lr = q // CPR
                lc = (q % CPR) * vec
                row = row0 + lr
                col = col0 + lc
                if row <= last and col < H:
                    e_in = es[(lr // BMI) * TCI + lc // BKI]
                    e_o = eo[(lr // BMO) * TCO + lc // BKO]
                    if e_in + FLOOR < e_o:
                        lossy[0] = 1  # more than 2^11 below the output block's largest scale
                    factor = T.reinterpret(T.cast(e_in - e_o + 127, u32) << u32(23), f32)
                    for v in T.unroll(vec):
                        b = T.cast(T.cast(xs[i * xv + v // 2], T.uint8), u32)
                        val = T.reinterpret(_e2m1_bits(T, (b >> T.cast(4 * (v % 2), u32)) & u32(15)), f32)
                        res[v] = T.cast(val * factor, fp8)
                    for p in T.unroll(vec // sw):
                        for v in T.vectorized(sw):
                            out[row, col + p * sw + v] = res[p * sw + v]

    return per_block_cast_lossless


# -- reference -------------------------------------------------------------------------------------
def exponents(sf: torch.Tensor) -> torch.Tensor:
    """The float32 bit pattern >> 23 of each scale, as TileKernels' kernel reads it (sign bit included): int64."""
    bits = torch.empty(sf.shape, dtype=torch.float32, device=sf.device).copy_(sf).view(torch.int32)
    return (bits.to(torch.int64) & 0xFFFFFFFF) >> 23


def padded_max(e, gm, gk):
    """The max of e over each gm x gk group of entries (the partial groups' missing entries count as 0)."""
    rows, cols = e.shape
    ro, co = -(-rows // gm), -(-cols // gk)
    padded = torch.nn.functional.pad(e, (0, co * gk - cols, 0, ro * gm - rows))
    return padded.view(ro, gm, co, gk).amax(dim=(1, 3))


def _analyse(shape, sf):
    """(e (rows_in, cols_in), e_out per output block, e_out per input block, bad-scale mask, output-underflow mask
    per output block, too-low mask per input block)."""
    bmi, bki, bmo, bko = (shape[k] for k in ("in_block_m", "in_block_k", "out_block_m", "out_block_k"))
    gm, gk = bmo // bmi, bko // bki
    e = exponents(sf.cpu())
    bits = torch.empty(sf.shape, dtype=torch.float32).copy_(sf.cpu()).view(torch.int32)
    bad = ((bits & 0x7FFFFF) != 0) | (e < 1) | (e > 254)
    rows, cols = e.shape
    m = padded_max(e, gm, gk)
    e_out = (m - HEADROOM).clamp(min=0)
    per_in = e_out.repeat_interleave(gm, 0).repeat_interleave(gk, 1)[:rows, :cols]
    return e, e_out, per_in, bad, m < HEADROOM + 1, e + FLOOR < per_in


def problem(shape, sf) -> str | None:
    """Why the cast of x with these scales would lose values (the first failing block), or None."""
    bmi, bki, bmo, bko = (shape[k] for k in ("in_block_m", "in_block_k", "out_block_m", "out_block_k"))
    e, e_out, per_in, bad, under, low = _analyse(shape, sf)
    gm, gk = bmo // bmi, bko // bki

    def where(r, c):
        return (f"input scale block ({r}, {c}) (tokens {r * bmi}..{(r + 1) * bmi - 1}, channels "
                f"{c * bki}..{(c + 1) * bki - 1}) of output block ({r // gm}, {c // gk})")

    if bad.any():
        r, c = (int(i) for i in bad.nonzero()[0])
        return (f"{where(r, c)} has scale {sf[r, c].item()!r}, not a positive normal power of two: only UE8M0 "
                "(power-of-two) scales re-block exactly")
    if under.any():
        r, c = (int(i) for i in under.nonzero()[0])
        top = int(padded_max(e, gm, gk)[r, c]) - 127
        return (f"output block ({r}, {c})'s largest input scale is 2^{top}: its output scale 2^{top - HEADROOM} "
                "would be below float32's normal range (TileKernels writes 0.0 there, losing the values)")
    if low.any():
        r, c = (int(i) for i in low.nonzero()[0])
        top = int(per_in[r, c]) + HEADROOM - 127
        k = int(e[r, c]) - int(per_in[r, c])
        return (f"{where(r, c)} has scale 2^{int(e[r, c]) - 127}, 2^{top - int(e[r, c]) + 127} below the block's "
                f"largest input scale 2^{top}: its values would be scaled by 2^{k} into e4m3, which holds 0.5 * 2^k "
                f"exactly only for k >= -{FLOOR} (at most 2^{HEADROOM + FLOOR} between one output block's scales)")
    return None


def reference_parts(shape, x, sf):
    """(values fp8 (n, hidden), scales float32 (rows_out, cols_out), lossy int32 (1,)) by TileKernels' formula."""
    from tkjit_kernels.quant.cast_back import decode

    bmi, bki = shape["in_block_m"], shape["in_block_k"]
    n, h = x.shape[0], shape["hidden"]
    _, e_out, per_in, bad, under, low = _analyse(shape, sf)
    e = exponents(sf.cpu())
    vals = decode({"in_fmt": "e2m1"}, x.cpu())
    fexp = (e - per_in + 127).clamp(1, 254)
    factor = (fexp.to(torch.int32) << 23).view(torch.float32)
    factor = factor.repeat_interleave(bmi, 0).repeat_interleave(bki, 1)[:n, :h]
    q = (vals * factor).to(torch.float8_e4m3fn)
    scales = (e_out.to(torch.int32) << 23).view(torch.float32)
    lossy = torch.tensor([int(bad.any() or under.any() or low.any())], dtype=torch.int32)
    return q, scales, lossy


def reference(shape, x, sf):
    return reference_parts(shape, x, sf)


def reference_colmajor(shape, x, sf):
    q, scales, lossy = reference_parts(shape, x, sf)
    rows, cols = scales.shape
    storage = torch.zeros(cols, tma_aligned(rows), dtype=torch.float32)
    storage[:, :rows] = scales.T
    return q, storage, lossy


def make_inputs(shape, device="cpu", seed=0):
    """Every e2m1 byte; scales 2^(m - 127 - d) with m an output block's largest exponent (in [100, 150]) and d in
    [0, 11] (11: the lossless limit), one input block per output block at d = 0. Odd seeds: the scales as a
    row-strided view of a wider buffer."""
    from tkjit_kernels.quant.cast_back import rowmajor_scales

    g = torch.Generator(device="cpu").manual_seed(seed)
    n, h = shape["num_tokens"], shape["hidden"]
    bmi, bki, bmo, bko = (shape[k] for k in ("in_block_m", "in_block_k", "out_block_m", "out_block_k"))
    x = torch.randint(-128, 128, (n, h // 2), generator=g, dtype=torch.int32).to(torch.int8)
    rows, cols = -(-n // bmi), -(-h // bki)
    gm, gk = bmo // bmi, bko // bki
    ro, co = -(-rows // gm), -(-cols // gk)
    top = torch.randint(100, 151, (ro, co), generator=g)
    d = torch.randint(0, HEADROOM + FLOOR + 1, (ro * gm, co * gk), generator=g)
    d.view(ro, gm, co, gk)[:, 0, :, 0] = 0  # the block's max is reached (when that block is real)
    e = top.repeat_interleave(gm, 0).repeat_interleave(gk, 1) - d
    e = e[:rows, :cols].to(torch.int32)
    sf = (e << 23).view(torch.float32)
    return x.to(device), rowmajor_scales(sf, seed, device)


def _bytes_moved(s, col_major=False):
    n, h = s["num_tokens"], s["hidden"]
    rows_in, rows_out = -(-n // s["in_block_m"]), -(-n // s["out_block_m"])
    out_rows = tma_aligned(rows_out) if col_major else rows_out
    return n * h // 2 + n * h + rows_in * _in_cols(s) * 4 + out_rows * num_blocks_k(s) * 4


PARAMS = (
    Runtime("num_tokens", hi=1 << 24, doc="tokens; runtime size, tuned per power-of-two bucket"),
    Static("hidden", lo=32, hi=65536, default=7168, doc="channels (codes) per token, a multiple of 32"),
    Static("in_block_m", lo=1, hi=256, default=1, doc="tokens per input scale"),
    Static("in_block_k", values=BLOCKS_K, default=32, doc="channels per input scale (e2m1: 32, MXFP4)"),
    Static("out_block_m", lo=1, hi=256, default=128, doc="tokens per output scale, a multiple of in_block_m"),
    Static("out_block_k", values=BLOCKS_K, default=128, doc="channels per output scale, a multiple of in_block_k"),
)
EXAMPLES = (
    {"num_tokens": 4096, "hidden": 7168},
    {"num_tokens": 7168, "hidden": 2048},
    {"num_tokens": 4096, "hidden": 7168, "out_block_m": 1},
    {"num_tokens": 4096, "hidden": 7168, "in_block_m": 32, "in_block_k": 32, "out_block_m": 128},
)
_X = TensorArg("x", "int8", ("num_tokens", lambda s: s["hidden"] // 2), align=x_align)
_SF = TensorArg("sf", "float32", (CeilDiv("num_tokens", "in_block_m"), _in_cols), strided=True, align=4)
_OUT = TensorArg("out", "float8_e4m3fn", ("num_tokens", "hidden"))
_LOSSY = TensorArg("lossy", "int32", (1,), zeroed=True)
COMMON = dict(
    family="quant",
    params=PARAMS,
    space=SPACE,
    default=default,
    constraint=constraint,
    arch_constraint=arch_constraint,
    check_shape=check_shape,
    pass_configs=pass_configs,
    inputs=(_X, _SF),
    make_inputs=make_inputs,
    tolerance=Tolerance(exact=True),
    examples=EXAMPLES,
)

build, build_colmajor = layout_builders(_build)

SPEC = register(
    KernelSpec(
        name="per_block_cast_lossless",
        doc="FP4 e2m1 + power-of-two block scales -> FP8 e4m3 re-blocked exactly, scales row-major, lossy flag",
        build=build,
        outputs=(_OUT, TensorArg("scales", "float32", (CeilDiv("num_tokens", "out_block_m"), num_blocks_k)),
                 _LOSSY),
        reference=reference,
        bytes_moved=_bytes_moved,
        **COMMON,
    )
)

SPEC_COLMAJOR = register(
    KernelSpec(
        name="per_block_cast_lossless_colmajor",
        doc="per_block_cast_lossless with TMA-aligned column-major scales (num_blocks_k, align(rows, 4)), padding 0",
        build=build_colmajor,
        outputs=(_OUT, TensorArg("scales", "float32",
                                 (num_blocks_k, CeilDiv("num_tokens", "out_block_m", TMA_ALIGN))), _LOSSY),
        reference=reference_colmajor,
        bytes_moved=lambda s: _bytes_moved(s, col_major=True),
        **COMMON,
    )
)
