"""`tkjit.get`: name + shape -> a compiled, loaded kernel. The path is get -> key -> cache -> compile -> load."""

from __future__ import annotations

import shutil
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tkjit import loader
from tkjit.arch import resolve_arch
from tkjit.cache import DISK_ERRNOS, KEY_FIELDS, Cache, Entry, PublishFailed, _private_tempdir
from tkjit.errors import CacheError, ConfigError, ShapeError, brief
from tkjit.kernel import CompiledKernel
from tkjit.key import key_material, key_of
from tkjit.registry import get_spec
from tkjit.spec import KernelSpec

_memo: dict[tuple, CompiledKernel] = {}  # exact get() arguments -> kernel (the hot path)
_by_key: dict[str, Callable[..., Any]] = {}  # cache key -> loaded launcher (one dlopen per binary)
_lock = threading.Lock()
_cache: Cache | None = None
_warned_readonly = False


def cache() -> Cache:
    global _cache
    if _cache is None:
        _cache = Cache()
    return _cache


def reset() -> None:
    """Forget the in-process memo and cache handle (tests; after changing TKJIT_CACHE_DIR)."""
    global _cache
    with _lock:
        _memo.clear()
        _by_key.clear()
        _cache = None


def _freeze(d: Mapping | None) -> tuple | None:
    # Types too: 1, 1.0 and True are equal keys, but only one of them is a valid int param.
    return None if d is None else tuple(sorted((k, type(v), v) for k, v in d.items()))


def get(
    name: str,
    shape: Mapping[str, Any] | None = None,
    *,
    arch: str | None = None,
    config: Mapping[str, Any] | None = None,
    **shape_kw: Any,
) -> CompiledKernel:
    """The compiled kernel for `name` at `shape` (a mapping, or keyword args).

    Config: explicit -> tuned DB (user's, then shipped) -> nearest tuned bucket -> heuristic default.
    """
    try:
        mk = (name, _freeze(shape), _freeze(shape_kw), arch, _freeze(config))
        hit = _memo.get(mk)
    except (TypeError, AttributeError):  # unhashable values or not a mapping: validation below says what
        mk, hit = None, None
    if hit is not None:
        return hit
    if shape is not None and not isinstance(shape, Mapping):
        raise ShapeError(f"{brief(name)}: shape must be a mapping of param name -> value, got {brief(shape)}")
    kernel = _resolve(name, {**(shape or {}), **shape_kw}, arch, config)
    if mk is not None:
        with _lock:
            _memo[mk] = kernel
    return kernel


def choose_config(spec: KernelSpec, full: dict, arch: str, config: Mapping | None) -> tuple[dict, str]:
    if config is not None:
        return spec.check_config(full, config, arch), "explicit"
    from tkjit.tuning_db import lookup

    found = lookup(spec, full, arch)
    if found is not None:
        cfg, source = found
        try:
            return spec.check_config(full, cfg, arch), source
        except ConfigError as e:  # a DB written for an older space: say so, serve the default
            warnings.warn(f"tkjit: ignoring tuned config from {source}: {e}", stacklevel=3)
    return spec.default_config(full, arch), "default"


def _resolve(name: str, shape: dict, arch: str | None, config: Mapping | None) -> CompiledKernel:
    spec = get_spec(name)
    full = spec.canonical_shape(shape)
    arch = resolve_arch(arch)
    cfg, source = choose_config(spec, full, arch, config)
    static = spec.static_shape(full)
    entry, key = ensure_entry(spec, static, cfg, arch, source)
    with _lock:
        launch = _by_key.get(key)
    if launch is None:
        tensors = [t.dims for t in (*spec.inputs, *spec.outputs)]
        loader.check_abi(entry.meta, arch, tensors, [p.name for p in spec.runtime_params])
        launch = loader.load(entry.file(entry.meta["lib"]), entry.meta)
        with _lock:
            launch = _by_key.setdefault(key, launch)
    # A kernel object per request: other sizes may share the binary but not where the config came from.
    k = CompiledKernel(spec, full, cfg, arch, key, source, entry.path, launch)
    if entry.path.parent.name == "entries":  # not for an uncached (read-only disk) build
        cache().touch(key)
    return k


def entry_key(spec: KernelSpec, static: dict, cfg: dict, arch: str) -> tuple[str, dict]:
    material = key_material(spec.name, spec.source_hash, static, cfg, spec.pass_configs(cfg), arch)
    return key_of(material), material


def ensure_entry(
    spec: KernelSpec, static: dict, cfg: dict, arch: str, source: str = "explicit", *, pin: bool = True
) -> tuple[Entry, str]:
    """The verified cache entry for this variant, compiled and published if absent.

    pin: mark the entry in use by this process (eviction skips it) before it is verified, so it
    cannot be pruned between verification and loading. A cache that cannot be written (read-only
    or full disk) still serves the kernel, built into a private temp dir, with one warning.
    """
    key, material = entry_key(spec, static, cfg, arch)
    meta = {
        "kernel": spec.name,
        "family": spec.family,
        "shape": static,
        "config": cfg,
        "arch": arch,
        "config_source": source,
        "toolchain": material["toolchain"],
        "spec_source": spec.source_hash,
    }
    expect = {k: meta[k] for k in KEY_FIELDS}
    build_error: list[BaseException] = []

    def build(staging: Path) -> dict:
        from tkjit.compiler import compile_to_dir  # imports TileLang: only on a miss

        t0 = time.perf_counter()
        try:
            extra = compile_to_dir(spec, static, cfg, arch, staging)
        except BaseException as e:
            build_error.append(e)
            raise
        extra["compile_s"] = round(time.perf_counter() - t0, 3)
        return extra

    c = cache()
    try:
        if pin:
            c.pin(key)
        return c.get_or_build(key, meta, build, expect=expect), key
    except CacheError:
        raise
    except PublishFailed as e:  # built, but the disk refused it: serve what was built
        if e.entry is not None:
            _warn_unwritable(e)
            e.entry.meta["uncached_reason"] = str(e)
            return e.entry, key
        return _build_in_memory(key, meta, build, e), key
    except OSError as e:
        if build_error and (build_error[-1] is not e or e.errno not in DISK_ERRNOS):
            raise  # the compiler failed, not the cache: compiling again would fail again
        build_error.clear()
        return _build_in_memory(key, meta, build, e), key


def _warn_unwritable(err: OSError) -> None:
    global _warned_readonly
    if not _warned_readonly:
        _warned_readonly = True
        warnings.warn(f"tkjit: cache not writable ({err}); compiling without caching", stacklevel=5)


def _build_in_memory(key: str, meta: dict, build, err: OSError) -> Entry:
    """Read-only or full cache disk: still serve the kernel, from a private temp dir, once warned."""
    _warn_unwritable(err)
    tmp = _private_tempdir()
    try:
        extra = build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Entry(key, tmp, {"key": key, "files": {}, "meta": {**meta, **extra, "uncached_reason": str(err)}})
