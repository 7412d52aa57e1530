"""Hostile or damaged cache contents: FIFOs and dirs where files belong, ill-typed or edited manifests, busy keys."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import stat
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent / "helpers"))

from reliability import fake_build, key, meta_for, spawn, wait_line  # noqa: E402

import tkjit  # noqa: E402
from tkjit import cli  # noqa: E402
from tkjit.cache import MANIFEST, Cache, CorruptEntry  # noqa: E402

CORRUPT_ROW = {"key", "status", "size", "created", "last_used"}


def _in_time(fn, timeout: float = 20.0, fifos: tuple[Path, ...] = ()):
    """fn() in a thread: a hang fails the test instead of the suite (and is then unblocked via the FIFOs)."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised in the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(timeout)
    hung = t.is_alive()
    if hung:
        for f in fifos:  # a reader or writer blocked opening a FIFO returns once the other end opens
            for flags in (os.O_RDONLY, os.O_WRONLY):
                with contextlib.suppress(OSError):
                    os.close(os.open(f, flags | os.O_NONBLOCK))
        t.join(5)
    assert not hung, f"{fn} did not return within {timeout:g}s"
    if "error" in out:
        raise out["error"]
    return out["value"], time.monotonic() - t0


def _built(tmp_path, n: int = 1, tag: str = "hostile") -> tuple[Cache, list[str]]:
    cache = Cache(tmp_path / "c")
    keys = [key(f"{tag}-{i}") for i in range(n)]
    for k in keys:
        cache.get_or_build(k, meta_for(k), fake_build(k))
    return cache, keys


def _quarantined(cache: Cache, k: str) -> list[str]:
    """The REASON of each quarantined copy of k."""
    return [(q / "REASON").read_text().strip() for q in (cache.base / "quarantine").iterdir() if q.name.startswith(k)]


