"""The declarative kernel spec: shapes, tunable space, constraints, default, builder, reference.

A spec is plain data plus a few functions. Nothing here imports TileLang: the builder is only
called by the compiler, so serving a cached kernel never needs the compiler.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tkjit.errors import ConfigError, ShapeError, SpecError, brief
from tkjit.match import exact_index

Shape = dict[str, Any]
Config = dict[str, Any]

_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # widest int a kernel argument takes


def _shown(value: Any) -> str:
    """A wrong-typed value and its type: '4' alone would not say it is a str."""
    shown = brief(value)
    return shown if isinstance(value, (int, float, type(None))) else f"{shown} (a {type(value).__name__})"


def pow2_bucket(value: int) -> int:
    """Smallest power of two >= value: tuning winners are shared inside a bucket."""
    return 1 << max(0, int(value) - 1).bit_length()


class Param(NamedTuple):
    """A shape parameter.

    static: compiled into the kernel (part of the cache key).
    runtime: a `T.dynamic` size; the kernel serves every value, tuning is per `bucket(value)`.
    """

    name: str
    type: type = int
    static: bool = True
    values: tuple | None = None  # allowed values, or None for the [lo, hi] range
    lo: float | None = None
    hi: float | None = None
    default: Any = None
    bucket: Callable[[int], int] | None = None
    doc: str = ""

    def check(self, value: Any) -> Any:
        """Return the canonical value or raise ShapeError naming the problem."""
        if self.type is bool:
            if not isinstance(value, bool):
                raise ShapeError(f"shape param {self.name!r} must be a bool, got {_shown(value)}")
        elif self.type is int:
            value = self._as_int(value)
        elif self.type is float:
            value = self._as_float(value)
        elif self.type is str:
            if not isinstance(value, str):
                raise ShapeError(f"shape param {self.name!r} must be a str, got {_shown(value)}")
        if self.values is not None and value not in self.values:
            raise ShapeError(f"shape param {self.name!r}={brief(value)} not allowed; allowed: {list(self.values)}")
        if self.lo is not None and value < self.lo:
            raise ShapeError(f"shape param {self.name!r}={brief(value)} below its minimum {self.lo}")
        if self.hi is not None and value > self.hi:
            raise ShapeError(f"shape param {self.name!r}={brief(value)} above its maximum {self.hi}")
        if self.type is int and not INT64_MIN <= value <= INT64_MAX:
            # No declared range, but the kernel still receives it as (at most) a 64-bit int.
            raise ShapeError(
                f"shape param {self.name!r}={brief(value)} does not fit the kernel's 64-bit int "
                f"[{INT64_MIN}, {INT64_MAX}]"
            )
        return value

    def _as_int(self, value: Any) -> int:
        # Lossless ints only: int and what implements __index__ (numpy, torch ints). Not bool,
        # not floats (4.0 may be a rounded 4.3), not strings (int() takes " 4 ", "1_0", "١٢").
        if not isinstance(value, bool):
            try:
                return operator.index(value)
            except (TypeError, ValueError):  # ValueError: e.g. a tensor of several elements
                pass
        raise ShapeError(f"shape param {self.name!r} must be an int, got {_shown(value)}")

    def _as_float(self, value: Any) -> float:
        # Numbers only: float() would also parse str and bytes.
        if not isinstance(value, (bool, str, bytes, bytearray)):
            try:
                value = float(value)
            except OverflowError:  # an int beyond 1.8e308
                raise ShapeError(f"shape param {self.name!r}={brief(value)} is too large for a float") from None
            except (TypeError, ValueError):
                pass
            else:
                if not math.isfinite(value):
                    raise ShapeError(f"shape param {self.name!r} must be finite, got {value!r}")
                return value
        raise ShapeError(f"shape param {self.name!r} must be a float, got {_shown(value)}")

    def describe(self) -> str:
        if self.values is not None:
            dom = "{" + ", ".join(map(str, self.values)) + "}"
        else:
            dom = f"[{self.lo if self.lo is not None else '-inf'}, {self.hi if self.hi is not None else 'inf'}]"
        kind = "static" if self.static else "runtime"
        extra = f", default {self.default}" if self.default is not None else ""
        return f"{self.name}: {self.type.__name__} {dom} ({kind}{extra})"


def Static(name: str, type: type = int, **kw: Any) -> Param:  # noqa: N802 - reads like a declaration
    return Param(name, type=type, static=True, **kw)


def Runtime(name: str, lo: int = 1, hi: int = 2**31 - 1, bucket=pow2_bucket, **kw: Any) -> Param:  # noqa: N802
    return Param(name, type=int, static=False, lo=lo, hi=hi, bucket=bucket, **kw)


class Align(NamedTuple):
    """A dim equal to param `name` rounded up to a multiple (e.g. TMA-aligned scale rows)."""

    name: str
    multiple: int

    def of(self, value: int) -> int:
        return -(-int(value) // self.multiple) * self.multiple


class CeilDiv(NamedTuple):
    """A dim equal to ceil(param `name` / divisor), rounded up to a multiple: one entry per block of
    `divisor` rows (per-block scales: ceil(num_tokens / block_m) rows). divisor: an int or the name of a
    static int param (a block size compiled in)."""

    name: str
    divisor: int | str
    multiple: int = 1

    def resolved(self, shape: Mapping[str, Any]) -> CeilDiv:
        """This dim with a named divisor replaced by its value in `shape`."""
        return self if isinstance(self.divisor, int) else CeilDiv(self.name, int(shape[self.divisor]), self.multiple)

    def of(self, value: int, shape: Mapping[str, Any] | None = None) -> int:
        d = self.divisor if isinstance(self.divisor, int) else int(shape[self.divisor])
        blocks = -(-int(value) // d)
        return -(-blocks // self.multiple) * self.multiple

    def __str__(self) -> str:
        text = f"ceil({self.name} / {self.divisor})"
        return f"align({text}, {self.multiple})" if self.multiple > 1 else text


Dim = str | int | Align | CeilDiv | Callable[[Shape], int]  # a callable may only read static params


def resolve_dim(d: Dim, shape: Mapping[str, Any]) -> int:
    if isinstance(d, str):
        return int(shape[d])
    if isinstance(d, Align):
        return d.of(shape[d.name])
    if isinstance(d, CeilDiv):
        return d.of(shape[d.name], shape)
    return int(d(shape)) if callable(d) else int(d)


def stride_name(arg: str, axis: int) -> str:
    """The runtime stride var of a strided tensor's axis: the builder's `T.dynamic` name and the ABI's."""
    return f"{arg}_stride{axis}"


