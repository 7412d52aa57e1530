"""Test-only specs for the kernel ABI's declarations beyond plain tensors, on the C target.

`axpy_inplace`: y += alpha * x (+ bias), with a run-time float scalar `alpha`, an optional `bias`
(the static flag `has_bias` selects the variant that takes it) and `y` updated in place.
`scale_traced`: out = alpha * x, and with the static flag `has_trace` an optional in-place input `trace`
(trace += out), which the call returns before `out` only in the variant taking it.
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


def build_scale_traced(shape, c):
    from tilelang import language as T

    n = T.dynamic("n")
    has_trace = shape["has_trace"]

    def scale_traced(x: T.Tensor[(n,), T.float32], trace: T.Tensor[(n,), T.float32] = None,
                     out: T.Tensor[(n,), T.float32] = None, alpha: T.float32 = None):
        with T.Kernel(1, threads=1) as _:
            for i in T.serial(n):
                out[i] = alpha * x[i]
                if has_trace:
                    trace[i] = trace[i] + alpha * x[i]

    if not has_trace:
        del scale_traced.__annotations__["trace"]
    return T.prim_func(scale_traced)


def _scale_traced_inputs(shape, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    n = shape["n"]
    x = torch.randn(n, generator=g).to(device)
    trace = (torch.randn(n, generator=g).to(device),) if shape["has_trace"] else ()
    return (x, *trace, 1.5)


def _scale_traced_reference(shape, x, *rest):
    """(trace after the call, out) in the variant taking trace, else out alone."""
    if shape["has_trace"]:
        trace, alpha = rest
        return trace + alpha * x, alpha * x
    (alpha,) = rest
    return alpha * x


SCALE_TRACED = register(
    KernelSpec(
        name="scale_traced",
        family="planted",
        doc="out = alpha * x, and trace += out into an optional in-place input (tests only)",
        params=(Runtime("n", hi=1 << 20), Static("has_trace", bool, default=False)),
        space={"unused": (0,)},
        default=lambda s: {"unused": 0},
        build=build_scale_traced,
        inputs=(
            TensorArg("x", "float32", ("n",)),
            TensorArg("trace", "float32", ("n",), inout=True, optional="has_trace"),
        ),
        outputs=(TensorArg("out", "float32", ("n",)),),
        scalars=(ScalarArg("alpha", float),),
        make_inputs=_scale_traced_inputs,
        reference=_scale_traced_reference,
        bytes_moved=lambda s: 16 * s["n"],
        examples=({"n": 64}, {"n": 64, "has_trace": True}),
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
