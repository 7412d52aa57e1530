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


def _phase_of(pid: int, counter: Path) -> str:
    """Where a killed worker was: before its build, building, publishing, or done."""
    lines = [line.split() for line in counted(counter) + counted(Path(f"{counter}.phases"))]
    mine = [w[1] for w in lines if w[0] == str(pid)]
    if not mine:
        return "before build"
    if mine.count("publish") > mine.count("published"):
        return "publishing"
    return "building" if len([m for m in mine if m not in ("publish", "published")]) > mine.count("published") \
        else "after publish"


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
            time.sleep(0.001)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    phases: dict[str, int] = {}
    env = worker_env(TKJIT_LOCK_TIMEOUT="30")
    try:
        for i in range(KILLS):
            k = keys[i % len(keys)]
            if (root / "v1" / "entries" / k).exists() and rng.random() < 0.8:
                cache.remove(k)  # mostly kill cold builds, sometimes a warm hit
            n0 = len(counted(counter))
            p = spawn("build", root, k, keys[(i + 3) % len(keys)], "--counter", counter, "--sleep", "0", "0.3",
                      "--slow-publish", env=env)
            if i % 5 == 0:  # a delay from the start: lands in start-up, lookup, lock or build
                time.sleep(rng.uniform(0.1, 0.5))
            else:  # a delay from the start of the build: lands in the build or the publish
                t0 = time.time()
                while len(counted(counter)) == n0 and p.poll() is None and time.time() - t0 < 20:
                    time.sleep(0.002)
                time.sleep(rng.uniform(0, 0.4))
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            so, se = p.communicate()
            assert p.returncode in (0, -signal.SIGKILL), f"worker failed ({p.returncode}): {se}"
            where = _phase_of(p.pid, counter) if p.returncode else "exited before the kill"
            phases[where] = phases.get(where, 0) + 1
            verify_all(cache)  # after every kill: whatever is published is whole
    finally:
        stop.set()
        t.join()
    assert not torn, torn
    killed = KILLS - phases.get("exited before the kill", 0)
    assert killed >= KILLS * 0.8, phases
    assert phases.get("building", 0) >= 10 and phases.get("publishing", 0) >= 3, phases
    leftovers = len(list((root / "v1" / "staging").iterdir()))
    # The next process works on every key, with no stale lock in its way, and cleans up after the dead.
    t0 = time.time()
    finish([spawn("build", root, *keys, "--counter", counter, env=worker_env(TKJIT_LOCK_TIMEOUT="5"))])
    assert time.time() - t0 < 20
    assert verify_all(cache) == sorted(keys)
    assert list((root / "v1" / "staging").iterdir()) == []
    print(f"\n{KILLS} kill -9s, {killed} of a live worker: {phases}; {leftovers} staging leftovers cleaned; "
          f"{reads[0]} concurrent verifies, none torn")


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


@pytest.mark.slow
def test_kill_9_during_a_real_compile(tmp_path):
    """The real compile path: kill a process mid-compile (TileLang running), the next one compiles and works."""
    root, counter = tmp_path / "c", tmp_path / "compiles"
    p = spawn("real", root, "sinkhorn_fwd", 100, "--counter", counter)
    t0 = time.time()
    while not counted(counter) and time.time() - t0 < 60 and p.poll() is None:
        time.sleep(0.05)  # the compile has started once the counter has its line
    time.sleep(0.5)
    assert p.poll() is None, "the compile finished before the kill"
    p.send_signal(signal.SIGKILL)
    p.communicate()
    assert list((root / "v1" / "staging").iterdir())  # it died holding a staging dir
    assert Cache(root).entries() == []
    finish([spawn("real", root, "sinkhorn_fwd", 100, "--counter", counter,
                  env=worker_env(TKJIT_LOCK_TIMEOUT="5"))], timeout=170)
    assert len(counted(counter)) == 2
    assert list((root / "v1" / "staging").iterdir()) == []
    (row,) = Cache(root).entries()
    Cache(root).verify(row["key"])
