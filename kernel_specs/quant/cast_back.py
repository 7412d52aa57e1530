"""cast_back: FP8 e4m3 / FP4 e2m1 values and their float32 or UE8M0 scales -> bf16 or float32 (dequantisation).

    out[t, c] = out_dtype(value(x[t, c]) * scale(t // block_tokens, c // block_channels))

one float32 multiply, rounded once to the output type (round to nearest even for bf16), bit-exact with
TileKernels' `cast_back` / `per_token_cast_back` and its torch reference (`tile_kernels.torch.cast_back`).
value(): e4m3 widened to float32 (exact), or an FP4 e2m1 code (+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}, code 8 is -0.0)
decoded from x stored as TileKernels stores it: int8, two codes per byte, low nibble first, so x is
(num_tokens, hidden / 2). block_tokens x block_channels is TileKernels' x_block_size: (1, g) per token and
group of g channels, (128, 128) / (32, 32) blocks; any positive sizes are taken, and the last block of a row
or column may be partial: the scales are (ceil(num_tokens / block_tokens), ceil(hidden / block_channels)).

Two specs share this file and one builder; they differ only in how the scales are laid out (TileKernels reads
the layout off the scales' strides: stride(0) == 1 means column-major):
  cast_back           sf (num_sf_rows, num_sf_cols) float32, rows at a runtime stride (a row-major tensor or
                      a row-strided view of one).
  cast_back_colmajor  sf as the storage of a column-major scale tensor: the caller passes s.T of the
                      (num_sf_rows, ...) column-major tensor s, i.e. a (num_sf_cols, num_sf_rows) float32 view
                      whose rows are s's columns, at s's runtime column stride (the TMA-aligned layout
                      per_token_cast_colmajor returns: stride align(num_tokens, 4)); or with sf_dtype int32
                      the packed UE8M0 form, (ceil(num_sf_cols / 4), num_sf_rows) int32, scale (r, k) being
                      2^(byte k % 4 of word [k // 4, r] - 127) (`tkjit.scales.pack_ue8m0`; byte 0 is +0.0).
Why two specs rather than a layout param: the scale tensor's axes come in the opposite order (the runtime
axis first resp. second), which a TensorArg's fixed dims cannot switch on a static param (per_token_cast's
reason); packed UE8M0 exists only column-major (TileKernels' layout), so the row-major spec refuses int32.
num_sf_rows is a runtime param of its own: it is ceil(num_tokens / block_tokens), which a dim cannot express.
The ops check it; the kernel clamps its scale row index to it, so a direct call with a short sf stays in
bounds. Its tuning bucket is constant: num_tokens alone picks the config.

x may be a row-strided view (rows starting on the chunk's input bytes, `x_align`); out is contiguous.
The whole output is a sequence of num_tokens * hidden / vec chunks of `vec` consecutive channels; thread tx
of a block handles chunks (block * iters + i) * threads + tx, i < iters, so a warp's loads and stores are
contiguous spans. A chunk's input is one vector load (e4m3: vec bytes, e2m1: vec / 2), its output
16-byte stores; its scales (one, or vec / block_channels when the group is narrower than the chunk) are
4-byte loads that neighbouring threads share (L1 hits). All iters' loads are issued before any store.
The e2m1 decode is integer work on the float32 bit pattern (no float4 type, no denormals): `_e2m1.decode_bits_tl`.
"""

import itertools

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Runtime, Static, TensorArg, Tolerance, cuda_only, plain_threads, stride_name
from tkjit_kernels.quant import _e2m1 as e2m1
from tkjit_kernels.quant._e2m1 import E2M1  # noqa: F401 (codes 0..15 as values; tests import it from here)
from tkjit_kernels.quant._e2m1 import decode_bits_tl as _e2m1_bits
from tkjit_kernels.quant._layouts import layout_builders

FORMATS = ("e4m3", "e2m1")  # x: float8_e4m3fn, or int8 holding two FP4 e2m1 codes per byte (TileKernels)
X_DTYPE = {"e4m3": "float8_e4m3fn", "e2m1": "int8"}
OUT_DTYPES = ("bfloat16", "float32")
OUT_BYTES = {"bfloat16": 2, "float32": 4}
SF_DTYPES = ("float32", "int32")  # int32: four UE8M0 exponents per word (column-major only)
SPACE = {
    "vec": (8, 16, 32),  # channels per chunk
    "threads": (128, 256, 512),
    "iters": (1, 2, 4),  # chunks per thread, loaded before any is stored
}
NUM_SMS = 132  # H200


