"""swiglu_backward_and_per_token_cast: the SwiGLU backward of MoE expert rows, its input gradient cast per token.

Per expanded row r (num_expand_tokens rows of x = [a | b], 2 * hidden channels, FP8 e4m3 with one float32 scale
per num_per_channels channels) and its routing weight w = weight[t, k] for pos_to_token_topk[r] = t * num_topk + k
(w = 0 for a padding row, entry < 0, or one past the weights):
    a, b   = x * x_sf                               (one multiply each, float32)
    clamp  (use_clamp): a > c -> c; b > c -> c, b < -c -> -c   (c = swiglu_clamp_value, a runtime scalar)
    t      = 1 + exp(-a);   s = 1 / t               (IEEE expf and divisions)
    act    = a / t * b;     out = bf16(act * w)
    gws    = g * w * s      (g = float32(grad_out))
    da     = gws * b * fma(a, 1 - s, 1)  (0 where a was clamped);   db = gws * a  (0 where b was clamped)
    x_grad = bf16([da | db]);  (x_grad_fp8, x_grad_sf) = per_token_cast([da | db], group num_per_channels)
    weight_grad[t, k] = sum over the row of g * act  (0 where token_topk_to_pos[t, k] < 0)
Semantics, operation order and dtypes follow TileKernels' `quant.swiglu_backward_and_per_token_cast` and its torch
reference (`torch.swiglu_backward`, then `torch.cast(..., 'e4m3', (1, num_per_channels), round_sf)` of the float32
gradient): out, x_grad and the cast are bit-exact with it on the GPU; the row sum weight_grad is a float32 sum in
another order (TileKernels' test compares it with atol=rtol=1e-4). The fma is the one TileKernels' reference
captures with torch.compile (nvcc contracts its kernel's `1 + a * (1 - s)`); here it is explicit (`__fmaf_rn`), and
the reference computes it exactly (`fma`). The spec's tolerance is relative (rtol 1e-3): `tkjit.testing.check`
runs the reference on the CPU, whose exp may differ from CUDA's expf by an ulp (a flipped bf16 / FP8 rounding);
the GPU tests compare the reference run on the GPU bit for bit.

The cast's groups are whole (hidden a multiple of num_per_channels, as TileKernels asserts): the a half's groups
are scales [0, hidden / npc), the b half's [hidden / npc, 2 * hidden / npc), as per_token_cast of the (E, 2 * hidden)
gradient lays them out.

Layout: one thread block per row (and, for rows < num_tokens * num_topk, the zeroing of weight_grad[row] when
token_topk_to_pos says that (token, k) went nowhere, as TileKernels does: the grid is max(E, num_tokens * num_topk)).
Thread tx handles chunks it * threads + tx of `vec` channels of both halves: loads of vec FP8 values of a and of b,
vec bf16 of grad_out, each chunk inside one scale group (vec divides num_per_channels), so a group's npc / vec
threads are consecutive lanes of one warp and its amax is a shuffle butterfly (`_group_amax.py`). A thread past
hidden in the last step computes zeros (the shuffles need every lane) and stores nothing; since groups are whole,
a group is wholly inside or outside. The row sum: per-thread partials, a warp butterfly, one shared-memory step.
"""

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Runtime, ScalarArg, Static, TensorArg, Tolerance, cuda_only, ieee_plain_threads
from tkjit_kernels.quant._group_amax import group_amax_macro
from tkjit_kernels.quant._per_channel import scale_blocks
from tkjit_kernels.quant.per_token_cast import reference as per_token_cast_reference

CHANNELS = (32, 128)  # TileKernels' num_per_channels
SPACE = {
    "vec": (4, 8, 16),  # channels per chunk: vec FP8 bytes of each half, 2 * vec bytes of grad_out
    "threads": (64, 128, 256, 512),  # one block per row
}


def _one(value: int) -> int:
    return 1  # the weights' rows add no tuning bucket: the work is the expanded rows


def check_shape(shape):
    h, npc = shape["hidden"], shape["num_per_channels"]
    if h % npc:
        return f"hidden={h} must be a multiple of num_per_channels={npc} (x's 2 * hidden of 2 * num_per_channels)"
    return None


