"""mhc_head_compute_mix_bwd: the gradients of mhc_head_compute_mix (TileKernels' MHCHeadComputeMix.backward).

output_mix_grad and input_mix (num_tokens, mhc_mult), mhc_scale (1,), mhc_base (mhc_mult,) float32 ->
  input_mix_grad         (num_tokens, mhc_mult)   dL/dz * mhc_scale, with dL/dz = s * (1 - s) * grad
  mhc_scale_grad_partial (num_partials, 1)        per block: sum of dL/dz * input_mix over its tokens
  mhc_base_grad_partial  (num_partials, mhc_mult) per block: sum of dL/dz over its tokens
(s = sigmoid(z), z = input_mix * mhc_scale + mhc_base, recomputed from the inputs as TileKernels' kernel
does). The op sums the partials over blocks in float32, as TileKernels sums its num_sms partials.

Layout `_mixes.backward_builder`: block b takes the tokens [b * ceil(N / P), ...), one per thread; each
thread keeps 1 + mhc_mult running sums, reduced by warp shuffles and the warps in order at the end. The
float32 sums are in an order of the kernel's (not TileKernels'), so they are compared with a tolerance.
Warp shuffles: CUDA targets only.
"""

from tkjit.registry import register
from tkjit.spec import KernelSpec, TensorArg
from tkjit_kernels.mhc._mixes import (
    BWD_SPACE,
    COMMON,
    MHC,
    PARTIALS,
    RUNTIME,
    arch_constraint_bwd,
    backward_builder,
    bwd_constraint,
    bwd_default,
    head_segments,
    random_inputs,
    reference_backward,
    vec_of,
)


def build(shape, c):
    return backward_builder(head_segments(shape), shape, c)


def make_inputs(shape, device="cpu", seed=0):
    # output_mix_grad, input_mix, mhc_scale, mhc_base
    return random_inputs(shape, head_segments(shape), device, seed, grad=True)


def reference(shape, output_mix_grad, input_mix, mhc_scale, mhc_base):
    return reference_backward(head_segments(shape), (output_mix_grad,), input_mix, mhc_scale, mhc_base,
                              shape["num_partials"], 1.0)


def _row_align(s, c):
    return 4 * vec_of(s["mhc_mult"], c["vec"])


def _rows(name):
    return TensorArg(name, "float32", ("num_tokens", "mhc_mult"), align=_row_align)


SPEC = register(
    KernelSpec(
        name="mhc_head_compute_mix_bwd",
        doc="Gradients of mhc_head_compute_mix: input_mix_grad, and per-block partial sums of mhc_scale's and "
            "mhc_base's",
        params=(RUNTIME, MHC, PARTIALS),
        space=dict(BWD_SPACE),
        default=lambda s: bwd_default(s, head_segments(s)),
        constraint=lambda s, c: bwd_constraint(s, c, head_segments(s)),
        arch_constraint=arch_constraint_bwd,
        build=build,
        inputs=(
            _rows("output_mix_grad"),
            _rows("input_mix"),
            TensorArg("mhc_scale", "float32", (1,), align=4),
            TensorArg("mhc_base", "float32", ("mhc_mult",), align=4),
        ),
        outputs=(
            _rows("input_mix_grad"),
            TensorArg("mhc_scale_grad_partial", "float32", ("num_partials", 1), align=4),
            TensorArg("mhc_base_grad_partial", "float32", ("num_partials", "mhc_mult"), align=4),
        ),
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=lambda s: 3 * s["num_tokens"] * s["mhc_mult"] * 4 + s["num_partials"] * (1 + s["mhc_mult"]) * 4,
        flops=lambda s: 12 * s["num_tokens"] * s["mhc_mult"],
        examples=(
            {"num_tokens": 4096, "mhc_mult": 4},
            {"num_tokens": 8192, "mhc_mult": 4},
            {"num_tokens": 1024, "mhc_mult": 8},
        ),
        **COMMON,
    )
)
