"""mhc_head_compute_mix: the pre-layer weights of mHC's head (TileKernels' `mhc_head_compute_mix`).

input_mix (num_tokens, mhc_mult) float32, mhc_scale (1,), mhc_base (mhc_mult,) float32 ->
output_mix (num_tokens, mhc_mult) float32 = sigmoid(input_mix * mhc_scale[0] + mhc_base) + mhc_pre_eps
(TileKernels' torch reference `mhc_head_compute_mix_ref`; its ops take (n0, n1, mhc_mult), flattened here).

One token per thread (`_mixes.forward_blocks`): its row in `vec`-float vectors, the affine step (nvcc
contracts it into one fma, as in TileKernels' kernel), 1 / (1 + exp(-z)) with IEEE exp, + eps. The
reference is float64 rounded once; the kernel is within a few float32 ulps (rtol 1e-5). The eps is
compiled in (a static param), as TileKernels compiles it into its kernel. Lowers on TileLang's C target.
"""

from tkjit.registry import register
from tkjit.spec import KernelSpec, TensorArg
from tkjit_kernels.mhc._mixes import (
    COMMON,
    FWD_SPACE,
    MHC,
    PRE_EPS,
    RUNTIME,
    arch_constraint_fwd,
    forward_blocks,
    fwd_constraint,
    fwd_default,
    head_segments,
    random_inputs,
    reference_forward,
    vec_of,
)


def build(shape, c):
    from tilelang import language as T

    m = shape["mhc_mult"]
    bt, threads = c["block_tokens"], c["threads"]
    load, (mix,), (store,) = forward_blocks(head_segments(shape), c["vec"], shape["mhc_pre_eps"], 1.0)
    num_tokens = T.dynamic("num_tokens")
    f32 = T.float32

    @T.prim_func
    def mhc_head_compute_mix(
        input_mix: T.Tensor[(num_tokens, m), f32],
        mhc_scale: T.Tensor[(1,), f32],
        mhc_base: T.Tensor[(m,), f32],
        output_mix: T.Tensor[(num_tokens, m), f32],
    ):
        with T.Kernel(T.ceildiv(num_tokens, bt), threads=threads) as bx:
            r = T.alloc_local((m,), f32)
            for t in T.Parallel(bt):
                tok = bx * bt + t
                if tok < num_tokens:
                    load(r, input_mix, tok)
                    mix(r, mhc_scale, mhc_base)
                    store(output_mix, tok, r)

    return mhc_head_compute_mix


def make_inputs(shape, device="cpu", seed=0):
    return random_inputs(shape, head_segments(shape), device, seed)  # input_mix, mhc_scale, mhc_base


def reference(shape, input_mix, mhc_scale, mhc_base):
    (out,) = reference_forward(head_segments(shape), input_mix, mhc_scale, mhc_base, shape["mhc_pre_eps"], 1.0)
    return out.to(input_mix.dtype)


def _row_align(s, c):
    return 4 * vec_of(s["mhc_mult"], c["vec"])


SPEC = register(
    KernelSpec(
        name="mhc_head_compute_mix",
        doc="mHC head mix: sigmoid(input_mix * mhc_scale + mhc_base) + mhc_pre_eps, float32 (num_tokens, mhc_mult)",
        params=(RUNTIME, MHC, PRE_EPS),
        space=dict(FWD_SPACE),
        default=lambda s: fwd_default(s, head_segments(s)),
        constraint=lambda s, c: fwd_constraint(s, c, head_segments(s)),
        arch_constraint=arch_constraint_fwd,
        build=build,
        inputs=(
            TensorArg("input_mix", "float32", ("num_tokens", "mhc_mult"), align=_row_align),
            TensorArg("mhc_scale", "float32", (1,), align=4),
            TensorArg("mhc_base", "float32", ("mhc_mult",), align=4),
        ),
        outputs=(TensorArg("output_mix", "float32", ("num_tokens", "mhc_mult"), align=_row_align),),
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=lambda s: 2 * s["num_tokens"] * s["mhc_mult"] * 4 + (1 + s["mhc_mult"]) * 4,
        flops=lambda s: 6 * s["num_tokens"] * s["mhc_mult"],
        examples=(
            {"num_tokens": 4096, "mhc_mult": 4, "mhc_pre_eps": 1e-2},
            {"num_tokens": 8192, "mhc_mult": 4, "mhc_pre_eps": 1e-2},
            {"num_tokens": 1024, "mhc_mult": 8, "mhc_pre_eps": 1e-2},
        ),
        **COMMON,
    )
)
