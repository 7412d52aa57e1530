"""tkjit.cache.Store: the interface a cache backend implements; Cache implements all of it."""

from __future__ import annotations

import inspect

from tkjit.cache import Cache, Store


def _methods(cls) -> dict[str, inspect.Signature]:
    return {n: inspect.signature(f) for n, f in vars(cls).items() if callable(f) and not n.startswith("_")}


def test_cache_is_a_store(tmp_path):
    assert isinstance(Cache(tmp_path / "c"), Store)


def test_cache_methods_have_the_store_signatures():
    want = _methods(Store)
    assert {"lookup", "get_or_build", "entry_path", "entries", "remove", "prune", "clear", "pin", "touch"} <= set(want)
    have = _methods(Cache)
    for name, sig in want.items():
        assert name in have, name
        assert list(have[name].parameters.values()) == list(sig.parameters.values()), name
