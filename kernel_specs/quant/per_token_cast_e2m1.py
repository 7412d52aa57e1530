"""per_token_cast_e2m1: x (num_tokens, hidden) bf16/f32 -> FP4 e2m1 values, two per byte, + one float32 scale per group.

TileKernels' `per_token_cast(x, 'e2m1', num_per_channels)` and its torch reference `cast` (fmt 'e2m1', block
(1, num_per_channels)), bit-exact for finite inputs. For every token and every run of `group` channels:
    amax  = max(|x|) over the group, clamped to >= 6 * 2^-126 (TileKernels' e2m1 clamp: the smallest scale 2^-126)
    scale = amax / 6                        (IEEE division; the dequantisation factor, stored)
    round_scale: scale = 2^ceil(log2(scale)) (UE8M0: exponent rounded up), inv = 1 / scale
    else:        inv = 6 / amax
    out   = e2m1(x * inv)                   (`_e2m1`: nearest, ties to even, saturating at 6; the sign kept)
stored as TileKernels stores FP4: int8 (num_tokens, hidden / 2), channel 2j in the low nibble of byte j.
Groups, shapes and the partial last group are per_token_cast's (group 16, 32, 64, 128 or hidden; hidden a multiple
of 16): this spec takes that spec's shape rules, tunable space, constraints and default, and differs only in the
constants and the encoding, so the two stay one design. Two specs share this file, as per_token_cast's do (the same
reason: the scale tensor's axis order): per_token_cast_e2m1 stores the scales (num_tokens, num_groups) row-major;
per_token_cast_e2m1_colmajor stores them column-major and TMA-aligned, (num_groups, align(num_tokens, 4)) with
the padding written 0.0, whose storage[:, :num_tokens].T view TileKernels' `use_tma_aligned_col_major_sf` returns
(packed UE8M0 is `tkjit.scales.pack_ue8m0` of it, as for the e4m3 cast).

The kernel is per_token_cast's (a group owned by `group_threads` threads, chunks of `vec` channels held in
registers, a shuffle / shared-memory amax) with the store changed: a chunk's vec values are scaled, encoded
with integer work on their float32 bits (`_e2m1.encode_tl`: two compares below 1.0, one rounding add above; no
float4 type, which sm_90 lacks in hardware) and packed to vec / 2 bytes, one vector store (2, 4 or 8 bytes).
"""

import torch

from tkjit.scales import TMA_ALIGN, tma_aligned
from tkjit.spec import TensorArg, Tolerance, cuda_only, stride_name
from tkjit_kernels.quant import _e2m1
from tkjit_kernels.quant import per_token_cast as _e4m3
from tkjit_kernels.quant._group_amax import group_amax_macro, group_load_macro, group_slots
from tkjit_kernels.quant._layouts import register_scale_layouts
from tkjit_kernels.quant._scale import scale_macro, token_scale_store_macro, ue8m0_ceil

num_groups = _e4m3.num_groups


arch_constraint = cuda_only("needs warp shuffles")


