"""mhc_multilayer_recompute: the layer inputs and residuals of num_layers mHC blocks, in one pass.

TileKernels' `modeling.mhc.ops.mhc_multilayer_recompute` (activation recomputation): from the first
layer's residual streams and every layer's mixes and layer output, it recomputes what the per-layer ops
computed in the forward,

    layer_input[l] = pre_apply_mix(res_l, pre_mix[l])                                  l < num_layers
    res_{l+1} = residual[l] = mhc_post_fwd(layer_output[l], res_l, post_mix[l], comb_mix[l])   l < num_post

with res_0 = initial_residual and num_post = num_layers or num_layers - 1 (the last layer's input
without its post). A token's streams stay in registers across the layers (float32 copies of the bf16
values), so the residuals are read once and written once instead of read back per layer.

Bit-identical to tkjit's unfused ops, one float operation for one: the layer input is pre_apply_mix's
sum (a float32 accumulator from +0.0, one fma per stream in order, rounded once), the residual is
mhc_post_fwd's as nvcc compiles it (`_post.forward_fma32`: fma(post, x, comb[0] * res[0]), then one fma per
stream), spelled here with explicit __fmul_rn / __fmaf_rn so that no contraction choice is left to
nvcc. The reference replays both exactly (`pre_apply_mix.mix_streams`, `_post.forward_fma32`).

The per-layer tensors come stacked: pre_mix (num_layers, num_tokens, mhc_mult), layer_output
(num_post, num_tokens, hidden), ... (tkjit's ABI has no tensor lists; TileKernels' lists are stacked by
the compat entry point, a copy unless they already are slices of one buffer). num_post >= 1: with no
post, the op is pre_apply_mix itself (the ops call that kernel).

Layout `_streams` (TileKernels' rows: a block's `rows` tokens, threads // rows lanes each, a lane's
`unroll` vectors of vec_bytes), each lane holding its vectors of all mhc_mult streams in float32 for
the whole run: mhc_mult * unroll * vec values, capped (MAX_STATE) to stay in registers. The mixes are
warp-uniform scalar loads (one transaction per warp). `unroll_layers` unrolls the layer loop, so that
the compiler may issue a layer's loads before the previous layer's stores.
"""

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Static, TensorArg
from tkjit_kernels.mhc._post import forward_fma32
from tkjit_kernels.mhc._streams import COMMON, PARAMS, geometry, random_streams
from tkjit_kernels.mhc._streams import constraint as row_constraint
from tkjit_kernels.moe._fused_rows import SPACE

MAX_LAYERS = 64
MAX_STATE = 64  # float32 stream values a lane keeps (its residual; the new residual doubles it)
DEFAULT_STATE = 32
UNROLL_LAYERS = 16  # the default unrolls the layer loop up to this many layers
ELEM = 2

RECOMPUTE_PARAMS = PARAMS + (
    Static("num_layers", lo=1, hi=MAX_LAYERS, default=10, doc="layers: entries of pre_mix_list / layer_input_list"),
    Static("num_post", lo=1, hi=MAX_LAYERS, default=9,
           doc="layers with a post mix: num_layers or num_layers - 1 (entries of layer_output_list, ...)"),
)


def check_shape(shape):
    L, P = shape["num_layers"], shape["num_post"]
    if P not in (L, L - 1):
        return f"num_post={P} must be num_layers={L} or num_layers - 1"
    return None


def state(shape, c) -> int:
    """float32 residual values one lane keeps: mhc_mult streams of its unroll vectors."""
    return shape["mhc_mult"] * c["unroll"] * c["vec_bytes"] // ELEM


def constraint(shape, c):
    problem = row_constraint(shape, c)
    if problem:
        return problem
    if state(shape, c) > MAX_STATE:
        return (f"mhc_mult * unroll * vec = {state(shape, c)} float32 residual values per lane (twice that with the "
                f"new residual): more than {MAX_STATE} spill registers")
    return None