class TensorArg(NamedTuple):
    """A tensor the kernel takes or returns. dims: param names, Align(name, m), ints, or shape -> int.

    strided: an input whose leading strides are runtime values (the builder declares it with
    `T.StridedTensor(dims, (T.dynamic(stride_name(name, 0)), ..., 1), dtype)`): one binary reads any
    view whose last axis is contiguous and whose rows do not overlap, e.g. `buf[:, :hidden]`.
    Otherwise the tensor must be contiguous.
    align: bytes its data pointer (and a strided tensor's leading strides) must be a multiple of:
    the widest vector access the kernel makes to it; an int or (shape, config) -> int.
    """

    name: str
    dtype: str | Callable[[Shape], str]
    dims: tuple[Dim, ...]
    strided: bool = False
    align: int | Callable[[Shape, Config], int] = 16
    # An input the kernel updates in place; the call returns that same tensor (an optional one only in the
    # variant that takes it).
    inout: bool = False
    zeroed: bool = False  # an output that starts as zeros (allocated so, or `out=` zero-filled): atomics
    optional: str | None = None  # an input that may be None: names the static bool param selecting it

    def present(self, shape: Mapping[str, Any]) -> bool:
        """Whether the variant for this (static) shape takes it: an optional's flag is compiled in."""
        return self.optional is None or bool(shape[self.optional])

    def resolve(self, shape: Mapping[str, Any]) -> tuple[str, tuple[int, ...]]:
        dtype = self.dtype(shape) if callable(self.dtype) else self.dtype
        return dtype, tuple(resolve_dim(d, shape) for d in self.dims)

    def stride_names(self) -> tuple[str, ...]:
        """Its runtime stride vars, one per leading axis (none unless strided)."""
        return tuple(stride_name(self.name, axis) for axis in range(len(self.dims) - 1)) if self.strided else ()

    def align_bytes(self, shape: Mapping[str, Any], config: Mapping[str, Any]) -> int:
        return int(self.align(dict(shape), dict(config)) if callable(self.align) else self.align)


