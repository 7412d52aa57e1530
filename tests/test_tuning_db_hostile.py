"""Hostile tuning DB files: serving (lookup, get) warns once per file and falls through; load_db raises.

Every malformed file in a DB dir -- garbage, the wrong JSON, NaN, bad buckets, deep nesting, a FIFO,
a directory, a link, a file over the size cap -- must not break `tkjit.get`: lookup warns once naming
the file and serves the next source (the other DB, the nearest bucket, the heuristic default).
Tools that write or validate a DB (`load_db`) still get a TuningDBError.
"""

import json
import os
import re
import resource
import signal
import time
import tracemalloc
import warnings
from pathlib import Path

import pytest

import tkjit
from tkjit import tuning_db
from tkjit.errors import TuningDBError

STATIC = {"n": 4, "repeat": 10, "eps": 1e-06}
MODEL = "G"
ARCH = "sm_90a"


def entry(bucket, config=None, **kw):
    e = {
        "kernel": "sinkhorn_fwd", "shape": dict(STATIC), "bucket": {"num_tokens": bucket},
        "config": config or cfg(64), "tuned_us": 10.0, "default_us": 12.0, "speedup": 1.2, "spread": 0.01,
        "versions": {"tilelang": "0.1.15", "tkjit": "0.1.0"}, "date": "2026-12-02", "gpu": "NVIDIA H200",
    }
    e.update(kw)
    return e


def cfg(bt, th=32, recip=True):
    return {"layout": "thread", "block_tokens": bt, "threads": th, "fast_math": False, "recip": recip}


def doc(*entries):
    return {"schema": 1, "arch": ARCH, "gpu": MODEL, "entries": list(entries)}


def _text(p: Path, s: str) -> None:
    p.write_text(s)


def _json(d) -> object:
    return lambda p: _text(p, json.dumps(d))  # json.dumps writes NaN/Infinity literally


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _oversize(p: Path) -> None:
    with open(p, "wb") as f:
        f.truncate(400 << 20)  # sparse: 400 MiB of zeros, no disk used


def _link_to(target: str) -> object:
    return lambda p: p.symlink_to(target)


def _link_to_good_db(p: Path) -> None:
    real = p.parent.parent.parent / f"elsewhere-{p.parent.parent.name}.json"
    real.write_text(json.dumps(doc(entry(4096, cfg(256)))))
    p.symlink_to(real)


def _link_to_fifo(p: Path) -> None:
    fifo = p.parent.parent.parent / f"fifo-{p.parent.parent.name}"
    os.mkfifo(fifo)
    p.symlink_to(fifo)


# name -> writes the hostile file at the given path
HOSTILE = {
    "garbage bytes": lambda p: p.write_bytes(b"\x00\xff\xfe\x80garbage\x1b[2J"),
    "empty file": lambda p: _text(p, ""),
    "empty object": lambda p: _text(p, "{}"),
    "a list": lambda p: _text(p, "[]"),
    "entries an object": _json({"schema": 1, "entries": {}}),
    "entry not an object": _json({"schema": 1, "entries": [3]}),
    "NaN value": _json(doc(entry(4096, tuned_us=float("nan")))),
    "Infinity in config": _json(doc(entry(4096, {**cfg(64), "block_tokens": float("inf")}))),
    "overflowing float in config": lambda p: _text(
        p, json.dumps(doc(entry(4096, cfg(64)))).replace('"block_tokens": 64', '"block_tokens": 1e999')),
    "huge int bucket": lambda p: _text(
        p, json.dumps(doc(entry(4096, cfg(64)))).replace('"num_tokens": 4096', '"num_tokens": ' + "9" * 5000)),
    "bucket 0": _json(doc(entry(0))),
    "negative bucket": _json(doc(entry(-4096))),
    "bucket a string": _json(doc(entry("4096"))),
    "config a list": _json(doc(entry(4096, [64, 32]))),
    "config a string": _json(doc(entry(4096, "fast"))),
    "shape a list": _json(doc(entry(4096, shape=[4]))),
    "deep nesting": lambda p: _text(p, "[" * 100_000),
    "deep nesting in an entry": lambda p: _text(
        p, json.dumps(doc(entry(4096))).replace('"date"', '"note": ' + "[" * 100_000 + "]" * 100_000 + ', "date"')),
    "FIFO": _fifo,
    "directory": lambda p: p.mkdir(),
    "oversize file": _oversize,
    "symlink to /dev/zero": _link_to("/dev/zero"),
    "symlink to a FIFO": _link_to_fifo,
    "symlink to a good DB": _link_to_good_db,
    "dangling symlink": _link_to("/nonexistent/tkjit-db.json"),
}


@pytest.fixture(autouse=True)
def no_hang(request):
    """A read that blocks (a FIFO with no writer) fails the test instead of hanging the run."""

    def boom(*_):
        raise TimeoutError("tuning DB read blocked")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(300 if request.node.get_closest_marker("slow") else 10)  # compiling takes a while
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture(autouse=True)
def no_runaway_read(request):
    """A read that never ends (a link to /dev/zero) fails with MemoryError instead of exhausting the host.

    Not for the tests that compile: the compiler's children inherit the limit.
    """
    if request.node.get_closest_marker("slow") or not Path("/proc/self/statm").exists():
        yield
        return
    vm = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = vm + (1 << 30)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.fixture
