"""CompiledKernel: the callable `get` returns. Checks tensors, allocates outputs, launches."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tkjit.errors import LaunchError, TensorError
from tkjit.spec import Align, KernelSpec, resolve_dim

_INT32_MAX = 2**31 - 1  # runtime sizes and strides are int32 kernel args
_TORCH_DTYPES: dict[str, Any] = {}  # spec dtype name -> torch dtype
_DTYPE_NAMES: dict[Any, str] = {}  # and back


def _dtype_tables() -> None:
    import torch

    _TORCH_DTYPES.update(
        {
            "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
            "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
            "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
            "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
        }
    )
    _DTYPE_NAMES.update({v: k for k, v in _TORCH_DTYPES.items()})


def torch_dtype(name: str):
    if not _TORCH_DTYPES:
        _dtype_tables()
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise TensorError(f"unsupported dtype {name!r}") from None


def dtype_name(dtype) -> str:
    """A torch dtype's name in specs ("bfloat16", ...); str(dtype) for one no spec names (shape checks refuse it)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        if not _DTYPE_NAMES:
            _dtype_tables()
        return _DTYPE_NAMES.get(dtype, str(dtype))


def _no_data(t) -> bool:
    """True for a tensor without real memory behind it: meta, FakeTensor (torch.compile tracing, FakeTensorMode),
    functional or other wrapper subclasses. Its data_ptr() is no address a kernel may touch."""
    if t.is_meta:
        return True
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(t):
        return True
    try:
        return t.untyped_storage().data_ptr() == 0 and t.numel() != 0
    except Exception:  # wrapper subclasses have no storage to ask
        return True


@dataclass
class _ArgCheck:
    name: str
    dtype: Any
    dims: list[tuple[str | None, int]]  # (runtime param, multiple it is rounded up to) or (None, static size)
    strided: bool = False  # leading strides are runtime args of the kernel (TensorArg.strided)
    align: int = 16  # bytes: data pointer (and leading strides of a strided arg) a multiple of this


