"""swiglu_forward_and_per_token_cast: x (num_tokens, 2 * hidden) bf16/f32 -> SwiGLU -> FP8 e4m3 values + one
float32 scale per token and group of `group` channels (TileKernels' `swiglu_forward_and_per_token_cast`).

Per token t and channel c < hidden, in float32 and in TileKernels' torch reference's order (`torch/swiglu.py`,
then `torch/cast.py` on the float32 result):
    l = x[t, c], r = x[t, hidden + c]
    swiglu_clamp_value > 0:  l = min(l, clamp), r = max(min(r, clamp), -clamp)
    y = l / (1 + exp(-l)) * r                (IEEE division; exp rounded to float32 before the add)
    has_weights:             y = y * w[t], w[t] = topk_weights.flat[p] for p = pos_to_token_topk[t] in
                             [0, num_weights), else 0.0 (TileKernels' reference: 0 for p < 0)
    has_expert:              a row with pos_to_expert[t] < 0 is a zero row (TileKernels' kernel skips it and
                             leaves its values and scales unwritten; its torch reference computes it, and with
                             p < 0 as well it is the zero row)
then per_token_cast's maths on y (`per_token_cast.py`): amax over the group clamped to >= sf_clamp_min (1e-4 by
default), scale = amax / 448 (round_scale: up to a power of two), out = fp8(clamp(y * inv, -448, 448)).
count_clamp: clamped_count (3,) int64 is an in-place counter: += #(l > clamp), #(r > clamp), #(r < -clamp) over
the rows read (a skipped pos_to_expert < 0 row counts nothing, as TileKernels' kernel). Inputs are finite
(TileKernels' kernel and reference part ways on NaN); hidden is a multiple of group (TileKernels: 128 or hidden).

The reference runs on the kernel's device (`reference_on_device`): the kernel's `expf` equals torch's CUDA exp
bit for bit, and torch's CPU exp differs from both in the last bit now and then (on an H100: 4 of 112 scales
of 7 tokens at hidden 2048 moved against a CPU reference, none against the CUDA one).

Why the add is `ieee_add`: `1 + expf(-l)` inlined could be contracted by nvcc into an FMA with expf's last
multiply, one rounding where TileKernels' torch reference has two (exp is its own kernel there).

Two specs, as per_token_cast: scales row-major (num_tokens, num_groups), or the TMA-aligned column-major
storage (num_groups, align(num_tokens, 4)) with padding 0.0 (`_colmajor`); packed UE8M0 comes from the latter
(`tkjit.scales.pack_ue8m0`). Layout and tunables are per_token_cast's (its SPACE, more `iters`, and its
constraint): a group is owned by `group_threads` threads, each loading `vec`-element chunks of l and of r (two
16-byte loads per chunk for bf16), computing y in registers, the group amax by `_group_amax`. A skipped row
(pos_to_expert < 0) neither reads x nor runs the SwiGLU: its values are zeros from the start (a fifth of the
routed benchmark's rows). The clamp counts are per-thread int32, summed by a warp butterfly and shared memory,
one int64 atomic per block and counter. The kernel is compute-bound as much as memory-bound (IEEE expf and
division an element), so it spends no instruction it need not: the e4m3 cast saturates at +-448 by itself.
"""

import struct

import torch

from tkjit.scales import TMA_ALIGN, tma_aligned
from tkjit.spec import Runtime, Static, TensorArg, Tolerance, cuda_only, ieee_plain_threads
from tkjit_kernels.quant import per_token_cast as ptc
from tkjit_kernels.quant._group_amax import group_amax_macro
from tkjit_kernels.quant._layouts import register_scale_layouts
from tkjit_kernels.quant._scale import scale_macro, token_scale_store_macro, ue8m0_ceil

