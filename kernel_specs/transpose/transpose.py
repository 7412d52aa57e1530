"""transpose / batched_transpose: swap the last two axes, bit-exact.

transpose:          x (rows, cols)        -> y (cols, rows)
batched_transpose:  x (batch, rows, cols) -> y (batch, cols, rows)
Two specs because a spec's tensors have a fixed rank; both come from one builder.
Any element type of 1, 2, 4 or 8 bytes (bf16, f32, fp8, ints...) is copied bit for bit.
`rows` (tokens) and `batch` are runtime sizes; `cols` (hidden size) and the dtype are compiled in.
x may be a view with runtime row (and batch) strides, e.g. `buf[:, :cols]` of a wider buffer: its
last axis contiguous, rows not overlapping, every row starting on the load width (`x_align`); one
binary serves every stride. y is contiguous.

Layout (one thread block per block_rows x block_cols tile of x):
  1. Each thread loads k x k micro-tiles (k = vec_bytes / element size): k rows of x, one
     vec_bytes-wide vector each, so a warp reads whole 128-byte lines.
  2. It transposes the micro-tile in registers and writes k vectors into a shared tile that is
     already in y's layout (block_cols rows of block_rows elements).
  3. After the barrier, threads copy the shared tile to y with vec_bytes-wide stores, lanes
     running along y's rows: whole lines again.
  The shared tile is swizzled: vector chunk q of shared row `row` lives at chunk q ^ ((row / k) % G)
  with G = 128 / vec_bytes chunks per 128 bytes of banks, so the vector stores of step 2 (lanes
  walk down rows) and the vector loads of step 3 (lanes walk along a row) are both conflict-free.
  swizzle=False is the plain layout (bank conflicts in step 2), kept for the tuner to compare.
  The grid is 1-D over tiles (no 65535 limit), raster picks the order: "cols" = consecutive
  blocks take neighbouring column tiles of the same rows (x read a row band at a time), "rows" =
  neighbouring row tiles (y written a row band at a time); gridDim.y is the batch.
  min_threads_per_sm=1024 puts __launch_bounds__(threads, 1024 / threads) on the kernel: nvcc then
  fits a k <= 8 micro-tile thread in 64 registers (72 without), four 256-thread blocks per SM.

Tails: a tile that lies wholly inside the tensor loads unchecked; it also stores whole vectors when
rows is a multiple of k (y's rows then start vector-aligned), else one element a lane with lanes
along y's rows (a warp still writes consecutive runs: 4001 x 576 bf16 went from 23.9 to 9.6 us on
an H100 against k strided elements a lane). Edge tiles check every row (and column when
cols % block_cols != 0) and store the same way, each element checked. When cols is not a multiple
of k the loads narrow to the largest power of two dividing cols. The kernel is written with T.Parallel
loops (no explicit thread index), so it lowers on TileLang's C target as well, for the dtypes
the C backend has types for (ints, float16/32/64; not bfloat16 or fp8).
"""

# No `from __future__ import annotations`: the prim_func annotations name local tuples.

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Runtime, Static, TensorArg, Tolerance, stride_name

ELEM_BYTES = {
    "float64": 8, "int64": 8,
    "float32": 4, "int32": 4,
    "bfloat16": 2, "float16": 2, "int16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1, "int8": 1,
}
DTYPES = tuple(ELEM_BYTES)
SMEM_LIMIT = 48 * 1024  # the default (static) shared memory cap per block
MAX_TILES_PER_THREAD = 8  # micro-tiles each thread moves (unrolled): keeps registers and code size sane

SPACE = {
    "block_rows": (32, 64, 128, 256),  # x rows per tile (y's contiguous axis)
    "block_cols": (32, 64, 128, 256),  # x cols per tile
    "threads": (128, 256),
    "vec_bytes": (8, 16),  # global and shared vector width
    "swizzle": (True, False),
    "min_threads_per_sm": (0, 1024),  # 0: no hint; else __launch_bounds__(threads, this / threads)
    "raster": ("cols", "rows"),  # block order on the 1-D grid: along x's rows first, or down them
}


