"""expand_to_fused_with_sf: quantised token rows AND their scale rows copied into the fused layout, bit-exactly.

x (num_tokens, hidden) (fp8 or any 1/2/4-byte element type, copied as bits), x_sf (num_tokens, hidden_sf)
float32 scales or int32 (four packed UE8M0 exponents), row-major and contiguous (TileKernels asserts
x_sf.is_contiguous(), whatever the output layout), token_topk_to_pos int32 (num_tokens, num_topk),
pos_to_expert int32 (num_expanded_tokens,) -> out (num_expanded_tokens, hidden) and out_sf
(TileKernels' `moe.expand_to_fused_with_sf`, on the mapping `get_fused_mapping` builds).
hidden_sf = ceil(hidden / num_per_channels), then ceil(that / 4) for int32 (packed) scales, as TileKernels
computes it from x.shape[1] (the packed width for int8-packed fp4 data, as there).

The rules are expand_to_fused's, for both tensors:
  * a padding row (pos_to_expert[p] < 0) is zero in out and in out_sf;
  * each (t, k) with a position p = token_topk_to_pos[t, k] in [0, num_expanded_tokens) whose row is
    not padding gets a copy of x[t] and of x_sf[t];
  * -1, and any other out-of-range position, is skipped (never read or written through);
  * a row that is neither padding nor mapped is left as it was (TileKernels' kernel does the same;
    its torch reference zeroes it; get_fused_mapping never makes one).

Two specs share this file and one builder; they differ only in how out_sf is stored:
  expand_to_fused_with_sf           out_sf (num_expanded_tokens, hidden_sf), row-major.
  expand_to_fused_with_sf_colmajor  out_sf stored column-major and TMA-aligned (TileKernels'
                                    `use_tma_aligned_col_major_sf=True`): storage (hidden_sf, P4),
                                    P4 = align(num_expanded_tokens, 4); scale (p, w) lives at w * P4 + p.
                                    The padding columns [num_expanded_tokens, P4) are written 0 (the
                                    reference's zeros; TileKernels leaves them unwritten). Callers want
                                    the view storage[:, :num_expanded_tokens].T (strides (1, P4)), which
                                    tkjit.ops returns, as TileKernels does.
(Two specs, as per_token_cast / per_token_cast_colmajor: a TensorArg's axis order cannot depend on a
static param.)

Layout: expand_to_fused's (`_fused_rows`) for the data; a block handles `rows` rows of the grid's
max(num_tokens, num_expanded_tokens) over one chunk of the hidden axis. The scale row's hidden_sf
4-byte words are spread over the lanes of all of a row's chunks (lane l of chunk b owns words
b * lanes + l + j * lanes * chunks), loaded once into registers with the data and stored to each valid
position: 4-byte stores, consecutive within a warp in the row-major layout, P4 * 4 bytes apart in the
column-major one (1/32 of the fp8 bytes at num_per_channels=128). The owner of row
num_expanded_tokens - 1 zeroes its words' padding columns of the column-major storage.
Tunables: threads, rows per block, vector width in bytes, vectors per lane (unroll), as expand_to_fused.
"""

import torch

from tkjit.registry import register
from tkjit.spec import Align, KernelSpec, Runtime, Static, TensorArg, Tolerance
from tkjit_kernels.moe._fused_rows import ELEM_BYTES as FLOAT_ELEM_BYTES
from tkjit_kernels.moe._fused_rows import SPACE, ceil_div, geometry, random_mapping
from tkjit_kernels.moe._fused_rows import constraint as row_constraint
from tkjit_kernels.moe._fused_rows import default as row_default
from tkjit_kernels.moe.expand_to_fused import MAX_UNROLLED_K, _bits, arch_constraint, pass_configs

# int8: TileKernels' packed fp4 (e2m1 x 2), uint8: its packed e5m6; copied as bits like the others.
ELEM_BYTES = {**FLOAT_ELEM_BYTES, "int8": 1, "uint8": 1}
DTYPES = tuple(ELEM_BYTES)
SF_DTYPES = ("float32", "int32")  # int32: four UE8M0 exponents packed per word
PER_CHANNELS = (32, 128)  # TileKernels asserts num_per_channels in [32, 128]
TMA_ALIGN = 4  # 4-byte scales per 16 bytes: TileKernels pads the column-major token axis to this


