"""The kernel catalog: built-in specs from `tkjit_kernels` (the `kernel_specs/` folder), plus user specs.

Users register from their own package with `tkjit.register(spec)`, or by declaring an entry point in
the `tkjit.specs` group that names a module to import (the module calls `register`).
"""

from __future__ import annotations

import importlib
import pkgutil
import threading

from tkjit.errors import SpecError, UnknownKernelError, brief
from tkjit.spec import KernelSpec, validate

_SPECS: dict[str, KernelSpec] = {}
_lock = threading.RLock()  # spec modules call register() while the catalog loads
_loaded = False


def register(spec: KernelSpec, *, replace: bool = False) -> KernelSpec:
    """Validate and add a spec to the catalog."""
    validate(spec)
    with _lock:
        old = _SPECS.get(spec.name)
        if old is not None and old is not spec and not replace:
            raise SpecError(f"a kernel named {spec.name!r} is already registered (pass replace=True)")
        _SPECS[spec.name] = spec
    return spec


def _load_all() -> None:
    """Import every built-in spec module and every `tkjit.specs` entry point (once)."""
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        import tkjit_kernels

        for mod in pkgutil.walk_packages(tkjit_kernels.__path__, "tkjit_kernels."):
            importlib.import_module(mod.name)
        try:
            from importlib.metadata import entry_points

            for ep in entry_points(group="tkjit.specs"):
                ep.load()
        except Exception as e:  # a broken third-party plugin must not hide the built-in catalog
            import warnings

            warnings.warn(f"tkjit: failed to load a 'tkjit.specs' entry point: {e}", stacklevel=2)
        _loaded = True


def get_spec(name: str) -> KernelSpec:
    if not isinstance(name, str):  # an unhashable name would fail the lookup with a bare TypeError
        raise UnknownKernelError(f"kernel name must be a str, got {brief(name)} (a {type(name).__name__})")
    spec = _SPECS.get(name)
    if spec is not None:
        return spec
    with _lock:
        import tkjit_kernels

        module = tkjit_kernels.INDEX.get(name)
        if module is not None:
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as e:
                if e.name != module:  # the spec exists but one of its imports does not
                    raise
    if name not in _SPECS:
        _load_all()
    spec = _SPECS.get(name)
    if spec is None:
        raise UnknownKernelError(f"unknown kernel {brief(name)}; known kernels: {sorted(_SPECS)}")
    return spec


def all_specs() -> list[KernelSpec]:
    _load_all()
    return [_SPECS[k] for k in sorted(_SPECS)]