_SCALAR_DTYPES = {int: ("int32", "int64"), float: ("float32", "float64"), bool: ("bool",)}


class ScalarArg(NamedTuple):
    """A scalar the kernel takes at run time (not compiled in, not in the key): the builder declares it
    as a PrimFunc parameter after the tensors, in spec order (`alpha: T.float32`). type: int, float or
    bool; dtype: its C type, by default int32 / float32 / bool."""

    name: str
    type: type = float
    dtype: str = ""

    @property
    def c_dtype(self) -> str:
        return self.dtype or _SCALAR_DTYPES.get(self.type, ("",))[0]


class Tolerance(NamedTuple):
    """How a kernel output is compared with the reference. Integer outputs (indices, counts) are always
    compared exactly: a relative error says nothing about a wrong index."""

    exact: bool = False
    rtol: float = 1e-5  # bound on ||out - ref|| / ||ref||
    max_abs: float | None = None

    def check(self, name: str, out, ref) -> str | None:
        """None when out matches ref, else a message saying how it does not."""
        import torch

        if out.shape != ref.shape:
            return f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
        if out.dtype != ref.dtype:
            return f"{name}: dtype {out.dtype} != reference {ref.dtype}"
        if self.exact or not out.dtype.is_floating_point:
            o, r = out, ref
            if o.dtype.is_floating_point and o.element_size() == 1:
                o, r = o.view(torch.uint8), r.view(torch.uint8)
            equal = torch.equal(o, r) if not o.dtype.is_floating_point else bool(
                ((o == r) | (o.isnan() & r.isnan())).all()
            )
            if not equal:
                bad = int((o != r).sum())
                return f"{name}: {bad} of {o.numel()} elements differ from the exact reference"
            return None
        o, r = out.double(), ref.double()
        if not bool(torch.isfinite(o).all()):
            return f"{name}: {int((~torch.isfinite(o)).sum())} non-finite elements (unwritten or NaN)"
        denom = float(r.norm()) or 1.0
        rel = float((o - r).norm()) / denom
        if rel > self.rtol:
            return f"{name}: relative error {rel:.3e} > {self.rtol:.1e}"
        if self.max_abs is not None:
            worst = float((o - r).abs().max()) if o.numel() else 0.0
            if worst > self.max_abs:
                return f"{name}: max abs error {worst:.3e} > {self.max_abs:.1e}"
        return None


def cuda_only(why: str) -> Callable[[str, Config, Shape], str | None]:
    """An arch_constraint for a kernel TileLang's C target cannot lower: every config is refused on "cpu",
    with `why` (what the kernel needs) in the message."""
    reason = f"{why}: CUDA targets only"

    def arch_constraint(arch: str, config: Config, shape: Shape) -> str | None:
        return reason if arch == "cpu" else None

    return arch_constraint


def plain_threads(config: Config) -> dict[str, Any]:
    """pass_configs of a kernel that places its own barriers and threads: no warp specialisation."""
    return {"tl.disable_warp_specialized": True}


def ieee_plain_threads(config: Config) -> dict[str, Any]:
    """plain_threads, and IEEE float maths (expf, divisions, no flush to zero): the kernels whose results are
    compared bit for bit with a reference computed with IEEE operations."""
    return {"tl.enable_fast_math": False, "tl.disable_warp_specialized": True}