def build(shape, c, col_major):
    from tilelang import language as T

    H, G, in_dtype, round_scale = shape["hidden"], shape["group"], shape["in_dtype"], shape["round_scale"]
    vec, tpg, threads, iters = c["vec"], c["group_threads"], c["threads"], c["iters"]
    NG = -(-H // G)  # groups per token; the last one is partial when group does not divide hidden
    cpt, tail, whole = group_slots(H, G, vec, tpg)  # chunk slots per thread, partial-group channels, whole slots
    per_thread = cpt * vec
    hv = vec // 2  # bytes of a chunk's output
    slots = threads // tpg  # groups a block works on at once
    gpb = slots * iters  # groups per block
    wpg = max(1, tpg // 32)  # warps per group
    group_amax = group_amax_macro(T, per_thread=per_thread, tpg=tpg)
    group_load = group_load_macro(T, hidden=H, group=G, vec=vec, tpg=tpg, in_dtype=in_dtype)
    num_tokens = T.dynamic("num_tokens")
    f32, u32, i8 = T.float32, T.uint32, T.int8
    sf_shape = (NG, T.ceildiv(num_tokens, TMA_ALIGN) * TMA_ALIGN) if col_major else (num_tokens, NG)
    group_scale = scale_macro(T, max_value=_e2m1.E2M1_MAX, round_scale=round_scale)
    store_scale = token_scale_store_macro(T, col_major=col_major, groups=NG, tma_align=TMA_ALIGN,
                                          padded_tokens=sf_shape[1])
    x_stride = T.dynamic(stride_name("x", 0))

    encode_chunk = _e2m1.chunk_codes_macro(T, vec=vec)

    @T.macro
    def cast_store(out, xs, bits, ob, inv, row, col, i, t):
        # Chunk slot i of thread t: vec values scaled and encoded, packed low nibble first, one vector store.
        encode_chunk(xs, i, inv, bits, ob)
        for v in T.vectorized(hv):
            out[row, col // 2 + (i * tpg + t) * hv + v] = ob[v]

    @T.prim_func
    def per_token_cast_e2m1(
        x: T.StridedTensor((num_tokens, H), (x_stride, 1), in_dtype),
        out: T.Tensor[(num_tokens, H // 2), i8],
        scales: T.Tensor[sf_shape, f32],
    ):
        # Rows start chunk-aligned (the launcher checks it, see x_align): the stride written as a multiple
        # of vec, so the index analysis proves the chunk loads aligned and emits vector loads.
        x = T.view(x, strides=((x_stride // vec) * vec, 1))
        with T.Kernel(T.ceildiv(num_tokens * NG, gpb), threads=threads) as bx:
            tx = T.get_thread_binding()
            xs = T.alloc_local((per_thread,), in_dtype)
            bits = T.alloc_local((vec,), u32)
            ob = T.alloc_local((hv,), i8)
            amax = T.alloc_local((1,), f32)
            sf = T.alloc_local((1,), f32)
            inv = T.alloc_local((1,), f32)
            if wpg > 1:
                red = T.alloc_shared((threads // 32,), f32)
            t = tx % tpg
            total = T.cast(num_tokens, "int64") * NG  # groups; int64: may pass 2^31
            for it in T.serial(iters):
                p = T.cast(bx, "int64") * gpb + it * slots + tx // tpg
                pc = T.min(p, total - 1)  # tail threads redo the last group, store nothing
                row = pc // NG
                col = (pc % NG) * G
                group_load(xs, x, row, col, t)
                group_amax(xs, amax, red if wpg > 1 else None, tx)
                # The clamp as its bits: 6 * 2^-126 exactly, whatever decimal a literal would print.
                amax[0] = T.max(amax[0], T.reinterpret(u32(_e2m1.AMAX_MIN_BITS), f32))
                group_scale(amax, sf, inv, 0)  # (sf >= 2^-126: normal)
                if p < total:
                    for i in T.unroll(whole):
                        cast_store(out, xs, bits, ob, inv, row, col, i, t)
                    if tail:  # the same stores, only for the real channels of a partial last group
                        for i in T.unroll(whole, cpt):
                            if col + (i * tpg + t) * vec < H:
                                cast_store(out, xs, bits, ob, inv, row, col, i, t)
                    if t == 0:
                        store_scale(scales, sf, pc, row, num_tokens)

    return per_token_cast_e2m1


def make_inputs(shape, device="cpu", seed=0):
    """per_token_cast's rows (many magnitudes, some under 1e-4, one all zero), and rows of `_e2m1.TIES` (every group
    holds 6: its amax): at scale 1 (row 7), scale 2^-100 (row 9, an exact inverse 2^100), times 3 (row 11, an
    inexact inverse), and times 2^-130 (row 13, float32 subnormals under the clamp: inverse 2^126)."""
    (x,) = _e4m3.make_inputs(shape, "cpu", seed)
    n, h = x.shape
    ties = torch.tensor(_e2m1.TIES, dtype=torch.float32).repeat(h // 16)
    for row, factor in ((7, 1.0), (9, 2.0**-100), (11, 3.0), (13, 2.0**-130)):
        if n > row:
            x[row] = (ties * factor).to(x.dtype)
    return (x.to(device),)


def scales_of(shape, x):
    """(scale, inv), each (n, num_groups, 1) float32, and x as float32 (n, num_groups, group), zero padded."""
    n, h, g = x.shape[0], shape["hidden"], shape["group"]
    ng = num_groups(shape)
    # A partial last group is padded with zeros: |0| never raises a max of |x| >= 0 (TileKernels' reference
    # masks the padding out); the padding's values are cut off again by the caller.
    xf = torch.nn.functional.pad(x.float(), (0, ng * g - h)).view(n, ng, g)
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=_e2m1.AMAX_MIN)
    top = torch.full_like(amax, _e2m1.E2M1_MAX)
    sf = amax / top
    if shape["round_scale"]:
        sf = ue8m0_ceil(sf)
        return sf, torch.ones_like(sf) / sf, xf
    return sf, top / amax, xf


def reference(shape, x):
    sf, inv, xf = scales_of(shape, x)
    n, h = x.shape[0], shape["hidden"]
    codes = _e2m1.encode(xf * inv).view(n, xf.shape[1] * xf.shape[2])[:, :h]
    return _e2m1.pack(codes), sf.view(n, xf.shape[1])


def reference_colmajor(shape, x):
    """Same values as `reference`; scales as (num_groups, align(num_tokens, 4)), padding 0.0."""
    q, sf = reference(shape, x)
    n, ng = sf.shape
    storage = torch.zeros(ng, tma_aligned(n), dtype=torch.float32, device=sf.device)
    storage[:, :n] = sf.T
    return q, storage


def _bytes_moved(s, col_major=False):
    n, h, ng = s["num_tokens"], s["hidden"], num_groups(s)
    sf_rows = tma_aligned(n) if col_major else n
    return n * h * (2 if s["in_dtype"] == "bfloat16" else 4) + n * h // 2 + ng * sf_rows * 4


EXAMPLES = (
    {"num_tokens": 4096, "hidden": 7168, "group": 32},
    {"num_tokens": 32768, "hidden": 7168, "group": 32, "round_scale": True},
    {"num_tokens": 4096, "hidden": 4096, "group": 16},
    {"num_tokens": 4096, "hidden": 7168, "group": 128, "in_dtype": "float32"},
    {"num_tokens": 4096, "hidden": 7168, "group": 7168},
)
COMMON = dict(
    family="quant",
    params=_e4m3.PARAMS,
    space=_e4m3.SPACE,
    default=_e4m3.default,
    constraint=_e4m3.constraint,
    arch_constraint=arch_constraint,
    check_shape=_e4m3.check_shape,
    pass_configs=_e4m3.pass_configs,
    inputs=(TensorArg("x", lambda s: s["in_dtype"], ("num_tokens", "hidden"), strided=True, align=_e4m3.x_align),),
    make_inputs=make_inputs,
    tolerance=Tolerance(exact=True),
)
_OUT = TensorArg("out", "int8", ("num_tokens", lambda s: s["hidden"] // 2))

SPEC, SPEC_COLMAJOR = register_scale_layouts(
    "per_token_cast_e2m1",
    "per-token, per-group FP4 e2m1 cast (two codes per int8) with float32 scales (amax / 6)",
    out=_OUT, groups=num_groups, build=build, reference=reference,
    reference_colmajor=reference_colmajor, bytes_moved=_bytes_moved, examples=EXAMPLES, **COMMON,
)
