"""One variant's cache entry: its key, and the entry itself, compiled and published on a miss.

`get` (in-process) and the compile pool's workers both come here: the miss path is in one place.
The compiler (TileLang) is imported only inside a build, so a hit never loads it.
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

from tkjit import envs
from tkjit.cache import DISK_ERRNOS, KEY_FIELDS, Cache, Entry, PublishFailed
from tkjit.errors import CacheError, CompileError, JitDisabledError
from tkjit.fs import private_tempdir
from tkjit.key import key_material, key_of
from tkjit.spec import KernelSpec, source_changed_since_import

log = logging.getLogger("tkjit.build")

_cache: Cache | None = None
_warned_readonly = False
_seen_keys: set[str] = set()  # keys this process has served (a disk hit is logged on the first only)
_pinned: dict[str, dict[str, str]] = {}  # arch -> the cache's pinned toolchain (compiler-less hosts)
_printed: set[tuple] = set()  # (kernel, static shape, arch) whose config TKJIT_PRINT_CONFIGS printed
_seen_lock = threading.Lock()


def cache() -> Cache:
    """This process's cache (at TKJIT_CACHE_DIR or the user cache dir), created on first use."""
    global _cache
    if _cache is None:
        _cache = Cache()
    return _cache


def reset_cache() -> None:
    """Forget the cache handle (after changing TKJIT_CACHE_DIR)."""
    global _cache
    _cache = None
    _pinned.clear()


def entry_key(spec: KernelSpec, static: dict, cfg: dict, arch: str) -> tuple[str, dict]:
    material = key_material(spec.name, spec.source_hash, static, cfg, spec.pass_configs(cfg), arch,
                            pinned=lambda: _pinned_toolchain(arch))
    return key_of(material), material


def _pinned_toolchain(arch: str) -> dict[str, str]:
    """The cache's pinned compiler versions for arch, read once per process (key.toolchain asks only on a
    host that lacks the compiler)."""
    if arch not in _pinned:
        _pinned[arch] = cache().pinned_toolchain(arch)
    return _pinned[arch]


def variant_meta(spec: KernelSpec, static: dict, cfg: dict, arch: str, source: str) -> tuple[str, dict, dict]:
    """(key, meta, key material) of a variant: the meta its entry is published with, whose KEY_FIELDS
    a lookup expects (`tkjit bundle export` looks variants up without building them)."""
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
    return key, meta, material


def _compact(d: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in d.items())


def print_config(spec: KernelSpec, static: dict, cfg: dict, arch: str, source: str) -> None:
    """TKJIT_PRINT_CONFIGS=1: the config each new (kernel, static shape, arch) gets, once, to stderr."""
    if not envs.flag(envs.PRINT_CONFIGS):
        return
    ident = (spec.name, tuple(sorted(static.items())), arch)
    with _seen_lock:
        if ident in _printed:
            return
        _printed.add(ident)
    print(f"tkjit: {spec.name} {_compact(static)} [{arch}]: config {_compact(cfg)} ({source})",
          file=sys.stderr, flush=True)


def ensure_entry(
    spec: KernelSpec, static: dict, cfg: dict, arch: str, source: str = "explicit", *, pin: bool = True,
    report: dict | None = None,
) -> tuple[Entry, str]:
    """The verified cache entry for this variant, compiled and published if absent.

    pin: mark the entry in use by this process (eviction skips it) before it is verified, so it
    cannot be pruned between verification and loading. A cache that cannot be written (read-only
    or full disk) still serves the kernel, built into a private temp dir, with one warning.
    report: if given, report["built"] is set to whether this call compiled the variant.
    TKJIT_DISABLE_JIT=1: a miss raises JitDisabledError instead of compiling.
    """
    key, meta, material = variant_meta(spec, static, cfg, arch, source)
    built: list[float] = []
    if report is not None:
        report["built"] = False
    expect = {k: meta[k] for k in KEY_FIELDS}
    build_error: list[BaseException] = []

    def build(staging: Path) -> dict:
        if envs.flag(envs.DISABLE_JIT):
            raise JitDisabledError(
                f"{spec.name} {_compact(static)} config {_compact(cfg)} ({source}) for {arch} is not in the "
                f"cache and {envs.DISABLE_JIT.name}=1 forbids compiling it (fill the cache with `tkjit compile`)"
            )
        from tkjit.compiler import compile_to_dir  # imports TileLang: only on a miss

        log.debug("compiling %s key %s material %s", spec.name, key, material)
        t0 = time.perf_counter()
        try:
            extra = compile_to_dir(spec, static, cfg, arch, staging)
        except BaseException as e:
            build_error.append(e)
            raise
        if source_changed_since_import(spec):
            # Never publish a binary that may come from other source than its key names.
            raise CompileError(
                f"{spec.name}: its source files were edited after this process imported them; the build may "
                "not match its cache key, so it was not kept: restart the process to build from the new source"
            )
        extra["compile_s"] = round(time.perf_counter() - t0, 3)
        built.append(extra["compile_s"])
        if report is not None:
            report["built"] = True
        log.info("compiled %s shape %s config %s (%s) in %.1f s, key %s",
                 spec.name, _compact(static), _compact(cfg), source, extra["compile_s"], key[:12])
        return extra

    print_config(spec, static, cfg, arch, source)
    entry, key = _ensure(key, meta, build, expect, build_error, pin)
    with _seen_lock:
        first = key not in _seen_keys
        _seen_keys.add(key)
    if first and not built:
        log.info("loaded %s shape %s config %s (%s) from the cache, key %s",
                 spec.name, _compact(static), _compact(cfg), source, key[:12])
    if first:
        log.debug("entry %s: %s", key, entry.path)
    return entry, key


def _ensure(key: str, meta: dict, build, expect: dict, build_error: list, pin: bool) -> tuple[Entry, str]:
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
    tmp = private_tempdir()
    try:
        extra = build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Entry(key, tmp, {"key": key, "files": {}, "meta": {**meta, **extra, "uncached_reason": str(err)}})
