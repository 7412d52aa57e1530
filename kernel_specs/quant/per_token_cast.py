"""per_token_cast: x (num_tokens, hidden) bf16/f32 -> FP8 e4m3 values + one float32 scale per group.

For every token and every run of `group` channels (group in {16, 32, 64, 128} or group == hidden):
    amax  = max(|x|) over the group, clamped to >= 1e-4
    scale = amax / 448                      (IEEE division; the dequantisation factor, stored)
    round_scale: scale = 2^ceil(log2(scale)) (UE8M0: exponent rounded up), inv = 1 / scale
    else:        inv = 448 / amax
    out   = fp8_e4m3(clamp(x * inv, -448, 448))   (round to nearest even)
hidden need not be a multiple of group (it is one of 16): a token has num_groups = ceil(hidden / group)
groups and the last one is partial, e.g. hidden 576, group 128: four groups of 128 and one of 64, whose
amax is over its 64 real channels (TileKernels does the same).
Semantics follow TileKernels' `per_token_cast` (e4m3) and its torch reference `cast`; the kernel is
bit-exact against the reference below for finite inputs (inf/NaN inputs are not supported: the
kernel's clamp turns a NaN product into 448 where torch keeps NaN).

Two specs share this file and one builder; they differ only in how the scales are stored:
  per_token_cast           scales (num_tokens, num_groups), row-major; num_groups = ceil(hidden / group).
  per_token_cast_colmajor  scales stored column-major and TMA-aligned, the layout DeepGEMM consumes
                           (TileKernels' `use_tma_aligned_col_major_sf`): storage (num_groups, T4),
                           T4 = align(num_tokens, 4), so every group's column starts on 16 bytes;
                           scale (token t, group g) lives at g * T4 + t. Padding entries
                           (t in [num_tokens, T4)) are written 0.0, so the whole storage is
                           deterministic and compared bit-exact (TileKernels leaves them unwritten).
                           Callers want the (num_tokens, num_groups) view storage[:, :num_tokens].T
                           (strides (1, T4)), which is what `tkjit.ops.per_token_cast(...,
                           col_major_scales=True)` returns, as TileKernels does.
Why two specs rather than a `col_major_scales` static param: a TensorArg's dims tuple is fixed, and
each entry is either a runtime size (a name, or Align) or a number from static params; the two
layouts put the runtime axis first resp. second, so "axis order depends on a static param" is not
expressible without changing the core. A second spec keeps both layouts fully checked (shape,
Align rounding, allocation) by CompiledKernel, tuned and cached under their own names; the values
and the tunable space are identical. The column-major scale stores are 4-byte scatters (a warp's
groups are mostly one token's neighbouring groups, T4 * 4 bytes apart); they are 1/32 of the fp8
bytes at group 128, and neighbouring tokens' stores land in the same sectors close in time, so L2
should merge them before DRAM (not yet measured on the H200).

x may be a view with a runtime row stride, e.g. `buf[:, :hidden]` of a wider buffer (its rows starting
on the chunk width, `x_align`); one binary serves every stride. out and scales are contiguous.

The whole tensor is a sequence of num_tokens * num_groups contiguous groups. A group is owned by
`group_threads` consecutive threads; thread t of a group loads chunks i * group_threads + t of `vec`
consecutive elements (16-byte loads for bf16 x 8 / f32 x 4; neighbouring threads and neighbouring
groups are adjacent, so every warp load is one contiguous span). The group max is a register max,
a shuffle butterfly, and for groups wider than a warp a shared-memory step. x is read once from
DRAM and kept in registers until it is cast.

A partial last group (hidden % group != 0, known when the kernel is built) runs the same code on a
group's worth of threads: the chunk slots that every group fills are loaded and stored unguarded,
the others only where the chunk lies inside the row (both hidden and group are multiples of 16, so
a chunk is either wholly inside or wholly outside); a missing chunk counts as zeros in the amax. The
guard is generated only for such shapes: when group divides hidden the code is the same as without it.
"""

import torch

from tkjit.scales import TMA_ALIGN, tma_aligned
from tkjit.spec import Runtime, Static, TensorArg, Tolerance, cuda_only, plain_threads, stride_name
from tkjit_kernels.quant._group_amax import group_amax_macro, group_load_macro, group_slots
from tkjit_kernels.quant._layouts import register_scale_layouts
from tkjit_kernels.quant._scale import scale_macro, token_scale_store_macro, ue8m0_ceil

GROUPS = (16, 32, 64, 128)  # TileKernels' per-group sizes (besides group == hidden)
FP8_MAX = 448.0
AMAX_MIN = 1e-4
MAX_ELEMS_PER_THREAD = 128  # registers per thread for the staged x
SPACE = {
    "vec": (4, 8, 16),  # elements per chunk (one or two 16-byte loads)
    "group_threads": (1, 2, 4, 8, 16, 32, 64, 128, 256, 512),  # threads sharing one scale
    "threads": (128, 256, 512),
    "iters": (1, 4),  # groups each thread handles in turn
}


