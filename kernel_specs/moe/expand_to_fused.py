"""expand_to_fused: token rows copied into the fused (per-expert, padded) layout, bit-exactly.

x (num_tokens, hidden), token_topk_to_pos int32 (num_tokens, num_topk), pos_to_expert int32
(num_expanded_tokens,) -> out (num_expanded_tokens, hidden) of x's dtype (TileKernels'
`moe.expand_to_fused`, on the mapping `get_fused_mapping` builds):
  * a padding row (pos_to_expert[p] < 0) is zero;
  * each (t, k) with a position p = token_topk_to_pos[t, k] in [0, num_expanded_tokens) whose row is
    not padding gets a copy of x[t];
  * -1, and any other out-of-range position, is skipped (never read or written through);
  * a row that is neither padding nor mapped is left as it was (not written), as in TileKernels'
    kernel (its torch reference zeroes it; get_fused_mapping never makes one).
A position mapped from a padding row's slot is dropped, so the padding row stays zero (TileKernels'
kernel races there); two slots mapped to one position leave one of their rows (unspecified).

Layout (`_fused_rows`): a block handles `rows` rows of the grid's max(num_tokens,
num_expanded_tokens) at once, over one chunk of the hidden axis. For its row r it zeroes out[r]'s
chunk when r is a padding position, then loads x[r]'s chunk once into registers and stores it to
each of the token's valid positions (the k stores of a vector share one load).
Tunables: threads, rows per block, vector width in bytes, vectors per lane (unroll: chunk size).
"""

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Runtime, Static, TensorArg, Tolerance, cuda_only, plain_threads
from tkjit_kernels.moe._fused_rows import ELEM_BYTES, SPACE, geometry, random_mapping
from tkjit_kernels.moe._fused_rows import constraint as row_constraint
from tkjit_kernels.moe._fused_rows import default as row_default

DTYPES = tuple(ELEM_BYTES)
MAX_UNROLLED_K = 16  # more slots than this run as a loop


def default(shape):
    return row_default(shape["hidden"], ELEM_BYTES[shape["dtype"]])


def constraint(shape, c):
    return row_constraint(shape["hidden"], ELEM_BYTES[shape["dtype"]], c)


arch_constraint = cuda_only("thread-indexed vector copies")


pass_configs = plain_threads


def build(shape, c):
    from tilelang import language as T

    H, K, dt = shape["hidden"], shape["num_topk"], shape["dtype"]
    vec, hv, lanes, chunk, chunks = geometry(H, ELEM_BYTES[dt], c)
    R, U, threads = c["rows"], c["unroll"], c["threads"]
    guard = hv % chunk != 0  # the last chunk runs past the row: guard its vectors
    slots = T.unroll if K <= MAX_UNROLLED_K else T.serial
    num_tokens = T.dynamic("num_tokens")
    num_expanded_tokens = T.dynamic("num_expanded_tokens")

    @T.prim_func
    def expand_to_fused(
        x: T.Tensor[(num_tokens, H), dt],
        token_topk_to_pos: T.Tensor[(num_tokens, K), T.int32],
        pos_to_expert: T.Tensor[(num_expanded_tokens,), T.int32],
        out: T.Tensor[(num_expanded_tokens, H), dt],
    ):
        with T.Kernel(T.ceildiv(T.max(num_tokens, num_expanded_tokens), R), chunks, threads=threads) as (bx, by):
            tx = T.get_thread_binding()
            xs = T.alloc_local((U * vec,), dt)
            row = bx * R + tx // lanes
            first = by * chunk + tx % lanes  # this lane's first vector; then every `lanes` vectors
            if row < num_expanded_tokens:
                if pos_to_expert[row] < 0:
                    for u in T.unroll(U):
                        if (not guard) or first + u * lanes < hv:
                            for v in T.vectorized(vec):
                                out[T.cast(row, "int64"), (first + u * lanes) * vec + v] = T.cast(T.float32(0), dt)
            if row < num_tokens:
                for u in T.unroll(U):
                    if (not guard) or first + u * lanes < hv:
                        for v in T.vectorized(vec):
                            xs[u * vec + v] = x[T.cast(row, "int64"), (first + u * lanes) * vec + v]
                for k in slots(K):
                    pos = token_topk_to_pos[row, k]
                    # Out-of-range positions are skipped; a padding row keeps its zeros.
                    if (pos >= 0) & (pos < num_expanded_tokens):
                        if pos_to_expert[pos] >= 0:
                            for u in T.unroll(U):
                                if (not guard) or first + u * lanes < hv:
                                    for v in T.vectorized(vec):
                                        out[T.cast(pos, "int64"), (first + u * lanes) * vec + v] = xs[u * vec + v]

    return expand_to_fused