FP8_MAX = ptc.FP8_MAX
GROUPS = ptc.GROUPS
# per_token_cast's space, with more groups a thread in turn (fewer blocks): the clamp counter costs one atomic per
# block and counter. At the routed shape 32 groups a block (256 threads, 8 a group) make 34816 blocks with
# iters=1; iters=64 makes 544, about TileKernels' persistent grid of 528. On an H100 iters=4 was fastest there,
# 16 and 64 within 4% (see the default below).
SPACE = {**ptc.SPACE, "iters": (1, 4, 16, 64)}
AMAX_MIN = 1e-4  # TileKernels' e4m3 amax clamp (its sf_clamp_min default)
# Smallest sf_clamp_min: amax / 448 stays a normal float32 (and 448 / amax finite), so the scale rounding holds.
SF_CLAMP_LO = FP8_MAX * 2.0**-126
F32_MAX = 3.4028234663852886e38


def f32(v: float) -> float:
    """v rounded to float32, as torch rounds a Python scalar against a float32 tensor."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def _f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def num_groups(shape) -> int:
    return shape["hidden"] // shape["group"]


# bf16 groups of 128 (TileKernels' per-token group): two 16-byte loads of each half a thread, eight threads a group,
# as 128-thread blocks of four groups a thread in turn where the clamp is counted (fewer blocks, fewer counter
# atomics), else 256-thread blocks of one. Measured on an H100
# (benchmarks/h200/2026-12-05_s15_h100_run1_sweep_swiglu_*): the routed shape (69632 rows, counted) 237.6 us, the
# fastest of 48 configs, against 311.6 for per_token_cast's default; 32768 dense rows 119.8 us, the fastest of 15,
# against 137.2. Other groups keep per_token_cast's default.
G128_COUNTED = {"vec": 16, "group_threads": 8, "threads": 128, "iters": 4}
G128 = {"vec": 16, "group_threads": 8, "threads": 256, "iters": 1}


def default(shape):
    if shape["group"] == 128 and shape["in_dtype"] == "bfloat16":
        return dict(G128_COUNTED if shape["count_clamp"] else G128)
    return ptc.default(shape)


def constraint(shape, c):
    return ptc.constraint(shape, c)


arch_constraint = cuda_only("needs warp shuffles, atomics and FP8 conversions")


pass_configs = ieee_plain_threads


def x_align(shape, c):
    """Bytes of one chunk (both halves' chunks start there): where x's data must start."""
    return ptc.x_align(shape, c)


def check_shape(shape):
    h, g, clamp = shape["hidden"], shape["group"], shape["swiglu_clamp_value"]
    if g not in GROUPS and g != h:
        return f"group={g} must be one of {list(GROUPS)} or equal to hidden={h}"
    if h % 16 or h % g:
        return f"hidden={h} must be a multiple of 16 and of group={g}"
    if not ptc._valid(shape):
        return f"group={g} cannot be split into power-of-two thread groups of <= {ptc.MAX_ELEMS_PER_THREAD} elements"
    if not shape["has_weights"] and shape.get("num_weights", 1) != 1:
        return f"num_weights={shape['num_weights']} must be 1 without has_weights (there is no weight table)"
    if shape["count_clamp"] and clamp == 0:
        return "count_clamp needs swiglu_clamp_value > 0 (0 means no clamp)"
    if shape["sf_clamp_min"] < SF_CLAMP_LO:
        return f"sf_clamp_min={shape['sf_clamp_min']} must be >= {SF_CLAMP_LO} (448 * 2^-126: normal scales)"
    return None


def build(shape, c, col_major):
    from tilelang import language as T

    H, G, in_dtype, round_scale = shape["hidden"], shape["group"], shape["in_dtype"], shape["round_scale"]
    has_w, has_e, count = shape["has_weights"], shape["has_expert"], shape["count_clamp"]
    clamp = f32(shape["swiglu_clamp_value"])
    vec, tpg, threads, iters = c["vec"], c["group_threads"], c["threads"], c["iters"]
    NG = H // G
    cpt = G // (vec * tpg)  # chunks per thread
    per_thread = cpt * vec
    slots = threads // tpg
    gpb = slots * iters
    wpg = max(1, tpg // 32)
    warps = threads // 32
    group_amax = group_amax_macro(T, per_thread=per_thread, tpg=tpg)
    num_tokens = T.dynamic("num_tokens")
    num_weights = T.dynamic("num_weights")
    fp32, fp8, i32, u32 = T.float32, T.float8_e4m3fn, T.int32, T.uint32
    sf_shape = (NG, T.ceildiv(num_tokens, TMA_ALIGN) * TMA_ALIGN) if col_major else (num_tokens, NG)
    group_scale = scale_macro(T, max_value=FP8_MAX, round_scale=round_scale)
    store_scale = token_scale_store_macro(T, col_major=col_major, groups=NG, tma_align=TMA_ALIGN,
                                          padded_tokens=sf_shape[1])

    def const(v):  # a float32 constant by its bits: never a decimal rounded twice on its way into the source
        return T.reinterpret(u32(_f32_bits(v)), fp32)

    @T.macro
    def swiglu_chunk(x, row, ch, i, live, xl, xr, lv, rv, ys, w, cnt):
        """Chunk i of a thread's group: x's vec gate and up values from channel ch, SwiGLU into ys, counted."""
        for v in T.vectorized(vec):
            xl[v] = x[row, ch + v]
        for v in T.vectorized(vec):
            xr[v] = x[row, H + ch + v]
        for v in T.unroll(vec):
            lv[0] = T.cast(xl[v], fp32)
            rv[0] = T.cast(xr[v], fp32)
            if clamp > 0:
                if count:
                    if live:
                        cnt[0] = cnt[0] + T.if_then_else(lv[0] > const(clamp), 1, 0)
                        cnt[1] = cnt[1] + T.if_then_else(rv[0] > const(clamp), 1, 0)
                        cnt[2] = cnt[2] + T.if_then_else(rv[0] < const(-clamp), 1, 0)
                lv[0] = T.min(lv[0], const(clamp))
                rv[0] = T.max(T.min(rv[0], const(clamp)), const(-clamp))
            ys[i * vec + v] = T.ieee_fdiv(lv[0], T.ieee_add(T.float32(1), T.exp(-lv[0]))) * rv[0]
            if has_w:
                ys[i * vec + v] = ys[i * vec + v] * w[0]

    def swiglu_forward_and_per_token_cast(
        x: T.Tensor[(num_tokens, 2 * H), in_dtype],
        pos_to_token_topk: T.Tensor[(num_tokens,), i32] = None,
        topk_weights: T.Tensor[(num_weights,), fp32] = None,
        pos_to_expert: T.Tensor[(num_tokens,), i32] = None,
        clamped_count: T.Tensor[(3,), T.int64] = None,
        out: T.Tensor[(num_tokens, H), fp8] = None,
        scales: T.Tensor[sf_shape, fp32] = None,
    ):
        with T.Kernel(T.ceildiv(num_tokens * NG, gpb), threads=threads) as bx:
            tx = T.get_thread_binding()
            xl = T.alloc_local((vec,), in_dtype)
            xr = T.alloc_local((vec,), in_dtype)
            ys = T.alloc_local((per_thread,), fp32)
            amax = T.alloc_local((1,), fp32)
            sf = T.alloc_local((1,), fp32)
            inv = T.alloc_local((1,), fp32)
            w = T.alloc_local((1,), fp32)
            lv = T.alloc_local((1,), fp32)
            rv = T.alloc_local((1,), fp32)
            if wpg > 1:
                red = T.alloc_shared((warps,), fp32)
            if count:
                cnt = T.alloc_local((3,), i32)
                cnt_red = T.alloc_shared((3, warps), i32)
                s = T.alloc_local((1,), i32)
                for k in T.unroll(3):
                    cnt[k] = 0
            else:
                cnt = None
            t = tx % tpg
            total = T.cast(num_tokens, "int64") * NG
            for it in T.serial(iters):
                p = T.cast(bx, "int64") * gpb + it * slots + tx // tpg
                pc = T.min(p, total - 1)  # tail threads redo the last group, store and count nothing
                row = pc // NG
                col = (pc % NG) * G
                live = (p < total) & (pos_to_expert[row] >= 0) if has_e else p < total
                w[0] = T.float32(1)
                if has_w:
                    pos = pos_to_token_topk[row]
                    w[0] = T.if_then_else((pos >= 0) & (pos < num_weights),
                                          topk_weights[T.max(T.min(pos, num_weights - 1), 0)], T.float32(0))
                for i in T.unroll(cpt):
                    if has_e:
                        if live:
                            swiglu_chunk(x, row, col + (i * tpg + t) * vec, i, live, xl, xr, lv, rv, ys, w, cnt)
                        else:  # a skipped row: zeros, without reading x or spending the SwiGLU on it
                            for v in T.unroll(vec):
                                ys[i * vec + v] = T.float32(0)
                    else:
                        swiglu_chunk(x, row, col + (i * tpg + t) * vec, i, live, xl, xr, lv, rv, ys, w, cnt)
                group_amax(ys, amax, red if wpg > 1 else None, tx)
                amax[0] = T.max(amax[0], const(f32(shape["sf_clamp_min"])))
                group_scale(amax, sf, inv, 0)
                if p < total:
                    for i in T.unroll(cpt):
                        for v in T.vectorized(vec):
                            # No clamp to +-448 first: the cast saturates to the largest finite e4m3 (the same
                            # values for finite inputs, two instructions an element fewer).
                            out[row, col + (i * tpg + t) * vec + v] = T.cast(ys[i * vec + v] * inv[0], fp8)
                    if t == 0:
                        store_scale(scales, sf, pc, row, num_tokens)
            if count:
                # The block's counts: a warp butterfly, one shared slot per warp, one atomic per counter.
                for k in T.unroll(3):
                    for step in T.unroll(5):
                        cnt[k] = cnt[k] + T.shfl_xor(cnt[k], 16 >> step)
                if tx % 32 == 0:
                    for k in T.unroll(3):
                        cnt_red[k, tx // 32] = cnt[k]
                T.sync_threads()
                if tx < 3:
                    s[0] = 0
                    for j in T.unroll(warps):
                        s[0] = s[0] + cnt_red[tx, j]
                    if s[0] != 0:
                        T.atomic_add(clamped_count[tx], T.cast(s[0], "int64"))

    for name, present in (("pos_to_token_topk", has_w), ("topk_weights", has_w), ("pos_to_expert", has_e)):
        if not present:
            del swiglu_forward_and_per_token_cast.__annotations__[name]
    return T.prim_func(swiglu_forward_and_per_token_cast)


def make_inputs(shape, device="cpu", seed=0):
    """x: rows of many magnitudes (some under the amax clamp, one zero), gate values well past the clamp on both
    sides; the routing map: weights of a (num_weights / 4, 4) table, about 1 in 8 entries -1 (odd seeds add
    entries >= num_weights and < -1, which weigh 0), rows with pos_to_expert -1; clamped_count starting at
    arbitrary values (it accumulates)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n, h = shape["num_tokens"], shape["hidden"]
    x = torch.randn(n, 2 * h, generator=g) * 3
    x = x * torch.exp(1.5 * torch.randn(n, 1, generator=g))
    x[3::17] *= 1e-6
    if n > 5:
        x[5] = 0
    inputs = [x.to(getattr(torch, shape["in_dtype"]))]
    if shape["has_weights"]:
        nw = shape["num_weights"]
        pos = torch.randint(0, nw, (n,), generator=g, dtype=torch.int32)
        pos[torch.rand(n, generator=g) < 0.125] = -1
        if seed % 2 == 1 and n:
            junk = torch.tensor([nw, nw + 7, 2**31 - 1, -2, -(2**31)], dtype=torch.int32)
            bad = torch.randperm(n, generator=g)[: max(1, n // 16)]
            pos[bad] = junk[torch.randint(0, junk.numel(), (bad.numel(),), generator=g)]
        wts = torch.rand(nw, generator=g) * 2
        inputs += [pos, wts]
    if shape["has_expert"]:
        pe = torch.randint(0, 256, (n,), generator=g, dtype=torch.int32)
        pe[torch.rand(n, generator=g) < 0.2] = -1
        inputs.append(pe)
    inputs.append(torch.randint(0, 1000, (3,), generator=g, dtype=torch.int64))
    return tuple(t.to(device) for t in inputs)


def split_inputs(shape, args):
    """(x, pos_to_token_topk, topk_weights, pos_to_expert, clamped_count), None for the absent ones."""
    args = list(args)
    x = args.pop(0)
    pos, wts = (args.pop(0), args.pop(0)) if shape["has_weights"] else (None, None)
    pe = args.pop(0) if shape["has_expert"] else None
    return x, pos, wts, pe, args.pop(0)


def swiglu(x, pos_to_token_topk=None, topk_weights=None, pos_to_expert=None, swiglu_clamp_value=0.0):
    """The float32 SwiGLU rows and the three clamp counts, in TileKernels' reference's operation order."""
    h = x.shape[1] // 2
    xf = x.float()
    if pos_to_expert is not None:  # skipped rows: zeros, counted as nothing
        xf = torch.where((pos_to_expert >= 0)[:, None], xf, torch.zeros_like(xf))
    left, right = xf[:, :h], xf[:, h:]
    counts = torch.zeros(3, dtype=torch.int64, device=x.device)
    if swiglu_clamp_value:
        c = f32(swiglu_clamp_value)
        counts = torch.stack([(left > c).sum(), (right > c).sum(), (right < -c).sum()]).to(torch.int64)
        left = torch.clamp(left, max=c)
        right = torch.clamp(right, min=-c, max=c)
    y = left / (1.0 + torch.exp(-left)) * right
    if pos_to_token_topk is not None:
        p = pos_to_token_topk.long()
        flat = topk_weights.reshape(-1).float()
        ok = (p >= 0) & (p < flat.numel())
        w = torch.zeros(p.shape, dtype=torch.float32, device=x.device)
        w[ok] = flat[p[ok]]
        y = y * w.unsqueeze(1)
    return y, counts


def cast(shape, y):
    """per_token_cast's reference on the float32 rows y, amax clamped to sf_clamp_min."""
    n, h, g = y.shape[0], shape["hidden"], shape["group"]
    ng = h // g
    amax = y.view(n, ng, g).abs().amax(-1, keepdim=True).clamp(min=f32(shape["sf_clamp_min"]))
    full = torch.full_like(amax, FP8_MAX)
    sf = amax / full
    if shape["round_scale"]:
        sf = ue8m0_ceil(sf)
        inv = torch.ones_like(sf) / sf
    else:
        inv = full / amax
    q = (y.view(n, ng, g) * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(n, h)
    return q, sf.view(n, ng)


def reference(shape, *inputs):
    """(clamped_count after the call, values, row-major scales)."""
    x, pos, wts, pe, counter = split_inputs(shape, inputs)
    y, counts = swiglu(x, pos, wts, pe, shape["swiglu_clamp_value"])
    counter = counter + counts if shape["count_clamp"] else counter.clone()
    q, sf = cast(shape, y)
    return counter, q, sf


def reference_colmajor(shape, *inputs):
    """Same as `reference`; scales as (num_groups, align(num_tokens, 4)), padding 0.0."""
    counter, q, sf = reference(shape, *inputs)
    n, ng = sf.shape
    storage = torch.zeros(ng, tma_aligned(n), dtype=torch.float32, device=sf.device)
    storage[:, :n] = sf.T
    return counter, q, storage


def _bytes_moved(s, col_major=False):
    n, h, ng = s["num_tokens"], s["hidden"], num_groups(s)
    eb = 2 if s["in_dtype"] == "bfloat16" else 4
    sf_rows = tma_aligned(n) if col_major else n
    per_row = 2 * h * eb + h + 8 * s["has_weights"] + 4 * s["has_expert"]
    return n * per_row + ng * sf_rows * 4


def _one(value: int) -> int:
    return 1  # the weight table's size adds no tuning bucket


PARAMS = (
    Runtime("num_tokens", hi=1 << 24, doc="(expanded) tokens; runtime size, tuned per power-of-two bucket"),
    Runtime("num_weights", hi=1 << 28, bucket=_one,
            doc="topk_weights' entries (num_tokens * num_topk of the map); 1 without has_weights"),
    Static("hidden", lo=16, hi=65536, default=2048, doc="output channels; x has 2 * hidden (gate, then up)"),
    Static("group", lo=16, hi=65536, default=128, doc="channels per scale: 16, 32, 64, 128 or hidden"),
    Static("in_dtype", type=str, values=("bfloat16", "float32"), default="bfloat16"),
    Static("round_scale", type=bool, default=False, doc="round scales up to powers of two (UE8M0)"),
    Static("has_weights", type=bool, default=False, doc="rows times topk_weights.flat[pos_to_token_topk]"),
    Static("has_expert", type=bool, default=False, doc="rows with pos_to_expert < 0 are zero rows"),
    Static("swiglu_clamp_value", type=float, lo=0.0, hi=F32_MAX, default=0.0, doc="clamp before SwiGLU; 0: none"),
    Static("count_clamp", type=bool, default=False, doc="add the clamp counts to clamped_count (in place)"),
    Static("sf_clamp_min", type=float, lo=0.0, hi=F32_MAX, default=AMAX_MIN, doc="amax clamp (TileKernels' 1e-4)"),
)
EXAMPLES = (
    {"num_tokens": 4096, "num_weights": 1, "hidden": 2048},
    {"num_tokens": 32768, "num_weights": 1, "hidden": 2048, "round_scale": True},
    {"num_tokens": 8192 * 8 + 256 * 16, "num_weights": 8192 * 8, "hidden": 2048, "has_weights": True,
     "has_expert": True, "swiglu_clamp_value": 10.0, "count_clamp": True},
    {"num_tokens": 4096, "num_weights": 1, "hidden": 4096, "group": 4096, "in_dtype": "float32"},
)
COMMON = dict(
    family="quant",
    params=PARAMS,
    space=SPACE,
    default=default,
    constraint=constraint,
    arch_constraint=arch_constraint,
    check_shape=check_shape,
    pass_configs=pass_configs,
    reference_on_device=True,  # exp: the kernel's expf is CUDA's, bit for bit; CPU torch's exp differs by an ulp
    inputs=(
        TensorArg("x", lambda s: s["in_dtype"], ("num_tokens", lambda s: 2 * s["hidden"]), align=x_align),
        TensorArg("pos_to_token_topk", "int32", ("num_tokens",), align=4, optional="has_weights"),
        TensorArg("topk_weights", "float32", ("num_weights",), align=4, optional="has_weights"),
        TensorArg("pos_to_expert", "int32", ("num_tokens",), align=4, optional="has_expert"),
        TensorArg("clamped_count", "int64", (3,), align=8, inout=True),
    ),
    make_inputs=make_inputs,
    tolerance=Tolerance(exact=True),
)
_OUT = TensorArg("out", "float8_e4m3fn", ("num_tokens", "hidden"))

SPEC, SPEC_COLMAJOR = register_scale_layouts(
    "swiglu_forward_and_per_token_cast",
    "SwiGLU (optional clamp, routing weights) then per-token FP8 e4m3 cast, float32 scales",
    out=_OUT, groups=num_groups, build=build, reference=reference,
    reference_colmajor=reference_colmajor, bytes_moved=_bytes_moved, examples=EXAMPLES, **COMMON,
)
