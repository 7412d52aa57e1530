"""What the TileKernels-compatible modules share: argument checks and the refusals.

Three kinds of failure, kept apart so a caller can tell them apart:
  * input TileKernels itself refuses (an assert there): a tkjit error (TensorError for a tensor,
    ShapeError for a size or option value) naming the argument;
  * input TileKernels accepts but tkjit has no kernel for (an op, a format, an option, a size):
    NotImplementedError naming the function, the option and the kernel family that will bring it.
    Never a silent fallback to another implementation;
  * everything else is the kernel's own error (tkjit.get / CompiledKernel).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping
from typing import Any

import torch

from tkjit.autograd import plain
from tkjit.errors import ShapeError, TensorError, brief

PACKAGE = "tile_kernels"


def missing(qualname: str, family: str, what: str | None = None) -> NotImplementedError:
    """The error of a TileKernels function (or option of one) tkjit has no kernel for yet.

    qualname: e.g. "quant.per_block_cast"; family: the tkjit kernel family (kernel_specs/<family>/)
    that will bring it; what: the unsupported option, e.g. "fmt='e2m1'" (None: the whole op).
    """
    if what is None:
        return NotImplementedError(
            f"{PACKAGE}.{qualname}: tkjit has no kernel for this op yet; it will come with tkjit's "
            f"'{family}' kernel family (kernel_specs/{family}/)"
        )
    return NotImplementedError(
        f"{PACKAGE}.{qualname}: {what} is not supported by tkjit yet; it will come with tkjit's "
        f"'{family}' kernel family (kernel_specs/{family}/)"
    )


def as_int(fn: str, name: str, value: Any) -> int:
    """An int argument (int or anything with __index__, not bool), or ShapeError naming it."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except (TypeError, ValueError):
            pass
    raise ShapeError(f"{PACKAGE}.{fn}: {name} must be an int, got {brief(value)}")


def as_float(fn: str, name: str, value: Any) -> float:
    if isinstance(value, (bool, str, bytes)):
        raise ShapeError(f"{PACKAGE}.{fn}: {name} must be a float, got {brief(value)}")
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        raise ShapeError(f"{PACKAGE}.{fn}: {name} must be a float, got {brief(value)}") from None