def _bits(t):
    """The tensor's bits as an int tensor of the same element size (index ops on fp8 everywhere)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def make_inputs(shape, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    n, h, k, p = shape["num_tokens"], shape["hidden"], shape["num_topk"], shape["num_expanded_tokens"]
    x = (torch.randn(n, h, generator=g) * 4).to(torch_dtype(shape["dtype"]))
    pos, pos_to_expert = random_mapping(g, n, k, p, seed)
    return x.to(device), pos.to(device), pos_to_expert.to(device)


def torch_dtype(name):
    return getattr(torch, name)


def reference(shape, x, token_topk_to_pos, pos_to_expert):
    n, k = token_topk_to_pos.shape
    p = pos_to_expert.shape[0]
    out = torch.zeros((p, x.shape[1]), dtype=x.dtype, device=x.device)
    pos = token_topk_to_pos.reshape(-1).long()
    ok = (pos >= 0) & (pos < p)
    ok &= pos_to_expert[pos.clamp(0, max(p - 1, 0))] >= 0 if p else ok
    src = torch.arange(n, device=x.device).repeat_interleave(k)
    _bits(out)[pos[ok]] = _bits(x)[src[ok]]
    return out


def bytes_moved(s):
    e = ELEM_BYTES[s["dtype"]]
    n, p, h, k = s["num_tokens"], s["num_expanded_tokens"], s["hidden"], s["num_topk"]
    return n * h * e + p * h * e + n * k * 4 + p * 4


SPEC = register(
    KernelSpec(
        name="expand_to_fused",
        family="moe",
        doc="copy each token's row to its fused-layout positions; padding rows zero (bit-exact)",
        params=(
            Runtime("num_tokens", hi=1 << 24, doc="tokens; runtime size, tuned per power-of-two bucket"),
            Runtime("num_expanded_tokens", hi=1 << 28, doc="rows of the fused layout (pos_to_expert's length)"),
            Static("hidden", lo=1, hi=1 << 16, default=7168, doc="elements per row"),
            Static("num_topk", lo=1, hi=1024, default=8, doc="slots per token"),
            Static("dtype", type=str, values=DTYPES, default="bfloat16", doc="element type (copied bit-exactly)"),
        ),
        space=dict(SPACE),
        default=default,
        constraint=constraint,
        arch_constraint=arch_constraint,
        pass_configs=pass_configs,
        build=build,
        inputs=(
            TensorArg("x", lambda s: s["dtype"], ("num_tokens", "hidden"), align=lambda s, c: c["vec_bytes"]),
            TensorArg("token_topk_to_pos", "int32", ("num_tokens", "num_topk"), align=4),
            TensorArg("pos_to_expert", "int32", ("num_expanded_tokens",), align=4),
        ),
        outputs=(
            TensorArg("out", lambda s: s["dtype"], ("num_expanded_tokens", "hidden"),
                      align=lambda s, c: c["vec_bytes"]),
        ),
        make_inputs=make_inputs,
        reference=reference,
        tolerance=Tolerance(exact=True),
        bytes_moved=bytes_moved,
        examples=(
            {"num_tokens": 8192, "num_expanded_tokens": 8192 * 8 + 256 * 64, "hidden": 7168, "num_topk": 8},
            {"num_tokens": 4096, "num_expanded_tokens": 4096 * 8 + 256 * 64, "hidden": 4096, "num_topk": 8},
            {"num_tokens": 4096, "num_expanded_tokens": 4096 * 6 + 72 * 64, "hidden": 576, "num_topk": 6},
            {"num_tokens": 8192, "num_expanded_tokens": 8192 * 8 + 256 * 64, "hidden": 7168, "num_topk": 8,
             "dtype": "float8_e4m3fn"},
        ),
    )
)
