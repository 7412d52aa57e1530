"""cast_back_e5m6: packed e5m6 values and their float32 or UE8M0 scales -> bf16 or float32 (dequantisation).

    out[t, c] = out_dtype(e5m6(t, c) * scale(t // block_tokens, c // block_channels))

one float32 multiply, rounded once to the output type, bit-exact with TileKernels' `cast_back(...,
x_special_fmt='e5m6')` (`cast_back_e5m6`) and its torch reference `cast_back_from_e5m6`. x holds the values
as per_token_cast_e5m6 writes them: eight 12-bit codes per three 32-bit words (`_e5m6`), seen here as int32
(num_tokens, hidden * 3 / 8) (TileKernels passes the same bytes as uint8 (num_tokens, hidden * 3 / 2); the
ops view them). A code decodes exactly to float32 (the top 12 bits of a float16).

Everything else is cast_back's (`cast_back.py`): the block sizes, the partial last blocks, the two specs and
their scale layouts (cast_back_e5m6: float32 row-major at a runtime row stride; cast_back_e5m6_colmajor: the
column-major storage view, float32 or packed UE8M0 int32), the num_sf_rows param and its clamp, the chunked
grid (thread tx of a block handles chunks (block * iters + i) * threads + tx, all iters' loads before any
store). A chunk of vec channels is 3 * vec / 8 words, loaded as three vec / 8-word vectors (4, 8 or 16
bytes), decoded eight values at a time, and stored as 16-byte vectors.
"""


import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Static, TensorArg, Tolerance, cuda_only, plain_threads, stride_name
from tkjit_kernels.quant import _e5m6
from tkjit_kernels.quant import cast_back as cb
from tkjit_kernels.quant._layouts import layout_builders

SPACE = {
    "vec": (8, 16, 32),  # channels per chunk: 3 * vec / 8 input words
    "threads": (128, 256, 512),
    "iters": (1, 2, 4),  # chunks per thread, loaded before any is stored
}


def x_width(shape) -> int:
    """x's row length in int32 words: three per eight channels."""
    return shape["hidden"] * 3 // 8


def constraint(shape, c):
    return cb.chunk_problem(shape, c["vec"])


def check_shape(shape):
    if shape["hidden"] % 8:
        return f"hidden={shape['hidden']} must be a multiple of 8 (eight e5m6 values fill three 32-bit words)"
    return cb.check_blocks(shape, SPACE, constraint)


def check_shape_rowmajor(shape):
    if shape["sf_dtype"] != "float32":
        return "row-major scales are float32; packed UE8M0 (int32) scales are column-major (cast_back_e5m6_colmajor)"
    return check_shape(shape)


def default(shape):
    # The narrowest chunk the groups allow: 8 channels, so a warp's stores are one contiguous span (16 bytes a
    # thread into bf16, 32 into float32) and its three 4-byte loads a contiguous 384 bytes; TileKernels' layout.
    # 32-channel chunks (three 16-byte loads) stored 16 bytes at a 64-byte (bf16) or 128-byte (float32) stride
    # between lanes, and ran 0.69-0.86x TileKernels' time on an H100 into bf16, 0.47x into float32 (session 28).
    # Four chunks per thread once there are enough to fill the GPU several times over (cast_back's rule).
    vec = next(v for v in sorted(SPACE["vec"]) if constraint(shape, {"vec": v}) is None)
    return {"vec": vec, "threads": 256, "iters": cb.iters_of(shape, vec)}


def x_align(shape, c):
    """Bytes of one vector load (vec / 8 words): where every row of x must start."""
    return c["vec"] // 2


arch_constraint = cuda_only("needs float16 and bf16 conversions")


pass_configs = plain_threads


