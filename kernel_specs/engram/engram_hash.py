"""engram_hash: Engram's n-gram hash embedding indices (TileKernels' `engram.engram_hash`).

ngram_token_ids (num_tokens, N) int32, multipliers (L, N) int64, vocab_sizes (L, N - 1, E) int32 and
offsets (L, (N - 1) * E) int32 -> (L, num_tokens, (N - 1) * E) int32, with N = max_ngram_size,
L = num_ngram_layers and E = num_embed_table_per_ngram. For layer l, token t and n-gram size n + 1
(n = 1 .. N - 1), table j:

    h_n = XOR over k = 0 .. n of  int64(ngram_token_ids[t, k]) * multipliers[l, k]     (64-bit, wrapping)
    out[l, t, (n - 1) * E + j] = int32(floormod(h_n, vocab_sizes[l, n - 1, j]) + offsets[l, (n - 1) * E + j])

bit-identical to TileKernels' torch reference: its products wrap in int64, its `%` is torch's
remainder (the sign of the divisor, as the kernel's floor-mod), and its int32 `+ offsets` wraps, which
is the int64 sum truncated to 32 bits. The products are taken in uint64 in the kernel (same bits as
the int64 ones; unsigned overflow is defined in C, signed is not) and the XOR is reinterpreted as
int64 for the modulo. A vocab size of 0 (torch's ZeroDivisionError) or -1 (INT64_MIN % -1 traps on
x86) divides by 1 instead: every index of such a table is its offset, never a fault; tkjit's ops
refuse sizes < 1 with TKJIT_CHECK_INDICES=1. Other negative sizes follow torch (results in (v, 0]).

Layout: the (num_tokens, (N - 1) * E) output slab of one layer as a flat array of `vec`-wide
vectors; blockIdx.y is the layer. A block owns threads * steps consecutive vectors, each thread one per
step, neighbouring threads neighbouring vectors (16-byte stores at vec = 4: a warp's stores are one
contiguous span). Blocks do not follow token boundaries, so any (N - 1) * E / vec fits any block.
E % vec == 0, so a vector never crosses a table row: its n is uniform and its vocab sizes and
offsets are vector loads too. Each vector re-reads its token's ids (n + 1 int32, from L1) and recomputes h_n: the 64-bit
modulo (one per output element, a software division on the GPU) costs far more than those few
multiplies. Vectors past the slab's end are skipped. Integer code in a `T.Parallel` loop: the same kernel
lowers on TileLang's C target and runs for real on a CPU host.
"""

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Runtime, Static, TensorArg, Tolerance

MAX_NGRAM = 8
MAX_LAYERS = 64
MAX_TABLES = 64
INT32_MAX = 2**31 - 1


def num_out_cols(shape) -> int:
    return (shape["max_ngram_size"] - 1) * shape["num_embed_table_per_ngram"]


def default(shape):
    e, tokens = shape["num_embed_table_per_ngram"], shape.get("num_tokens", 8192)
    vec = next(v for v in (4, 2, 1) if e % v == 0)
    # The work is the 64-bit modulos, not the bytes: one or two vectors per thread keeps every SM's
    # warps busy; small batches (decode) take one so that they still spread over all 132 SMs.
    work = tokens * shape["num_ngram_layers"] * num_out_cols(shape)
    return {"threads": 128, "vec": vec, "steps": 2 if work >= (1 << 22) else 1}


def constraint(shape, c):
    e, vec = shape["num_embed_table_per_ngram"], c["vec"]
    if e % vec:
        return f"vec={vec} accesses need num_embed_table_per_ngram={e} to be a multiple of {vec}"
    return None


def check_shape(shape):
    if shape["num_ngram_layers"] * shape["num_tokens"] * num_out_cols(shape) > INT32_MAX:
        return "num_ngram_layers * num_tokens * (max_ngram_size - 1) * num_embed_table_per_ngram exceeds int32"
    return None


