"""mhc_pre_split_mixes_bwd: the gradients of mhc_pre_split_mixes (TileKernels' MHCPreSplitMixes.backward).

pre_layer_mix_grad, post_layer_mix_grad (num_tokens, mhc_mult), comb_res_mix_grad (num_tokens, mhc_mult**2),
input_mixes (num_tokens, W), mhc_scale (3,), mhc_base (W,) float32, W = 2 * mhc_mult + mhc_mult**2 ->
  input_mixes_grad       (num_tokens, W)   dL/dz * mhc_scale[k]
  mhc_scale_grad_partial (num_partials, 3) per block: sums of dL/dz * input_mixes over each column range
  mhc_base_grad_partial  (num_partials, W) per block: sums of dL/dz
with dL/dz = grad * s * (1 - s) (pre), grad * mult * s * (1 - s) (post), grad (comb), s the recomputed
sigmoid. TileKernels' kernel reads the saved post_layer_mix for the post columns (grad * post * (1 - post /
mult), the same value up to rounding, and a division by mult); this kernel recomputes s from input_mixes,
which it reads anyway, so it needs no saved output and is defined at mult = 0. The op sums the partials in
float32, as TileKernels sums its num_sms partials.

Layout `_mixes.backward_builder` (one token per thread, block partials by warp shuffles and shared memory);
each thread keeps 3 + W running sums (27 at mhc_mult 4, 83 at 8). CUDA targets only.
"""

from tkjit.registry import register
from tkjit.spec import KernelSpec, TensorArg
from tkjit_kernels.mhc._mixes import (
    BWD_SPACE,
    COMMON,
    MHC,
    PARTIALS,
    POST_MULT,
    RUNTIME,
    arch_constraint_bwd,
    backward_builder,
    bwd_constraint,
    bwd_default,
    random_inputs,
    reference_backward,
    split_segments,
    vec_of,
)
from tkjit_kernels.mhc.pre_split_mixes import width


def build(shape, c):
    return backward_builder(split_segments(shape), shape, c)


def make_inputs(shape, device="cpu", seed=0):
    # pre_layer_mix_grad, post_layer_mix_grad, comb_res_mix_grad, input_mixes, mhc_scale, mhc_base
    return random_inputs(shape, split_segments(shape), device, seed, grad=True)


def reference(shape, pre_grad, post_grad, comb_grad, input_mixes, mhc_scale, mhc_base):
    return reference_backward(split_segments(shape), (pre_grad, post_grad, comb_grad), input_mixes, mhc_scale,
                              mhc_base, shape["num_partials"], shape["mhc_post_mult_value"])


def _arg(name, dim):
    return TensorArg(name, "float32", ("num_tokens", dim), align=lambda s, c: 4 * vec_of(
        s["mhc_mult"] if dim == "mhc_mult" else dim(s), c["vec"]))


def _m2(s):
    return s["mhc_mult"] ** 2


SPEC = register(
    KernelSpec(
        name="mhc_pre_split_mixes_bwd",
        doc="Gradients of mhc_pre_split_mixes: input_mixes_grad, and per-block partial sums of mhc_scale's "
            "and mhc_base's",
        params=(RUNTIME, MHC, POST_MULT, PARTIALS),
        space=dict(BWD_SPACE),
        default=lambda s: bwd_default(s, split_segments(s)),
        constraint=lambda s, c: bwd_constraint(s, c, split_segments(s)),
        arch_constraint=arch_constraint_bwd,
        build=build,
        inputs=(
            _arg("pre_layer_mix_grad", "mhc_mult"),
            _arg("post_layer_mix_grad", "mhc_mult"),
            _arg("comb_res_mix_grad", _m2),
            _arg("input_mixes", width),
            TensorArg("mhc_scale", "float32", (3,), align=4),
            TensorArg("mhc_base", "float32", (width,), align=4),
        ),
        outputs=(
            _arg("input_mixes_grad", width),
            TensorArg("mhc_scale_grad_partial", "float32", ("num_partials", 3), align=4),
            TensorArg("mhc_base_grad_partial", "float32", ("num_partials", width), align=4),
        ),
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=lambda s: 3 * s["num_tokens"] * width(s) * 4 + s["num_partials"] * (3 + width(s)) * 4,
        flops=lambda s: s["num_tokens"] * (5 * width(s) + 10 * s["mhc_mult"]),
        examples=(
            {"num_tokens": 4096, "mhc_mult": 4},
            {"num_tokens": 8192, "mhc_mult": 4},
            {"num_tokens": 1024, "mhc_mult": 8},
            {"num_tokens": 2048, "mhc_mult": 2},
        ),
        **COMMON,
    )
)