def _build(shape, c, col_major):
    from tilelang import language as T

    H, BT, BC = shape["hidden"], shape["block_tokens"], shape["block_channels"]
    odt, sdt = shape["out_dtype"], shape["sf_dtype"]
    vec, threads, iters = c["vec"], c["threads"], c["iters"]
    f32, u32 = T.float32, T.uint32
    wv = vec // 8  # words per load; a chunk is three loads
    CW = 3 * wv  # words per chunk
    XW = x_width(shape)
    NSC = cb.num_sf_cols(shape)
    S = min(vec, BC)  # channels sharing one scale inside a chunk
    NS = vec // S  # scales per chunk
    ow = 16 // cb.OUT_BYTES[odt]  # output elements per 16-byte store
    CPR = H // vec  # chunks per row
    per_block = threads * iters
    num_tokens = T.dynamic("num_tokens")
    num_sf_rows = T.dynamic("num_sf_rows")
    x_stride = T.dynamic(stride_name("x", 0))
    sf_stride = T.dynamic(stride_name("sf", 0))
    sf_shape = (cb.sf_words(shape), num_sf_rows) if col_major else (num_sf_rows, NSC)

    @T.macro
    def decode8(ws, vals):
        # The eight codes of three words (written out: decode_tl picks its bits by a Python index).
        vals[0] = _e5m6.decode_tl(T, ws, 0)
        vals[1] = _e5m6.decode_tl(T, ws, 1)
        vals[2] = _e5m6.decode_tl(T, ws, 2)
        vals[3] = _e5m6.decode_tl(T, ws, 3)
        vals[4] = _e5m6.decode_tl(T, ws, 4)
        vals[5] = _e5m6.decode_tl(T, ws, 5)
        vals[6] = _e5m6.decode_tl(T, ws, 6)
        vals[7] = _e5m6.decode_tl(T, ws, 7)

    @T.prim_func
    def cast_back_e5m6(
        x: T.StridedTensor((num_tokens, XW), (x_stride, 1), "int32"),
        sf: T.StridedTensor(sf_shape, (sf_stride, 1), sdt),
        out: T.Tensor[(num_tokens, H), odt],
    ):
        # Rows start load-aligned (the launcher checks it, see x_align): the stride written as a multiple of
        # the load, so the index analysis proves the loads aligned and emits vector loads.
        x = T.view(x, strides=((x_stride // wv) * wv, 1))
        with T.Kernel(T.ceildiv(num_tokens * CPR, per_block), threads=threads) as bx:
            tx = T.get_thread_binding()
            xs = T.alloc_local((iters * CW,), "int32")
            sc = T.alloc_local((iters * NS,), f32)
            ws = T.alloc_local((3,), u32)
            vals = T.alloc_local((8,), f32)
            res = T.alloc_local((vec,), odt)
            total = T.cast(num_tokens, "int64") * CPR  # chunks; int64: may pass 2^31 elements
            for it in T.unroll(iters):
                p = T.cast(bx, "int64") * per_block + it * threads + tx
                pc = T.min(p, total - 1)  # tail threads reload the last chunk and store nothing
                row = pc // CPR
                col = (pc % CPR) * vec
                for q in T.unroll(3):
                    for v in T.vectorized(wv):
                        xs[it * CW + q * wv + v] = x[row, (pc % CPR) * CW + q * wv + v]
                # Clamped: a direct call with fewer scale rows than ceil(num_tokens / BT) stays in bounds.
                srow = T.min(row // BT, T.cast(num_sf_rows, "int64") - 1)
                for s in T.unroll(NS):
                    sc[it * NS + s] = cb.load_scale(T, sf, (col + s * S) // BC, srow, col_major, sdt)
            for it in T.unroll(iters):
                p = T.cast(bx, "int64") * per_block + it * threads + tx
                if p < total:
                    orow = p // CPR
                    ocol = (p % CPR) * vec
                    for j in T.unroll(wv):
                        for q in T.unroll(3):
                            ws[q] = T.reinterpret(xs[it * CW + j * 3 + q], u32)
                        decode8(ws, vals)
                        for k in T.unroll(8):
                            res[j * 8 + k] = T.cast(vals[k] * sc[it * NS + (j * 8 + k) // S], odt)
                    for i in T.unroll(vec // ow):
                        for v in T.vectorized(ow):
                            out[orow, ocol + i * ow + v] = res[i * ow + v]

    return cast_back_e5m6


def make_codes(n, hidden, g):
    """(n, hidden) random finite e5m6 codes: every sign, exponent 0..30 (subnormals included) and mantissa."""
    sign = torch.randint(0, 2, (n, hidden), generator=g) << 11
    exp = torch.randint(0, 31, (n, hidden), generator=g) << 6
    return sign | exp | torch.randint(0, 64, (n, hidden), generator=g)


def make_inputs(shape, device="cpu", seed=0):
    """x: random finite codes (no infinities or NaNs: the product with a 0 scale would be NaN); scales as
    cast_back's (many magnitudes, some 0, packed exponents 100..150 and 0). Products stay normal floats."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = _e5m6.pack(make_codes(shape["num_tokens"], shape["hidden"], g))
    return x.to(device), cb.make_scales(shape, g).to(device)


def make_inputs_rowmajor(shape, device="cpu", seed=0):
    x, sf = make_inputs(shape, "cpu", seed)
    return x.to(device), cb.rowmajor_scales(sf, seed, device)


def make_inputs_colmajor(shape, device="cpu", seed=0):
    x, sf = make_inputs(shape, "cpu", seed)
    return x.to(device), cb.colmajor_storage(sf, seed, device)


def values(x):
    """int32 words (num_tokens, hidden * 3 / 8) -> float32 values (num_tokens, hidden)."""
    return _e5m6.decode(_e5m6.unpack(x))


def reference(shape, x, sf):
    return cb.dequant(shape, values(x), sf)


def reference_colmajor(shape, x, sf):
    """sf is the (num_sf_cols or words, num_sf_rows) storage view: its transpose holds the scales."""
    return cb.dequant(shape, values(x), cb.colmajor_scales(shape, sf))


def _bytes_moved(s, col_major=False):
    n, h = s["num_tokens"], s["hidden"]
    m = cb.sf_rows_of(n, s["block_tokens"])
    sf = m * (cb.sf_words(s) if col_major else cb.num_sf_cols(s)) * 4
    return n * h * 3 // 2 + n * h * cb.OUT_BYTES[s["out_dtype"]] + sf


PARAMS = tuple(
    Static("hidden", lo=8, hi=65536, default=7168, doc="channels per token, a multiple of 8") if p.name == "hidden"
    else p for p in cb.PARAMS if p.name != "in_fmt"
)
EXAMPLES = (
    {"num_tokens": 4096, "num_sf_rows": 4096, "hidden": 7168, "block_channels": 7168},
    {"num_tokens": 32768, "num_sf_rows": 32768, "hidden": 7168, "block_channels": 7168, "out_dtype": "float32"},
    {"num_tokens": 4096, "num_sf_rows": 4096, "hidden": 7168},
    {"num_tokens": 4096, "num_sf_rows": 32, "hidden": 7168, "block_tokens": 128},
)
EXAMPLES_COLMAJOR = EXAMPLES[:3] + (
    {"num_tokens": 4001, "num_sf_rows": 4001, "hidden": 576, "block_channels": 576, "sf_dtype": "int32"},
)
_X = TensorArg("x", "int32", ("num_tokens", x_width), strided=True, align=x_align)
_OUT = TensorArg("out", lambda s: s["out_dtype"], ("num_tokens", "hidden"))
COMMON = dict(
    family="quant",
    params=PARAMS,
    space=SPACE,
    default=default,
    constraint=constraint,
    arch_constraint=arch_constraint,
    pass_configs=pass_configs,
    outputs=(_OUT,),
    tolerance=Tolerance(exact=True),
)

build, build_colmajor = layout_builders(_build)

SPEC = register(
    KernelSpec(
        name="cast_back_e5m6",
        doc="packed e5m6 values (three int32 words per eight) times float32 block scales -> bf16 / float32",
        build=build,
        check_shape=check_shape_rowmajor,
        inputs=(_X, TensorArg("sf", "float32", ("num_sf_rows", cb.num_sf_cols), strided=True, align=4)),
        make_inputs=make_inputs_rowmajor,
        reference=reference,
        bytes_moved=_bytes_moved,
        examples=EXAMPLES,
        **COMMON,
    )
)

SPEC_COLMAJOR = register(
    KernelSpec(
        name="cast_back_e5m6_colmajor",
        doc="cast_back_e5m6 with column-major scales, passed as their (cols, rows) storage view; float32 or UE8M0",
        build=build_colmajor,
        check_shape=check_shape,
        inputs=(_X, TensorArg("sf", lambda s: s["sf_dtype"], (cb.sf_words, "num_sf_rows"), strided=True, align=4)),
        make_inputs=make_inputs_colmajor,
        reference=reference_colmajor,
        bytes_moved=lambda s: _bytes_moved(s, col_major=True),
        examples=EXAMPLES_COLMAJOR,
        **COMMON,
    )
)
