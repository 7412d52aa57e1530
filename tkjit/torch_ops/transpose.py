"""torch.ops.tkjit.transpose."""

import torch

from tkjit.kernel import dtype_name
from tkjit.torch_ops.checks import fake_check, need
from tkjit.torch_ops.serve import kernel_for


def transpose_impl(x, config=None):
    """(rows, cols) -> (cols, rows), or (batch, rows, cols) -> (batch, cols, rows), bit-exact."""
    def shape_of():
        need(x, (2, 3), "transpose")
        shape = {"rows": max(1, x.shape[-2]), "cols": x.shape[-1], "dtype": dtype_name(x.dtype)}
        if x.dim() == 3:
            shape["batch"] = max(1, x.shape[0])
        return shape

    name = "batched_transpose" if getattr(x, "ndim", None) == 3 else "transpose"
    return kernel_for(name, x, (), config, shape_of)(x)


transpose = torch.library.custom_op(
    "tkjit::transpose", mutates_args=(), schema="(Tensor x, str? config=None) -> Tensor"
)(transpose_impl)


@transpose.register_fake
def _(x, config=None):
    need(x, (2, 3), "transpose")
    name = "batched_transpose" if x.dim() == 3 else "transpose"
    fake_check(name, {"cols": int(x.shape[-1]), "dtype": dtype_name(x.dtype)}, x)
    return x.new_empty((*x.shape[:-2], x.shape[-1], x.shape[-2]))
