"""A process that uses the cache, for the cache tests (run as a script, killed at will).

    cache_worker.py build ROOT KEY [KEY...] --counter FILE [--sleep A B] [--pin] [--loops N]
        get_or_build each key with a fast fake builder that writes deterministic files in
        chunks with random sleeps (so a kill lands mid-write), append one line to FILE per
        build, check the returned entry's contents, print one JSON line per key.
    cache_worker.py maint ROOT --seconds S
        loop entries() / prune(random) / clear() for S seconds; print the counts.
    cache_worker.py pin ROOT KEY
        pin KEY, print "pinned", then sleep until killed.
    cache_worker.py hold-lock ROOT KEY
        take KEY's build lock, print "locked", then sleep until killed.
    cache_worker.py real ROOT NAME NUM_TOKENS --counter FILE
        tkjit.get(NAME, arch="cpu") for real (counting compile_to_dir calls), run it, check it.

Start time: when TKJIT_TEST_START is set (an epoch time), wait until then so that all workers
hit the cache at once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tkjit.cache import Cache  # noqa: E402

FILES = {"kernel.bin": 48 * 1024, "kernel.src": 4 * 1024}


def payload(key: str, name: str, size: int) -> bytes:
    out = bytearray()
    i = 0
    while len(out) < size:
        out += hashlib.sha256(f"{key}/{name}/{i}".encode()).digest()
        i += 1
    return bytes(out[:size])


def meta_for(key: str) -> dict:
    return {"kernel": "fake", "arch": "cpu", "shape": {"k": key[:8]}, "config": {}, "toolchain": {"fake": "1"}}


def check_entry(entry, key: str) -> None:
    assert entry.key == key, (entry.key, key)
    for name, size in FILES.items():
        data = (entry.path / name).read_bytes()
        if data != payload(key, name, size):
            raise SystemExit(f"WRONG CONTENT in {entry.path / name}")
    if entry.meta.get("built_by") is None or entry.meta["shape"] != {"k": key[:8]}:
        raise SystemExit(f"WRONG META {entry.meta}")


def make_builder(key: str, counter: str | None, sleep: tuple[float, float]):
    def build(staging: Path) -> dict:
        if counter:
            with open(counter, "a") as f:
                f.write(f"{os.getpid()} {key}\n")
        time.sleep(random.uniform(*sleep))
        for name, size in FILES.items():
            data = payload(key, name, size)
            with open(staging / name, "wb") as f:
                for off in range(0, size, 8192):  # chunks: a kill can land mid-file
                    f.write(data[off : off + 8192])
                    f.flush()
                    if random.random() < 0.2:
                        time.sleep(random.uniform(0, sleep[1] / 10))
        return {"built_by": os.getpid()}

    return build


def slow_publish(phases: str | None) -> None:
    """Widen the publish window (fsync/rename) so random kills land inside it too; log the phases."""
    import tkjit.cache as c

    real_fsync, real_rename, real_publish = os.fsync, os.rename, c.Cache._publish

    def fsync(fd):
        time.sleep(random.uniform(0, 0.03))
        return real_fsync(fd)

    def rename(a, b):
        time.sleep(random.uniform(0, 0.03))
        return real_rename(a, b)

    def log(what: str) -> None:
        if phases:
            with open(phases, "a") as f:
                f.write(f"{os.getpid()} {what}\n")

    def publish(self, key, staging, meta):
        log("publish")
        real_publish(self, key, staging, meta)
        log("published")

    c.os.fsync = fsync  # c.os is os: this process only
    c.os.rename = rename
    c.Cache._publish = publish


def wait_start() -> None:
    t = os.environ.get("TKJIT_TEST_START")
    if t:
        time.sleep(max(0.0, float(t) - time.time()))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode")
    ap.add_argument("root")
    ap.add_argument("rest", nargs="*")
    ap.add_argument("--counter")
    ap.add_argument("--sleep", nargs=2, type=float, default=(0.0, 0.0))
    ap.add_argument("--pin", action="store_true")
    ap.add_argument("--unpin", action="store_true")
    ap.add_argument("--loops", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--slow-publish", action="store_true")
    a = ap.parse_args()
    cache = Cache(Path(a.root))

    if a.mode == "build":
        if a.slow_publish:
            slow_publish(a.counter + ".phases" if a.counter else None)
        wait_start()
        for _ in range(a.loops):
            for key in a.rest:
                if a.pin:
                    cache.pin(key)
                entry = cache.get_or_build(key, meta_for(key), make_builder(key, a.counter, tuple(a.sleep)))
                check_entry(entry, key)
                if a.unpin:
                    cache.unpin(key)
                print(json.dumps({"key": key, "built_by": entry.meta["built_by"], "pid": os.getpid()}), flush=True)
        return 0
    if a.mode == "maint":
        wait_start()
        end = time.time() + a.seconds
        n = {"list": 0, "prune": 0, "clear": 0, "removed": 0}
        while time.time() < end:
            r = random.random()
            if r < 0.5:
                cache.entries()
                n["list"] += 1
            elif r < 0.85:
                n["removed"] += len(cache.prune(random.choice([0, 60_000, 200_000])))
                n["prune"] += 1
            else:
                n["removed"] += cache.clear().removed
                n["clear"] += 1
            time.sleep(0.005)
        print(json.dumps(n), flush=True)
        return 0
    if a.mode == "pin":
        assert cache.pin(a.rest[0])
        print("pinned", flush=True)
        time.sleep(3600)
        return 0
    if a.mode == "hold-lock":
        with cache.lock(a.rest[0]):
            print("locked", flush=True)
            time.sleep(3600)
        return 0
    if a.mode == "real":
        os.environ["TKJIT_CACHE_DIR"] = a.root
        import tkjit
        import tkjit.compiler as comp
        from tkjit.testing import check

        real = comp.compile_to_dir

        def counted(*args, **kw):
            with open(a.counter, "a") as f:
                f.write(f"{os.getpid()}\n")
            return real(*args, **kw)

        comp.compile_to_dir = counted
        name, num_tokens = a.rest[0], int(a.rest[1])
        wait_start()
        k = tkjit.get(name, {"num_tokens": num_tokens}, arch="cpu")
        problem = check(k, k.shape, device="cpu", seed=1)
        if problem:
            raise SystemExit(f"WRONG RESULT: {problem}")
        print(json.dumps({"key": k.key, "path": str(k.path), "pid": os.getpid()}), flush=True)
        return 0
    raise SystemExit(f"unknown mode {a.mode}")


if __name__ == "__main__":
    sys.exit(main())