def constraint(shape, c):
    npc, vec, threads = shape["num_per_channels"], c["vec"], c["threads"]
    if npc % vec:
        return f"vec={vec} must divide num_per_channels={npc} (a chunk inside one scale group)"
    if threads * vec > 2 * max(shape["hidden"], 512):
        return f"threads * vec = {threads * vec} channels per step is more than twice hidden={shape['hidden']}"
    return None


def default(shape):
    # 8 channels per chunk (8-byte FP8 loads, 16-byte bf16 loads and stores), and as many threads as cover a
    # row in about two steps (a row of 7168 channels: 512 threads; 2048: 128), at least 128.
    h = shape["hidden"]
    threads = 128
    while threads < 512 and threads * 8 * 2 < h:
        threads *= 2
    return {"vec": 8, "threads": threads}


arch_constraint = cuda_only("needs warp shuffles, bf16 and FP8 conversions")


pass_configs = ieee_plain_threads


def build(shape, c):
    from tilelang import language as T

    H, npc, K = shape["hidden"], shape["num_per_channels"], shape["num_topk"]
    use_clamp = shape["use_clamp"]
    vec, threads = c["vec"], c["threads"]
    tpg = npc // vec  # consecutive threads of one scale group
    ngh = H // npc  # scale groups per half
    steps = -(-H // (threads * vec))
    warps = threads // 32
    group_amax = group_amax_macro(T, per_thread=vec, tpg=tpg)
    scale_and_inv, quantise = scale_blocks(shape["round_scale"])
    E = T.dynamic("num_expand_tokens")
    N = T.dynamic("num_tokens")
    f32, bf16, fp8, i32 = T.float32, T.bfloat16, T.float8_e4m3fn, T.int32

    @T.prim_func
    def swiglu_backward_and_per_token_cast(
        x: T.Tensor[(E, 2 * H), fp8],
        x_sf: T.Tensor[(E, 2 * ngh), f32],
        grad_out: T.Tensor[(E, H), bf16],
        weight: T.Tensor[(N, K), f32],
        pos_to_token_topk: T.Tensor[(E,), i32],
        token_topk_to_pos: T.Tensor[(N, K), i32],
        out: T.Tensor[(E, H), bf16],
        x_grad_fp8: T.Tensor[(E, 2 * H), fp8],
        x_grad_sf: T.Tensor[(E, 2 * ngh), f32],
        x_grad: T.Tensor[(E, 2 * H), bf16],
        weight_grad: T.Tensor[(N, K), f32],
        swiglu_clamp_value: T.float32,
    ):
        with T.Kernel(T.max(E, N * K), threads=threads) as bx:
            tx = T.get_thread_binding()
            xa = T.alloc_local((vec,), fp8)
            xb = T.alloc_local((vec,), fp8)
            go = T.alloc_local((vec,), bf16)
            da = T.alloc_local((vec,), f32)
            db = T.alloc_local((vec,), f32)
            ob = T.alloc_local((vec,), bf16)
            am = T.alloc_local((1,), f32)
            amax = T.alloc_local((2,), f32)
            sf = T.alloc_local((2,), f32)
            inv = T.alloc_local((2,), f32)
            sfa = T.alloc_local((1,), f32)
            sfb = T.alloc_local((1,), f32)
            w = T.alloc_local((1,), f32)
            acc = T.alloc_local((1,), f32)
            idx = T.alloc_local((1,), i32)
            red = T.alloc_shared((warps,), f32)
            if bx < N * K:  # a (token, k) that went nowhere gets a zero gradient (no row writes it)
                if tx == 0:
                    if token_topk_to_pos[bx // K, bx % K] < 0:
                        weight_grad[bx // K, bx % K] = T.float32(0)
            if bx < E:
                row = T.cast(bx, "int64")  # int64: row offsets pass 2^31 elements for large x
                idx[0] = pos_to_token_topk[row]
                if idx[0] >= N * K:  # past the weights: a padding row, as a negative entry
                    idx[0] = -1
                w[0] = T.float32(0)
                if idx[0] >= 0:
                    w[0] = weight[idx[0] // K, idx[0] % K]
                acc[0] = T.float32(0)
                for it in T.serial(steps):
                    col = (it * threads + tx) * vec
                    live = col < H
                    if live:
                        for v in T.vectorized(vec):
                            xa[v] = x[row, col + v]
                        for v in T.vectorized(vec):
                            xb[v] = x[row, H + col + v]
                        for v in T.vectorized(vec):
                            go[v] = grad_out[row, col + v]
                        sfa[0] = x_sf[row, col // npc]
                        sfb[0] = x_sf[row, ngh + col // npc]
                    else:
                        for v in T.vectorized(vec):
                            xa[v] = T.cast(0, fp8)
                        for v in T.vectorized(vec):
                            xb[v] = T.cast(0, fp8)
                        for v in T.vectorized(vec):
                            go[v] = T.cast(0, bf16)
                        sfa[0] = T.float32(0)
                        sfb[0] = T.float32(0)
                    for v in T.unroll(vec):
                        a = T.alloc_var(f32)
                        b = T.alloc_var(f32)
                        a = T.cast(xa[v], f32) * sfa[0]
                        b = T.cast(xb[v], f32) * sfb[0]
                        ca = a > swiglu_clamp_value if use_clamp else False
                        cbu = b > swiglu_clamp_value if use_clamp else False
                        cbl = b < -swiglu_clamp_value if use_clamp else False
                        if use_clamp:
                            a = T.Select(ca, swiglu_clamp_value, a)
                            b = T.Select(cbu, swiglu_clamp_value, b)
                            b = T.Select(cbl, -swiglu_clamp_value, b)
                        g = T.cast(go[v], f32)
                        t = T.float32(1) + T.exp(-a)
                        act = T.ieee_fdiv(a, t) * b
                        acc[0] = acc[0] + g * act
                        s = T.ieee_fdiv(T.float32(1), t)
                        gws = g * w[0] * s
                        ob[v] = T.cast(act * w[0], bf16)
                        if use_clamp:
                            da[v] = T.Select(ca, T.float32(0), gws * b * T.ieee_fmaf(a, T.float32(1) - s, T.float32(1)))
                            db[v] = T.Select(T.Or(cbu, cbl), T.float32(0), gws * a)
                        else:
                            da[v] = gws * b * T.ieee_fmaf(a, T.float32(1) - s, T.float32(1))
                            db[v] = gws * a
                    group_amax(da, am, None, tx)
                    amax[0] = am[0]
                    group_amax(db, am, None, tx)
                    amax[1] = am[0]
                    scale_and_inv(amax, sf, inv, 0)
                    scale_and_inv(amax, sf, inv, 1)
                    if live:
                        for v in T.vectorized(vec):
                            out[row, col + v] = ob[v]
                        for v in T.vectorized(vec):
                            x_grad[row, col + v] = T.cast(da[v], bf16)
                        for v in T.vectorized(vec):
                            x_grad[row, H + col + v] = T.cast(db[v], bf16)
                        for v in T.vectorized(vec):
                            x_grad_fp8[row, col + v] = quantise(da[v], inv[0])
                        for v in T.vectorized(vec):
                            x_grad_fp8[row, H + col + v] = quantise(db[v], inv[1])
                        if tx % tpg == 0:
                            x_grad_sf[row, col // npc] = sf[0]
                            x_grad_sf[row, ngh + col // npc] = sf[1]
                # The row's dot product: a warp butterfly, then the warps' partials in order.
                for step in T.unroll(5):
                    acc[0] = acc[0] + T.shfl_xor(acc[0], 16 >> step)
                if tx % 32 == 0:
                    red[tx // 32] = acc[0]
                T.sync_threads()
                if tx == 0:
                    if idx[0] >= 0:
                        acc[0] = red[0]
                        for j in T.unroll(1, warps):
                            acc[0] = acc[0] + red[j]
                        weight_grad[idx[0] // K, idx[0] % K] = acc[0]

    return swiglu_backward_and_per_token_cast


# -- the reference -------------------------------------------------------------------------------------------

def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 a * b + c rounded once (what CUDA's fmaf gives), on any device, without an fma kernel: the product
    is exact in float64, TwoSum gives the sum's rounding error, and rounding the sum to odd in float64 (53 bits >=
    2 * 24 + 2) makes its rounding to float32 the correctly rounded one."""
    p = a.double() * b.double()
    c = c.double().expand_as(p)
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    inexact = (err != 0) & torch.isfinite(err)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    s = torch.where(inexact & even, torch.nextafter(s, toward), s)
    return s.float()


def _gradients(shape, x, x_sf, grad_out, weight, pos_to_token_topk, token_topk_to_pos, swiglu_clamp_value):
    """(out float32 (E, H), x_grad float32 (E, 2H), weight_grad float32 (N, K)): TileKernels' swiglu_backward,
    operation for operation."""
    h, npc = shape["hidden"], shape["num_per_channels"]
    e = x.shape[0]
    n, k = weight.shape
    xf = x.float() * x_sf.repeat_interleave(npc, dim=1)
    a, b = xf[:, :h].clone(), xf[:, h:].clone()
    if shape["use_clamp"]:
        swiglu_clamp_value = float(swiglu_clamp_value)
        ca = a > swiglu_clamp_value
        a[ca] = swiglu_clamp_value
        cbu, cbl = b > swiglu_clamp_value, b < -swiglu_clamp_value
        cb = cbu | cbl
        b[cbu] = swiglu_clamp_value
        b[cbl] = -swiglu_clamp_value
    t = 1.0 + torch.exp(-a)
    s = torch.ones_like(a) / t
    idx = pos_to_token_topk.long()
    valid = (idx >= 0) & (idx < n * k)
    w = torch.zeros(e, dtype=torch.float32, device=x.device)
    w[valid] = weight.reshape(-1)[idx[valid]]
    g = grad_out.float()
    gws = g * w.unsqueeze(1) * s
    da = gws * b * fma(a, 1.0 - s, torch.ones((), device=x.device))
    db = gws * a
    if shape["use_clamp"]:
        da[ca] = 0.0
        db[cb] = 0.0
    act = a / t * b
    out = act * w.unsqueeze(1)
    weight_grad = torch.zeros_like(weight)
    dots = (g * act).sum(dim=1)
    weight_grad.view(-1)[idx[valid]] = dots[valid]
    return out, torch.cat([da, db], dim=1), weight_grad


def reference(shape, x, x_sf, grad_out, weight, pos_to_token_topk, token_topk_to_pos, swiglu_clamp_value=0.0):
    out, xg, weight_grad = _gradients(shape, x, x_sf, grad_out, weight, pos_to_token_topk, token_topk_to_pos,
                                      swiglu_clamp_value)
    cast = {"hidden": 2 * shape["hidden"], "group": shape["num_per_channels"], "round_scale": shape["round_scale"]}
    q, sf = per_token_cast_reference(cast, xg)
    return out.to(torch.bfloat16), q, sf, xg.to(torch.bfloat16), weight_grad


def make_inputs(shape, device="cpu", seed=0):
    """A consistent routing: num_tokens tokens, each k of its num_topk slots sent (1 in 8 not: -1) to a row of
    [0, E); the remaining rows are padding (-1). x: per-token-cast-like FP8 values (every finite byte) with scales
    of many magnitudes, so that some a, b pass the clamp values 0.5 and 10 and some do not. swiglu_clamp_value:
    0.5 on even seeds, 10 on odd ones (used only with use_clamp)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    e, n, k, h, npc = (shape["num_expand_tokens"], shape["num_tokens"], shape["num_topk"], shape["hidden"],
                       shape["num_per_channels"])
    b = torch.randint(0, 254, (e, 2 * h), generator=g, dtype=torch.int32)
    b = b + (b >= 0x7F).int()  # skip 0x7F (NaN); 0xFF is past the range
    x = b.to(torch.uint8).view(torch.float8_e4m3fn)
    x_sf = torch.exp2(torch.randint(-12, -4, (e, 2 * h // npc), generator=g).float())
    x_sf *= torch.rand(e, 2 * h // npc, generator=g) + 0.5
    grad_out = (torch.randn(e, h, generator=g) * torch.exp(torch.randn(e, 1, generator=g))).to(torch.bfloat16)
    weight = torch.rand(n, k, generator=g)
    sent = torch.rand(n * k, generator=g) >= 0.125
    slots = torch.nonzero(sent).flatten()[: e - e // 8]  # about 1 in 8 rows padding
    rows = torch.randperm(e, generator=g)[: slots.numel()]
    pos = torch.full((e,), -1, dtype=torch.int32)
    pos[rows] = slots.int()
    t2p = torch.full((n * k,), -1, dtype=torch.int32)
    t2p[slots] = rows.int()
    inputs = (x, x_sf, grad_out, weight, pos, t2p.view(n, k))
    return (*(t.to(device) for t in inputs), 0.5 if seed % 2 == 0 else 10.0)


def bytes_moved(s) -> int:
    """Per row: x (2H bytes) and its scales, grad_out, the map entry read; out, the FP8 gradient and its scales,
    the bf16 gradient written; the weights, their map and gradient once."""
    e, h, nk = s["num_expand_tokens"], s["hidden"], s["num_tokens"] * s["num_topk"]
    scales = 2 * h // s["num_per_channels"] * 4
    return e * (2 * h + scales + 2 * h + 4 + 2 * h + 2 * h + scales + 4 * h) + nk * 12


PARAMS = (
    Runtime("num_expand_tokens", hi=1 << 24, doc="expanded rows (x's); runtime size, tuned per power-of-two bucket"),
    Runtime("num_tokens", hi=1 << 24, bucket=_one, doc="tokens (weight's rows)"),
    Static("num_topk", lo=1, hi=64, default=8, doc="routing slots per token (weight's columns)"),
    Static("hidden", lo=32, hi=32768, default=7168, doc="channels of each half of x; a multiple of num_per_channels"),
    Static("num_per_channels", values=CHANNELS, default=128, doc="channels per scale, of x and of the gradient"),
    Static("round_scale", type=bool, default=False, doc="round the gradient's scales up to powers of two (UE8M0)"),
    Static("use_clamp", type=bool, default=False, doc="clamp a and b at swiglu_clamp_value (TileKernels' not None)"),
)
EXAMPLES = (
    {"num_expand_tokens": 24576, "num_tokens": 4001, "num_topk": 6, "hidden": 7168},
    {"num_expand_tokens": 36864, "num_tokens": 4001, "num_topk": 8, "hidden": 2048, "num_per_channels": 32,
     "round_scale": True, "use_clamp": True},
    {"num_expand_tokens": 16384, "num_tokens": 4001, "num_topk": 2, "hidden": 4096, "round_scale": True},
)


SPEC = register(
    KernelSpec(
        name="swiglu_backward_and_per_token_cast",
        family="quant",
        doc="SwiGLU backward of FP8 MoE rows (weighted by routing weights) with a per-token FP8 cast of the gradient",
        params=PARAMS,
        space=SPACE,
        default=default,
        constraint=constraint,
        arch_constraint=arch_constraint,
        check_shape=check_shape,
        pass_configs=pass_configs,
        build=build,
        inputs=(
            TensorArg("x", "float8_e4m3fn", ("num_expand_tokens", lambda s: 2 * s["hidden"])),
            TensorArg("x_sf", "float32", ("num_expand_tokens", lambda s: 2 * s["hidden"] // s["num_per_channels"]),
                      align=4),
            TensorArg("grad_out", "bfloat16", ("num_expand_tokens", "hidden")),
            TensorArg("weight", "float32", ("num_tokens", "num_topk"), align=4),
            TensorArg("pos_to_token_topk", "int32", ("num_expand_tokens",), align=4),
            TensorArg("token_topk_to_pos", "int32", ("num_tokens", "num_topk"), align=4),
        ),
        outputs=(
            TensorArg("out", "bfloat16", ("num_expand_tokens", "hidden")),
            TensorArg("x_grad_fp8", "float8_e4m3fn", ("num_expand_tokens", lambda s: 2 * s["hidden"])),
            TensorArg("x_grad_sf", "float32",
                      ("num_expand_tokens", lambda s: 2 * s["hidden"] // s["num_per_channels"])),
            TensorArg("x_grad", "bfloat16", ("num_expand_tokens", lambda s: 2 * s["hidden"])),
            TensorArg("weight_grad", "float32", ("num_tokens", "num_topk")),
        ),
        scalars=(ScalarArg("swiglu_clamp_value", float),),
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=bytes_moved,
        tolerance=Tolerance(rtol=1e-3),
        examples=EXAMPLES,
    )
)