def build(shape, c):
    from tilelang import language as T

    n_max, layers, e = shape["max_ngram_size"], shape["num_ngram_layers"], shape["num_embed_table_per_ngram"]
    cols = num_out_cols(shape)
    threads, vec, steps = c["threads"], c["vec"], c["steps"]
    vpt = cols // vec  # vectors per token
    block = threads * steps
    num_tokens = T.dynamic("num_tokens")
    i32, i64, u64 = T.int32, T.int64, T.uint64

    @T.prim_func
    def engram_hash(
        ngram_token_ids: T.Tensor[(num_tokens, n_max), i32],
        multipliers: T.Tensor[(layers, n_max), i64],
        vocab_sizes: T.Tensor[(layers, n_max - 1, e), i32],
        offsets: T.Tensor[(layers, cols), i32],
        output: T.Tensor[(layers, num_tokens, cols), i32],
    ):
        with T.Kernel(T.ceildiv(num_tokens * vpt, block), layers, threads=threads) as (bx, layer):
            h = T.alloc_local((1,), u64)
            vs = T.alloc_local((vec,), i32)
            offs = T.alloc_local((vec,), i32)
            y = T.alloc_local((vec,), i32)
            for t in T.Parallel(block):
                idx = bx * block + t
                tok = idx // vpt
                col = (idx % vpt) * vec
                if idx < num_tokens * vpt:
                    g = col // e  # this vector's n - 1: tables of the (g + 2)-gram
                    for v in T.vectorized(vec):
                        vs[v] = vocab_sizes[layer, g, col % e + v]
                    for v in T.vectorized(vec):
                        offs[v] = offsets[layer, col + v]
                    h[0] = T.cast(ngram_token_ids[tok, 0], u64) * T.cast(multipliers[layer, 0], u64)
                    for k in T.unroll(1, n_max):
                        if k <= g + 1:
                            h[0] = h[0] ^ (T.cast(ngram_token_ids[tok, k], u64) * T.cast(multipliers[layer, k], u64))
                    for v in T.unroll(vec):
                        d = T.cast(vs[v], i64)
                        d = T.if_then_else((d >= -1) & (d <= 1), T.int64(1), d)  # 0, -1: see the docstring
                        y[v] = T.cast(T.floormod(T.cast(h[0], i64), d) + T.cast(offs[v], i64), i32)
                    for v in T.vectorized(vec):
                        output[layer, tok, col + v] = y[v]

    return engram_hash