def hidden_sf(shape) -> int:
    """Scale words per row: ceil(hidden / num_per_channels), packed four to an int32 word for int32."""
    n = ceil_div(shape["hidden"], shape["num_per_channels"])
    return ceil_div(n, 4) if shape["sf_dtype"] == "int32" else n


def default(shape):
    return row_default(shape["hidden"], ELEM_BYTES[shape["dtype"]])


def constraint(shape, c):
    return row_constraint(shape["hidden"], ELEM_BYTES[shape["dtype"]], c)


def build(shape, c):
    return _build(shape, c, col_major=False)


def build_colmajor(shape, c):
    return _build(shape, c, col_major=True)


def _build(shape, c, col_major):
    from tilelang import language as T

    H, K, dt, sdt = shape["hidden"], shape["num_topk"], shape["dtype"], shape["sf_dtype"]
    SW = hidden_sf(shape)
    vec, hv, lanes, chunk, chunks = geometry(H, ELEM_BYTES[dt], c)
    R, U, threads = c["rows"], c["unroll"], c["threads"]
    guard = hv % chunk != 0  # the last chunk runs past the row: guard its vectors
    SL = lanes * chunks  # lanes over all of a row's chunks, each owning scale words
    SI = ceil_div(SW, SL)  # scale words per lane
    sf_guard = SW % SL != 0
    slots = T.unroll if K <= MAX_UNROLLED_K else T.serial
    num_tokens = T.dynamic("num_tokens")
    num_expanded_tokens = T.dynamic("num_expanded_tokens")
    # Column-major: (SW, num_expanded_tokens rounded up to TMA_ALIGN), the same expression as the
    # TensorArg's Align("num_expanded_tokens", TMA_ALIGN), so the launcher's shape check binds it.
    padded = T.ceildiv(num_expanded_tokens, TMA_ALIGN) * TMA_ALIGN
    sf_shape = (SW, padded) if col_major else (num_expanded_tokens, SW)

    @T.prim_func
    def expand_to_fused_with_sf(
        x: T.Tensor[(num_tokens, H), dt],
        x_sf: T.Tensor[(num_tokens, SW), sdt],
        token_topk_to_pos: T.Tensor[(num_tokens, K), T.int32],
        pos_to_expert: T.Tensor[(num_expanded_tokens,), T.int32],
        out: T.Tensor[(num_expanded_tokens, H), dt],
        out_sf: T.Tensor[sf_shape, sdt],
    ):
        with T.Kernel(T.ceildiv(T.max(num_tokens, num_expanded_tokens), R), chunks, threads=threads) as (bx, by):
            tx = T.get_thread_binding()
            xs = T.alloc_local((U * vec,), dt)
            ss = T.alloc_local((SI,), sdt)
            row = bx * R + tx // lanes
            first = by * chunk + tx % lanes  # this lane's first vector; then every `lanes` vectors
            word = by * lanes + tx % lanes  # this lane's first scale word; then every SL words
            if row < num_expanded_tokens:
                if pos_to_expert[row] < 0:
                    for u in T.unroll(U):
                        if (not guard) or first + u * lanes < hv:
                            for v in T.vectorized(vec):
                                out[T.cast(row, "int64"), (first + u * lanes) * vec + v] = T.cast(T.float32(0), dt)
                    for j in T.unroll(SI):
                        if (not sf_guard) or word + j * SL < SW:
                            if col_major:
                                out_sf[T.cast(word + j * SL, "int64"), row] = T.cast(0, sdt)
                            else:
                                out_sf[T.cast(row, "int64"), word + j * SL] = T.cast(0, sdt)
                if col_major:
                    if row == num_expanded_tokens - 1:  # the last row's owner zeroes the padding columns
                        for j in T.unroll(SI):
                            if (not sf_guard) or word + j * SL < SW:
                                for e in T.unroll(1, TMA_ALIGN):
                                    if row + e < padded:
                                        out_sf[T.cast(word + j * SL, "int64"), row + e] = T.cast(0, sdt)
            if row < num_tokens:
                for u in T.unroll(U):
                    if (not guard) or first + u * lanes < hv:
                        for v in T.vectorized(vec):
                            xs[u * vec + v] = x[T.cast(row, "int64"), (first + u * lanes) * vec + v]
                for j in T.unroll(SI):
                    if (not sf_guard) or word + j * SL < SW:
                        ss[j] = x_sf[T.cast(row, "int64"), word + j * SL]
                for k in slots(K):
                    pos = token_topk_to_pos[row, k]
                    # Out-of-range positions are skipped; a padding row keeps its zeros.
                    if (pos >= 0) & (pos < num_expanded_tokens):
                        if pos_to_expert[pos] >= 0:
                            for u in T.unroll(U):
                                if (not guard) or first + u * lanes < hv:
                                    for v in T.vectorized(vec):
                                        out[T.cast(pos, "int64"), (first + u * lanes) * vec + v] = xs[u * vec + v]
                            for j in T.unroll(SI):
                                if (not sf_guard) or word + j * SL < SW:
                                    if col_major:
                                        out_sf[T.cast(word + j * SL, "int64"), pos] = ss[j]
                                    else:
                                        out_sf[T.cast(pos, "int64"), word + j * SL] = ss[j]

    return expand_to_fused_with_sf