@dataclass
class KernelSpec:
    name: str
    family: str
    doc: str
    params: tuple[Param, ...]
    space: dict[str, tuple]
    default: Callable[[Shape], Config]
    build: Callable[[Shape, Config], Any]  # (static shape, config) -> tilelang PrimFunc
    inputs: tuple[TensorArg, ...]
    outputs: tuple[TensorArg, ...]
    make_inputs: Callable[..., tuple]  # (shape, device, seed) -> input tensors
    reference: Callable[..., Any]  # (shape, *inputs) -> output tensor(s)
    bytes_moved: Callable[[Shape], int]
    constraint: Callable[[Shape, Config], str | None] = lambda shape, config: None
    # (arch, config, shape) -> reason or None: what a target cannot lower (e.g. the C target)
    arch_constraint: Callable[[str, Config, Shape], str | None] = lambda arch, config, shape: None
    pass_configs: Callable[[Config], dict[str, Any]] = lambda config: {}
    # (shape, config, device) -> reason or None: a config the GPU it runs on cannot launch, for kernels whose
    # blocks must all be resident at once (a cooperative grid). device: `tkjit.arch.device_limits`.
    device_constraint: Callable[[Shape, Config, Mapping[str, int]], str | None] | None = None
    tolerance: Tolerance = field(default_factory=Tolerance)
    flops: Callable[[Shape], int] | None = None
    check_shape: Callable[[Shape], str | None] = lambda shape: None  # cross-param rules
    examples: tuple[Shape, ...] = ()  # realistic full shapes: validation, `compile --all-defaults`, bench
    scalars: tuple[ScalarArg, ...] = ()  # run-time scalars, PrimFunc params after the tensors
    # Config overrides that make the kernel IEEE-exact where its fast configs are not (fast math, reciprocals):
    # TKJIT_EXACT_MATH=1 serves the chosen config with these applied. Empty: the kernel is always exact.
    exact: Mapping[str, Any] = field(default_factory=dict)
    # Tunables added to the space after configs were tuned, each with the value that builds the kernel as it was
    # before it: a tuned entry written without them (a user's DB, a winners file) is served with these filled in,
    # not dropped for the default.
    added: Mapping[str, Any] = field(default_factory=dict)
    # The reference runs where the inputs are, not on CPU copies: its result depends on the device's maths
    # library (torch's CUDA expf and its CPU exp differ in the last bit), and the kernel matches the device's.
    # Such a reference gets the caller's tensors themselves: it must not write into them.
    reference_on_device: bool = False
    source_hash: str = ""

    # -- shapes -------------------------------------------------------------------------
    @property
    def static_params(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if p.static)

    @property
    def runtime_params(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if not p.static)

    def canonical_shape(self, shape: Mapping[str, Any], *, need_runtime: bool = True) -> Shape:
        """Validated shape with defaults filled in; errors list what is allowed."""
        if not isinstance(shape, Mapping):
            raise ShapeError(f"{self.name}: shape must be a mapping of param name -> value, got {_shown(shape)}")
        known = {p.name: p for p in self.params}
        extra = sorted(set(shape) - set(known), key=brief)
        if extra:
            raise ShapeError(
                f"{self.name}: unknown shape params {_listed(extra)}; expected: "
                + "; ".join(p.describe() for p in self.params)
            )
        out: Shape = {}
        missing = []
        for p in self.params:
            if p.name in shape:
                out[p.name] = p.check(shape[p.name])
            elif p.default is not None:
                out[p.name] = p.default
            elif p.static or need_runtime:
                missing.append(p.describe())
        if missing:
            raise ShapeError(f"{self.name}: missing shape params: {'; '.join(missing)}")
        problem = self.check_shape(out) if all(p.name in out for p in self.params) else None
        if problem:
            raise ShapeError(f"{self.name}: {problem}")
        return out

    def static_shape(self, shape: Mapping[str, Any]) -> Shape:
        return {p.name: shape[p.name] for p in self.static_params}

    def bucket(self, shape: Mapping[str, Any]) -> Shape:
        """The runtime sizes mapped to their tuning buckets."""
        return {p.name: (p.bucket or (lambda v: v))(shape[p.name]) for p in self.runtime_params if p.name in shape}

    # -- configs ------------------------------------------------------------------------
    def check_config(self, shape: Mapping[str, Any], config: Mapping[str, Any], arch: str | None = None) -> Config:
        """Validate a full config against the space and constraints."""
        if not isinstance(config, Mapping):
            raise ConfigError(f"{self.name}: config must be a mapping, got {_shown(config)}")
        extra = sorted(set(config) - set(self.space), key=brief)
        missing = sorted(set(self.space) - set(config), key=repr)
        if extra or missing:
            raise ConfigError(
                f"{self.name}: config keys {_listed(sorted(config, key=brief))} do not match the space "
                f"{sorted(self.space)}"
                + (f" (unknown: {_listed(extra)})" if extra else "")
                + (f" (missing: {missing})" if missing else "")
            )
        for k, v in config.items():
            allowed = self.space[k]
            if exact_index(allowed, v) is None:
                raise ConfigError(f"{self.name}: config {k}={brief(v)} not in the space; allowed: {list(allowed)}")
        cfg = {k: config[k] for k in self.space}
        reason = self.constraint(dict(shape), cfg) or (self.arch_constraint(arch, cfg, dict(shape)) if arch else None)
        if reason:
            raise ConfigError(f"{self.name}: config {cfg} not allowed for shape {dict(shape)}: {reason}")
        return cfg

    def configs(self, shape: Mapping[str, Any], arch: str | None = None) -> list[Config]:
        """Every config in the space that the constraints allow for this shape."""
        import itertools

        keys = list(self.space)
        out = []
        for combo in itertools.product(*(self.space[k] for k in keys)):
            cfg = dict(zip(keys, combo))
            if not self.constraint(dict(shape), cfg) and not (arch and self.arch_constraint(arch, cfg, dict(shape))):
                out.append(cfg)
        return out

    def default_config(self, shape: Mapping[str, Any], arch: str | None = None) -> Config:
        cfg = self.default(dict(shape))
        reason = self.arch_constraint(arch, cfg, dict(shape)) if arch else None
        if reason:
            # The heuristic targets GPUs; on other targets take the first allowed config.
            allowed = self.configs(shape, arch)
            if not allowed:
                raise ConfigError(f"{self.name}: no config in the space supports arch {arch} ({reason})")
            cfg = allowed[0]
        return self.check_config(shape, cfg, arch)

    # -- tensors ------------------------------------------------------------------------
    def abi_tensors(self, static_shape: Mapping[str, Any]) -> tuple[TensorArg, ...]:
        """The tensor params of the variant for this static shape, in order: inputs (an absent optional
        left out), then outputs."""
        return tuple(t for t in self.inputs if t.present(static_shape)) + self.outputs

    def abi_scalars(self) -> list[dict[str, str]]:
        """The scalar params as the ABI records them: [{"name", "dtype"}], in order."""
        return [{"name": s.name, "dtype": s.c_dtype} for s in self.scalars]

    def output_decls(self, shape: Mapping[str, Any]) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(t.name, *t.resolve(shape)) for t in self.outputs]