def _geometry(shape, c):
    eb = ELEM_BYTES[shape["dtype"]]
    k = max(1, c["vec_bytes"] // eb)  # micro-tile side = elements per vector
    groups = 128 // c["vec_bytes"]  # vector slots in one pass over the 32 banks
    return eb, k, groups


def _load_elems(shape, c):
    """Elements per vector load of x: a micro-tile row, narrowed to the largest power of two dividing cols."""
    _, k, _ = _geometry(shape, c)
    return min(k, shape["cols"] & -shape["cols"])


def x_align(shape, c):
    """Bytes of x's vector loads: where each of x's rows must start (its address and row stride)."""
    return _load_elems(shape, c) * ELEM_BYTES[shape["dtype"]]


def constraint(shape, c):
    eb, k, groups = _geometry(shape, c)
    br, bc, nt = c["block_rows"], c["block_cols"], c["threads"]
    if c["vec_bytes"] < eb:
        return f"vec_bytes {c['vec_bytes']} is narrower than one {shape['dtype']} element"
    if br % k or bc % k:
        return f"tile sides must be multiples of the micro-tile side {k}"
    tiles = (br // k) * (bc // k)
    if tiles % nt:
        return f"{tiles} micro-tiles of {k}x{k} do not divide over {nt} threads"
    if tiles // nt > MAX_TILES_PER_THREAD:
        return f"{tiles // nt} micro-tiles per thread (> {MAX_TILES_PER_THREAD}): use a smaller tile or more threads"
    if br * bc * eb > SMEM_LIMIT:
        return f"tile of {br * bc * eb} bytes exceeds {SMEM_LIMIT} bytes of shared memory"
    if c["swizzle"] and (br // k) % groups:
        return f"the swizzle needs block_rows * {eb} bytes to be a multiple of 128 ({br // k} chunks per row)"
    return None


def default(shape):
    """~32 KB tiles, 256-byte runs of y per shared row, swizzled, 16-byte vectors (8 for 1-byte
    types, whose 16 x 16 micro-tile would need ~150 registers), and an occupancy hint capping
    registers at 64 so four 256-thread blocks fit on an SM (the k <= 8 micro-tiles fit in 64)."""
    eb = ELEM_BYTES[shape["dtype"]]
    cols = shape["cols"]
    vec = 16 if eb >= 2 else 8
    br = max(32, 256 // eb)
    bc = 128 if cols > 64 else (64 if cols > 32 else 32)
    for b_r in (br, br // 2, br * 2, 32, 64, 128, 256):
        for b_c in (bc, 64, 32, 128, 256):
            for nt in (256, 128):
                for sw in (True, False):
                    cfg = {"block_rows": b_r, "block_cols": b_c, "threads": nt, "vec_bytes": vec, "swizzle": sw,
                           "min_threads_per_sm": 1024, "raster": "cols"}
                    if b_r in SPACE["block_rows"] and b_c in SPACE["block_cols"] and not constraint(shape, cfg):
                        return cfg
    raise AssertionError("transpose: no default config fits")  # unreachable: 32 x 32, 128 threads fits all


def build(shape, c):
    return _build(shape, c, batched=False)


def build_batched(shape, c):
    return _build(shape, c, batched=True)


def _build(shape, c, batched):
    from tilelang import language as T
    from tilelang.language.annotations import annotate_min_blocks_per_sm

    dtype, cols = shape["dtype"], shape["cols"]
    eb, k, groups = _geometry(shape, c)
    br, bc, nt, swizzle = c["block_rows"], c["block_cols"], c["threads"], c["swizzle"]
    chunks = br // k  # vectors per shared row
    per_thread_in = (br // k) * (bc // k) // nt  # micro-tiles per thread
    per_thread_out = bc * chunks // nt  # output vectors per thread
    kin = _load_elems(shape, c)  # input vector width: the largest power of two dividing cols
    col_tail = cols % bc != 0
    min_blocks = c["min_threads_per_sm"] // nt
    raster = c["raster"]
    col_tiles = -(-cols // bc)  # occupancy hint: caps registers per thread

    rows = T.dynamic("rows")
    if batched:
        batch = T.dynamic("batch")
        x_shape, y_shape = (batch, rows, cols), (batch, cols, rows)
        x_strides = (T.dynamic(stride_name("x", 0)), T.dynamic(stride_name("x", 1)), 1)
        nb = batch
    else:
        x_shape, y_shape = (rows, cols), (cols, rows)
        x_strides = (T.dynamic(stride_name("x", 0)), 1)
        nb = 1

    def ix(b, i, j):
        return (b, i, j) if batched else (i, j)

    def swz(q, row):
        return q ^ ((row // k) % groups) if swizzle else q

    @T.prim_func
    def transpose(x: T.StridedTensor(x_shape, x_strides, dtype), y: T.Tensor[y_shape, dtype]):
        # x's rows start load-aligned (the launcher checks it, see x_align): strides written as multiples
        # of kin, so the index analysis proves the kin-wide loads aligned and emits vector loads.
        x = T.view(x, strides=tuple((st // kin) * kin for st in x_strides[:-1]) + (1,))
        with T.Kernel(T.ceildiv(rows, br) * col_tiles, nb, threads=nt) as (bid, bz):
            if min_blocks > 1:
                annotate_min_blocks_per_sm(min_blocks)
            s = T.alloc_shared((bc, br), dtype)
            tmp = T.alloc_local((k, k), dtype)
            tmpt = T.alloc_local((k, k), dtype)
            if raster == "cols":  # consecutive blocks walk along a band of x's rows
                r0 = (bid // col_tiles) * br
                c0 = (bid % col_tiles) * bc
            else:  # consecutive blocks walk down x's rows (along a band of y's rows)
                r0 = (bid % T.ceildiv(rows, br)) * br
                c0 = (bid // T.ceildiv(rows, br)) * bc
            # interior: the tile lies wholly inside x (unchecked vector loads); aligned: y's rows also start on
            # a k-element vector (rows % k == 0), so the stores can be whole vectors too.
            if col_tail:
                fast = (r0 + br <= rows) and (c0 + bc <= cols)
            else:
                fast = r0 + br <= rows
            # 1-2: micro-tiles of x -> registers -> transposed into the shared tile.
            for t in T.Parallel(nt):
                for it in T.unroll(per_thread_in):
                    m = it * nt + t
                    mi = m // (bc // k)
                    mj = m % (bc // k)
                    if fast:
                        for rr in T.unroll(k):
                            for vv in T.unroll(k // kin):
                                for v in T.vectorized(kin):
                                    tmp[rr, vv * kin + v] = x[ix(bz, r0 + mi * k + rr, c0 + mj * k + vv * kin + v)]
                    else:
                        for rr in T.unroll(k):
                            for vv in T.unroll(k // kin):
                                if (r0 + mi * k + rr < rows) and (c0 + mj * k + vv * kin < cols):
                                    for v in T.vectorized(kin):
                                        tmp[rr, vv * kin + v] = x[ix(bz, r0 + mi * k + rr, c0 + mj * k + vv * kin + v)]
                    for v in T.unroll(k):
                        for w in T.unroll(k):
                            tmpt[v, w] = tmp[w, v]
                    for v in T.unroll(k):
                        for w in T.vectorized(k):
                            s[mj * k + v, swz(mi, mj * k + v) * k + w] = tmpt[v, w]
            # 3: the shared tile (y's layout) -> y, lanes along y's rows: k-wide vectors where y's rows start
            # vector-aligned, else one element a lane (a warp still writes whole consecutive runs), bounds
            # checked only on edge tiles.
            vec_out = fast and (rows % k == 0)
            for t in T.Parallel(nt):
                for it in T.unroll(per_thread_out):
                    m = it * nt + t
                    q = m % chunks
                    row = m // chunks
                    if vec_out:
                        T.assume(rows % k == 0)  # y's rows start vector-aligned
                        for w in T.vectorized(k):
                            y[ix(bz, c0 + row, r0 + q * k + w)] = s[row, swz(q, row) * k + w]
                    else:  # the same number of elements, lane t taking element t of each run of nt
                        for w in T.unroll(k):
                            e = (it * k + w) * nt + t
                            er = e // br
                            ec = e % br
                            if fast or ((c0 + er < cols) and (r0 + ec < rows)):
                                y[ix(bz, c0 + er, r0 + ec)] = s[er, swz(ec // k, er) * k + ec % k]

    return transpose


def pass_configs(c):
    # Bounds are checked by hand (whole vectors on the edge path); TileLang's automatic per-element
    # guards would block vectorisation of the interior tiles.
    return {"tl.disable_safe_memory_legalize": True, "tl.disable_warp_specialized": True}


def make_inputs(shape, device="cpu", seed=0):
    """Random bits of the dtype, minus the patterns tkjit.testing poisons outputs with (NaN for
    floats, 0xFF for 1-byte floats, the extreme int): an element the kernel never wrote cannot
    then match the reference by accident."""
    from tkjit.kernel import torch_dtype

    g = torch.Generator(device="cpu").manual_seed(seed)
    dt = torch_dtype(shape["dtype"])
    eb = ELEM_BYTES[shape["dtype"]]
    dims = (shape["batch"],) if "batch" in shape else ()
    dims += (shape["rows"], shape["cols"] * eb)
    raw = torch.randint(0, 256, dims, generator=g, dtype=torch.uint8)
    if eb == 1:
        raw[raw == 0xFF] = 0x01
        if dt == torch.int8:
            raw[raw == 0x80] = 0x01
    x = raw.view(dt)
    if eb > 1:
        if dt.is_floating_point:
            x[x.isnan()] = 1.0
        else:
            x[x == torch.iinfo(dt).min] = 1
    return (x.to(device),)


def arch_constraint(arch, c, shape):
    if arch == "cpu" and shape["dtype"] in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return f"TileLang's C target has no {shape['dtype']} type"
    return None


def reference(shape, x):
    return x.transpose(-1, -2).contiguous()


def _bytes(s):
    return 2 * s.get("batch", 1) * s["rows"] * s["cols"] * ELEM_BYTES[s["dtype"]]


_DTYPE = Static("dtype", type=str, values=DTYPES, default="bfloat16", doc="element type (copied bit-exactly)")
_COLS = Static("cols", lo=1, hi=1 << 20, doc="x's last axis (hidden size), compiled in")
_ROWS = Runtime("rows", doc="x's second-to-last axis (tokens); runtime, tuned per power-of-two bucket")


def _dtype_of(s):
    return s["dtype"]


# The two specs differ only in rank: the builder, the batch param, the tensors' dims, the examples.
COMMON = dict(
    family="transpose",
    space=SPACE,
    default=default,
    constraint=constraint,
    arch_constraint=arch_constraint,
    pass_configs=pass_configs,
    make_inputs=make_inputs,
    reference=reference,
    tolerance=Tolerance(exact=True),
    bytes_moved=_bytes,
)

SPEC = register(
    KernelSpec(
        name="transpose",
        doc="y = x.T for a (rows, cols) tensor of any 1/2/4/8-byte dtype, bit-exact",
        params=(_DTYPE, _COLS, _ROWS),
        build=build,
        inputs=(TensorArg("x", _dtype_of, ("rows", "cols"), strided=True, align=x_align),),
        outputs=(TensorArg("y", _dtype_of, ("cols", "rows")),),
        examples=(
            {"dtype": "bfloat16", "cols": 7168, "rows": 16384},
            {"dtype": "float32", "cols": 4096, "rows": 4096},
            {"dtype": "float8_e4m3fn", "cols": 7168, "rows": 8192},
            {"dtype": "bfloat16", "cols": 2112, "rows": 4001},
        ),
        **COMMON,
    )
)

BATCHED_SPEC = register(
    KernelSpec(
        name="batched_transpose",
        doc="y = x.transpose(1, 2) for a (batch, rows, cols) tensor of any 1/2/4/8-byte dtype, bit-exact",
        params=(_DTYPE, _COLS, _ROWS, Runtime("batch", hi=65535, doc="batch size (gridDim.y); runtime")),
        build=build_batched,
        inputs=(TensorArg("x", _dtype_of, ("batch", "rows", "cols"), strided=True, align=x_align),),
        outputs=(TensorArg("y", _dtype_of, ("batch", "cols", "rows")),),
        examples=(
            {"dtype": "bfloat16", "cols": 2048, "rows": 4096, "batch": 8},
            {"dtype": "float32", "cols": 128, "rows": 4096, "batch": 64},
        ),
        **COMMON,
    )
)
