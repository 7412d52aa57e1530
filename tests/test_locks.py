"""tkjit.locks: exclusive and shared flocks, timeouts, holders that unlink, repaired lock paths."""

from __future__ import annotations

import os
import stat
import threading
import time

import pytest

from tkjit.errors import CacheError
from tkjit.locks import LockTimeout, acquire, file_lock, is_locked, open_lock_file, release, try_lock


def test_exclusive_excludes_and_release_frees(tmp_path):
    path = tmp_path / "a.lock"
    fd = acquire(path, timeout=0)
    assert fd is not None
    try:
        # flock belongs to the open file: a second open, even in this process, is another holder
        assert try_lock(path) is None and try_lock(path, shared=True) is None
        assert is_locked(path)
    finally:
        release(fd)
    assert not is_locked(path)
    again = try_lock(path)
    assert again is not None
    release(again)


def test_shared_holders_keep_an_exclusive_one_out(tmp_path):
    path = tmp_path / "used"
    a, b = acquire(path, shared=True, timeout=0), acquire(path, shared=True, timeout=0)
    assert a is not None and b is not None
    assert try_lock(path) is None and is_locked(path)
    release(a)
    assert try_lock(path) is None
    release(b)
    fd = try_lock(path)
    assert fd is not None
    release(fd)


def test_timeout_raises_lock_timeout_with_the_path_and_hint(tmp_path):
    path = tmp_path / "k.lock"
    fd = acquire(path, timeout=None)
    try:
        t0 = time.monotonic()
        with pytest.raises(LockTimeout) as ei:
            with file_lock(path, timeout=0.2, hint=": someone is busy"):
                pass
        assert 0.2 <= time.monotonic() - t0 < 5
        assert str(path) in str(ei.value) and str(ei.value).endswith(": someone is busy")
        assert isinstance(ei.value, CacheError)
    finally:
        release(fd)
    with file_lock(path, timeout=0):
        assert is_locked(path)
    assert not is_locked(path)


def test_a_waiter_never_holds_an_unlinked_inode(tmp_path):
    """The holder unlinks the file before releasing: the waiter must lock the new file at the path."""
    path = tmp_path / "k.lock"
    fd = acquire(path, timeout=None)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(acquire(path, timeout=10)))
    waiter.start()
    time.sleep(0.1)
    os.unlink(path)
    release(fd)
    waiter.join(15)
    (wfd,) = got
    try:
        assert wfd is not None and os.fstat(wfd).st_ino == os.stat(path).st_ino
    finally:
        release(wfd)


def test_created_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        release(acquire(tmp_path / "x.lock", timeout=0))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(tmp_path / "x.lock").st_mode) == 0o600


@pytest.mark.parametrize("kind", ["dir", "fifo"])
def test_a_wrong_kind_at_the_path_is_replaced(tmp_path, kind):
    path = tmp_path / "k.lock"
    if kind == "dir":
        path.mkdir()
        (path / "junk").write_text("x")
    else:
        os.mkfifo(path, 0o600)
    fd = acquire(path, timeout=0)  # a FIFO opened blocking would hang here
    assert fd is not None and stat.S_ISREG(os.lstat(path).st_mode)
    release(fd)


def test_a_link_is_refused_and_kept(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    path = tmp_path / "k.lock"
    path.symlink_to(target)
    with pytest.raises(CacheError, match="symbolic link"):
        acquire(path, timeout=0)
    assert try_lock(path) is None  # cannot be taken: left alone, like a held lock
    assert path.is_symlink() and target.read_text() == "keep"


def test_is_locked_never_creates(tmp_path):
    assert not is_locked(tmp_path / "absent")
    assert not os.path.lexists(tmp_path / "absent")
    with pytest.raises(FileNotFoundError):
        open_lock_file(tmp_path / "absent", os.O_RDWR)


def test_tuning_db_writers_in_parallel_lose_no_entry(cache_dir):
    """write_entries merges under the DB file's lock: concurrent writers never drop each other's entries."""
    from tkjit import tuning_db

    path = tuning_db.db_path(tuning_db.user_db_dir(), "sm_90a", "NVIDIA H200")

    def entry(bucket: int) -> dict:
        return {
            "kernel": "sinkhorn_fwd", "shape": {"n": 4, "repeat": 10, "eps": 1e-06}, "bucket": {"num_tokens": bucket},
            "config": {"layout": "thread", "block_tokens": 64, "threads": 32, "fast_math": False, "recip": True},
            "tuned_us": 10.0, "default_us": 12.0, "speedup": 1.2, "spread": 0.01,
            "versions": {"tilelang": "0.1.15", "tkjit": "0.1.0"}, "date": "2026-12-02", "gpu": "NVIDIA H200",
        }

    def writer(i: int) -> None:
        for j in range(5):
            tuning_db.write_entries(path, [entry(1 + 10 * i + j)], arch="sm_90a", gpu="NVIDIA H200")

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    buckets = sorted(e["bucket"]["num_tokens"] for e in tuning_db.load_db(path).doc["entries"])
    assert buckets == sorted(1 + 10 * i + j for i in range(6) for j in range(5))
    assert list(path.parent.glob("*.bad.*")) == []