def default(shape):
    """The widest vectors that keep <= DEFAULT_STATE values per lane (else <= MAX_STATE); then the fewest
    idle vector slots, 128 threads, the most vectors per lane (fewer mix loads per element), the fewest rows
    per block; the layer loop unrolled up to UNROLL_LAYERS layers."""
    unrolled = shape["num_layers"] <= UNROLL_LAYERS
    for cap in (DEFAULT_STATE, MAX_STATE):
        best = None
        for vb in (16, 8, 4, 2):
            for threads in (128, 64, 256):
                for rows in SPACE["rows"]:
                    for unroll in SPACE["unroll"]:
                        c = {"threads": threads, "rows": rows, "vec_bytes": vb, "unroll": unroll,
                             "unroll_layers": unrolled}
                        if constraint(shape, c) or state(shape, c) > cap:
                            continue
                        _, hv, _, chunk, chunks, _ = geometry(shape, c)
                        score = (-vb, chunks * chunk - hv, threads != 128, -unroll, rows)
                        if best is None or score < best[0]:
                            best = (score, c)
        if best is not None:
            return best[1]
    raise AssertionError(f"no config for {shape}")  # unreachable: 2-byte vectors of 16 streams fit MAX_STATE


def build(shape, c):
    from tilelang import language as T

    M, H, L, P = shape["mhc_mult"], shape["hidden"], shape["num_layers"], shape["num_post"]
    vec, hv, lanes, chunk, chunks, guard = geometry(shape, c)
    R, U, threads = c["rows"], c["unroll"], c["threads"]
    E = U * vec  # values per stream a lane keeps
    layers = T.unroll if c["unroll_layers"] else T.serial
    num_tokens = T.dynamic("num_tokens")
    bf16, f32, i64 = T.bfloat16, T.float32, "int64"

    @T.prim_func
    def mhc_multilayer_recompute(
        initial_residual: T.Tensor[(num_tokens, M, H), bf16],
        pre_mix: T.Tensor[(L, num_tokens, M), f32],
        layer_output: T.Tensor[(P, num_tokens, H), bf16],
        post_mix: T.Tensor[(P, num_tokens, M), f32],
        comb_mix: T.Tensor[(P, num_tokens, M, M), f32],
        layer_input: T.Tensor[(L, num_tokens, H), bf16],
        residual: T.Tensor[(P, num_tokens, M, H), bf16],
    ):
        with T.Kernel(T.ceildiv(num_tokens, R), chunks, threads=threads) as (bx, by):
            tx = T.get_thread_binding()
            res = T.alloc_local((M, E), f32)  # the streams, float32 copies of bf16 values
            nres = T.alloc_local((M, E), f32)
            acc = T.alloc_local((E,), f32)
            io = T.alloc_local((E,), bf16)
            lo = T.alloc_local((E,), bf16)
            w = T.alloc_local((M,), f32)
            pm = T.alloc_local((M,), f32)
            cm = T.alloc_local((M, M), f32)
            row = bx * R + tx // lanes
            first = by * chunk + tx % lanes  # this lane's first vector; then every `lanes` vectors
            if row < num_tokens:
                t = T.cast(row, i64)
                for m in T.unroll(M):
                    for u in T.unroll(U):
                        if (not guard) or first + u * lanes < hv:
                            for v in T.vectorized(vec):
                                io[u * vec + v] = initial_residual[t, m, (first + u * lanes) * vec + v]
                    for e in T.unroll(E):
                        res[m, e] = T.cast(io[e], f32)

                for l in layers(L):
                    li = T.cast(l, i64)
                    # pre_apply_mix: acc = fma(pre_mix[m], res[m], acc) from +0.0, in stream order
                    for m in T.unroll(M):
                        w[m] = pre_mix[li, t, m]
                    for e in T.unroll(E):
                        acc[e] = T.float32(0)
                    for m in T.unroll(M):
                        for e in T.unroll(E):
                            acc[e] = T.call_extern("float32", "__fmaf_rn", w[m], res[m, e], acc[e])
                    for e in T.unroll(E):
                        io[e] = T.cast(acc[e], bf16)
                    for u in T.unroll(U):
                        if (not guard) or first + u * lanes < hv:
                            for v in T.vectorized(vec):
                                layer_input[li, t, (first + u * lanes) * vec + v] = io[u * vec + v]
                    if l < P:
                        # mhc_post_fwd: fma(post[o], x, comb[0, o] * res[0]), then fma(comb[m, o], res[m], .)
                        for m in T.unroll(M):
                            pm[m] = post_mix[li, t, m]
                        for m in T.unroll(M):
                            for o in T.unroll(M):
                                cm[m, o] = comb_mix[li, t, m, o]
                        for u in T.unroll(U):
                            if (not guard) or first + u * lanes < hv:
                                for v in T.vectorized(vec):
                                    lo[u * vec + v] = layer_output[li, t, (first + u * lanes) * vec + v]
                        for o in T.unroll(M):
                            for e in T.unroll(E):
                                acc[e] = T.call_extern("float32", "__fmul_rn", cm[0, o], res[0, e])
                                acc[e] = T.call_extern("float32", "__fmaf_rn", pm[o], T.cast(lo[e], f32), acc[e])
                                for m in T.unroll(1, M):
                                    acc[e] = T.call_extern("float32", "__fmaf_rn", cm[m, o], res[m, e], acc[e])
                                io[e] = T.cast(acc[e], bf16)
                                nres[o, e] = T.cast(io[e], f32)
                            for u in T.unroll(U):
                                if (not guard) or first + u * lanes < hv:
                                    for v in T.vectorized(vec):
                                        residual[li, t, o, (first + u * lanes) * vec + v] = io[u * vec + v]
                        for m in T.unroll(M):
                            for e in T.unroll(E):
                                res[m, e] = nres[m, e]

    return mhc_multilayer_recompute


