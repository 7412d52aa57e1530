"""The checks an op runs before its kernel's own (eager calls) and in its fake implementation (tracing):
tensors' ranks and dtypes, index ranges, sizes that may be symbolic (torch.compile with dynamic shapes)."""

import torch

from tkjit.envs import CHECK_INDICES, flag
from tkjit.errors import TensorError, TkjitError
from tkjit.kernel import torch_dtype
from tkjit.spec import Align, CeilDiv


def need(x, ndim, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() not in ndim:
        want = " or ".join(f"{n}-D" for n in ndim)
        raise TensorError(f"{what}: expected a {want} tensor, got {getattr(x, 'shape', type(x).__name__)}")


def need_dtype(t: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """TensorError unless t has `dtype`: for a tensor the op computes on in torch before a kernel would check it."""
    if t.dtype != dtype:
        raise TensorError(f"{what} has dtype {t.dtype}, expected {dtype}")


def check_indices(op: str, name: str, t: torch.Tensor, hi: int, lo: int = -1) -> None:
    """With TKJIT_CHECK_INDICES=1: TensorError unless every entry of the index tensor t is in [lo, hi).

    Off by default (it costs a device sync); the kernels never access memory out of bounds either way.
    """
    if not check_indices_on() or t.numel() == 0 or t.is_meta:
        return
    bad = ((t < lo) | (t >= hi)).nonzero()
    if bad.numel():
        where = tuple(int(i) for i in bad[0])
        raise TensorError(
            f"{op}: {name}{list(where)} = {int(t[where])} is out of range [{lo}, {hi})"
        )


def check_indices_on() -> bool:
    return flag(CHECK_INDICES)


def check(cond, message, error: type[TkjitError] = TensorError) -> None:
    """`error(message())` unless cond. For conditions on sizes that may be symbolic (torch.compile with dynamic
    shapes), torch._check's way: a guard or runtime assert, where `if not cond` would specialise the graph on
    the size. message: a callable, so the text is only built on failure."""
    if type(cond) is bool:  # eager calls and static sizes: no symbolic machinery (µs a call)
        if not cond:
            raise error(message())
        return
    torch._check_with(error, cond, message)


def need_contiguous(t: torch.Tensor, what: str) -> None:
    """TensorError unless t is contiguous: for a tensor the op views in another shape before the kernel sees
    it (the kernel's own check would come after a torch error from the view)."""
    if not t.is_contiguous():
        raise TensorError(f"{what} must be contiguous (call .contiguous()); got strides {t.stride()} for shape "
                          f"{tuple(t.shape)}")


def check_block_rows(name: str, sf: torch.Tensor, num_tokens, block: int) -> None:
    """The kernel's check of per-block scales' rows, ceil(num_tokens / block) (a CeilDiv dim, which fake_check
    leaves to its caller), where the sizes may be symbolic (a fake call)."""
    got, want = sf.shape[0], (num_tokens + block - 1) // block
    check(got == want, lambda: f"{name}: input sf axis 0 is {got}, expected ceil(num_tokens / {block}) ({want})")


def fake_check(name: str, shape: dict, *tensors: torch.Tensor) -> None:
    """What the real call would refuse before launching, at trace time: bad shape params, dtypes, sizes,
    with the kernel's own messages (tkjit.kernel's checks). Also the real call's checks where it launches
    nothing (empty inputs), so that those are refused as the kernel would refuse them.

    shape holds the static params (plain ints, read off the tensors with int(): compiled in, so a
    traced graph specialises on them) and may hold runtime sizes given as int arguments; the runtime
    sizes read off the tensors may be symbolic: each must agree with the first tensor having it (a guard
    or runtime assert, not a specialisation). tensors: the inputs the variant takes, in the spec's order
    (optional ones it does not take left out), or a leading part of them.
    """
    from tkjit.registry import get_spec

    spec = get_spec(name)
    full = spec.canonical_shape({**{p.name: 1 for p in spec.runtime_params}, **shape})
    runtime = {p.name for p in spec.runtime_params}
    sizes: dict = {}  # each runtime size, as the first tensor having it says (the kernel's rule)
    for t, arg in zip(tensors, [a for a in spec.inputs if a.present(full)]):
        dtype, dims = arg.resolve(full)
        if not isinstance(t, torch.Tensor):
            raise TensorError(f"{name}: input {arg.name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch_dtype(dtype):
            raise TensorError(f"{name}: input {arg.name} has dtype {t.dtype}, expected {torch_dtype(dtype)}")
        if t.dim() != len(dims):
            raise TensorError(f"{name}: input {arg.name} has {t.dim()} dims {tuple(t.shape)}, expected {len(dims)} "
                              f"({_dims_text(arg, dims, full, runtime)})")
        for axis, (d, size) in enumerate(zip(arg.dims, dims)):
            got = t.shape[axis]
            if isinstance(d, str) and d in runtime:
                want = sizes.setdefault(d, got)
                check(got == want, lambda arg=arg, axis=axis, d=d, got=got, want=want:
                       f"{name}: input {arg.name} axis {axis} ({d}) is {got}, other tensors say {want}")
            elif isinstance(d, (Align, CeilDiv)) and d.name in runtime:
                continue  # a function of a runtime size: the caller checks it (e.g. per-block scales' rows)
            elif got != size:
                raise TensorError(f"{name}: input {arg.name} has shape {tuple(t.shape)}, expected "
                                  f"({_dims_text(arg, dims, full, runtime)}) (axis {axis} must be {size}, compiled in)")


def _dims_text(arg, dims: tuple, full: dict, runtime: set) -> str:
    """An input's dims as the kernel's messages write them: sizes of runtime params by name, the rest by value."""
    def one(d, size) -> str:
        if isinstance(d, str) and d in runtime:
            return d
        if isinstance(d, CeilDiv) and d.name in runtime:
            return str(d.resolved(full))
        if isinstance(d, Align) and d.name in runtime:
            return f"align({d.name}, {d.multiple})"
        return str(size)

    return ", ".join(one(d, size) for d, size in zip(arg.dims, dims))