def tensor(fn: str, name: str, x: Any, ndim: tuple[int, ...], dtypes: tuple[torch.dtype, ...] | None = None) -> None:
    """TileKernels' asserts on a tensor argument, as TensorError naming it."""
    if not isinstance(x, torch.Tensor):
        raise TensorError(f"{PACKAGE}.{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in ndim:
        want = " or ".join(f"{n}-D" for n in ndim)
        raise TensorError(f"{PACKAGE}.{fn}: {name} must be {want}, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        want = ", ".join(str(d) for d in dtypes)
        raise TensorError(f"{PACKAGE}.{fn}: {name} must be {want}, got {x.dtype}")


@functools.lru_cache(maxsize=4096)
def _unsupported(kernel: str, items: tuple[tuple[str, Any], ...]) -> tuple[str, str] | None:
    """(param, reason) for the first shape param of `kernel`'s spec that refuses its value, ("", reason)
    for a cross-param rule, or None when the spec takes the shape. Cached: the compat call pays it once
    per shape."""
    from tkjit.registry import get_spec

    spec = get_spec(kernel)
    values = dict(items)
    for p in spec.params:
        if p.name in values:
            try:
                p.check(values[p.name])
            except ShapeError as e:
                return p.name, str(e)
    try:
        spec.canonical_shape({**{p.name: 1 for p in spec.runtime_params}, **values})
    except ShapeError as e:
        return "", str(e)
    return None


@functools.cache
def _runtime_params(kernel: str) -> dict[str, Any]:
    from tkjit.registry import get_spec

    return {p.name: p for p in get_spec(kernel).runtime_params}


def _runtime_problem(kernel: str, runtime: Mapping[str, int]) -> tuple[str, str] | None:
    """(size, reason) for the first runtime size `kernel`'s spec refuses (not cached: they vary call to call)."""
    params = _runtime_params(kernel)
    for name, value in runtime.items():
        try:
            params[name].check(value)
        except ShapeError as e:
            return name, str(e)
    return None


# Under torch.compile the static check runs once, while tracing, and its answer is a constant of the graph
# (the spec registry's lock and cache are not traceable, and need not be: the answer depends on Python
# values only).
_unsupported_at_trace = torch.compiler.assume_constant_result(lambda kernel, items: _unsupported(kernel, items))


def _constant(v: Any) -> Any:
    """A static param's value as a Python constant while tracing (see require_kernel)."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        return operator.index(v)
    return v.__float__() if isinstance(v, float) else v


def require_kernel(
    fn: str,
    family: str,
    kernel: str,
    shape: Mapping[str, Any],
    names: Mapping[str, str],
    runtime: Mapping[str, int] | None = None,
) -> None:
    """NotImplementedError when tkjit's `kernel` spec does not take `shape` (its static params, checked
    against the spec itself, so a widened spec widens the compat layer with it) or the `runtime` sizes.
    names: spec param -> the TileKernels argument it comes from, for the message."""
    if torch.compiler.is_compiling():
        # Traced: the static values as constants (operator.index and __float__ specialise a symbolic size or
        # scalar, guarded: the kernel is built for one value anyway); the runtime sizes stay symbolic, left to
        # the op's own checks.
        items = tuple((k, _constant(v)) for k, v in shape.items())
        problem = _unsupported_at_trace(kernel, items)
        if problem is None:
            return
        values = dict(items)
    else:
        problem = _unsupported(kernel, tuple(shape.items()))  # (a caller's dict literal keeps one order)
        if problem is None and runtime:
            problem = _runtime_problem(kernel, runtime)
        if problem is None:
            return
        values = {**shape, **(runtime or {})}
    param, reason = problem
    if param:
        what = f"{names.get(param, param)}={brief(values[param])}"
    else:
        what = ", ".join(f"{names.get(k, k)}={brief(values[k])}" for k in shape)
    raise missing(fn, family, f"{what} ({reason})")


# The widest vector access tkjit's kernels make on a row-strided input (per_token_cast: two 16-byte
# loads per chunk). A view whose rows start on this is read in place.
ROW_ALIGN_BYTES = 32


def off_alignment(x: torch.Tensor, align: int) -> bool:
    """Whether x's data pointer is off an `align`-byte boundary. Traced (torch.compile), or a FakeTensor, meta
    tensor or subclass, a tensor has no address: False, and a view off the boundary (a slice into a row) is
    refused by the kernel at run time, naming it, rather than copied."""
    return plain(x) and x.data_ptr() % align != 0


def rows_aligned(x: torch.Tensor) -> torch.Tensor:
    """x itself when tkjit's kernels can read it in place, else a contiguous copy.

    TileKernels reads any row stride that is a multiple of 4 elements (transpose) or any stride at all
    (per_token_cast, a compile-time constant there); tkjit's kernels read a row-strided view in place
    only when its rows start on their vector width. A view that is not aligned so is copied first
    (same values, one more pass over x) rather than refused: the call is a drop-in either way.
    """
    if x.is_contiguous():  # (the common case first: a call's host cost is a few microseconds)
        # A contiguous x's rows are as aligned as its start: the kernels narrow their loads to the row width.
        if off_alignment(x, ROW_ALIGN_BYTES) and x.numel():
            return x.clone()  # a fresh, aligned allocation
        return x
    if x.numel() == 0 or x.stride(-1) != 1:
        return x  # (a last axis that is not contiguous is the kernel's to refuse, naming it)
    eb = x.element_size()
    leading = [s for s, n in zip(x.stride()[:-1], x.shape[:-1]) if n > 1]
    if off_alignment(x, ROW_ALIGN_BYTES) or any(s * eb % ROW_ALIGN_BYTES for s in leading):
        return x.clone(memory_format=torch.contiguous_format)  # a fresh, aligned allocation
    return x
