"""Test-only specs for the kernel ABI's declarations beyond plain tensors, on the C target.

`axpy_inplace`: y += alpha * x (+ bias), with a run-time float scalar `alpha`, an optional `bias`
(the static flag `has_bias` selects the variant that takes it) and `y` updated in place.
`bincount_scaled`: counts[idx[i]] += weight * scale for i < n, into a zeroed output whose length
`num_bins` no input gives (the caller passes it, or an `out=` tensor), with an int scalar `scale`
and a bool scalar `skip_negative` (negative indices dropped, else counted into bin 0).
"""

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Runtime, ScalarArg, Static, TensorArg


def build_axpy(shape, c):
    from tilelang import language as T

    n = T.dynamic("n")
    if shape["has_bias"]:

        @T.prim_func
        def axpy(x: T.Tensor[(n,), T.float32], y: T.Tensor[(n,), T.float32], bias: T.Tensor[(n,), T.float32],
                 alpha: T.float32):
            with T.Kernel(1, threads=1) as _:
                for i in T.serial(n):
                    y[i] = y[i] + alpha * x[i] + bias[i]

    else:

        @T.prim_func
        def axpy(x: T.Tensor[(n,), T.float32], y: T.Tensor[(n,), T.float32], alpha: T.float32):
            with T.Kernel(1, threads=1) as _:
                for i in T.serial(n):
                    y[i] = y[i] + alpha * x[i]

    return axpy


def _axpy_inputs(shape, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    n = shape["n"]
    x, y = torch.randn(n, generator=g), torch.randn(n, generator=g)
    bias = torch.randn(n, generator=g) if shape["has_bias"] else None
    return tuple(t if t is None else t.to(device) for t in (x, y, bias))


AXPY = register(
    KernelSpec(
        name="axpy_inplace",
        family="planted",
        doc="y += alpha * x (+ bias): a run-time scalar, an optional input, an in-place input (tests only)",
        params=(Runtime("n", hi=1 << 20), Static("has_bias", bool, default=False)),
        space={"unused": (0,)},
        default=lambda s: {"unused": 0},
        build=build_axpy,
        inputs=(
            TensorArg("x", "float32", ("n",)),
            TensorArg("y", "float32", ("n",), inout=True),
            TensorArg("bias", "float32", ("n",), optional="has_bias"),
        ),
        outputs=(),
        scalars=(ScalarArg("alpha", float),),
        make_inputs=_axpy_inputs,
        reference=lambda shape, x, y, bias, alpha: y + alpha * x + (0 if bias is None else bias),
        bytes_moved=lambda s: 12 * s["n"],
        examples=({"n": 64},),
    ),
    replace=True,
)


def build_bincount(shape, c):
    from tilelang import language as T

    n, num_bins = T.dynamic("n"), T.dynamic("num_bins")

    @T.prim_func
    def bincount(idx: T.Tensor[(n,), T.int32], weight: T.Tensor[(n,), T.float32],
                 counts: T.Tensor[(num_bins,), T.float32], scale: T.int32, skip_negative: T.bool):
        with T.Kernel(1, threads=1) as _:
            for i in T.serial(n):
                b = T.if_then_else(skip_negative, idx[i], T.max(idx[i], 0))
                if b >= 0:
                    if b < num_bins:
                        counts[b] = counts[b] + weight[i] * T.cast(scale, "float32")

    return bincount


def bincount_reference(idx, weight, num_bins, scale, skip_negative):
    keep = (idx < num_bins) & ((idx >= 0) | (not skip_negative))
    out = torch.zeros(num_bins, dtype=torch.float32)
    return out.index_add_(0, idx[keep].clamp(min=0).long(), (weight * scale)[keep])


BINCOUNT = register(
    KernelSpec(
        name="bincount_scaled",
        family="planted",
        doc="counts[idx[i]] += weight[i] * scale into a zeroed, caller-sized output (tests only)",
        params=(Runtime("n", hi=1 << 20), Runtime("num_bins", hi=1 << 20)),
        space={"unused": (0,)},
        default=lambda s: {"unused": 0},
        build=build_bincount,
        inputs=(TensorArg("idx", "int32", ("n",)), TensorArg("weight", "float32", ("n",))),
        outputs=(TensorArg("counts", "float32", ("num_bins",), zeroed=True),),
        scalars=(ScalarArg("scale", int), ScalarArg("skip_negative", bool)),
        make_inputs=lambda shape, device="cpu", seed=0: (
            torch.randint(-2, shape["num_bins"] + 2, (shape["n"],), dtype=torch.int32).to(device),
            torch.randn(shape["n"]).to(device),
        ),
        reference=lambda shape, idx, weight, scale=1, skip_negative=True: bincount_reference(
            idx, weight, shape["num_bins"], scale, skip_negative
        ),
        bytes_moved=lambda s: 8 * s["n"] + 4 * s["num_bins"],
        examples=({"n": 64, "num_bins": 8},),
    ),
    replace=True,
)
