"""reduce_fused: each token's rows of the fused (per-expert) layout summed back, weighted, bit-exactly.

x (num_expanded_tokens, hidden) bfloat16/float16/float32/float8_e4m3fn, token_topk_to_pos int32 (num_tokens, num_topk),
optional topk_weights float32 (num_tokens, num_topk), x_sf float32 (num_expanded_tokens,) and sf
float32 (1,) -> out (num_tokens, hidden) of x's dtype, or float8_e4m3fn (`e4m3_out`). TileKernels'
`moe.reduce_fused`, which takes x of any float dtype (an e4m3 x with its per-row x_sf is a QuantTensor):

    acc = +0.0 (float32)
    for k in order, for each p = token_topk_to_pos[t, k] in [0, num_expanded_tokens):
        s = topk_weights[t, k] (or 1.0), times x_sf[p] when given (a float32 product)
        acc = fma(float(x[p]), s, acc)            (one rounding: a fused multiply-add)
    out[t] = cast(acc * sf[0] when given, else acc)

-1 and any other out-of-range position is skipped (never read through). An e4m3 output (e4m3_out, or
an e4m3 x without it) saturates to +-448 (NaN stays NaN), as TileKernels' kernel does (its torch
reference's cast gives NaN beyond 448). sf is only for the e4m3 output (TileKernels asserts it).

Layout (`_fused_rows`): a block handles `rows` tokens over one chunk of the hidden axis; each lane
accumulates its `unroll` vectors in float32 registers over the token's slots (the slot's row
loaded as `vec_bytes`-byte vectors), then scales, casts and stores them.
Tunables: threads, rows per block, vector width in bytes, vectors per lane (unroll: chunk size).
"""

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Runtime, Static, TensorArg, Tolerance, cuda_only, plain_threads
from tkjit_kernels.moe._fused_rows import SPACE, geometry, random_mapping
from tkjit_kernels.moe._fused_rows import constraint as row_constraint
from tkjit_kernels.moe._fused_rows import default as row_default

IN_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")
ELEM = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
FP8_MAX = 448.0
MAX_UNROLLED_K = 16  # more slots than this run as a loop


def out_dtype(shape) -> str:
    return "float8_e4m3fn" if shape["e4m3_out"] else shape["in_dtype"]


def default(shape):
    return row_default(shape["hidden"], ELEM[shape["in_dtype"]])


def constraint(shape, c):
    return row_constraint(shape["hidden"], ELEM[shape["in_dtype"]], c)


def check_shape(shape):
    if shape["has_sf"] and not shape["e4m3_out"]:
        return "has_sf needs e4m3_out: only the FP8 output takes sf (as in TileKernels)"
    return None


arch_constraint = cuda_only("thread-indexed vector loads and __fmaf_rn")


pass_configs = plain_threads


