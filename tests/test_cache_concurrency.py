"""Many processes on one cache: one compile per key, every result whole, maintenance alongside."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "helpers"))

from reliability import counted, finish, key, spawn, verify_all, worker_env  # noqa: E402

from tkjit.cache import Cache  # noqa: E402

N = 16


def _start_env(delay: float) -> dict[str, str]:
    # All workers wait for the same instant, so they hit the cold key together.
    return worker_env(TKJIT_TEST_START=str(time.time() + delay), TKJIT_LOCK_TIMEOUT="120")


def test_16_processes_one_cold_key_compile_once(tmp_path):
    root, counter = tmp_path / "c", tmp_path / "builds"
    k = key("same")
    env = _start_env(3.0)
    procs = [spawn("build", root, k, "--counter", counter, "--sleep", "1.0", "1.0", env=env) for _ in range(N)]
    results = finish(procs)
    builds = counted(counter)
    assert len(builds) == 1, f"{len(builds)} compiles for one key: {builds}"
    builder = int(builds[0].split()[0])
    assert all(r[0]["key"] == k and r[0]["built_by"] == builder for r in results)  # every one got that build
    assert verify_all(Cache(root)) == [k]
    assert list((root / "v1" / "staging").iterdir()) == []


def test_16_processes_16_keys(tmp_path):
    root, counter = tmp_path / "c", tmp_path / "builds"
    keys = [key(f"many-{i}") for i in range(N)]
    env = _start_env(3.0)
    procs = [spawn("build", root, k, "--counter", counter, "--sleep", "0.2", "0.6", env=env) for k in keys]
    finish(procs)
    assert sorted(line.split()[1] for line in counted(counter)) == sorted(keys)
    assert verify_all(Cache(root)) == sorted(keys)


def test_list_prune_clear_while_compiling(tmp_path):
    """Builders churn 12 keys while a maintainer lists, prunes and clears: nobody crashes or sees a torn entry."""
    root, counter = tmp_path / "c", tmp_path / "builds"
    keys = [key(f"churn-{i}") for i in range(12)]
    env = _start_env(2.5)
    mine = [keys[i::3] + keys[:4] for i in range(6)]
    builders = [
        spawn("build", root, *ks, "--counter", counter, "--sleep", "0", "0.05", "--loops", "6", "--pin", "--unpin",
              env=env)
        for ks in mine
    ]
    maint = [spawn("maint", root, "--seconds", "6", env=env) for _ in range(2)]
    results = finish(builders)
    stats = finish(maint)
    assert sum(len(r) for r in results) == sum(6 * len(ks) for ks in mine)
    done = [line for out in stats for line in out]
    assert sum(d["list"] for d in done) > 10 and sum(d["prune"] + d["clear"] for d in done) > 10
    # Builds happened again after evictions (the churn was real) but each key was built once per eviction.
    assert len(counted(counter)) >= len(keys)
    verify_all(Cache(root))
    print(f"\nchurn: {sum(len(r) for r in results)} verified gets, {len(counted(counter))} builds, maintenance {done}")


@pytest.mark.slow
def test_real_compile_4_processes(tmp_path):
    """End to end on the real compile path: 4 processes, one TileLang compile, 4 correct results."""
    root, counter = tmp_path / "c", tmp_path / "compiles"
    env = _start_env(4.0)
    procs = [spawn("real", root, "sinkhorn_fwd", 300 + i, "--counter", counter, env=env) for i in range(4)]
    results = finish(procs, timeout=170)
    assert len(counted(counter)) == 1
    keys = {r[0]["key"] for r in results}
    assert len(keys) == 1  # same binary for every runtime size
    rows = Cache(root).entries()
    assert [r["key"] for r in rows] == list(keys) and rows[0]["arch"] == "cpu"
    Cache(root).verify(rows[0]["key"])


def test_threads_in_one_process_one_cold_key(tmp_path):
    """flock is per open file, so threads of one process serialise on the key lock like processes."""
    import threading

    from reliability import fake_build, meta_for

    cache = Cache(tmp_path / "c")
    k = key("threads")
    calls: list = []
    slow = fake_build(k, calls)

    def build(staging):
        time.sleep(0.3)
        return slow(staging)

    got, errors = [], []

    def run():
        try:
            got.append(cache.get_or_build(k, meta_for(k), build).path)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and calls == [k] and len(got) == 8 and len(set(got)) == 1
