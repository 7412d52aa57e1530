"""`tkjit.get`: name + shape -> a compiled, loaded kernel.

The path: get (memo) -> spec.canonical_shape -> tuning_db.choose_config -> build.ensure_entry (key,
cache, compile on a miss) -> loader -> CompiledKernel.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from tkjit import envs, loader
from tkjit.arch import resolve_arch
from tkjit.build import cache, ensure_entry, reset_cache
from tkjit.errors import ShapeError, brief
from tkjit.kernel import CompiledKernel
from tkjit.memo import Memo
from tkjit.registry import get_spec
from tkjit.tuning_db import choose_config

_memo: dict[tuple, CompiledKernel] = {}  # exact get() arguments (canonical order) -> kernel
_fast: dict[tuple, CompiledKernel] = {}  # get(name, dict, arch=...) as called -> kernel (the hot path)
_by_key: dict[str, Callable[..., Any]] = {}  # cache key -> loaded launcher (one dlopen per binary)
_calls: list[Memo] = []  # ops' memos of checked call signatures (call_memo); reset() clears them too
_lock = threading.Lock()
_chosen: set[tuple] = set()  # (kernel, shape bucket, arch) whose config choice was logged
log = logging.getLogger("tkjit.api")


def reset() -> None:
    """Forget the in-process memo and cache handle (tests; after changing TKJIT_CACHE_DIR)."""
    with _lock:
        _memo.clear()
        _fast.clear()
        _by_key.clear()
        for m in _calls:
            m.clear()
        reset_cache()


def call_memo(bound: int) -> Memo:
    """A memo for an op's checked call signatures (signature -> what a call with it resolved to: its kernel
    object, its scalars), so a repeat call skips the argument checks and the config choice; cleared by
    reset(), since what it holds came from the cache and the config in force then."""
    m = Memo(bound)
    _calls.append(m)
    return m


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
    if not shape_kw and type(shape) is dict and config is None:
        # The hot path (tkjit.ops): the dict as given, its keys in their order and its values with their
        # types (1, 1.0 and True are equal keys, only one of them a valid int param), nothing sorted.
        try:
            fk = (name, arch, tuple(shape), tuple(shape.values()), tuple(map(type, shape.values())))
            hit = _fast.get(fk)
        except TypeError:  # an unhashable value: validation below says what
            fk = hit = None
        if hit is not None:
            return hit
    else:
        fk = None
    try:
        mk = (name, _freeze(shape), _freeze(shape_kw), arch, _freeze(config))
        hit = _memo.get(mk)
    except (TypeError, AttributeError):  # unhashable values or not a mapping: validation below says what
        mk, hit = None, None
    if hit is None:
        if shape is not None and not isinstance(shape, Mapping):
            raise ShapeError(f"{brief(name)}: shape must be a mapping of param name -> value, got {brief(shape)}")
        hit = _resolve(name, {**(shape or {}), **shape_kw}, arch, config)
        if mk is not None:
            with _lock:
                hit = _memo.setdefault(mk, hit)
    if fk is not None:
        with _lock:
            _fast[fk] = hit
    return hit


def _resolve(name: str, shape: dict, arch: str | None, config: Mapping | None) -> CompiledKernel:
    spec = get_spec(name)
    full = spec.canonical_shape(shape)
    arch = resolve_arch(arch)
    cfg, source = choose_config(spec, full, arch, config, exact=envs.flag(envs.EXACT_MATH))
    static = spec.static_shape(full)
    try:
        ident = (name, tuple(sorted(spec.bucket(full).items())), arch)
    except Exception:  # a spec whose bucket cannot be computed: the static shape stands in
        ident = (name, tuple(sorted(static.items())), arch)
    with _lock:
        first, _ = ident not in _chosen, _chosen.add(ident)
    if first:
        log.info("config for %s %s [%s]: %s (%s)", name, dict(ident[1]), arch, cfg, source)
    entry, key = ensure_entry(spec, static, cfg, arch, source)
    with _lock:
        launch = _by_key.get(key)
    if launch is None:
        tensors = spec.abi_tensors(static)
        loader.check_abi(entry.meta, arch, tensors, [p.name for p in spec.runtime_params], spec.abi_scalars())
        launch = loader.load(entry.file(entry.meta["lib"]), entry.meta)
        with _lock:
            launch = _by_key.setdefault(key, launch)
    # A kernel object per request: other sizes may share the binary but not where the config came from.
    k = CompiledKernel(spec, full, cfg, arch, key, source, entry.path, launch)
    if entry.path.parent.name == "entries":  # not for an uncached (read-only disk) build
        cache().touch(key)
    return k
