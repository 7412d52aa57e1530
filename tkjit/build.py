"""One variant's cache entry: its key, and the entry itself, compiled and published on a miss.

`get` (in-process) and the compile pool's workers both come here: the miss path is in one place.
The compiler (TileLang) is imported only inside a build, so a hit never loads it.
"""

from __future__ import annotations

import shutil
import time
import warnings
from pathlib import Path

from tkjit.cache import DISK_ERRNOS, KEY_FIELDS, Cache, Entry, PublishFailed
from tkjit.errors import CacheError
from tkjit.fs import private_tempdir
from tkjit.key import key_material, key_of
from tkjit.spec import KernelSpec

_cache: Cache | None = None
_warned_readonly = False


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
    tmp = private_tempdir()
    try:
        extra = build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Entry(key, tmp, {"key": key, "files": {}, "meta": {**meta, **extra, "uncached_reason": str(err)}})