def _listed(items: Sequence) -> str:
    """[a, b] with each item shown briefly, at most 10 of them."""
    shown = [brief(x) for x in items[:10]] + ([f"... {len(items) - 10} more"] if len(items) > 10 else [])
    return "[" + ", ".join(shown) + "]"


def source_hash_of(obj: Any) -> str:
    """Hash of the source that defines a spec: the module defining `obj` (its builder) and every
    module of the same top-level package that it imports, directly or through one another (a
    family's shared `_common.py`, a sibling spec). Editing any of them changes the spec's key.

    Imports are read from the source, not from sys.modules, so the hash does not depend on what
    else happens to be loaded. A module without such imports hashes as its source alone."""
    module = inspect.getmodule(obj)
    try:
        src = inspect.getsource(module) if module is not None else repr(obj)
    except (OSError, TypeError):
        src = repr(obj)
    h = hashlib.sha256(src.encode())
    for name, text in _imported_sources(module, src):
        h.update(b"\0" + name.encode() + b"\0" + text.encode())
    return h.hexdigest()[:16]


_derived_hashes: dict[Any, str] = {}  # builder -> the source hash `validate` derived for it at import


def source_changed_since_import(spec: KernelSpec) -> bool:
    """Whether the files a spec's key hashes were edited since the spec was imported. TileLang parses a
    builder's source from disk when it builds, so after such an edit the binary may come from the new
    text while the key (and the code running in this process) names the old one. Only for a hash derived
    from the source (an explicit `source_hash` is the spec author's)."""
    then = _derived_hashes.get(spec.build)
    return then is not None and then == spec.source_hash and source_hash_of(spec.build) != then