def build(shape, c):
    from tilelang import language as T

    H, K, in_dt, o_dt = shape["hidden"], shape["num_topk"], shape["in_dtype"], out_dtype(shape)
    has_w, has_x_sf, has_sf = shape["has_weights"], shape["has_x_sf"], shape["has_sf"]
    vec, hv, lanes, chunk, chunks = geometry(H, ELEM[in_dt], c)
    R, U, threads = c["rows"], c["unroll"], c["threads"]
    guard = hv % chunk != 0  # the last chunk runs past the row: guard its vectors
    slots = T.unroll if K <= MAX_UNROLLED_K else T.serial
    num_tokens = T.dynamic("num_tokens")
    num_expanded_tokens = T.dynamic("num_expanded_tokens")
    f32 = T.float32
    w = min(vec, 4)  # the e4m3 cast's vector: float4 at most

    def saturated(a):
        # Saturate (NaN compares false and stays NaN); the cast then rounds to nearest even.
        return T.cast(T.if_then_else(a > T.float32(FP8_MAX), T.float32(FP8_MAX),
                                     T.if_then_else(a < T.float32(-FP8_MAX), T.float32(-FP8_MAX), a)), o_dt)

    def reduce_fused(
        x: T.Tensor[(num_expanded_tokens, H), in_dt],
        topk_weights: T.Tensor[(num_tokens, K), f32] = None,
        token_topk_to_pos: T.Tensor[(num_tokens, K), T.int32] = None,
        sf: T.Tensor[(1,), f32] = None,
        x_sf: T.Tensor[(num_expanded_tokens,), f32] = None,
        out: T.Tensor[(num_tokens, H), o_dt] = None,
    ):
        with T.Kernel(T.ceildiv(num_tokens, R), chunks, threads=threads) as (bx, by):
            tx = T.get_thread_binding()
            acc = T.alloc_local((U * vec,), f32)
            xs = T.alloc_local((U * vec,), in_dt)
            ys = T.alloc_local((U * vec,), o_dt)
            s = T.alloc_local((1,), f32)
            row = bx * R + tx // lanes
            first = by * chunk + tx % lanes  # this lane's first vector; then every `lanes` vectors
            if row < num_tokens:
                for e in T.unroll(U * vec):
                    acc[e] = T.float32(0)
                for k in slots(K):
                    pos = token_topk_to_pos[row, k]
                    if (pos >= 0) & (pos < num_expanded_tokens):  # out-of-range slots are skipped
                        if has_w:
                            s[0] = topk_weights[row, k]
                        else:
                            s[0] = T.float32(1.0)
                        if has_x_sf:
                            s[0] = s[0] * x_sf[pos]
                        for u in T.unroll(U):
                            if guard:
                                if first + u * lanes < hv:
                                    for v in T.vectorized(vec):
                                        xs[u * vec + v] = x[T.cast(pos, "int64"), (first + u * lanes) * vec + v]
                            else:
                                for v in T.vectorized(vec):
                                    xs[u * vec + v] = x[T.cast(pos, "int64"), (first + u * lanes) * vec + v]
                        for e in T.unroll(U * vec):
                            # One rounding per slot, as TileKernels (its reference is compiled to an FMA).
                            acc[e] = T.call_extern("float32", "__fmaf_rn", T.cast(xs[e], f32), s[0], acc[e])
                if o_dt == "float8_e4m3fn":
                    if has_sf:
                        for e in T.unroll(U * vec):
                            acc[e] = acc[e] * sf[0]
                    if vec >= 2:
                        # A vectorized cast (float4 / float2 pieces): TileLang lowers it to
                        # __nv_cvt_float2_to_fp8x2(.., __NV_SATFINITE, __NV_E4M3), one cvt per pair, which
                        # saturates to +-448, keeps NaN and rounds to nearest even, as TileKernels' kernel
                        # casts (before: a clamp and a scalar cast per element, the same values).
                        for h in T.unroll(U * vec // w):
                            for v in T.vectorized(w):
                                ys[h * w + v] = T.cast(acc[h * w + v], o_dt)
                    else:
                        for e in T.unroll(U * vec):
                            ys[e] = saturated(acc[e])
                else:
                    for e in T.unroll(U * vec):
                        if has_sf:
                            acc[e] = acc[e] * sf[0]
                        ys[e] = T.cast(acc[e], o_dt)
                for u in T.unroll(U):
                    if guard:
                        if first + u * lanes < hv:
                            for v in T.vectorized(vec):
                                out[T.cast(row, "int64"), (first + u * lanes) * vec + v] = ys[u * vec + v]
                    else:
                        for v in T.vectorized(vec):
                            out[T.cast(row, "int64"), (first + u * lanes) * vec + v] = ys[u * vec + v]

    # The variant's parameters: an absent optional input is left out of the PrimFunc's signature.
    for name, present in (("topk_weights", has_w), ("sf", has_sf), ("x_sf", has_x_sf)):
        if not present:
            del reduce_fused.__annotations__[name]
    return T.prim_func(reduce_fused)


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 fma(a, b, c) rounded once (nearest even), exactly, from float64 arithmetic.

    a * b is exact in float64 (24 + 24 bits); a + b rounded to float64 then to float32 can be
    wrong only when the float64 sum lands exactly on a float32 midpoint while the exact sum is not
    there: TwoSum gives the float64 sum's exact error, whose sign says on which side the true value
    lies."""
    p = a.double() * b.double()
    c64 = c.double()
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)  # TwoSum: s + err == p + c exactly
    r = s.float()
    rd = r.double()
    nb = torch.nextafter(r, torch.where(s > rd, torch.inf, -torch.inf).float())  # the other neighbour
    tie = (s != rd) & (s == (rd + nb.double()) * 0.5) & (err != 0) & torch.isfinite(s)
    exact_toward_nb = (err > 0) == (nb.double() > rd)
    return torch.where(tie & exact_toward_nb, nb, r)


def make_inputs(shape, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    n, h, k, p = shape["num_tokens"], shape["hidden"], shape["num_topk"], shape["num_expanded_tokens"]
    x = torch.randn(p, h, generator=g) * torch.exp(torch.randn(p, 1, generator=g))
    if out_dtype(shape) == "float8_e4m3fn" and seed % 2 == 1 and p:
        x[torch.randint(0, p, (max(1, p // 16),), generator=g)] *= 300  # sums past 448: saturation
    if shape["in_dtype"] == "float8_e4m3fn":
        x = x.clamp(-FP8_MAX, FP8_MAX)  # (torch's cast gives NaN past 448)
    x = x.to(getattr(torch, shape["in_dtype"]))
    pos, _ = random_mapping(g, n, k, p, seed)
    w = torch.rand(n, k, generator=g) if shape["has_weights"] else None
    sf = (torch.rand(1, generator=g) + 0.5) if shape["has_sf"] else None
    x_sf = (torch.rand(p, generator=g) * 2) if shape["has_x_sf"] else None
    # The variant's inputs only (an absent optional left out), as its kernel takes them positionally.
    return tuple(t.to(device) for t in (x, w, pos, sf, x_sf) if t is not None)


def split_inputs(shape, args):
    """(x, topk_weights, token_topk_to_pos, sf, x_sf) from the variant's inputs, None for the absent ones."""
    args = list(args)
    x = args.pop(0)
    w = args.pop(0) if shape["has_weights"] else None
    pos = args.pop(0)
    sf = args.pop(0) if shape["has_sf"] else None
    x_sf = args.pop(0) if shape["has_x_sf"] else None
    return x, w, pos, sf, x_sf


def reference(shape, *inputs):
    x, topk_weights, token_topk_to_pos, sf, x_sf = split_inputs(shape, inputs)
    p = x.shape[0]
    n, k = token_topk_to_pos.shape
    acc = torch.zeros((n, x.shape[1]), dtype=torch.float32, device=x.device)
    for j in range(k):
        pos = token_topk_to_pos[:, j].long()
        ok = (pos >= 0) & (pos < p)
        safe = pos.clamp(0, max(p - 1, 0))
        if not bool(ok.any()):
            continue
        rows = x[safe].float()
        s = topk_weights[:, j].clone() if topk_weights is not None else torch.ones(n, device=x.device)
        if x_sf is not None:
            s = s * x_sf[safe]
        acc = torch.where(ok[:, None], fma32(rows, s[:, None].expand_as(rows), acc), acc)
    if sf is not None:
        acc = acc * sf[0]
    if out_dtype(shape) == "float8_e4m3fn":
        acc = torch.where(acc.isnan(), acc, acc.clamp(-FP8_MAX, FP8_MAX))
    return acc.to(getattr(torch, out_dtype(shape)))


def bytes_moved(s):
    e, eo = ELEM[s["in_dtype"]], ELEM[out_dtype(s)]
    n, h, k = s["num_tokens"], s["hidden"], s["num_topk"]
    # every slot's row read once (get_fused_mapping maps ~all slots), each token's row written
    return n * k * (h * e + 4 + 4 * s["has_weights"] + 4 * s["has_x_sf"]) + n * h * eo


def _out_align(s, c):
    return c["vec_bytes"] // ELEM[s["in_dtype"]] * ELEM[out_dtype(s)]


SPEC = register(
    KernelSpec(
        name="reduce_fused",
        family="moe",
        doc="sum each token's fused-layout rows, weighted, with one FMA per slot (bit-exact)",
        params=(
            Runtime("num_tokens", hi=1 << 24, doc="tokens; runtime size, tuned per power-of-two bucket"),
            Runtime("num_expanded_tokens", hi=1 << 28, doc="rows of the fused layout (x's rows)"),
            Static("hidden", lo=1, hi=1 << 16, default=7168, doc="elements per row"),
            Static("num_topk", lo=1, hi=1024, default=8, doc="slots per token"),
            Static("in_dtype", type=str, values=IN_DTYPES, default="bfloat16", doc="x's dtype"),
            Static("e4m3_out", type=bool, default=False, doc="float8_e4m3fn output (fp8_format='e4m3')"),
            Static("has_weights", type=bool, default=True, doc="topk_weights given"),
            Static("has_x_sf", type=bool, default=False, doc="per-row scale x_sf given (x is a QuantTensor)"),
            Static("has_sf", type=bool, default=False, doc="output scale sf given (e4m3_out only)"),
        ),
        space=dict(SPACE),
        default=default,
        constraint=constraint,
        arch_constraint=arch_constraint,
        check_shape=check_shape,
        pass_configs=pass_configs,
        build=build,
        inputs=(
            TensorArg("x", lambda s: s["in_dtype"], ("num_expanded_tokens", "hidden"),
                      align=lambda s, c: c["vec_bytes"]),
            TensorArg("topk_weights", "float32", ("num_tokens", "num_topk"), align=4, optional="has_weights"),
            TensorArg("token_topk_to_pos", "int32", ("num_tokens", "num_topk"), align=4),
            TensorArg("sf", "float32", (1,), align=4, optional="has_sf"),
            TensorArg("x_sf", "float32", ("num_expanded_tokens",), align=4, optional="has_x_sf"),
        ),
        outputs=(TensorArg("out", out_dtype, ("num_tokens", "hidden"), align=_out_align),),
        make_inputs=make_inputs,
        reference=reference,
        tolerance=Tolerance(exact=True),
        bytes_moved=bytes_moved,
        examples=(
            {"num_tokens": 8192, "num_expanded_tokens": 8192 * 8 + 256 * 64, "hidden": 7168, "num_topk": 8},
            {"num_tokens": 4096, "num_expanded_tokens": 4096 * 8 + 256 * 64, "hidden": 4096, "num_topk": 8},
            {"num_tokens": 8192, "num_expanded_tokens": 8192 * 8 + 256 * 64, "hidden": 7168, "num_topk": 8,
             "e4m3_out": True, "has_x_sf": True, "has_sf": True},
            {"num_tokens": 4096, "num_expanded_tokens": 4096 * 6 + 72 * 64, "hidden": 2048, "num_topk": 6,
             "in_dtype": "float32", "has_weights": False},
        ),
    )
)
