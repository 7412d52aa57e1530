"""Size cap by LRU eviction that never evicts an entry in use; read-only or full disks still serve kernels."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "helpers"))

from reliability import FILES, fake_build, key, meta_for, spawn, verify_all, wait_line, worker_env  # noqa: E402

import tkjit  # noqa: E402
from tkjit import build  # noqa: E402
from tkjit.cache import Cache  # noqa: E402
from tkjit.errors import CacheError  # noqa: E402

SIZE = sum(FILES.values())


def _fill(cache: Cache, n: int, tag: str = "lru") -> list[str]:
    keys = [key(f"{tag}-{i}") for i in range(n)]
    for k in keys:
        cache.get_or_build(k, meta_for(k), fake_build(k))
    return keys


def _age(cache: Cache, keys_oldest_first: list[str]) -> None:
    t = time.time() - 1000
    for i, k in enumerate(keys_oldest_first):
        os.utime(cache.base / "entries" / f"{k}.used", (t + i, t + i))


def _py(code: str, root: Path) -> str:
    out = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, env=worker_env(),
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_prune_evicts_least_recently_used_first(tmp_path):
    cache = Cache(tmp_path / "c")
    keys = _fill(cache, 6)
    order = [keys[i] for i in (3, 0, 5, 1, 4, 2)]  # use order unrelated to build order
    _age(cache, order)
    assert cache.total_bytes() == 6 * SIZE
    removed = cache.prune(3 * SIZE)
    assert removed == order[:3]
    assert sorted(verify_all(cache)) == sorted(order[3:])
    assert cache.total_bytes() <= 3 * SIZE
    assert cache.prune(10 * SIZE) == []
    assert sorted(cache.prune(0)) == sorted(order[3:]) and cache.entries() == []
    assert [p.name for p in (cache.base / "entries").iterdir()] == []  # no orphan .used marks left


def test_prune_never_evicts_an_entry_in_use(tmp_path):
    cache = Cache(tmp_path / "c")
    keys = _fill(cache, 4)
    _age(cache, keys)
    holder = spawn("pin", cache.root, keys[0])  # the oldest: first in line for eviction
    wait_line(holder, "pinned")
    try:
        assert cache.in_use(keys[0])
        cache.pin(keys[1])  # in this process too
        assert sorted(cache.prune(0)) == sorted(keys[2:])
        assert sorted(verify_all(cache)) == sorted(keys[:2])
        assert not cache.remove(keys[0])  # explicit remove keeps an in-use entry too (unless force)
    finally:
        holder.kill()
        holder.communicate()
    cache.unpin(keys[1])
    assert not cache.in_use(keys[0])
    assert sorted(cache.prune(0)) == sorted(keys[:2])


def test_prune_skips_an_entry_being_built_or_removed(tmp_path):
    cache = Cache(tmp_path / "c")
    keys = _fill(cache, 2)
    locker = spawn("hold-lock", cache.root, keys[0])
    wait_line(locker, "locked")
    try:
        assert cache.prune(0) == [keys[1]]
    finally:
        locker.kill()
        locker.communicate()
    assert cache.prune(0) == [keys[0]]


def test_cap_enforced_after_each_publish(tmp_path, monkeypatch):
    cap = 3 * SIZE + 100
    monkeypatch.setenv("TKJIT_CACHE_MAX_BYTES", str(cap))
    cache = Cache(tmp_path / "c")
    holder_key = key("cap-held")
    cache.get_or_build(holder_key, meta_for(holder_key), fake_build(holder_key))
    _age(cache, [holder_key])
    holder = spawn("pin", cache.root, holder_key)  # the oldest entry, in use by another process
    wait_line(holder, "pinned")
    try:
        built = []
        for i in range(8):
            k = key(f"cap-{i}")
            cache.get_or_build(k, meta_for(k), fake_build(k))
            built.append(k)
            assert cache.total_bytes() <= cap, f"over the cap after publish {i}"
            assert cache.verify(k)  # the entry just published is never the one evicted
        assert sorted(verify_all(cache)) == sorted([holder_key, *built[-2:]])
    finally:
        holder.kill()
        holder.communicate()


def test_cap_accepts_units_and_rejects_nonsense(tmp_path, monkeypatch):
    from tkjit.cache import max_bytes_from_env

    for text, want in (("10G", 10 << 30), ("500M", 500 << 20), ("64KiB", 64 << 10), ("123", 123), ("1.5k", 1536)):
        monkeypatch.setenv("TKJIT_CACHE_MAX_BYTES", text)
        assert max_bytes_from_env() == want
    for text in ("lots", "-1", "inf", "nan", "10Q"):
        monkeypatch.setenv("TKJIT_CACHE_MAX_BYTES", text)
        with pytest.raises(CacheError, match="TKJIT_CACHE_MAX_BYTES"):
            Cache(tmp_path / "c").get_or_build(key(1), {}, fake_build(key(1)))
    with pytest.raises(CacheError):
        Cache(tmp_path / "c").prune(-5)


def test_old_versions_age_out_through_the_cap(tmp_path, monkeypatch):
    """Entries of an old toolchain are never hit again, so they are the first the cap evicts."""
    cache = Cache(tmp_path / "c")
    old = _fill(cache, 3, "old-toolchain")
    _age(cache, old)
    monkeypatch.setenv("TKJIT_CACHE_MAX_BYTES", str(3 * SIZE))
    new = _fill(cache, 3, "new-toolchain")
    assert sorted(verify_all(cache)) == sorted(new)


# -- read-only and full disks (real compiles) -------------------------------------------------


def _warn_count(rec) -> int:
    return sum("cache not writable" in str(w.message) for w in rec)


def _run(k, n_tokens=50):
    from tkjit.testing import check

    assert check(k, {**k.shape, "num_tokens": n_tokens}, device="cpu") is None


@pytest.fixture
def fresh(cache_dir, monkeypatch):
    monkeypatch.setattr(build, "_warned_readonly", False)
    compiles = []
    import tkjit.compiler as comp

    real = comp.compile_to_dir

    def counted(*a, **kw):
        compiles.append(a[1])
        return real(*a, **kw)

    monkeypatch.setattr(comp, "compile_to_dir", counted)
    return cache_dir, compiles


@pytest.mark.slow
def test_full_disk_staging_serves_in_memory_with_one_warning(fresh, monkeypatch):
    cache_dir, compiles = fresh
    real = tempfile.mkdtemp

    def mkdtemp(*a, dir=None, **kw):  # noqa: A002
        if dir is not None and str(dir).startswith(str(cache_dir)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, dir=dir, **kw)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        k1 = tkjit.get("sinkhorn_fwd", {"num_tokens": 64}, arch="cpu")
        k2 = tkjit.get("sinkhorn_fwd", {"num_tokens": 64, "n": 2}, arch="cpu")
    assert _warn_count(rec) == 1
    _run(k1), _run(k2)
    assert len(compiles) == 2 and Cache(cache_dir).entries() == []


@pytest.mark.slow
def test_read_only_publish_serves_what_was_built(fresh, monkeypatch):
    cache_dir, compiles = fresh
    real = os.rename

    def rename(a, b):
        if str(b).startswith(str(cache_dir / "v1" / "entries")):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(a, b)

    monkeypatch.setattr(os, "rename", rename)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        k = tkjit.get("sinkhorn_fwd", {"num_tokens": 64, "n": 3}, arch="cpu")
    assert _warn_count(rec) == 1
    assert len(compiles) == 1  # built once: the built files are served, not compiled again
    _run(k)
    assert Cache(cache_dir).entries() == [] and list((cache_dir / "v1" / "staging").iterdir()) == []


@pytest.mark.slow
def test_read_only_bind_mount(fresh, tmp_path):
    """A real read-only cache: a warm entry is served from it, a cold one compiled in memory."""
    cache_dir, compiles = fresh
    k1 = tkjit.get("sinkhorn_fwd", {"num_tokens": 64, "n": 4, "repeat": 3}, arch="cpu")
    assert len(compiles) == 1
    if subprocess.run(["mount", "--bind", str(cache_dir), str(cache_dir)], capture_output=True).returncode:
        pytest.skip("cannot bind-mount here")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(cache_dir)], capture_output=True).returncode:
            pytest.skip("cannot remount read-only here")
        with pytest.raises(OSError):
            (cache_dir / "probe").write_text("x")
        tkjit.reset()
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            again = tkjit.get("sinkhorn_fwd", {"num_tokens": 64, "n": 4, "repeat": 3}, arch="cpu")
            assert _warn_count(rec) == 0 and len(compiles) == 1  # served from the read-only cache
            cold = tkjit.get("sinkhorn_fwd", {"num_tokens": 64, "n": 4, "repeat": 4}, arch="cpu")
            cold2 = tkjit.get("sinkhorn_fwd", {"num_tokens": 64, "n": 4, "repeat": 5}, arch="cpu")
        assert _warn_count(rec) == 1 and len(compiles) == 3
        assert again.key == k1.key
        _run(again), _run(cold), _run(cold2)
    finally:
        subprocess.run(["umount", str(cache_dir)], check=True)


@pytest.mark.slow
def test_entry_loaded_by_get_is_in_use_for_other_processes(fresh):
    cache_dir, compiles = fresh
    k = tkjit.get("sinkhorn_fwd", {"num_tokens": 64, "n": 2, "repeat": 2}, arch="cpu")
    code = "import sys; from tkjit.cache import Cache; print(len(Cache(sys.argv[1]).prune(0)))"
    assert _py(code, cache_dir) == "0"  # a kernel this process loaded is never evicted under it
    Cache(cache_dir).verify(k.key)


def test_compiler_errors_are_not_mistaken_for_a_full_disk(cache_dir, monkeypatch):
    import tkjit.compiler as comp
    from tkjit.registry import get_spec

    calls = []

    def broken(*a, **kw):
        calls.append(1)
        raise FileNotFoundError(errno.ENOENT, "nvcc not found")

    monkeypatch.setattr(comp, "compile_to_dir", broken)
    spec = get_spec("sinkhorn_fwd")
    full = spec.canonical_shape({"num_tokens": 8})
    with pytest.raises(FileNotFoundError, match="nvcc"):
        build.ensure_entry(spec, spec.static_shape(full), spec.default_config(full, "cpu"), "cpu")
    assert calls == [1]