def make_inputs(shape, device="cpu", seed=0):
    """x: random values (ints clear of the -128 / 255 poison of tkjit.testing); x_sf: float32 powers
    of two and non-powers, or int32 words of four random exponent bytes (never INT32_MIN, the poison)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n, h, k, p = shape["num_tokens"], shape["hidden"], shape["num_topk"], shape["num_expanded_tokens"]
    dt = getattr(torch, shape["dtype"])
    if dt == torch.int8:
        x = torch.randint(-127, 128, (n, h), generator=g, dtype=torch.int8)
    elif dt == torch.uint8:
        x = torch.randint(0, 255, (n, h), generator=g, dtype=torch.uint8)
    else:
        x = (torch.randn(n, h, generator=g) * 4).to(dt)
    sw = hidden_sf(shape)
    if shape["sf_dtype"] == "int32":
        x_sf = torch.randint(-(2**31) + 1, 2**31 - 1, (n, sw), generator=g, dtype=torch.int64).to(torch.int32)
    else:
        x_sf = torch.exp2(torch.randint(-20, 20, (n, sw), generator=g).float())
        x_sf[:, 1::3] *= torch.rand(n, len(range(1, sw, 3)), generator=g) + 0.5
    pos, pos_to_expert = random_mapping(g, n, k, p, seed)
    return x.to(device), x_sf.to(device), pos.to(device), pos_to_expert.to(device)


def _expand(rows_of, src, pos, ok, p):
    out = torch.zeros((p, src.shape[1]), dtype=src.dtype, device=src.device)
    _bits(out)[pos[ok]] = _bits(src)[rows_of[ok]]
    return out


def reference(shape, x, x_sf, token_topk_to_pos, pos_to_expert):
    n, k = token_topk_to_pos.shape
    p = pos_to_expert.shape[0]
    pos = token_topk_to_pos.reshape(-1).long()
    ok = (pos >= 0) & (pos < p)
    ok &= pos_to_expert[pos.clamp(0, max(p - 1, 0))] >= 0 if p else ok
    src = torch.arange(n, device=x.device).repeat_interleave(k)
    return _expand(src, x, pos, ok, p), _expand(src, x_sf, pos, ok, p)


def reference_colmajor(shape, x, x_sf, token_topk_to_pos, pos_to_expert):
    """Same values as `reference`; out_sf as its (hidden_sf, align(num_expanded_tokens, 4)) storage, padding 0."""
    out, sf = reference(shape, x, x_sf, token_topk_to_pos, pos_to_expert)
    p, sw = sf.shape
    storage = torch.zeros((sw, ceil_div(p, TMA_ALIGN) * TMA_ALIGN), dtype=sf.dtype, device=sf.device)
    storage[:, :p] = sf.T
    return out, storage


def _bytes_moved(s, col_major=False):
    e, sw = ELEM_BYTES[s["dtype"]], hidden_sf(s)
    n, p, h, k = s["num_tokens"], s["num_expanded_tokens"], s["hidden"], s["num_topk"]
    sf_rows = ceil_div(p, TMA_ALIGN) * TMA_ALIGN if col_major else p
    return n * (h * e + sw * 4) + p * h * e + sf_rows * sw * 4 + n * k * 4 + p * 4


PARAMS = (
    Runtime("num_tokens", hi=1 << 24, doc="tokens; runtime size, tuned per power-of-two bucket"),
    Runtime("num_expanded_tokens", hi=1 << 28, doc="rows of the fused layout (pos_to_expert's length)"),
    Static("hidden", lo=1, hi=1 << 16, default=7168, doc="elements per row (x.shape[1])"),
    Static("num_topk", lo=1, hi=1024, default=8, doc="slots per token"),
    Static("num_per_channels", values=PER_CHANNELS, default=128, doc="channels per scale"),
    Static("dtype", type=str, values=DTYPES, default="float8_e4m3fn", doc="x's element type (copied bit-exactly)"),
    Static("sf_dtype", type=str, values=SF_DTYPES, default="float32",
           doc="scale type: float32, or int32 holding four packed UE8M0 exponents"),
)
EXAMPLES = (
    {"num_tokens": 8192, "num_expanded_tokens": 8192 * 8 + 256 * 64, "hidden": 7168, "num_topk": 8},
    {"num_tokens": 4096, "num_expanded_tokens": 4096 * 8 + 256 * 64, "hidden": 4096, "num_topk": 8},
    {"num_tokens": 4096, "num_expanded_tokens": 4096 * 6 + 72 * 64, "hidden": 576, "num_topk": 6},
    {"num_tokens": 8192, "num_expanded_tokens": 8192 * 8 + 256 * 64, "hidden": 7168, "num_topk": 8,
     "num_per_channels": 32, "sf_dtype": "int32"},
)


def _x_align(s, c):
    return c["vec_bytes"]  # x's and out's rows start on the vector width


INPUTS = (
    TensorArg("x", lambda s: s["dtype"], ("num_tokens", "hidden"), align=_x_align),
    TensorArg("x_sf", lambda s: s["sf_dtype"], ("num_tokens", hidden_sf), align=4),
    TensorArg("token_topk_to_pos", "int32", ("num_tokens", "num_topk"), align=4),
    TensorArg("pos_to_expert", "int32", ("num_expanded_tokens",), align=4),
)
_OUT = TensorArg("out", lambda s: s["dtype"], ("num_expanded_tokens", "hidden"), align=_x_align)
COMMON = dict(
    family="moe",
    params=PARAMS,
    space=dict(SPACE),
    default=default,
    constraint=constraint,
    arch_constraint=arch_constraint,
    pass_configs=pass_configs,
    inputs=INPUTS,
    make_inputs=make_inputs,
    tolerance=Tolerance(exact=True),
    examples=EXAMPLES,
)

SPEC = register(
    KernelSpec(
        name="expand_to_fused_with_sf",
        doc="copy each token's row and scale row to its fused-layout positions, scales row-major (bit-exact)",
        build=build,
        outputs=(_OUT, TensorArg("out_sf", lambda s: s["sf_dtype"], ("num_expanded_tokens", hidden_sf), align=4)),
        reference=reference,
        bytes_moved=_bytes_moved,
        **COMMON,
    )
)

SPEC_COLMAJOR = register(
    KernelSpec(
        name="expand_to_fused_with_sf_colmajor",
        doc="expand_to_fused_with_sf with TMA-aligned column-major scales (hidden_sf, align(rows, 4)), padding 0",
        build=build_colmajor,
        outputs=(_OUT, TensorArg("out_sf", lambda s: s["sf_dtype"], (hidden_sf, Align("num_expanded_tokens",
                                                                                      TMA_ALIGN)), align=4)),
        reference=reference_colmajor,
        bytes_moved=lambda s: _bytes_moved(s, col_major=True),
        **COMMON,
    )
)