# An import statement at the start of a line (indented too: imports inside functions count). Read
# from the text, not parsed (ast.parse costs milliseconds per spec module on a cold start); text that
# only looks like an import (in a docstring) can only add a module to the hash, never drop one.
_IMPORT_RE = re.compile(
    r"^[ \t]*(?:from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#;]*)|import[ \t]+([^\n#;]*))", re.M
)


def _imported_sources(module: Any, src: str) -> list[tuple[str, str]]:
    """(name, source) of the modules of `module`'s top-level package that `src` imports, transitively,
    sorted by name; `module` itself excluded. Nothing for a module outside a package."""
    import sys
    from pathlib import Path

    name = getattr(module, "__name__", "") or ""
    root = name.partition(".")[0]
    root_file = getattr(sys.modules.get(root), "__file__", None)
    if "." not in name or not root_file or Path(root_file).name != "__init__.py":
        return []
    root_dir = Path(root_file).parent

    def locate(dotted: str) -> Path | None:
        parts = dotted.split(".")
        if parts[0] != root or not all(p.isidentifier() for p in parts):
            return None
        base = root_dir.joinpath(*parts[1:])
        for path in ((base.with_suffix(".py"),) if len(parts) > 1 else ()) + (base / "__init__.py",):
            if path.is_file():
                return path
        return None

    def imports(mod: str, is_package: bool, text: str) -> set[str]:
        out: set[str] = set()
        for dots, base, names, plain in _IMPORT_RE.findall(text):
            if plain:  # import a.b [as c], d
                out.update(part.split()[0] for part in plain.split(",") if part.split())
                continue
            if dots:  # relative: from the package holding `mod`
                pkg = mod.split(".") if is_package else mod.split(".")[:-1]
                if len(dots) - 1 >= len(pkg):
                    continue
                base = ".".join(pkg[: len(pkg) - (len(dots) - 1)] + ([base] if base else []))
            out.add(base)  # from X import y: y is X's attribute or its submodule X.y
            names = re.sub(r"#[^\n]*", "", names).strip("()")  # a parenthesised list may hold comments
            out.update(f"{base}.{part.split()[0]}" for part in names.split(",") if part.split())
        return out

    own_file = getattr(module, "__file__", None)
    seen = {name}
    found: dict[str, str] = {}
    todo = [(name, own_file is not None and Path(own_file).name == "__init__.py", src)]
    while todo:
        mod, is_package, text = todo.pop()
        for dep in sorted(imports(mod, is_package, text)):
            if dep in seen:
                continue
            seen.add(dep)
            path = locate(dep)
            if path is None:
                continue
            try:
                dep_text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                dep_text = f"<unreadable {path}>"
            found[dep] = dep_text
            todo.append((dep, path.name == "__init__.py", dep_text))
    return sorted(found.items())