def dbs(tmp_path, monkeypatch, cache_dir):
    shipped = tmp_path / "shipped"
    monkeypatch.setenv("TKJIT_TUNING_DB", str(shipped))
    monkeypatch.setenv("TKJIT_GPU_NAME", MODEL)
    monkeypatch.delenv("TKJIT_NO_TUNED_DB", raising=False)
    tuning_db.clear_memo()
    yield tuning_db.user_db_dir(), shipped
    tuning_db.clear_memo()


def spec():
    return tkjit.get_spec("sinkhorn_fwd")


def full(tokens, n=4):
    return spec().canonical_shape({"num_tokens": tokens, "n": n})


def write(root, entries, model=MODEL, arch=ARCH):
    return tuning_db.write_entries(tuning_db.db_path(root, arch, model), entries, arch=arch, gpu=model)


def plant(root: Path, what: str, name: str = MODEL + ".json", arch: str = ARCH) -> Path:
    p = root / arch / name
    p.parent.mkdir(parents=True, exist_ok=True)
    HOSTILE[what](p)
    return p


def db_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "tuning DB" in str(w.message)]


def lookup_twice(tokens=4096, arch=ARCH):
    """Two lookups: both results, and the tuning-DB warnings of both together."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        first = tuning_db.lookup(spec(), full(tokens), arch)
        second = tuning_db.lookup(spec(), full(tokens), arch)
    return first, second, db_warnings(rec)


def assert_warned_once(msgs: list[str], path: Path) -> None:
    assert len(msgs) == 1, msgs
    assert str(path) in msgs[0] and msgs[0].startswith("tkjit: "), msgs[0]


@pytest.mark.parametrize("what", list(HOSTILE))
def test_hostile_user_db_warns_once_and_shipped_serves(dbs, what):
    user, shipped = dbs
    write(shipped, [entry(4096, cfg(64))])
    p = plant(user, what)
    first, second, msgs = lookup_twice()
    assert first == second == (cfg(64), "tuned:shipped")
    assert_warned_once(msgs, p)


@pytest.mark.parametrize("what", list(HOSTILE))
def test_hostile_shipped_db_warns_once_and_nearest_user_serves(dbs, what):
    user, shipped = dbs
    write(user, [entry(65536, cfg(128))])
    p = plant(shipped, what)
    first, second, msgs = lookup_twice()
    assert first == second == (cfg(128), "tuned:nearest(user, num_tokens=65536)")
    assert_warned_once(msgs, p)


@pytest.mark.parametrize("what", list(HOSTILE))
def test_hostile_only_db_warns_once_and_default_serves(dbs, what):
    user, _ = dbs
    p = plant(user, what)
    first, second, msgs = lookup_twice()
    assert first is None and second is None  # None: the heuristic default serves
    assert_warned_once(msgs, p)


@pytest.mark.parametrize("what", list(HOSTILE))
def test_hostile_file_raises_for_tools(dbs, what):
    """load_db (what writers and validators use) still raises, naming the file."""
    user, _ = dbs
    p = plant(user, what)
    with pytest.raises(TuningDBError, match=re.escape(str(p))):
        tuning_db.load_db(p)


def test_hostile_fallback_file_of_the_arch_is_skipped(dbs):
    """A model without its own file uses the arch's other files: a hostile one among them is skipped."""
    _, shipped = dbs
    write(shipped, [entry(4096, cfg(64))], model="Other GPU")
    bad = [plant(shipped, w, name=f"{i:02d}.json") for i, w in enumerate(["garbage bytes", "FIFO", "directory"])]
    first, second, msgs = lookup_twice()
    assert first == second == (cfg(64), "tuned:shipped")
    assert len(msgs) == len(bad), msgs
    for p in bad:
        assert sum(str(p) in m for m in msgs) == 1, (p, msgs)


def test_oversize_file_is_not_read(dbs):
    """Over the cap is refused from fstat, without reading the file."""
    user, _ = dbs
    p = plant(user, "oversize file")
    tracemalloc.start()
    try:
        t = time.perf_counter()
        _, _, msgs = lookup_twice()
        elapsed = time.perf_counter() - t
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert_warned_once(msgs, p)
    assert "cap" in msgs[0]
    assert peak < 16 << 20 and elapsed < 5, (peak, elapsed)