def make_inputs(shape, device="cpu", seed=0):
    """Even seeds: Engram's own scheme (token ids of a 129280-token vocabulary, odd multipliers small
    enough that no product wraps, table sizes in [1000, 2^20), offsets the tables' exclusive prefix
    sums as TileKernels' `make_offsets`). Odd seeds: everything wraps: any int32 ids (negative too),
    multipliers over the whole int64 range, table sizes over [1, 2^31) with some of 1 and 2^31 - 1, and
    random offsets whose sums overflow int32."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    t, n, layers, e = shape["num_tokens"], shape["max_ngram_size"], shape["num_ngram_layers"], \
        shape["num_embed_table_per_ngram"]
    cols = num_out_cols(shape)
    if seed % 2 == 0:
        ids = torch.randint(0, 129280, (t, n), generator=g, dtype=torch.int32)
        mult = torch.randint(0, (2**63 - 1) // 129280 // 2, (layers, n), generator=g, dtype=torch.int64) * 2 + 1
        vocab = torch.randint(1000, 1 << 20, (layers, n - 1, e), generator=g, dtype=torch.int32)
        flat = vocab.view(layers, cols)
        offsets = torch.cat([torch.zeros(layers, 1, dtype=torch.int32), flat[:, :-1].cumsum(1, dtype=torch.int32)], 1)
    else:
        ids = torch.randint(-(2**31), 2**31, (t, n), generator=g, dtype=torch.int64).to(torch.int32)
        mult = torch.randint(-(2**63), 2**63 - 1, (layers, n), generator=g, dtype=torch.int64)
        vocab = torch.randint(1, 2**31 - 1, (layers, n - 1, e), generator=g, dtype=torch.int64)
        vocab.view(-1)[::5] = 1
        vocab.view(-1)[1::7] = 2**31 - 1
        vocab = vocab.to(torch.int32)
        offsets = torch.randint(-(2**31), 2**31, (layers, cols), generator=g, dtype=torch.int64).to(torch.int32)
    return tuple(x.to(device) for x in (ids, mult, vocab, offsets))


def reference(shape, ngram_token_ids, multipliers, vocab_sizes, offsets):
    layers, n = multipliers.shape
    prod = ngram_token_ids.long()[None] * multipliers[:, None, :]  # (L, T, N): int64, wrapping
    h = prod[:, :, 0]
    parts = []
    for i in range(1, n):
        h = h ^ prod[:, :, i]
        d = vocab_sizes[:, i - 1, :].long()
        d = torch.where((d >= -1) & (d <= 1), 1, d)  # the kernel's guard (torch would raise on 0)
        parts.append(torch.remainder(h[:, :, None], d[:, None, :]))
    # int64 sum truncated to int32: the bits of TileKernels' wrapping int32 `(h % v).int() + offsets`.
    return (torch.cat(parts, -1) + offsets[:, None, :].long()).to(torch.int32)


def _bytes(s):
    t, n, layers, cols = s["num_tokens"], s["max_ngram_size"], s["num_ngram_layers"], num_out_cols(s)
    # ids once (later layers read them from L2), the per-layer tables, the int32 output.
    return t * n * 4 + layers * (n * 8 + 2 * cols * 4) + layers * t * cols * 4


SPACE = {
    "threads": (32, 64, 128, 256, 512),
    "vec": (1, 2, 4),
    "steps": (1, 2, 4, 8),
}

SPEC = register(
    KernelSpec(
        name="engram_hash",
        family="engram",
        doc="Engram n-gram hash embedding indices: xor of int64 id * multiplier, floor-mod table size, + offset",
        params=(
            Runtime("num_tokens", hi=1 << 26, doc="tokens; runtime size, tuned per power-of-two bucket"),
            Static("max_ngram_size", lo=2, hi=MAX_NGRAM, default=3, doc="N: n-grams of sizes 2 .. N"),
            Static("num_ngram_layers", lo=1, hi=MAX_LAYERS, default=2, doc="L: Engram layers, one hash each"),
            Static("num_embed_table_per_ngram", lo=1, hi=MAX_TABLES, default=8, doc="E: tables per n-gram size"),
        ),
        space=SPACE,
        default=default,
        constraint=constraint,
        check_shape=check_shape,
        build=build,
        pass_configs=lambda c: {"tl.disable_warp_specialized": True},
        inputs=(
            TensorArg("ngram_token_ids", "int32", ("num_tokens", "max_ngram_size"), align=4),
            TensorArg("multipliers", "int64", ("num_ngram_layers", "max_ngram_size"), align=8),
            TensorArg("vocab_sizes", "int32",
                      ("num_ngram_layers", lambda s: s["max_ngram_size"] - 1, "num_embed_table_per_ngram"),
                      align=lambda s, c: 4 * c["vec"]),
            TensorArg("offsets", "int32", ("num_ngram_layers", num_out_cols), align=lambda s, c: 4 * c["vec"]),
        ),
        outputs=(
            TensorArg("output", "int32", ("num_ngram_layers", "num_tokens", num_out_cols),
                      align=lambda s, c: 4 * c["vec"]),
        ),
        make_inputs=make_inputs,
        reference=reference,
        tolerance=Tolerance(exact=True),
        bytes_moved=_bytes,
        examples=(
            {"num_tokens": 8192, "max_ngram_size": 3, "num_ngram_layers": 2, "num_embed_table_per_ngram": 8},
            {"num_tokens": 65536, "max_ngram_size": 3, "num_ngram_layers": 2, "num_embed_table_per_ngram": 8},
            {"num_tokens": 4096, "max_ngram_size": 4, "num_ngram_layers": 1, "num_embed_table_per_ngram": 6},
        ),
    )
)