def validate(spec: KernelSpec) -> None:
    """Registration-time checks: names and domains sane, default inside the space."""
    if not _NAME_RE.fullmatch(spec.name or ""):
        raise SpecError(f"spec name {spec.name!r} must match {_NAME_RE.pattern}")
    if not _NAME_RE.fullmatch(spec.family or ""):
        raise SpecError(f"{spec.name}: family {spec.family!r} must match {_NAME_RE.pattern}")
    names = [p.name for p in spec.params]
    if len(set(names)) != len(names):
        raise SpecError(f"{spec.name}: duplicate shape params in {names}")
    for p in spec.params:
        if not _NAME_RE.fullmatch(p.name):
            raise SpecError(f"{spec.name}: shape param name {p.name!r} must match {_NAME_RE.pattern}")
        if p.type not in (int, float, str, bool):
            raise SpecError(f"{spec.name}: shape param {p.name} has unsupported type {p.type}")
        if not p.static and p.type is not int:
            raise SpecError(f"{spec.name}: runtime param {p.name} must be an int")
        if p.lo is not None and p.hi is not None and p.lo > p.hi:
            raise SpecError(f"{spec.name}: shape param {p.name} has lo > hi")
        if p.values is not None and len(p.values) == 0:
            raise SpecError(f"{spec.name}: shape param {p.name} has an empty domain")
        if p.default is not None:
            try:
                p.check(p.default)
            except ShapeError as e:
                raise SpecError(f"{spec.name}: default of {p.name} outside its domain: {e}") from None
    if not spec.space:
        raise SpecError(f"{spec.name}: empty tunable space")
    for k, vals in spec.space.items():
        if not _NAME_RE.fullmatch(k):
            raise SpecError(f"{spec.name}: tunable name {k!r} must match {_NAME_RE.pattern}")
        if not isinstance(vals, tuple) or not vals:
            raise SpecError(f"{spec.name}: tunable {k} needs a non-empty tuple of candidates")
        if len(set(map(repr, vals))) != len(vals):
            raise SpecError(f"{spec.name}: tunable {k} has duplicate candidates")
        for v in vals:
            if not isinstance(v, (int, float, str, bool)):
                raise SpecError(f"{spec.name}: tunable {k} candidate {v!r} must be int, float, str or bool")
    for k, v in spec.exact.items():
        if k not in spec.space or v not in spec.space[k]:
            raise SpecError(f"{spec.name}: exact override {k}={v!r} is not a candidate of the space")
    for k, v in spec.added.items():
        if k not in spec.space or v not in spec.space[k]:
            raise SpecError(f"{spec.name}: added tunable {k}={v!r} is not a candidate of the space")
    arg_names = [t.name for t in (*spec.inputs, *spec.outputs)] + [s.name for s in spec.scalars]
    # Every variant returns something: an optional inout input is returned only by the variants taking it.
    returned = spec.outputs or [t for t in spec.inputs if t.inout and t.optional is None]
    if len(set(arg_names)) != len(arg_names) or not returned or set(arg_names) & set(names):
        raise SpecError(
            f"{spec.name}: tensor and scalar names must be unique and differ from the shape params, and there must "
            f"be an output or an inout input that is not optional: {arg_names}"
        )
    for s in spec.scalars:
        if not _NAME_RE.fullmatch(s.name) or s.type not in _SCALAR_DTYPES or s.c_dtype not in _SCALAR_DTYPES[s.type]:
            raise SpecError(f"{spec.name}: scalar {s.name!r} must be int, float or bool with a dtype in "
                            f"{_SCALAR_DTYPES.get(s.type, ())}, got {s.type} {s.dtype!r}")
    by_name = {p.name: p for p in spec.params}
    for t in spec.outputs:
        if t.inout or t.optional:
            raise SpecError(f"{spec.name}: output {t.name} cannot be inout or optional (declare it as an input)")
    for t in spec.inputs:
        if t.zeroed:
            raise SpecError(f"{spec.name}: input {t.name} cannot be zeroed (outputs only)")
        if t.optional is not None:
            p = by_name.get(t.optional)
            if p is None or not p.static or p.type is not bool:
                raise SpecError(f"{spec.name}: optional input {t.name} must name a static bool param, got "
                                f"{t.optional!r}")
    for t in (*spec.inputs, *spec.outputs):
        for d in t.dims:
            ref = d.name if isinstance(d, (Align, CeilDiv)) else d
            if isinstance(ref, str) and ref not in names:
                raise SpecError(f"{spec.name}: tensor {t.name} names unknown dim {ref!r}")
            if isinstance(d, Align) and d.multiple < 1:
                raise SpecError(f"{spec.name}: tensor {t.name} has Align multiple {d.multiple} < 1")
            if isinstance(d, CeilDiv):
                div = by_name.get(d.divisor) if isinstance(d.divisor, str) else None
                if d.multiple < 1 or (isinstance(d.divisor, int) and d.divisor < 1) or (
                        isinstance(d.divisor, str) and (div is None or not div.static or div.type is not int)):
                    raise SpecError(f"{spec.name}: tensor {t.name} has CeilDiv {d}: the divisor must be an int >= 1 "
                                    "or a static int param, the multiple >= 1")
    if not spec.examples:
        raise SpecError(f"{spec.name}: give at least one example shape")
    for ex in spec.examples:
        try:
            full = spec.canonical_shape(ex)
            spec.default_config(full)
        except (ShapeError, ConfigError) as e:
            raise SpecError(f"{spec.name}: example {ex} or its default config is invalid: {e}") from None
    if not spec.source_hash:
        spec.source_hash = _derived_hashes[spec.build] = source_hash_of(spec.build)
