"""mhc_pre_split_mixes: split mHC's raw mixes into the layer's weights (TileKernels' `mhc_pre_split_mixes`).

input_mixes (num_tokens, W) float32, W = 2 * mhc_mult + mhc_mult**2, mhc_scale (3,), mhc_base (W,) ->
  pre_layer_mix  (num_tokens, mhc_mult)      sigmoid(z[:, :m]) + mhc_pre_eps
  post_layer_mix (num_tokens, mhc_mult)      sigmoid(z[:, m:2m]) * mhc_post_mult_value
  comb_res_mix   (num_tokens, mhc_mult**2)   z[:, 2m:]
with z = input_mixes * mhc_scale[k] + mhc_base (k = 0, 1, 2 for the three column ranges), TileKernels' torch
reference `mhc_pre_split_mixes_ref` (its ops return (n0, n1, m, 1), (n0, n1, m, 1), (n0, n1, m, m) views of
these).

One token per thread (`_mixes.forward_blocks`): the row in `vec`-float vectors (24 floats at mhc_mult 4), the
three segments' maths in registers, three stores. The eps and the multiplier are compiled in (static
params), as TileKernels compiles them. float64 reference rounded once; rtol 1e-5. Lowers on the C target.
"""

from tkjit.registry import register
from tkjit.spec import KernelSpec, TensorArg
from tkjit_kernels.mhc._mixes import (
    COMMON,
    FWD_SPACE,
    MHC,
    POST_MULT,
    PRE_EPS,
    RUNTIME,
    arch_constraint_fwd,
    forward_blocks,
    fwd_constraint,
    fwd_default,
    random_inputs,
    reference_forward,
    row_width,
    split_segments,
    vec_of,
)


def width(s):
    return 2 * s["mhc_mult"] + s["mhc_mult"] ** 2


def build(shape, c):
    from tilelang import language as T

    m = shape["mhc_mult"]
    segs = split_segments(shape)
    W = row_width(segs)
    bt, threads = c["block_tokens"], c["threads"]
    load, mixes, stores = forward_blocks(segs, c["vec"], shape["mhc_pre_eps"], shape["mhc_post_mult_value"])
    num_tokens = T.dynamic("num_tokens")
    f32 = T.float32

    @T.prim_func
    def mhc_pre_split_mixes(
        input_mixes: T.Tensor[(num_tokens, W), f32],
        mhc_scale: T.Tensor[(3,), f32],
        mhc_base: T.Tensor[(W,), f32],
        pre_layer_mix: T.Tensor[(num_tokens, m), f32],
        post_layer_mix: T.Tensor[(num_tokens, m), f32],
        comb_res_mix: T.Tensor[(num_tokens, m * m), f32],
    ):
        with T.Kernel(T.ceildiv(num_tokens, bt), threads=threads) as bx:
            r = T.alloc_local((W,), f32)
            for t in T.Parallel(bt):
                tok = bx * bt + t
                if tok < num_tokens:
                    load(r, input_mixes, tok)
                    mixes[0](r, mhc_scale, mhc_base)
                    mixes[1](r, mhc_scale, mhc_base)
                    mixes[2](r, mhc_scale, mhc_base)
                    stores[0](pre_layer_mix, tok, r)
                    stores[1](post_layer_mix, tok, r)
                    stores[2](comb_res_mix, tok, r)

    return mhc_pre_split_mixes


def make_inputs(shape, device="cpu", seed=0):
    return random_inputs(shape, split_segments(shape), device, seed)  # input_mixes, mhc_scale, mhc_base


def reference(shape, input_mixes, mhc_scale, mhc_base):
    outs = reference_forward(split_segments(shape), input_mixes, mhc_scale, mhc_base, shape["mhc_pre_eps"],
                             shape["mhc_post_mult_value"])
    return tuple(o.to(input_mixes.dtype) for o in outs)


def _align(dim):
    return lambda s, c: 4 * vec_of(dim(s), c["vec"])


def _m(s):
    return s["mhc_mult"]


def _m2(s):
    return s["mhc_mult"] ** 2


SPEC = register(
    KernelSpec(
        name="mhc_pre_split_mixes",
        doc="mHC pre split: input_mixes * mhc_scale + mhc_base -> sigmoid + eps, sigmoid * mult, and the "
            "comb matrix, float32",
        params=(RUNTIME, MHC, POST_MULT, PRE_EPS),
        space=dict(FWD_SPACE),
        default=lambda s: fwd_default(s, split_segments(s)),
        constraint=lambda s, c: fwd_constraint(s, c, split_segments(s)),
        arch_constraint=arch_constraint_fwd,
        build=build,
        inputs=(
            TensorArg("input_mixes", "float32", ("num_tokens", width), align=_align(width)),
            TensorArg("mhc_scale", "float32", (3,), align=4),
            TensorArg("mhc_base", "float32", (width,), align=4),
        ),
        outputs=(
            TensorArg("pre_layer_mix", "float32", ("num_tokens", "mhc_mult"), align=_align(_m)),
            TensorArg("post_layer_mix", "float32", ("num_tokens", "mhc_mult"), align=_align(_m)),
            TensorArg("comb_res_mix", "float32", ("num_tokens", _m2), align=_align(_m2)),
        ),
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=lambda s: 2 * s["num_tokens"] * width(s) * 4 + (3 + width(s)) * 4,
        flops=lambda s: s["num_tokens"] * (2 * width(s) + 8 * s["mhc_mult"]),
        examples=(
            {"num_tokens": 4096, "mhc_mult": 4},
            {"num_tokens": 8192, "mhc_mult": 4},
            {"num_tokens": 1024, "mhc_mult": 8},
            {"num_tokens": 2048, "mhc_mult": 2},
        ),
        **COMMON,
    )
)