def random_mixes(g, shape, count, seed):
    """count layers of (pre_mix, post_mix, comb_mix) float32 as TileKernels' test draws them (standard
    normal); odd seeds zero some (a -0 product then meets the +0.0 start of the sums)."""
    n, m = shape["num_tokens"], shape["mhc_mult"]
    pre = torch.randn(count, n, m, generator=g)
    post = torch.randn(count, n, m, generator=g)
    comb = torch.randn(count, n, m, m, generator=g)
    if seed % 2 == 1:
        pre[:, ::3, 0] = 0.0
        post[:, 1::4, -1] = 0.0
        comb[:, 2::5, 0, :] = 0.0
    return pre, post, comb


def make_inputs(shape, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    L, P = shape["num_layers"], shape["num_post"]
    residual = random_streams(g, shape, shape["mhc_mult"], seed)
    outputs = torch.stack([random_streams(g, shape, 1, seed)[:, 0] for _ in range(P)])
    pre, post, comb = random_mixes(g, shape, L, seed)
    tensors = (residual, pre, outputs, post[:P].contiguous(), comb[:P].contiguous())
    return tuple(t.to(device) for t in tensors)


CHUNK_ELEMS = 1 << 18  # stream elements a chunk of tokens the reference replays at once


def recompute(initial_residual, pre_mix, layer_output, post_mix, comb_mix):
    """(layer_input (num_layers, t, hidden), residual (num_post, t, mhc, hidden)) bf16 on the CPU: each
    layer as tkjit's pre_apply_mix and mhc_post_fwd kernels compute it, exactly.

    Tokens are independent: the replay runs over chunks of about CHUNK_ELEMS stream elements, whose float64
    temporaries (a dozen per fma) stay in the CPU's caches; over all tokens at once it was memory-bound, 2.5-5x
    slower (19-25 s against 4.7-7.5 s at 1024 tokens x 4 x 2560 x 10 layers, 2 cores), minutes at the benchmark
    shapes."""
    t, m, h = initial_residual.shape
    step = max(1, CHUNK_ELEMS // (m * h))
    if t <= step:
        return _recompute(initial_residual, pre_mix, layer_output, post_mix, comb_mix)
    parts = [_recompute(initial_residual[i:i + step], pre_mix[:, i:i + step], layer_output[:, i:i + step],
                        post_mix[:, i:i + step], comb_mix[:, i:i + step]) for i in range(0, t, step)]
    return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)


def _recompute(initial_residual, pre_mix, layer_output, post_mix, comb_mix):
    from tkjit_kernels.mhc.pre_apply_mix import mix_streams

    res = initial_residual.cpu()
    inputs, residuals = [], []
    for l in range(pre_mix.shape[0]):
        inputs.append(mix_streams(res, pre_mix[l]).to(torch.bfloat16))
        if l < layer_output.shape[0]:
            res = forward_fma32(layer_output[l], res, post_mix[l], comb_mix[l]).to(torch.bfloat16)
            residuals.append(res)
    t, m, h = initial_residual.shape
    stack = lambda xs, shape: torch.stack(xs) if xs else torch.empty(shape, dtype=torch.bfloat16)  # noqa: E731
    return stack(inputs, (0, t, h)), stack(residuals, (0, t, m, h))


def reference(shape, initial_residual, pre_mix, layer_output, post_mix, comb_mix):
    li, res = recompute(initial_residual, pre_mix, layer_output, post_mix, comb_mix)
    return li.to(initial_residual.device), res.to(initial_residual.device)


def _rows(s, streams):
    return s["num_tokens"] * streams * s["hidden"] * ELEM


def bytes_moved(s):
    """TileKernels' io_fused: the first residual read once; per layer its pre mix and input written; per
    post layer its output read, its post and comb mixes, its residual written."""
    n, m, L, P = s["num_tokens"], s["mhc_mult"], s["num_layers"], s["num_post"]
    return (_rows(s, m) + L * (n * m * 4 + _rows(s, 1))
            + P * (_rows(s, 1) + n * m * 4 + n * m * m * 4 + _rows(s, m)))


def _align(shape, c):
    return c["vec_bytes"]


SPEC = register(
    KernelSpec(
        name="mhc_multilayer_recompute",
        doc="mHC recompute: num_layers layer inputs and residuals (pre_apply_mix, mhc_post_fwd) in one pass",
        build=build,
        inputs=(
            TensorArg("initial_residual", "bfloat16", ("num_tokens", "mhc_mult", "hidden"), align=_align),
            TensorArg("pre_mix", "float32", ("num_layers", "num_tokens", "mhc_mult"), align=4),
            TensorArg("layer_output", "bfloat16", ("num_post", "num_tokens", "hidden"), align=_align),
            TensorArg("post_mix", "float32", ("num_post", "num_tokens", "mhc_mult"), align=4),
            TensorArg("comb_mix", "float32", ("num_post", "num_tokens", "mhc_mult", "mhc_mult"), align=4),
        ),
        outputs=(
            TensorArg("layer_input", "bfloat16", ("num_layers", "num_tokens", "hidden"), align=_align),
            TensorArg("residual", "bfloat16", ("num_post", "num_tokens", "mhc_mult", "hidden"), align=_align),
        ),
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=bytes_moved,
        flops=lambda s: 2 * s["num_tokens"] * s["hidden"] * s["mhc_mult"] * (
            s["num_layers"] + s["num_post"] * (s["mhc_mult"] + 1)),
        examples=(
            {"num_tokens": 8192, "mhc_mult": 4, "hidden": 7168, "num_layers": 10, "num_post": 9},
            {"num_tokens": 8192, "mhc_mult": 4, "hidden": 2560, "num_layers": 10, "num_post": 10},
            {"num_tokens": 4096, "mhc_mult": 4, "hidden": 4096, "num_layers": 1, "num_post": 1},
        ),
        **{**COMMON, "params": RECOMPUTE_PARAMS, "space": {**SPACE, "unroll_layers": (False, True)},
           "default": default, "constraint": constraint},
        check_shape=check_shape,
    )
)