def test_size_cap_is_enforced_on_a_valid_doc(dbs, monkeypatch):
    """A well-formed doc just over the cap is refused; one at the cap is served."""
    user, shipped = dbs
    write(shipped, [entry(4096, cfg(64))])
    p = write(user, [entry(4096, cfg(256))])
    size = p.stat().st_size
    monkeypatch.setattr(tuning_db, "MAX_DB_BYTES", size)
    assert tuning_db.lookup(spec(), full(4096), ARCH) == (cfg(256), "tuned:user")
    tuning_db.clear_memo()
    monkeypatch.setattr(tuning_db, "MAX_DB_BYTES", size - 1)
    first, _, msgs = lookup_twice()
    assert first == (cfg(64), "tuned:shipped")
    assert_warned_once(msgs, p)
    with pytest.raises(TuningDBError, match="cap"):
        tuning_db.load_db(p)


def test_cap_is_a_few_mib():
    assert 1 << 20 <= tuning_db.MAX_DB_BYTES <= 64 << 20


def test_fixed_file_serves_again_and_a_new_problem_warns_again(dbs):
    user, shipped = dbs
    write(shipped, [entry(4096, cfg(64))])
    p = plant(user, "garbage bytes")
    _, _, msgs = lookup_twice()
    assert_warned_once(msgs, p)
    p.unlink()
    write(user, [entry(4096, cfg(256))])
    first, _, msgs = lookup_twice()
    assert first == (cfg(256), "tuned:user") and msgs == []
    p.unlink()
    plant(user, "bucket 0")
    first, _, msgs = lookup_twice()
    assert first == (cfg(64), "tuned:shipped")
    assert_warned_once(msgs, p)


def test_good_db_still_served_and_memoised(dbs):
    user, _ = dbs
    p = write(user, [entry(4096, cfg(256))])
    first, second, msgs = lookup_twice()
    assert first == second == (cfg(256), "tuned:user") and msgs == []
    assert tuning_db.load_db(p) is tuning_db.load_db(p)


@pytest.mark.slow
def test_get_serves_default_past_hostile_dbs(dbs, monkeypatch):
    """End to end: a real CPU kernel is built with the default config past a dir of hostile files."""
    user, shipped = dbs
    monkeypatch.delenv("TKJIT_GPU_NAME")
    model = tuning_db.gpu_model("cpu")
    own = tuning_db.file_stem(model) + ".json"
    bad = [plant(user, "garbage bytes", name=own, arch="cpu"), plant(shipped, "NaN value", name=own, arch="cpu")]
    bad += [plant(shipped, w, name=f"{i:02d}.json", arch="cpu")
            for i, w in enumerate(["FIFO", "directory", "oversize file", "deep nesting", "symlink to /dev/zero"])]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        k = tkjit.get("sinkhorn_fwd", {"num_tokens": 64, "n": 4}, arch="cpu")
        tkjit.reset()  # forget the memoised kernel: the second get asks the DBs again
        k2 = tkjit.get("sinkhorn_fwd", {"num_tokens": 64, "n": 4}, arch="cpu")
    assert k.config_source == k2.config_source == "default"
    msgs = db_warnings(rec)
    assert len(msgs) == len(bad), msgs
    for p in bad:
        assert sum(str(p) in m for m in msgs) == 1, (p, msgs)


@pytest.mark.slow
def test_get_serves_shipped_past_a_hostile_user_db(dbs, monkeypatch):
    user, shipped = dbs
    monkeypatch.delenv("TKJIT_GPU_NAME")
    model = tuning_db.gpu_model("cpu")
    write(shipped, [entry(64, cfg(64))], model=model, arch="cpu")
    p = plant(user, "bucket 0", name=tuning_db.file_stem(model) + ".json", arch="cpu")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        k = tkjit.get("sinkhorn_fwd", {"num_tokens": 64, "n": 4}, arch="cpu")
    assert (k.config_source, k.config) == ("tuned:shipped", cfg(64))
    assert_warned_once(db_warnings(rec), p)


@pytest.mark.parametrize("what", ["garbage bytes", "FIFO", "directory", "oversize file", "symlink to /dev/zero"])
def test_writer_moves_a_hostile_file_aside(dbs, what):
    """write_entries (pretune) never reads a hostile file: it keeps it aside as .bad and writes a good one."""
    user, _ = dbs
    p = plant(user, what)
    tuning_db.write_entries(p, [entry(4096, cfg(256))], arch=ARCH, gpu=MODEL)
    assert [e["config"] for e in tuning_db.load_db(p).doc["entries"]] == [cfg(256)]
    assert len(list(p.parent.glob(p.name + ".bad.*"))) == 1
    first, _, msgs = lookup_twice()
    assert first == (cfg(256), "tuned:user") and msgs == []


def test_unlistable_db_dir_warns_once_and_shipped_serves(dbs, monkeypatch):
    user, shipped = dbs
    write(shipped, [entry(4096, cfg(64))])
    d = user / ARCH
    d.mkdir(parents=True)
    listdir = os.listdir

    def no_access(path="."):
        if Path(path) == d:
            raise PermissionError(13, "Permission denied", str(path))
        return listdir(path)

    monkeypatch.setattr(tuning_db.os, "listdir", no_access)
    first, second, msgs = lookup_twice()
    assert first == second == (cfg(64), "tuned:shipped")
    assert_warned_once(msgs, d)
