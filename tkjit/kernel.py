"""CompiledKernel: the callable `get` returns. Checks tensors, allocates outputs, launches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from tkjit.errors import LaunchError, ShapeError, TensorError
from tkjit.memo import Memo
from tkjit.spec import Align, CeilDiv, KernelSpec, ScalarArg, resolve_dim

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


_SCALAR_RANGE = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


def _scalar_check(s: ScalarArg) -> Callable[[Any], bool]:
    """A plan's quick test of a scalar: exactly its type (and in range); anything else takes the full
    checks, which convert or name the problem (`_scalar`)."""
    if s.type is bool:
        return lambda v: type(v) is bool
    if s.type is int:
        lo, hi = _SCALAR_RANGE[s.c_dtype]
        return lambda v: type(v) is int and lo <= v <= hi
    return lambda v: type(v) is float


def _scalar(kernel: str, s: ScalarArg, v: Any):
    """A scalar argument as the kernel takes it, or a TensorError naming it."""
    import operator

    if s.type is bool:
        if isinstance(v, bool):
            return v
    elif s.type is int:
        if not isinstance(v, bool):
            try:
                v = operator.index(v)
            except (TypeError, ValueError):
                pass
            else:
                lo, hi = _SCALAR_RANGE[s.c_dtype]
                if lo <= v <= hi:
                    return v
                raise TensorError(f"{kernel}: scalar {s.name}={v} does not fit {s.c_dtype} [{lo}, {hi}]")
    elif not isinstance(v, (bool, str, bytes)):
        try:
            v = float(v)
        except (TypeError, ValueError, OverflowError):
            pass
        else:
            return v  # inf and nan pass: a float scalar may mean them
    raise TensorError(f"{kernel}: scalar {s.name} must be a {s.type.__name__}, got {v!r} (a {type(v).__name__})")


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


class _ArgCheck(NamedTuple):  # a NamedTuple, not a dataclass: it is built at import (a fresh process's start)
    name: str
    dtype: Any
    # (runtime param, multiple it is rounded up to, or its CeilDiv with the divisor resolved) or (None, static size)
    dims: list[tuple[str | None, Any]]
    strided: bool = False  # leading strides are runtime args of the kernel (TensorArg.strided)
    align: int = 16  # bytes: data pointer (and leading strides of a strided arg) a multiple of this
    present: bool = True  # an optional input this variant takes (False: the caller passes None)
    optional: str | None = None  # the static bool param selecting an optional input
    inout: bool = False  # updated in place and returned (where present)
    zeroed: bool = False  # an output that starts as zeros


def _sigs(tensors: Sequence) -> tuple:
    """What a plan is keyed on, per tensor: everything the full checks read but its data pointer."""
    return tuple([(t.shape, t.stride(), t.dtype, t.device) for t in tensors])


_MAX_PLANS = 64  # call signatures remembered per kernel object (a serving loop sees a handful)


class CompiledKernel:
    """The callable `tkjit.get` returns: checks a call's tensors, allocates its outputs, launches.

    The first call with a given signature (each input's shape, strides, dtype and device) runs every
    check; a call that passes leaves a plan for its signature (outputs' shapes, the launcher bound to
    those shapes and strides), and later calls with that signature only check what the signature does
    not fix: that each input is a plain tensor (not a FakeTensor or other subclass) and its data pointer's
    alignment. Calls into `out=` tensors have plans of their own, keyed on the outputs' signature too;
    in-place inputs are planned like any other."""

    def __init__(self, spec: KernelSpec, shape: dict[str, Any], config: dict[str, Any], arch: str, key: str,
                 config_source: str, path: Path, _launch: Callable[..., Any], _checked_devices: set | None = None):
        self.spec = spec
        self.shape = shape  # the canonical shape it was asked for (static + runtime)
        self.config = config
        self.arch = arch
        self.key = key
        self.config_source = config_source
        self.path = path
        self._plans: Memo = Memo(_MAX_PLANS)  # signature -> Callable[[tuple], Any]
        self._out_plans: Memo = Memo(_MAX_PLANS)  # calls with out=: -> Callable[[tuple, Sequence], Any]
        self._launch_fn = _launch
        self._checked_devices = set() if _checked_devices is None else _checked_devices
        self.__post_init__()

    @property
    def _launch(self) -> Callable[..., Any]:
        return self._launch_fn

    @_launch.setter
    def _launch(self, fn: Callable[..., Any]) -> None:
        self._launch_fn = fn
        self._plans.clear()  # plans hold the launcher they were bound with
        self._out_plans.clear()

    def __repr__(self) -> str:
        return f"CompiledKernel({self.describe()})"

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
                elif isinstance(d, CeilDiv) and d.name in runtime:
                    dims.append((d.name, d.resolved(self.shape)))
                else:
                    dims.append((None, resolve_dim(d, self.shape)))
            return _ArgCheck(t.name, torch_dtype(dtype), dims, t.strided, t.align_bytes(self.shape, self.config),
                             t.present(self.shape), t.optional, t.inout, t.zeroed)

        self._in = [plan(t) for t in self.spec.inputs]
        self._out = [plan(t) for t in self.spec.outputs]
        self._runtime = runtime
        # Sizes no input gives (caller-sized outputs): from a keyword of the call or from `out=`.
        from_inputs = {r for a in self._in if a.present for r, m in a.dims if r and m == 1}
        self._caller_sized = tuple(sorted({r for a in self._out for r, _ in a.dims if r} - from_inputs))
        self._scalars = self.spec.scalars
        self._inouts = [i for i, a in enumerate(self._in) if a.inout and a.present]  # (as the call returns)
        self._simple = not (self._scalars or self._caller_sized or self._inouts
                            or any(a.zeroed for a in self._out) or any(not a.present for a in self._in))
        # A plan checks the scalars, zero-fills the zeroed outputs, takes the present inputs only (as a call
        # passes them), has the caller's sizes (or the out= tensors) in its signature and returns the
        # in-place inputs before the outputs, as the full checks do.
        self._present = [a for a in self._in if a.present]
        self._n_in = len(self._present)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def caller_sized(self) -> tuple[str, ...]:
        """Runtime sizes of outputs that no input gives: a call passes each by name (or gives out=)."""
        return self._caller_sized

    def __call__(self, *args, out=None, **kw):
        """Run on the input tensors, then the spec's scalars, positionally or by name (an optional input
        this variant does not take is left out, or passed as None by name); a caller-sized output's size
        by name (or read off `out=`).
        Returns the inout inputs this variant takes, then the outputs (one tensor, or a tuple when there are
        several).

        An empty batch (a runtime size of 0) launches nothing: outputs come back with their shapes,
        zeroed ones zero-filled."""
        if out is None:
            try:  # the fast path: a plan for this signature (see the class doc)
                if kw:  # caller-sized outputs' sizes by name: part of the signature
                    plan = self._plans.get((*[(t.shape, t.stride(), t.dtype, t.device) for t in args[:self._n_in]],
                                            tuple(sorted(kw.items()))))
                elif len(args) == 1:
                    t = args[0]
                    plan = self._plans.get((t.shape, t.stride(), t.dtype, t.device))
                else:  # the tensors' signature; a plan checks the scalars after them
                    plan = self._plans.get(tuple([(t.shape, t.stride(), t.dtype, t.device)
                                                  for t in args[:self._n_in]]))
            except Exception:  # not tensors, or unhashable: the full checks below name the problem
                plan = None
            if plan is not None:
                got = plan(args)
                if got is not None:
                    return got
        elif not kw:
            try:
                outs = out if isinstance(out, (tuple, list)) else (out,)
                plan = self._out_plans.get((_sigs(args[:self._n_in]), _sigs(outs)))
            except Exception:
                plan = None
            if plan is not None:
                got = plan(args, outs)
                if got is not None:
                    return got
        return self._call(args, out, kw)

    def _call(self, args: tuple, out: Any, kw: dict[str, Any]):
        """A call through every check; leaves a plan for its signature where the call is plain (see _plan)."""
        import torch

        if self._simple and not kw:
            inputs, scalars, given = args, (), {}
            if len(inputs) != len(self._in):
                raise TensorError(
                    f"{self.name}: expected {len(self._in)} input tensors ({', '.join(a.name for a in self._in)}), "
                    f"got {len(inputs)}"
                )
        else:
            inputs, scalars, given = self._split_args(args, kw)
        sizes: dict[str, int] = {}
        device = None
        for t, a in zip(inputs, self._in):
            if a.present:
                self._bind(t, a, sizes)
        for t, a in zip(inputs, self._in):
            if a.present:
                if t is None and a.optional:
                    raise TensorError(f"{self.name}: input {a.name} is None but this kernel was built with "
                                      f"{a.optional}=True; pass it, or get the variant with {a.optional}=False")
                device = self._check(t, a, sizes, device)
            elif t is not None:
                raise TensorError(
                    f"{self.name}: input {a.name} is given but this kernel was built with {a.optional}=False; "
                    f"get the variant with {a.optional}=True to pass it"
                )
        if given:
            self._bind_given(given, sizes)
        for name, v in sizes.items():
            p = self._runtime[name]
            if v != 0:
                p.check(v)
        if out is None:
            missing = [r for r in self._caller_sized if r not in sizes]
            if missing:
                raise ShapeError(
                    f"{self.name}: output size {', '.join(missing)} is not read off any input: pass it to the call "
                    f"({', '.join(f'{r}=...' for r in missing)}) or give out= tensors"
                )
            # An empty batch launches nothing: its outputs are zeros (an output with no runtime axis,
            # e.g. per-id counts, is then well defined), not whatever torch.empty returned.
            idle = any(v == 0 for v in sizes.values())
            outs = [(torch.zeros if a.zeroed or idle else torch.empty)(self._dims_of(a, sizes), dtype=a.dtype,
                                                                        device=device)
                    for a in self._out]
            if outs and type(outs[0]) is not torch.Tensor and _no_data(outs[0]):  # under a FakeTensorMode
                raise self._fake_error(outs[0], self._out[0], "output")
        else:
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            if len(outs) != len(self._out):
                raise TensorError(f"{self.name}: expected {len(self._out)} output tensors, got {len(outs)}")
            for t, a in zip(outs, self._out):
                self._check(t, a, sizes, device, output=True)
            idle = any(v == 0 for v in sizes.values())  # (as above: an empty batch's outputs are zeros)
            for t, a in zip(outs, self._out):
                if a.zeroed or idle:
                    t.zero_()
        if device.type == "cuda" and device.index not in self._checked_devices:
            self._check_device(device)
        launched = all(v != 0 for v in sizes.values())  # an empty batch launches nothing
        if launched:
            tensors = inputs if self._simple else [t for t, a in zip(inputs, self._in) if a.present]
            if any(t.requires_grad for t in tensors):
                # A kernel call is not an autograd op (tkjit.autograd wraps the pairs that are);
                # DLPack export refuses tensors that require grad.
                tensors = [t.detach() for t in tensors]
            try:
                self._launch(*tensors, *outs, *scalars)
            except LaunchError:
                raise
            except Exception as e:  # tvm_ffi reports argument/launch problems as its own errors
                raise LaunchError(f"{self.name}: launch failed: {type(e).__name__}: {e}") from e
        if len(args) == self._n_in + len(self._scalars) and (not kw if out is not None else
                                                               set(kw) <= set(self._caller_sized)):
            # a plain call: the present inputs and the scalars positionally, sizes by name or out= tensors
            present = tuple(t for t, a in zip(inputs, self._in) if a.present)
            if out is None:
                self._plan(present, outs, device, launched, kw)
            else:
                self._plan_out(present, outs, launched)
        if self._inouts:
            outs = [inputs[i] for i in self._inouts] + outs
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _plan(self, inputs: tuple, outs: list, device, launched: bool, sizes: dict[str, Any]) -> None:
        """Remember what a checked plain call (plain tensors then the scalars, positionally; no out=) fixed
        for its signature: the outputs' shapes and dtypes and the launcher bound to these shapes and
        strides. What the signature does not fix is checked again by the plan at each call: that every
        input is a plain torch.Tensor, that its data pointer is aligned as the kernel reads it, and that
        each scalar is exactly of its type and in range (a plan refuses to serve otherwise, and the full
        checks run and name the problem)."""
        import torch

        tensor = torch.Tensor
        if any(type(t) is not tensor for t in inputs) or not (outs or self._inouts):
            return
        bind = getattr(self._launch, "bind", None)
        if launched and bind is None:  # a plain function as launcher (tests): every call is checked
            return
        if sizes:  # the key __call__ looks up: the tensors', then the sizes given by name
            sig = (*[(t.shape, t.stride(), t.dtype, t.device) for t in inputs], tuple(sorted(sizes.items())))
        elif len(inputs) == 1 and not self._scalars:  # (one argument: bare)
            t = inputs[0]
            sig = (t.shape, t.stride(), t.dtype, t.device)
        else:
            sig = tuple([(t.shape, t.stride(), t.dtype, t.device) for t in inputs])
        go = bind([*inputs, *outs], len(inputs)) if launched else None
        aligned = tuple((i, a.align) for i, a in enumerate(self._present) if a.align > 1)
        specs = tuple((tuple(o.shape), o.dtype) for o in outs)
        empty, name = torch.empty, self.name

        n_in, n_args = len(inputs), len(inputs) + len(self._scalars)
        zeroed = any(a.zeroed for a in self._out) or not launched  # (an empty batch's outputs are zeros)
        inouts = tuple(self._present.index(self._in[i]) for i in self._inouts)
        if self._scalars or zeroed or inouts:  # the general form: scalars, zero-filled outputs, in-place inputs
            scalar_ok = tuple(_scalar_check(s) for s in self._scalars)
            fills = tuple(torch.zeros if a.zeroed or not launched else empty for a in self._out)

            def plan(args: tuple):
                if len(args) != n_args:
                    return None
                tensors, scalars = args[:n_in], args[n_in:]
                for t in tensors:
                    if type(t) is not tensor:
                        return None
                for i, align in aligned:
                    if tensors[i].data_ptr() % align:
                        return None
                for ok, v in zip(scalar_ok, scalars):
                    if not ok(v):
                        return None
                got = [fill(shape, dtype=dtype, device=device) for fill, (shape, dtype) in zip(fills, specs)]
                if go is not None:
                    try:
                        go(tensors, got, scalars)
                    except LaunchError:
                        raise
                    except Exception as e:
                        raise LaunchError(f"{name}: launch failed: {type(e).__name__}: {e}") from e
                if inouts:
                    got = [tensors[i] for i in inouts] + got
                return got[0] if len(got) == 1 else tuple(got)
        elif len(inputs) == 1 and len(specs) == 1:  # the common form, without the loops
            (shape, dtype), = specs
            align = aligned[0][1] if aligned else 1

            def plan(args: tuple):
                if len(args) != 1:
                    return None
                x = args[0]
                if type(x) is not tensor or x.data_ptr() % align:
                    return None
                y = empty(shape, dtype=dtype, device=device)
                if go is not None:
                    try:
                        go(args, (y,))
                    except LaunchError:
                        raise
                    except Exception as e:
                        raise LaunchError(f"{name}: launch failed: {type(e).__name__}: {e}") from e
                return y
        else:
            def plan(args: tuple):
                if len(args) != n_in:
                    return None
                for t in args:
                    if type(t) is not tensor:
                        return None
                for i, align in aligned:
                    if args[i].data_ptr() % align:
                        return None
                got = [empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
                if go is not None:
                    try:
                        go(args, got)
                    except LaunchError:
                        raise
                    except Exception as e:
                        raise LaunchError(f"{name}: launch failed: {type(e).__name__}: {e}") from e
                return got[0] if len(got) == 1 else tuple(got)

        self._plans.remember(sig, plan)

    def _plan_out(self, inputs: tuple, outs: list, launched: bool) -> None:
        """As _plan, for a checked call into out= tensors: the signature is the inputs' and the outputs'
        (shapes, strides, dtypes, devices), so each call only checks that every tensor is a plain
        torch.Tensor with its data pointer aligned as the kernel accesses it, and the scalars."""
        import torch

        tensor = torch.Tensor
        if any(type(t) is not tensor for t in (*inputs, *outs)):
            return
        bind = getattr(self._launch, "bind", None)
        if launched and bind is None:  # a plain function as launcher (tests): every call is checked
            return
        sig = (_sigs(inputs), _sigs(outs))
        go = bind([*inputs, *outs], len(inputs)) if launched else None
        aligned = tuple((i, a.align) for i, a in enumerate(self._present) if a.align > 1)
        out_aligned = tuple((i, a.align) for i, a in enumerate(self._out) if a.align > 1)
        scalar_ok = tuple(_scalar_check(s) for s in self._scalars)
        zeroed = tuple(i for i, a in enumerate(self._out) if a.zeroed or not launched)  # (empty batch: zeros)
        inouts = tuple(self._present.index(self._in[i]) for i in self._inouts)
        n_in, n_out, n_args, name = len(inputs), len(outs), len(inputs) + len(self._scalars), self.name

        def plan(args: tuple, outs: Sequence):
            if len(args) != n_args or len(outs) != n_out:
                return None
            tensors, scalars = args[:n_in], args[n_in:]
            for t in (*tensors, *outs):
                if type(t) is not tensor:
                    return None
            for i, align in aligned:
                if tensors[i].data_ptr() % align:
                    return None
            for i, align in out_aligned:
                if outs[i].data_ptr() % align:
                    return None
            for ok, v in zip(scalar_ok, scalars):
                if not ok(v):
                    return None
            for i in zeroed:
                outs[i].zero_()
            if go is not None:
                try:
                    go(tensors, outs, scalars)
                except LaunchError:
                    raise
                except Exception as e:
                    raise LaunchError(f"{name}: launch failed: {type(e).__name__}: {e}") from e
            got = [tensors[i] for i in inouts] + list(outs)
            return got[0] if len(got) == 1 else tuple(got)

        self._out_plans.remember(sig, plan)

    def _split_args(self, args: tuple, kw: dict) -> tuple[list, list, dict[str, int]]:
        """(inputs, scalar values in spec order, caller-given sizes) from a call's arguments."""
        # Positionally: the inputs this variant takes (an absent optional left out), then the scalars.
        names = [a.name for a in self._in if a.present] + [s.name for s in self._scalars]
        if len(args) > len(names):
            raise TensorError(f"{self.name}: expected at most {len(names)} arguments ({', '.join(names)}), "
                              f"got {len(args)}")
        values = dict(zip(names, args))
        given: dict[str, int] = {}
        for k, v in kw.items():
            if k in self._caller_sized:
                given[k] = v
            elif k not in names and not any(a.name == k for a in self._in):
                extra = f"; output sizes: {', '.join(self._caller_sized)}" if self._caller_sized else ""
                raise TensorError(f"{self.name}: unknown argument {k!r}; arguments: {', '.join(names)}{extra}")
            elif k in values:
                raise TensorError(f"{self.name}: argument {k!r} given twice (positionally and by name)")
            else:
                values[k] = v
        inputs = []
        for a in self._in:
            if a.name in values:
                inputs.append(values[a.name])
            elif not a.present:
                inputs.append(None)
            else:
                raise TensorError(f"{self.name}: missing input tensor {a.name}; arguments: {', '.join(names)}")
        scalars = []
        for s in self._scalars:
            if s.name not in values:
                raise TensorError(f"{self.name}: missing scalar {s.name} ({s.type.__name__}); pass it after the "
                                  f"tensors or as {s.name}=...")
            scalars.append(_scalar(self.name, s, values[s.name]))
        return inputs, scalars, given

    def _bind_given(self, given: dict[str, Any], sizes: dict[str, int]) -> None:
        for name, v in given.items():
            if not (type(v) is int and v == 0):  # 0: an empty output, below any declared minimum
                try:
                    v = self._runtime[name].check(v)
                except ShapeError as e:
                    raise ShapeError(f"{self.name}: output size: {e}") from None
            if sizes.setdefault(name, v) != v:
                raise ShapeError(f"{self.name}: {name}={v} given, but the out= tensors say {sizes[name]}")

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
        return [(m.of(sizes[r]) if type(m) is CeilDiv else -(-sizes[r] // m) * m) if r else m for r, m in a.dims]

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
            elif type(size) is CeilDiv:
                want = size.of(sizes[rname]) if rname in sizes else None
                if want is None or got != want:
                    raise TensorError(
                        f"{self.name}: {role} {a.name} axis {axis} is {got}, expected {size} ({want})"
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
        return ", ".join((str(s) if type(s) is CeilDiv else f"align({r}, {s})" if s > 1 else r) if r else str(s)
                         for r, s in a.dims)

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
