"""kill -9 at random points of compile and publish: no partial entry is ever visible, nothing sticks."""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "helpers"))

from reliability import counted, finish, key, spawn, verify_all, wait_line, worker_env  # noqa: E402

from tkjit.cache import Cache, CorruptEntry  # noqa: E402
from tkjit.errors import CacheError  # noqa: E402

KILLS = 50


def test_kill_9_during_compile_and_publish(tmp_path):
    root, counter = tmp_path / "c", tmp_path / "builds"
    cache = Cache(root)
    cache.ensure()
    keys = [key(f"crash-{i}") for i in range(8)]
    rng = random.Random(1234)
    torn: list[str] = []
    stop = threading.Event()
    reads = [0]

    def reader():  # a reader all along: it must never see a published entry that does not verify
        while not stop.is_set():
            for p in (root / "v1" / "entries").iterdir():
                if p.name.endswith(".used"):
                    continue
                try:
                    cache.verify(p.name)
                    reads[0] += 1
                except FileNotFoundError:
                    pass
                except CorruptEntry as e:
                    torn.append(f"{p.name}: {e}")

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    killed_alive = 0
    env = worker_env(TKJIT_LOCK_TIMEOUT="30")
    try:
        for i in range(KILLS):
            k = keys[i % len(keys)]
            if (root / "v1" / "entries" / k).exists() and rng.random() < 0.7:
                cache.remove(k)  # mostly kill cold builds, sometimes a warm hit
            p = spawn("build", root, k, keys[(i + 3) % len(keys)], "--counter", counter, "--sleep", "0", "0.15",
                      "--slow-publish", env=env)
            time.sleep(rng.uniform(0.1, 0.45))  # ~0.1 s is interpreter start: kills land all over the build
            if p.poll() is None:
                killed_alive += 1
                p.send_signal(signal.SIGKILL)
            so, se = p.communicate()
            assert p.returncode in (0, -signal.SIGKILL), f"worker failed ({p.returncode}): {se}"
            verify_all(cache)  # after every kill: whatever is published is whole
    finally:
        stop.set()
        t.join()
    assert not torn, torn
    assert killed_alive >= KILLS * 0.8, f"only {killed_alive} kills hit a live process"
    assert reads[0] > 0
    builds_started = len(counted(counter))
    leftovers = len(list((root / "v1" / "staging").iterdir()))
    # The next process works on every key, with no stale lock in its way, and cleans up after the dead.
    t0 = time.time()
    finish([spawn("build", root, *keys, "--counter", counter, env=worker_env(TKJIT_LOCK_TIMEOUT="5"))])
    assert time.time() - t0 < 20
    assert verify_all(cache) == sorted(keys)
    assert list((root / "v1" / "staging").iterdir()) == []
    print(f"\n{KILLS} kills ({killed_alive} mid-run), {builds_started} builds started, {leftovers} staging "
          f"leftovers cleaned, {reads[0]} concurrent verifies")


def test_kill_9_holding_the_lock_releases_it(tmp_path):
    root = tmp_path / "c"
    k = key("lock")
    p = spawn("hold-lock", root, k)
    wait_line(p, "locked")
    cache = Cache(root)
    os.environ["TKJIT_LOCK_TIMEOUT"] = "0.5"
    try:
        t0 = time.time()
        with pytest.raises(CacheError, match="TKJIT_LOCK_TIMEOUT") as ei:
            with cache.lock(k):
                pass
        assert 0.4 < time.time() - t0 < 5
        assert str(cache.base / "locks" / f"{k}.lock") in str(ei.value)
        os.kill(p.pid, signal.SIGKILL)
        p.communicate()
        t0 = time.time()
        with cache.lock(k):  # the dead holder's lock is gone at once
            pass
        assert time.time() - t0 < 0.5
    finally:
        del os.environ["TKJIT_LOCK_TIMEOUT"]
        if p.poll() is None:
            p.kill()


def test_lock_timeout_must_be_a_number(tmp_path, monkeypatch):
    monkeypatch.setenv("TKJIT_LOCK_TIMEOUT", "soon")
    with pytest.raises(CacheError, match="TKJIT_LOCK_TIMEOUT='soon'"):
        with Cache(tmp_path / "c").lock(key(1)):
            pass