def _elem_bytes(shape):
    return 2 if shape["in_dtype"] == "bfloat16" else 4


def default(shape):
    g, eb = shape["group"], _elem_bytes(shape)
    vec = 16 // eb  # one 16-byte load per chunk
    # About four chunks per thread (64 bytes in flight each): enough loads outstanding to cover
    # DRAM latency. A group stays inside one warp where it can; wide groups (group == hidden)
    # take as many threads as keep the staged x in registers.
    chunks = g // vec
    tpg = 1 << (max(1, min(chunks // 4, 32)).bit_length() - 1)
    while chunks % tpg:
        tpg //= 2
    while (chunks // tpg) * vec > MAX_ELEMS_PER_THREAD and chunks % (2 * tpg) == 0:
        tpg *= 2
    cfg = {"vec": vec, "group_threads": tpg, "threads": 256 if tpg <= 256 else 512, "iters": 1}
    if constraint(shape, cfg) is None:
        return cfg
    # Odd wide groups: the valid config with the fewest registers per thread.
    return min(_valid(shape), key=lambda c: (shape["group"] // c["group_threads"], -c["vec"], c["iters"]))


def _valid(shape):
    import itertools

    keys = list(SPACE)
    combos = (dict(zip(keys, vals)) for vals in itertools.product(*SPACE.values()))
    return [c for c in combos if constraint(shape, c) is None]


def check_shape(shape):
    h, g = shape["hidden"], shape["group"]
    if g not in GROUPS and g != h:
        return f"group={g} must be one of {list(GROUPS)} or equal to hidden={h}"
    if h % 16:
        return f"hidden={h} must be a multiple of 16 (16-byte vector loads and stores)"
    if not _valid(shape):
        return (
            f"group={g} cannot be split into power-of-two thread groups holding <= "
            f"{MAX_ELEMS_PER_THREAD} elements each (use a group with a larger power-of-two factor)"
        )
    return None


def constraint(shape, c):
    g, vec, tpg, threads = shape["group"], c["vec"], c["group_threads"], c["threads"]
    if vec * _elem_bytes(shape) > 32:
        return "a chunk is at most 32 bytes (two 16-byte loads)"
    if g % (vec * tpg):
        return f"group={g} is not a multiple of vec*group_threads={vec * tpg}"
    if g // tpg > MAX_ELEMS_PER_THREAD:
        return f"{g // tpg} elements per thread would spill (max {MAX_ELEMS_PER_THREAD})"
    if tpg > threads:
        return "a group cannot span more than one block"
    return None


def x_align(shape, c):
    """Bytes of one chunk (`vec` elements, loaded as one or two 16-byte vectors): where every row of x
    must start (its address and row stride)."""
    return c["vec"] * _elem_bytes(shape)


arch_constraint = cuda_only("needs warp shuffles and FP8 conversions")


def build(shape, c, col_major):
    from tilelang import language as T

    H, G, in_dtype, round_scale = shape["hidden"], shape["group"], shape["in_dtype"], shape["round_scale"]
    vec, tpg, threads, iters = c["vec"], c["group_threads"], c["threads"], c["iters"]
    NG = -(-H // G)  # groups per token; the last one is partial when group does not divide hidden
    cpt, tail, whole = group_slots(H, G, vec, tpg)  # chunk slots per thread, partial-group channels, whole slots
    per_thread = cpt * vec
    slots = threads // tpg  # groups a block works on at once
    gpb = slots * iters  # groups per block
    wpg = max(1, tpg // 32)  # warps per group
    group_amax = group_amax_macro(T, per_thread=per_thread, tpg=tpg)
    group_load = group_load_macro(T, hidden=H, group=G, vec=vec, tpg=tpg, in_dtype=in_dtype)
    num_tokens = T.dynamic("num_tokens")
    f32, fp8 = T.float32, T.float8_e4m3fn
    # Column-major scales: (NG, num_tokens rounded up to TMA_ALIGN), the same expression as the
    # TensorArg's Align("num_tokens", TMA_ALIGN), so the launcher's shape check binds it.
    sf_shape = (NG, T.ceildiv(num_tokens, TMA_ALIGN) * TMA_ALIGN) if col_major else (num_tokens, NG)
    group_scale = scale_macro(T, max_value=FP8_MAX, round_scale=round_scale)
    store_scale = token_scale_store_macro(T, col_major=col_major, groups=NG, tma_align=TMA_ALIGN,
                                          padded_tokens=sf_shape[1])

    x_stride = T.dynamic(stride_name("x", 0))  # x's row stride: x may be a view such as buf[:, :hidden]

    @T.prim_func
    def per_token_cast(
        x: T.StridedTensor((num_tokens, H), (x_stride, 1), in_dtype),
        out: T.Tensor[(num_tokens, H), fp8],
        scales: T.Tensor[sf_shape, f32],
    ):
        # Rows start chunk-aligned (the launcher checks it, see x_align): the stride written as a multiple
        # of vec, so the index analysis proves the chunk loads aligned and emits vector loads.
        x = T.view(x, strides=((x_stride // vec) * vec, 1))
        with T.Kernel(T.ceildiv(num_tokens * NG, gpb), threads=threads) as bx:
            tx = T.get_thread_binding()
            xs = T.alloc_local((per_thread,), in_dtype)
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
                amax[0] = T.max(amax[0], T.float32(AMAX_MIN))
                group_scale(amax, sf, inv, 0)
                if p < total:
                    for i in T.unroll(whole):
                        for v in T.vectorized(vec):
                            out[row, col + (i * tpg + t) * vec + v] = T.cast(
                                T.max(
                                    T.min(T.cast(xs[i * vec + v], f32) * inv[0], T.float32(FP8_MAX)),
                                    T.float32(-FP8_MAX),
                                ),
                                fp8,
                            )
                    if tail:  # the same stores, only for the real channels of a partial last group
                        for i in T.unroll(whole, cpt):
                            if col + (i * tpg + t) * vec < H:
                                for v in T.vectorized(vec):
                                    out[row, col + (i * tpg + t) * vec + v] = T.cast(
                                        T.max(
                                            T.min(T.cast(xs[i * vec + v], f32) * inv[0], T.float32(FP8_MAX)),
                                            T.float32(-FP8_MAX),
                                        ),
                                        fp8,
                                    )
                    if t == 0:
                        store_scale(scales, sf, pc, row, num_tokens)

    return per_token_cast


def make_inputs(shape, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    n, h = shape["num_tokens"], shape["hidden"]
    x = torch.randn(n, h, generator=g, dtype=torch.float32)
    # Rows spanning many magnitudes, some under the amax clamp, one all zero.
    x = x * torch.exp(2 * torch.randn(n, 1, generator=g))
    x[3::17] *= 1e-7
    if n > 5:
        x[5] = 0
    return (x.to(getattr(torch, shape["in_dtype"])).to(device),)


def num_groups(shape) -> int:
    """Scales per token: ceil(hidden / group); the last group is partial when group does not divide hidden."""
    return -(-shape["hidden"] // shape["group"])


def reference(shape, x):
    n, h, g = x.shape[0], shape["hidden"], shape["group"]
    ng = num_groups(shape)
    # A partial last group is padded with zeros: |0| never raises a max of |x| >= 0, so its amax is
    # over its real channels only (TileKernels' reference masks the padding out); the padding's
    # values are cut off again below.
    xf = torch.nn.functional.pad(x.float(), (0, ng * g - h)).view(n, ng, g)
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=AMAX_MIN)
    full = torch.full_like(amax, FP8_MAX)
    sf = amax / full
    if shape["round_scale"]:
        sf = ue8m0_ceil(sf)
        inv = torch.ones_like(sf) / sf
    else:
        inv = full / amax
    q = (xf * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(n, ng * g)[:, :h].contiguous()
    return q, sf.view(n, ng)


def reference_colmajor(shape, x):
    """Same values as `reference`; scales as (num_groups, align(num_tokens, 4)), padding 0.0."""
    q, sf = reference(shape, x)
    n, ng = sf.shape
    storage = torch.zeros(ng, tma_aligned(n), dtype=torch.float32)
    storage[:, :n] = sf.T
    return q, storage


pass_configs = plain_threads


def _bytes_moved(s, col_major=False):
    n, h, ng = s["num_tokens"], s["hidden"], num_groups(s)
    sf_rows = tma_aligned(n) if col_major else n
    return n * h * (_elem_bytes(s) + 1) + ng * sf_rows * 4


PARAMS = (
    Runtime("num_tokens", hi=1 << 24, doc="tokens; runtime size, tuned per power-of-two bucket"),
    Static("hidden", lo=16, hi=65536, default=7168, doc="channels per token"),
    Static("group", lo=16, hi=65536, default=128, doc="channels per scale: 16, 32, 64, 128 or hidden"),
    Static("in_dtype", type=str, values=("bfloat16", "float32"), default="bfloat16"),
    Static("round_scale", type=bool, default=False, doc="round scales up to powers of two (UE8M0)"),
)
EXAMPLES = (
    {"num_tokens": 4096, "hidden": 7168, "group": 128},
    {"num_tokens": 32768, "hidden": 7168, "group": 128},
    {"num_tokens": 4096, "hidden": 4096, "group": 128, "round_scale": True},
    {"num_tokens": 4096, "hidden": 7168, "group": 7168, "in_dtype": "float32"},
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
    inputs=(TensorArg("x", lambda s: s["in_dtype"], ("num_tokens", "hidden"), strided=True, align=x_align),),
    make_inputs=make_inputs,
    tolerance=Tolerance(exact=True),
)
_OUT = TensorArg("out", "float8_e4m3fn", ("num_tokens", "hidden"))

SPEC, SPEC_COLMAJOR = register_scale_layouts(
    "per_token_cast",
    "per-token, per-group FP8 e4m3 cast with float32 scales (amax / 448)",
    out=_OUT, groups=num_groups, build=build, reference=reference,
    reference_colmajor=reference_colmajor, bytes_moved=_bytes_moved, examples=EXAMPLES, **COMMON,
)