def in_bytes(shape) -> float:
    """Bytes of x per channel."""
    return 1 if shape["in_fmt"] == "e4m3" else 0.5


def x_width(shape) -> int:
    """x's row length in elements: hidden, or hidden / 2 bytes of packed e2m1 pairs."""
    return shape["hidden"] if shape["in_fmt"] == "e4m3" else shape["hidden"] // 2


def num_sf_cols(shape) -> int:
    """Scale columns: ceil(hidden / block_channels); the last group is partial when it does not divide hidden."""
    return -(-shape["hidden"] // shape["block_channels"])


def sf_words(shape) -> int:
    """The column-major scale storage's rows: num_sf_cols, or ceil(num_sf_cols / 4) int32 words when packed."""
    n = num_sf_cols(shape)
    return -(-n // 4) if shape["sf_dtype"] == "int32" else n


def sf_rows_of(num_tokens: int, block_tokens: int) -> int:
    """The scales' token rows for num_tokens: ceil(num_tokens / block_tokens)."""
    return -(-num_tokens // block_tokens)


def chunk_problem(shape, vec: int) -> str | None:
    """Why a chunk of vec channels cannot serve this shape (the rule of every dequantising kernel here)."""
    h, bc = shape["hidden"], shape["block_channels"]
    if h % vec:
        return f"hidden={h} is not a multiple of vec={vec}"
    if bc % vec and vec % bc:
        return f"block_channels={bc} and vec={vec}: a chunk must lie in one group or hold whole groups"
    return None


def constraint(shape, c):
    problem = chunk_problem(shape, c["vec"])
    if problem is None and c["vec"] * in_bytes(shape) > 16:
        problem = f"a chunk's input is at most one 16-byte load ({c['vec']} {shape['in_fmt']} values are more)"
    return problem


def any_valid(shape, space, constraint) -> bool:
    """Whether some config of `space` passes `constraint` at this shape."""
    keys = list(space)
    return any(constraint(shape, dict(zip(keys, vals))) is None for vals in itertools.product(*space.values()))


def check_blocks(shape, space, constraint) -> str | None:
    """The checks a dequantising spec's shape shares: a chunk width for the groups, and num_sf_rows equal to
    ceil(num_tokens / block_tokens)."""
    bt, bc = shape["block_tokens"], shape["block_channels"]
    if not any_valid(shape, space, constraint):
        return f"block_channels={bc} must be a multiple of 8 or divide 8 (groups whole in 8-channel chunks)"
    if "num_tokens" in shape and "num_sf_rows" in shape:
        want = sf_rows_of(shape["num_tokens"], bt)
        if shape["num_sf_rows"] != want:
            return (f"num_sf_rows={shape['num_sf_rows']} must be ceil(num_tokens / block_tokens) = "
                    f"ceil({shape['num_tokens']} / {bt}) = {want}")
    return None


def check_shape(shape):
    if shape["hidden"] % 16:
        return f"hidden={shape['hidden']} must be a multiple of 16 (vector loads and stores)"
    return check_blocks(shape, SPACE, constraint)


def check_shape_rowmajor(shape):
    if shape["sf_dtype"] != "float32":
        return "row-major scales are float32; packed UE8M0 (int32) scales are column-major (cast_back_colmajor)"
    return check_shape(shape)


def default(shape):
    # 16-byte input loads where the groups allow (e4m3: 16 channels, e2m1: 32), else the widest valid chunk.
    # Four chunks per thread once there are enough chunks to fill the GPU several times over: more bytes in
    # flight per thread for the large (memory-bound) sizes, more blocks for the small ones.
    vec = next(v for v in sorted(SPACE["vec"], reverse=True) if constraint(shape, {"vec": v}) is None)
    return {"vec": vec, "threads": 256, "iters": iters_of(shape, vec)}


def iters_of(shape, vec: int) -> int:
    """Chunks per thread of the defaults: 4 once the chunks fill the GPU several times over, else 1."""
    chunks = shape.get("num_tokens", 1) * shape["hidden"] // vec
    return 4 if chunks >= NUM_SMS * 256 * 16 else 1


def x_align(shape, c):
    """Bytes of a chunk's input (one vector load): where every row of x must start."""
    return max(4, int(c["vec"] * in_bytes(shape)))


arch_constraint = cuda_only("needs FP8 and bf16 conversions")


pass_configs = plain_threads


def load_scale(T, sf, k, srow, col_major, sdt):
    """The float32 scale of scale row srow, column k: sf[srow, k] row-major, sf[k, srow] from the column-major
    storage view, or byte k % 4 of word sf[k // 4, srow] as 2^(byte - 127) (the bit pattern byte << 23)."""
    if not col_major:
        return sf[srow, k]
    if sdt != "int32":
        return sf[k, srow]
    byte = T.cast((sf[k // 4, srow] >> T.cast((k % 4) * 8, "int32")) & 255, "uint32")
    return T.reinterpret(byte << T.uint32(23), T.float32)


def _build(shape, c, col_major):
    from tilelang import language as T

    H, BT, BC = shape["hidden"], shape["block_tokens"], shape["block_channels"]
    fmt, odt, sdt = shape["in_fmt"], shape["out_dtype"], shape["sf_dtype"]
    vec, threads, iters = c["vec"], c["threads"], c["iters"]
    f32 = T.float32
    fp4 = fmt == "e2m1"
    XW = x_width(shape)
    xv = vec // 2 if fp4 else vec  # x elements per chunk (bytes for e2m1 pairs)
    NSC = num_sf_cols(shape)
    S = min(vec, BC)  # channels sharing one scale inside a chunk
    NS = vec // S  # scales per chunk
    ow = 16 // OUT_BYTES[odt]  # output elements per 16-byte store
    CPR = H // vec  # chunks per row
    per_block = threads * iters
    num_tokens = T.dynamic("num_tokens")
    num_sf_rows = T.dynamic("num_sf_rows")
    x_stride = T.dynamic(stride_name("x", 0))
    sf_stride = T.dynamic(stride_name("sf", 0))
    sf_shape = (sf_words(shape), num_sf_rows) if col_major else (num_sf_rows, NSC)

    @T.prim_func
    def cast_back(
        x: T.StridedTensor((num_tokens, XW), (x_stride, 1), X_DTYPE[fmt]),
        sf: T.StridedTensor(sf_shape, (sf_stride, 1), sdt),
        out: T.Tensor[(num_tokens, H), odt],
    ):
        # Rows start chunk-aligned (the launcher checks it, see x_align): the stride written as a multiple of
        # the chunk, so the index analysis proves the loads aligned and emits vector loads.
        x = T.view(x, strides=((x_stride // xv) * xv, 1))
        with T.Kernel(T.ceildiv(num_tokens * CPR, per_block), threads=threads) as bx:
            tx = T.get_thread_binding()
            xs = T.alloc_local((iters * xv,), X_DTYPE[fmt])
            sc = T.alloc_local((iters * NS,), f32)
            res = T.alloc_local((vec,), odt)
            total = T.cast(num_tokens, "int64") * CPR  # chunks; int64: may pass 2^31 elements
            for it in T.unroll(iters):
                p = T.cast(bx, "int64") * per_block + it * threads + tx
                pc = T.min(p, total - 1)  # tail threads reload the last chunk and store nothing
                row = pc // CPR
                col = (pc % CPR) * vec
                for v in T.vectorized(xv):
                    xs[it * xv + v] = x[row, (pc % CPR) * xv + v]
                # Clamped: a direct call with fewer scale rows than ceil(num_tokens / BT) stays in bounds.
                srow = T.min(row // BT, T.cast(num_sf_rows, "int64") - 1)
                for s in T.unroll(NS):
                    sc[it * NS + s] = load_scale(T, sf, (col + s * S) // BC, srow, col_major, sdt)
            for it in T.unroll(iters):
                p = T.cast(bx, "int64") * per_block + it * threads + tx
                if p < total:
                    orow = p // CPR
                    ocol = (p % CPR) * vec
                    for v in T.unroll(vec):
                        if fp4:
                            b = T.cast(T.cast(xs[it * xv + v // 2], "uint8"), "uint32")
                            val = T.reinterpret(_e2m1_bits(T, (b >> T.cast(4 * (v % 2), "uint32")) & T.uint32(15)), f32)
                        else:
                            val = T.cast(xs[it * xv + v], f32)
                        res[v] = T.cast(val * sc[it * NS + v // S], odt)
                    for i in T.unroll(vec // ow):
                        for v in T.vectorized(ow):
                            out[orow, ocol + i * ow + v] = res[i * ow + v]

    return cast_back


def make_inputs(shape, device="cpu", seed=0):
    """x: every finite code (e4m3: all bytes but the NaNs 0x7F / 0xFF; e2m1: all 256 bytes); scales of many
    magnitudes, some 0 (float32: powers of two and not; packed: exponent bytes 100..150 and 0). Products stay
    normal float32 numbers. The column-major scales are the s.T view of a TMA-aligned (num_sf_rows rounded up
    to 4) column-major buffer whose padding holds garbage, as a caller's would."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = shape["num_tokens"]
    if shape["in_fmt"] == "e4m3":
        b = torch.randint(0, 254, (n, shape["hidden"]), generator=g, dtype=torch.int32)
        b = b + (b >= 0x7F).int()  # skip 0x7F (NaN); 0xFF is past the range
        x = b.to(torch.uint8).view(torch.float8_e4m3fn)
    else:
        x = torch.randint(-128, 128, (n, shape["hidden"] // 2), generator=g, dtype=torch.int32).to(torch.int8)
    return x.to(device), make_scales(shape, g).to(device)


def make_scales(shape, g):
    """Scales of many magnitudes, some 0 (float32: powers of two and not; packed: exponent bytes 100..150 and
    0), drawn from the generator g: (num_sf_rows, num_sf_cols) float32, or (num_sf_rows, ceil(cols / 4)) int32."""
    m = sf_rows_of(shape["num_tokens"], shape["block_tokens"])
    k = num_sf_cols(shape)
    if shape["sf_dtype"] == "int32":
        e = torch.randint(100, 151, (m, -(-k // 4) * 4), generator=g, dtype=torch.int32)
        e[::5, ::3] = 0
        e[:, k:] = torch.randint(0, 256, (m, e.shape[1] - k), generator=g)  # bytes past the last group: unused
        sf = e.to(torch.uint8).view(torch.int32)  # (m, words): byte i of word j is group 4j + i
    else:
        s = torch.exp2(torch.randint(-20, 12, (m, k), generator=g).float())
        s[:, 1::3] *= torch.rand(m, len(range(1, k, 3)), generator=g) + 0.5
        s[2::7, ::5] = 0.0
        sf = s
    return sf


def make_inputs_colmajor(shape, device="cpu", seed=0):
    x, sf = make_inputs(shape, "cpu", seed)
    return x.to(device), colmajor_storage(sf, seed, device)


def colmajor_storage(sf, seed, device="cpu"):
    """The scales as make_inputs_colmajor passes them: the storage view of a TMA-aligned column-major buffer,
    on device."""
    return _colmajor_storage(sf, torch.Generator(device="cpu").manual_seed(seed + 1), device)


def make_inputs_rowmajor(shape, device="cpu", seed=0):
    x, sf = make_inputs(shape, "cpu", seed)
    return x.to(device), rowmajor_scales(sf, seed, device)


def rowmajor_scales(sf, seed, device="cpu"):
    """Odd seeds: the scales as a row-strided view of a wider buffer (NaN past the columns); even: as they are.
    Made on device: .to(device) would copy the view into a contiguous tensor."""
    if seed % 2:
        wide = torch.full((sf.shape[0], sf.shape[1] + 3), float("nan"), device=device)
        wide[:, : sf.shape[1]] = sf.to(device)
        return wide[:, : sf.shape[1]]
    return sf.to(device)


def _colmajor_storage(s, g, device="cpu"):
    """(rows, cols) scales -> the (cols, rows) storage view of their column-major, TMA-aligned buffer
    (cols, align(rows, 4)) on device, the padding filled with garbage the kernel must not read. (Made on
    the device: moving the view there would copy it into a contiguous tensor, losing the layout.)"""
    rows, cols = s.shape
    buf = torch.randint(0, 255, (cols, -(-rows // 4) * 4 * s.element_size()), generator=g, dtype=torch.int32)
    buf = buf.to(torch.uint8).view(s.dtype).to(device)
    buf[:, :rows] = s.T.to(device)
    return buf[:, :rows]


def decode(shape, x):
    """x's values as float32 (num_tokens, hidden): e4m3 widened, or e2m1 pairs decoded low nibble first."""
    if shape["in_fmt"] == "e4m3":
        return x.float()
    return e2m1.decode(e2m1.unpack(x))


def unpack_ue8m0(words, cols):
    """(rows, ceil(cols / 4)) int32 packed UE8M0 -> (rows, cols) float32: byte i of word j -> 2^(e - 127)
    of group 4j + i, as the bit pattern e << 23 (so 0 -> +0.0, 255 -> inf), TileKernels' transform_sf."""
    # Shifts, not a uint8 view: any strides (a view of one row or one word), zero rows, and torch.compile.
    rows, w = words.shape
    shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=words.device)
    b = ((words.to(torch.int32)[:, :, None] >> shifts) & 0xFF).reshape(rows, 4 * w)[:, :cols]
    return (b << 23).view(torch.float32)


def dequant(shape, values, scales):
    """float32 values (num_tokens, hidden) times their block's scale, rounded once to out_dtype."""
    n, h = values.shape[0], shape["hidden"]
    s = scales.repeat_interleave(shape["block_tokens"], 0).repeat_interleave(shape["block_channels"], 1)[:n, :h]
    return (values * s).to(getattr(torch, shape["out_dtype"]))


def colmajor_scales(shape, sf):
    """The (num_sf_cols or words, num_sf_rows) storage view -> the float32 scales (num_sf_rows, num_sf_cols)."""
    scales = sf.T
    if shape["sf_dtype"] == "int32":
        scales = unpack_ue8m0(scales, num_sf_cols(shape))
    return scales


def reference(shape, x, sf):
    return dequant(shape, decode(shape, x), sf)


def reference_colmajor(shape, x, sf):
    """sf is the (num_sf_cols or words, num_sf_rows) storage view: its transpose holds the scales."""
    return dequant(shape, decode(shape, x), colmajor_scales(shape, sf))


def _bytes_moved(s, col_major=False):
    n, h = s["num_tokens"], s["hidden"]
    m = sf_rows_of(n, s["block_tokens"])
    sf = m * (sf_words(s) if col_major else num_sf_cols(s)) * 4
    return int(n * h * (in_bytes(s) + OUT_BYTES[s["out_dtype"]])) + sf


def _one(value: int) -> int:
    return 1  # num_sf_rows follows num_tokens: it adds no tuning bucket of its own


PARAMS = (
    Runtime("num_tokens", hi=1 << 24, doc="tokens; runtime size, tuned per power-of-two bucket"),
    Runtime("num_sf_rows", hi=1 << 24, bucket=_one, doc="scale rows: ceil(num_tokens / block_tokens)"),
    Static("hidden", lo=16, hi=65536, default=7168, doc="channels per token (the logical width for e2m1)"),
    Static("block_tokens", lo=1, hi=65536, default=1, doc="tokens per scale (TileKernels' num_per_tokens)"),
    Static("block_channels", lo=1, hi=65536, default=128, doc="channels per scale (num_per_channels)"),
    Static("in_fmt", type=str, values=FORMATS, default="e4m3", doc="e4m3 (float8_e4m3fn) or e2m1 (int8 pairs)"),
    Static("out_dtype", type=str, values=OUT_DTYPES, default="bfloat16"),
    Static("sf_dtype", type=str, values=SF_DTYPES, default="float32",
           doc="float32 scales, or int32 words of four UE8M0 exponents (column-major only)"),
)
EXAMPLES = (
    {"num_tokens": 4096, "num_sf_rows": 4096, "hidden": 7168},
    {"num_tokens": 32768, "num_sf_rows": 32768, "hidden": 7168, "out_dtype": "float32"},
    {"num_tokens": 4096, "num_sf_rows": 32, "hidden": 7168, "block_tokens": 128},
    {"num_tokens": 4096, "num_sf_rows": 4096, "hidden": 7168, "block_channels": 32, "in_fmt": "e2m1"},
)
EXAMPLES_COLMAJOR = EXAMPLES[:3] + (
    {"num_tokens": 4096, "num_sf_rows": 4096, "hidden": 7168, "block_channels": 32, "in_fmt": "e2m1",
     "sf_dtype": "int32"},
)
_X = TensorArg("x", lambda s: X_DTYPE[s["in_fmt"]], ("num_tokens", x_width), strided=True, align=x_align)
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
        name="cast_back",
        doc="FP8 e4m3 / FP4 e2m1 values times float32 block scales -> bf16 or float32, scales row-major",
        build=build,
        check_shape=check_shape_rowmajor,
        inputs=(_X, TensorArg("sf", "float32", ("num_sf_rows", num_sf_cols), strided=True, align=4)),
        make_inputs=make_inputs_rowmajor,
        reference=reference,
        bytes_moved=_bytes_moved,
        examples=EXAMPLES,
        **COMMON,
    )
)

SPEC_COLMAJOR = register(
    KernelSpec(
        name="cast_back_colmajor",
        doc="cast_back with column-major scales, passed as their (cols, rows) storage view; float32 or UE8M0",
        build=build_colmajor,
        check_shape=check_shape,
        inputs=(_X, TensorArg("sf", lambda s: s["sf_dtype"], (sf_words, "num_sf_rows"), strided=True, align=4)),
        make_inputs=make_inputs_colmajor,
        reference=reference_colmajor,
        bytes_moved=lambda s: _bytes_moved(s, col_major=True),
        examples=EXAMPLES_COLMAJOR,
        **COMMON,
    )
)