@dataclass
class CompiledKernel:
    spec: KernelSpec
    shape: dict[str, Any]  # the canonical shape it was asked for (static + runtime)
    config: dict[str, Any]
    arch: str
    key: str
    config_source: str
    path: Path
    _launch: Callable[..., Any] = field(repr=False)
    _checked_devices: set = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        runtime = {p.name: p for p in self.spec.runtime_params}
        self._device_type = "cpu" if self.arch == "cpu" else "cuda"

        def plan(t) -> _ArgCheck:
            # A dim is a runtime size (a plain name, or Align(name, m)) or a number from static params.
            dtype, _ = t.resolve({**self.shape, **{r: 1 for r in runtime}})
            dims = []
            for d in t.dims:
                if isinstance(d, str) and d in runtime:
                    dims.append((d, 1))
                elif isinstance(d, Align) and d.name in runtime:
                    dims.append((d.name, d.multiple))
                else:
                    dims.append((None, resolve_dim(d, self.shape)))
            return _ArgCheck(t.name, torch_dtype(dtype), dims, t.strided, t.align_bytes(self.shape, self.config))

        self._in = [plan(t) for t in self.spec.inputs]
        self._out = [plan(t) for t in self.spec.outputs]
        self._runtime = runtime

    @property
    def name(self) -> str:
        return self.spec.name

    def __call__(self, *inputs, out=None):
        """Run on input tensors; returns the output (a tuple when the spec has several)."""
        import torch

        if len(inputs) != len(self._in):
            raise TensorError(
                f"{self.name}: expected {len(self._in)} input tensors ({', '.join(a.name for a in self._in)}), "
                f"got {len(inputs)}"
            )
        sizes: dict[str, int] = {}
        device = None
        for t, a in zip(inputs, self._in):
            self._bind(t, a, sizes)
        for t, a in zip(inputs, self._in):
            device = self._check(t, a, sizes, device)
        for name, v in sizes.items():
            p = self._runtime[name]
            if v != 0:
                p.check(v)
        if out is None:
            outs = [torch.empty(self._dims_of(a, sizes), dtype=a.dtype, device=device) for a in self._out]
            if type(outs[0]) is not torch.Tensor and _no_data(outs[0]):  # under a FakeTensorMode
                raise self._fake_error(outs[0], self._out[0], "output")
        else:
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            if len(outs) != len(self._out):
                raise TensorError(f"{self.name}: expected {len(self._out)} output tensors, got {len(outs)}")
            for t, a in zip(outs, self._out):
                self._check(t, a, sizes, device, output=True)
        if device.type == "cuda" and device.index not in self._checked_devices:
            self._check_device(device)
        if all(v != 0 for v in sizes.values()):  # an empty batch launches nothing
            if any(t.requires_grad for t in inputs):
                # A kernel call is not an autograd op (tkjit.autograd wraps the pairs that are);
                # DLPack export refuses tensors that require grad.
                inputs = tuple(t.detach() for t in inputs)
            try:
                self._launch(*inputs, *outs)
            except LaunchError:
                raise
            except Exception as e:  # tvm_ffi reports argument/launch problems as its own errors
                raise LaunchError(f"{self.name}: launch failed: {type(e).__name__}: {e}") from e
        return outs[0] if len(outs) == 1 else tuple(outs)

    @staticmethod
    def _bind(t, a: _ArgCheck, sizes: dict[str, int]) -> None:
        """Runtime sizes read off plain runtime axes (first tensor wins; _check reports conflicts)."""
        shape = getattr(t, "shape", None)
        if shape is None or len(shape) != len(a.dims):
            return
        for (rname, mult), got in zip(a.dims, shape):
            if rname is not None and mult == 1:
                sizes.setdefault(rname, int(got))

    @staticmethod
    def _dims_of(a: _ArgCheck, sizes: dict[str, int]) -> list[int]:
        return [(-(-sizes[r] // m) * m if r else m) for r, m in a.dims]

    def _check(self, t, a: _ArgCheck, sizes: dict[str, int], device, output: bool = False):
        import torch

        role = "output" if output else "input"
        if not isinstance(t, torch.Tensor):
            raise TensorError(f"{self.name}: {role} {a.name} must be a torch.Tensor, got {type(t).__name__}")
        if type(t) is not torch.Tensor and _no_data(t):
            raise self._fake_error(t, a, role)
        if t.dtype != a.dtype:
            raise TensorError(f"{self.name}: {role} {a.name} has dtype {t.dtype}, expected {a.dtype}")
        if t.dim() != len(a.dims):
            raise TensorError(
                f"{self.name}: {role} {a.name} has {t.dim()} dims {tuple(t.shape)}, expected {len(a.dims)} "
                f"({self._dims_text(a)})"
            )
        for axis, ((rname, size), got) in enumerate(zip(a.dims, t.shape)):
            if rname is None:
                if got != size:
                    raise TensorError(
                        f"{self.name}: {role} {a.name} has shape {tuple(t.shape)}, expected ({self._dims_text(a)})"
                        f" (axis {axis} must be {size}, compiled in)"
                    )
            elif size > 1:  # Align(rname, size)
                want = -(-sizes[rname] // size) * size if rname in sizes else None
                if want is None or got != want:
                    raise TensorError(
                        f"{self.name}: {role} {a.name} axis {axis} is {got}, expected {rname} rounded up to a "
                        f"multiple of {size} ({want})"
                    )
            elif sizes.setdefault(rname, got) != got:
                raise TensorError(
                    f"{self.name}: {role} {a.name} axis {axis} ({rname}) is {got}, other tensors say {sizes[rname]}"
                )
        if t.device.type != self._device_type:
            if t.is_meta:
                raise self._fake_error(t, a, role)
            raise TensorError(
                f"{self.name}: {role} {a.name} is on {t.device}, this kernel was built for {self.arch} "
                f"and needs {self._device_type} tensors"
            )
        if device is not None and t.device != device:
            raise TensorError(f"{self.name}: {role} {a.name} is on {t.device}, other tensors on {device}")
        if a.strided:
            self._check_strided(t, a, role)
        elif not t.is_contiguous():
            raise TensorError(
                f"{self.name}: {role} {a.name} must be contiguous (call .contiguous()); got strides {t.stride()} "
                f"for shape {tuple(t.shape)}"
            )
        elif t.storage_offset() and t.data_ptr() % a.align:
            raise TensorError(
                f"{self.name}: {role} {a.name} is not {a.align}-byte aligned (a sliced view?): the kernel "
                f"accesses it with {a.align}-byte vectors"
            )
        return t.device

    def _check_strided(self, t, a: _ArgCheck, role: str) -> None:
        """A strided arg: last axis contiguous, every other axis (of more than one element) a stride of at
        least a row (rows do not overlap) that the kernel's int32 stride arg holds, and every row starting
        on the kernel's vector width."""
        st, shape = t.stride(), t.shape
        cols = shape[-1]
        for axis in range(len(st) - 1):
            if shape[axis] > 1 and not cols <= st[axis] <= _INT32_MAX:
                break
        else:
            axis = None
        if axis is not None or (st[-1] != 1 and cols != 1):
            lead = ", ".join([f">= {cols}"] * (len(st) - 1))
            raise TensorError(
                f"{self.name}: {role} {a.name} must have a contiguous last axis and non-overlapping rows: "
                f"expected strides ({lead}, 1) (at most {_INT32_MAX}), got {st} for shape {tuple(shape)} "
                "(call .contiguous())"
            )
        align = a.align
        if align > 1 and t.numel():
            eb = t.element_size()
            if t.data_ptr() % align or any(s * eb % align for s, n in zip(st[:-1], shape) if n > 1):
                raise TensorError(
                    f"{self.name}: {role} {a.name} is a view whose rows are not {align}-byte aligned: the kernel "
                    f"(config {self.config}) reads it with {align}-byte vectors, so its start and its leading "
                    f"strides must be multiples of {align} bytes ({align // eb} elements); got address % {align} "
                    f"= {t.data_ptr() % align} and strides {st} ({eb}-byte elements). Slice at an aligned "
                    "offset, use a wider buffer whose rows are aligned, or call .contiguous()"
                )

    def _fake_error(self, t, a: _ArgCheck, role: str) -> TensorError:
        return TensorError(
            f"{self.name}: {role} {a.name} ({type(t).__name__} on {t.device}) is a fake/meta tensor: it has no data; "
            "call the op under torch.compile or through torch.ops.tkjit so its fake implementation runs"
        )

    def _dims_text(self, a: _ArgCheck) -> str:
        return ", ".join((f"align({r}, {s})" if s > 1 else r) if r else str(s) for r, s in a.dims)

    def _check_device(self, device) -> None:
        from tkjit.arch import current_arch

        found = current_arch(device.index)
        if found != self.arch:
            raise LaunchError(
                f"{self.name}: kernel built for {self.arch} but {device} is {found}; "
                f"get it with arch=None (or arch={found!r})"
            )
        self._checked_devices.add(device.index)

    def describe(self) -> str:
        return (
            f"{self.name} {self.spec.static_shape(self.shape)} arch={self.arch} "
            f"config={self.config} ({self.config_source}) key={self.key}"
        )