def _damage(path: Path, kind: str) -> None:
    """Put a dir (with content) or a FIFO where a file belongs."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    if kind == "dir":
        path.mkdir(mode=0o700)
        (path / "junk").write_text("x")
    else:
        os.mkfifo(path, 0o600)


# -- 1. a FIFO where the manifest belongs ------------------------------------------------------


@pytest.mark.parametrize("op", ["entries", "prune", "clear", "lookup", "verify"])
def test_fifo_manifest_never_hangs_and_is_corrupt(tmp_path, op):
    cache, (k, good) = _built(tmp_path, 2)
    m = cache.entry_path(k) / MANIFEST
    m.unlink()
    os.mkfifo(m, 0o600)
    fresh = Cache(cache.root)
    if op == "entries":
        rows, _ = _in_time(fresh.entries, fifos=(m,))
        row = next(r for r in rows if r["key"] == k)
        assert row["status"] == "corrupt" and set(row) == CORRUPT_ROW
        assert next(r for r in rows if r["key"] == good)["kernel"] == "fake"
    elif op == "prune":
        removed, _ = _in_time(lambda: fresh.prune(0), fifos=(m,))
        assert sorted(removed) == sorted([k, good])
    elif op == "clear":
        res, _ = _in_time(fresh.clear, fifos=(m,))
        assert res.removed == 2 and not res.skipped
    elif op == "lookup":
        assert _in_time(lambda: fresh.lookup(k), fifos=(m,))[0] is None
        assert any("regular file" in r for r in _quarantined(cache, k))
    else:
        with pytest.raises(CorruptEntry, match="regular file"):
            _in_time(lambda: fresh.verify(k), fifos=(m,))
    if op in ("prune", "clear", "lookup"):
        assert not os.path.lexists(cache.entry_path(k))
        assert [r["key"] for r in fresh.entries()] == ([good] if op == "lookup" else [])


def test_fifo_as_an_entry_file_is_corrupt_not_a_hang(tmp_path):
    cache, (k,) = _built(tmp_path)
    f = cache.entry_path(k) / "kernel.bin"
    f.unlink()
    os.mkfifo(f, 0o600)
    assert _in_time(lambda: Cache(cache.root).lookup(k, meta_for(k)), fifos=(f,))[0] is None
    assert any("regular file" in r for r in _quarantined(cache, k))


@pytest.mark.parametrize("kind", ["fifo", "file"])
def test_non_dir_as_the_entry_is_corrupt_not_an_error(tmp_path, kind):
    cache, (k, good) = _built(tmp_path, 2)
    e = cache.entry_path(k)
    shutil.rmtree(e)
    if kind == "fifo":
        os.mkfifo(e, 0o600)
    else:
        e.write_bytes(b"x")
        os.chmod(e, 0o600)
    fresh = Cache(cache.root)
    rows, _ = _in_time(fresh.entries, fifos=(e,))
    assert next(r for r in rows if r["key"] == k)["status"] == "corrupt"
    with pytest.raises(CorruptEntry, match="not a directory"):
        _in_time(lambda: fresh.verify(k), fifos=(e,))
    assert _in_time(lambda: fresh.lookup(k), fifos=(e,))[0] is None
    assert not os.path.lexists(e)
    calls: list = []
    fresh.get_or_build(k, meta_for(k), fake_build(k, calls))
    assert calls == [k] and fresh.lookup(good) is not None


# -- 2. missing parents under a loose umask ----------------------------------------------------


def test_missing_parents_created_private_under_umask_002(tmp_path):
    root = tmp_path / "a" / "b" / "c" / "cache"
    old = os.umask(0o002)
    try:
        Cache(root).ensure()
        Cache(root).ensure()  # a later run must not refuse the parents the first one made
        k = key("umask")
        Cache(root).get_or_build(k, meta_for(k), fake_build(k))
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c", root):
        assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700, d


def test_existing_parents_are_left_alone(tmp_path):
    (tmp_path / "mine").mkdir(mode=0o755)
    os.chmod(tmp_path / "mine", 0o755)
    Cache(tmp_path / "mine" / "new" / "cache").ensure()
    assert stat.S_IMODE(os.lstat(tmp_path / "mine").st_mode) == 0o755
    assert stat.S_IMODE(os.lstat(tmp_path / "mine" / "new").st_mode) == 0o700


# -- 3. a dir or FIFO where a lock or use mark belongs -----------------------------------------


@pytest.mark.parametrize("kind", ["dir", "fifo"])
def test_prune_lock_not_a_file_is_repaired(tmp_path, kind):
    cache, keys = _built(tmp_path, 2)
    g = cache.base / "locks" / "prune.lock"
    _damage(g, kind)
    removed, _ = _in_time(lambda: Cache(cache.root).prune(0), fifos=(g,))
    assert sorted(removed) == sorted(keys)
    assert stat.S_ISREG(os.lstat(g).st_mode)


@pytest.mark.parametrize("kind", ["dir", "fifo"])
def test_key_lock_not_a_file_is_repaired(tmp_path, kind):
    cache, (k, other) = _built(tmp_path, 2)
    lk = cache.base / "locks" / f"{k}.lock"
    _damage(lk, kind)
    fresh = Cache(cache.root)
    removed, _ = _in_time(lambda: fresh.prune(0), fifos=(lk,))
    assert sorted(removed) == sorted([k, other]), "the entry must stay evictable"
    _damage(lk, kind)
    calls: list = []
    e, _ = _in_time(lambda: fresh.get_or_build(k, meta_for(k), fake_build(k, calls)), fifos=(lk,))
    assert calls == [k] and e.key == k
    _damage(lk, kind)

    def locked() -> None:
        with fresh.lock(k):
            assert stat.S_ISREG(os.lstat(lk).st_mode)

    _in_time(locked, fifos=(lk,))
    _damage(lk, kind)
    assert _in_time(lambda: fresh.remove(k), fifos=(lk,))[0] is True


@pytest.mark.parametrize("kind", ["dir", "fifo"])
def test_use_mark_not_a_file_is_repaired(tmp_path, kind):
    cache, (k, other) = _built(tmp_path, 2)
    used = cache.base / "entries" / f"{k}.used"
    fresh = Cache(cache.root)
    _damage(used, kind)
    _in_time(lambda: fresh.touch(k), fifos=(used,))
    assert stat.S_ISREG(os.lstat(used).st_mode)
    _damage(used, kind)
    assert _in_time(lambda: fresh.in_use(k), fifos=(used,))[0] is False
    _damage(used, kind)
    rows, _ = _in_time(fresh.entries, fifos=(used,))
    assert {r["key"] for r in rows} == {k, other} and all("status" not in r for r in rows)
    removed, _ = _in_time(lambda: fresh.prune(0), fifos=(used,))
    assert sorted(removed) == sorted([k, other]), "the entry must stay evictable"
    assert list((cache.base / "entries").iterdir()) == []
    fresh.get_or_build(k, meta_for(k), fake_build(k))
    _damage(used, kind)
    assert _in_time(lambda: fresh.pin(k), fifos=(used,))[0] is True
    try:
        assert stat.S_ISREG(os.lstat(used).st_mode) and fresh.in_use(k)
        assert fresh.prune(0) == []
    finally:
        fresh.unpin(k)


def test_a_lock_dir_that_cannot_be_removed_is_a_clear_error(tmp_path, monkeypatch):
    import tkjit.locks as locks  # it repairs lock paths

    cache, (k,) = _built(tmp_path)
    lk = cache.base / "locks" / f"{k}.lock"
    _damage(lk, "dir")

    def refuse(path, *a, **kw):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(locks.shutil, "rmtree", refuse)
    with pytest.raises(tkjit.CacheError) as ei:
        with cache.lock(k):
            pass
    assert str(lk) in str(ei.value) and "rm -r" in str(ei.value)


# -- 4. manifests with the wrong structure or types --------------------------------------------


def _set(path: tuple, value):
    def edit(m: dict) -> dict:
        d = m
        for p in path[:-1]:
            d = d[p]
        d[path[-1]] = value
        return m

    return edit


BAD_MANIFESTS = {
    "shape is a string": _set(("meta", "shape"), "oops"),
    "kernel is a number": _set(("meta", "kernel"), 5),
    "file size is a string": _set(("files", "kernel.bin", "size"), "x"),
    "file size negative": _set(("files", "kernel.bin", "size"), -1),
    "file size a bool": _set(("files", "kernel.bin", "size"), True),
    "file size huge": _set(("files", "kernel.bin", "size"), 10**400),
    "file sha256 a number": _set(("files", "kernel.bin", "sha256"), 123),
    "file sha256 not hex": _set(("files", "kernel.bin", "sha256"), "z" * 64),
    "file info a list": _set(("files", "kernel.bin"), [1, 2]),
    "file name with a slash": _set(("files", "a/b"), {"size": 1, "sha256": "0" * 64}),
    "files empty": _set(("files",), {}),
    "files a list": _set(("files",), ["kernel.bin"]),
    "config is a list": _set(("meta", "config"), [1]),
    "created is a string": _set(("created",), "yesterday"),
    "created is NaN": _set(("created",), float("nan")),
    "created is infinite": _set(("created",), float("inf")),
    "created far away": _set(("created",), 1e300),
    "created is a bool": _set(("created",), True),
    "arch is a list": _set(("meta", "arch"), ["sm_90a"]),
    "family is a dict": _set(("meta", "family"), {}),
    "config_source is a list": _set(("meta", "config_source"), ["tuned"]),
    "lib is a list": _set(("meta", "lib"), ["kernel.bin"]),
    "toolchain is a string": _set(("meta", "toolchain"), "x"),
    "meta is a list": _set(("meta",), [1]),
    "meta missing": lambda m: {k: v for k, v in m.items() if k != "meta"},
    "key is a number": _set(("key",), 5),
    "manifest is a string": lambda m: "manifest",
    "manifest is a list": lambda m: [m],
    "deeply nested": lambda m: "RAW:" + "[" * 100000 + "]" * 100000,
}


def _write_manifest(entry: Path, m) -> None:
    text = m[4:] if isinstance(m, str) and m.startswith("RAW:") else json.dumps(m)
    (entry / MANIFEST).write_text(text)


def _read_manifest(entry: Path) -> dict:
    return json.loads((entry / MANIFEST).read_text())


@pytest.fixture
def cli_cache(tmp_path, monkeypatch):
    """A cache that tkjit.cli commands, run in this process, use."""
    root = tmp_path / "c"
    monkeypatch.setenv("TKJIT_CACHE_DIR", str(root))
    tkjit.reset()
    yield Cache(root)
    tkjit.reset()


def _cli(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(list(argv))
    return rc, buf.getvalue()


@pytest.mark.parametrize("what", list(BAD_MANIFESTS))
def test_malformed_manifest_listed_as_corrupt_and_quarantined(cli_cache, what):
    cache = cli_cache
    k, good = key("bad"), key("good")
    for k_ in (k, good):
        cache.get_or_build(k_, meta_for(k_), fake_build(k_))
    _write_manifest(cache.entry_path(k), BAD_MANIFESTS[what](_read_manifest(cache.entry_path(k))))
    rows = {r["key"]: r for r in Cache(cache.root).entries()}
    assert rows[k]["status"] == "corrupt" and set(rows[k]) == CORRUPT_ROW, rows[k]
    assert rows[good]["kernel"] == "fake" and "status" not in rows[good]
    rc, out = _cli("list")
    assert rc == 0
    assert any(k[:12] in line and "corrupt" in line for line in out.splitlines()), out
    rc, out = _cli("list", "--json")
    assert rc == 0 and json.loads(out)
    assert Cache(cache.root).lookup(k) is None
    assert len(_quarantined(cache, k)) == 1 and not os.path.lexists(cache.entry_path(k))
    assert Cache(cache.root).lookup(good) is not None


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
SPOTS = [(), ("key",), ("files",), ("files", "kernel.bin"), ("files", "kernel.bin", "size"),
         ("files", "kernel.bin", "sha256"), ("meta",), ("created",)] + [
    ("meta", f) for f in ("kernel", "arch", "shape", "config", "config_source", "family", "lib", "toolchain",
                          "abi", "spec_source", "status", "size", "key")]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spot=st.sampled_from(SPOTS), value=JSON)
def test_any_manifest_content_never_breaks_list(cli_cache, spot, value):
    cache = cli_cache
    k = key("fuzz")
    cache.get_or_build(k, meta_for(k), fake_build(k))
    m = _read_manifest(cache.entry_path(k))
    m = value if spot == () else _set(spot, value)(m)
    _write_manifest(cache.entry_path(k), m)
    (row,) = Cache(cache.root).entries()
    if row.get("status") == "corrupt":
        assert set(row) == CORRUPT_ROW
    else:
        for f in ("kernel", "arch", "config_source", "family", "lib"):
            assert isinstance(row.get(f, ""), str), row
        for f in ("shape", "config"):
            assert isinstance(row.get(f, {}), dict), row
        assert isinstance(row["size"], int) and row["size"] >= 0
    rc, out = _cli("list")
    assert rc == 0 and k[:12] in out


# -- 5. clear skips busy keys ------------------------------------------------------------------


def test_clear_skips_busy_keys_and_reports_them(cli_cache, monkeypatch):
    monkeypatch.setenv("TKJIT_LOCK_TIMEOUT", "600")
    cache = cli_cache
    keys = [key(f"clear-{i}") for i in range(4)]
    for k in keys:
        cache.get_or_build(k, meta_for(k), fake_build(k))
    busy, pinned = keys[0], keys[1]
    locker = spawn("hold-lock", cache.root, busy)  # a long compile of that key
    pinner = spawn("pin", cache.root, pinned)
    try:
        wait_line(locker, "locked")
        wait_line(pinner, "pinned")
        res, took = _in_time(Cache(cache.root).clear, timeout=10)
        assert took < 10
        assert res.removed == 2 and sorted(res.skipped) == sorted([busy, pinned])
        assert {r["key"] for r in Cache(cache.root).entries()} == {busy, pinned}
        Cache(cache.root).verify(busy)
        (rc, out), _ = _in_time(lambda: _cli("clear"), timeout=10)
        assert rc == 0 and "removed 0 entries" in out and "skipped 2 in use or being built" in out
        assert busy[:12] in out and pinned[:12] in out
    finally:
        for p in (locker, pinner):
            p.kill()
            p.communicate()
    res = Cache(cache.root).clear()
    assert res.removed == 2 and res.skipped == ()
    rc, out = _cli("clear")
    assert rc == 0 and "removed 0 entries" in out and "skipped" not in out


# -- 6. the manifest is checksummed ------------------------------------------------------------

ABI = {"loader": "ctypes", "dynamic": [{"name": "n", "arg": 0, "axis": 0}]}


def _flip_axis(m: dict) -> None:
    m["meta"]["abi"]["dynamic"][0]["axis"] = 1


MANIFEST_EDITS = {
    "dynamic axis": _flip_axis,
    "loader kind": lambda m: m["meta"]["abi"].update(loader="tvm_ffi"),
    "lib": lambda m: m["meta"].update(lib="kernel.src"),
    "extra meta field": lambda m: m["meta"].update(evil=1),
    "config_source": lambda m: m["meta"].update(config_source="tuned:user"),
    "files table swapped": lambda m: m["files"].update(
        {"kernel.bin": m["files"]["kernel.src"], "kernel.src": m["files"]["kernel.bin"]}),
    "extra top-level field": lambda m: m.update(extra=1),
    "checksum removed": lambda m: m.pop("meta_sha256"),
    "checksum not a string": lambda m: m.update(meta_sha256=5),
}


@pytest.mark.parametrize("what", list(MANIFEST_EDITS))
def test_edited_manifest_fails_its_checksum(tmp_path, what):
    cache = Cache(tmp_path / "c")
    k = key("sealed")
    meta = {**meta_for(k), "abi": ABI}
    cache.get_or_build(k, meta, fake_build(k))
    e = cache.entry_path(k)
    m = _read_manifest(e)
    assert isinstance(m.get("meta_sha256"), str)
    MANIFEST_EDITS[what](m)
    _write_manifest(e, m)
    with pytest.raises(CorruptEntry, match="manifest meta does not match its checksum"):
        Cache(cache.root).verify(k)
    assert Cache(cache.root).lookup(k) is None
    assert _quarantined(cache, k) == ["manifest meta does not match its checksum"]
    calls: list = []
    again = cache.get_or_build(k, meta, fake_build(k, calls))
    assert calls == [k] and again.meta["abi"] == ABI


def test_created_is_not_sealed(tmp_path):
    cache = Cache(tmp_path / "c")
    k = key("sealed")
    cache.get_or_build(k, meta_for(k), fake_build(k))
    m = _read_manifest(cache.entry_path(k))
    m["created"] = 1.0  # informational only (the LRU fallback): rewriting it is harmless
    _write_manifest(cache.entry_path(k), m)
    assert Cache(cache.root).verify(k, meta_for(k)).manifest["created"] == 1.0


def test_artifact_format_is_in_the_key():
    from tkjit import key as keymod
    from tkjit.version import ARTIFACT_FORMAT

    assert ARTIFACT_FORMAT >= 2  # manifests carry meta_sha256: entries of format 1 are never looked up
    material = keymod.key_material("s", "h", {}, {}, {}, "cpu")
    assert material["toolchain"]["format"] == str(ARTIFACT_FORMAT)
