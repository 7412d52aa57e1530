"""Shared pieces of the cache tests (tests/test_cache_*.py): worker processes, fake builders, whole-cache checks."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from cache_worker import FILES, meta_for, payload  # noqa: F401  (re-exported for the tests)

from tkjit.cache import Cache, CorruptEntry

WORKER = Path(__file__).with_name("cache_worker.py")
REPO = Path(__file__).resolve().parents[2]


def key(i: int | str) -> str:
    return hashlib.sha1(f"reliability-{i}".encode()).hexdigest()


def worker_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def spawn(*args: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), *map(str, args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or worker_env(), **kw,
    )


def finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[list[dict]]:
    """Wait for workers; every one must exit 0. Returns each worker's JSON lines."""
    out = []
    for p in procs:
        so, se = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"worker {p.args} failed ({p.returncode}):\n{so}\n{se}"
        out.append([json.loads(line) for line in so.splitlines() if line.startswith("{")])
    return out


def wait_line(p: subprocess.Popen, want: str, timeout: float = 30) -> None:
    t0 = time.time()
    line = p.stdout.readline()
    err = p.stderr.read() if p.poll() is not None else ""
    assert line.strip() == want, f"worker said {line!r} after {time.time() - t0:.1f}s; stderr: {err}"


def fake_build(key_: str, calls: list | None = None, files: dict[str, int] | None = None, extra: dict | None = None):
    """An in-process builder that writes the deterministic worker payload."""

    def build(staging: Path) -> dict:
        if calls is not None:
            calls.append(key_)
        for name, size in (files or FILES).items():
            (staging / name).write_bytes(payload(key_, name, size))
        return {"built_by": os.getpid(), **(extra or {})}

    return build


def verify_all(cache: Cache) -> list[str]:
    """Every published entry must verify and hold exactly its key's payload."""
    keys = []
    edir = cache.base / "entries"
    for p in sorted(edir.iterdir()):
        if p.name.endswith(".used"):
            continue
        try:
            e = cache.verify(p.name)
        except FileNotFoundError:
            continue
        except CorruptEntry as err:
            raise AssertionError(f"published entry {p.name} does not verify: {err}") from None
        for name, size in FILES.items():
            if (e.path / name).exists():
                assert (e.path / name).read_bytes() == payload(p.name, name, size), f"{p.name}/{name} torn"
        keys.append(p.name)
    return keys


def counted(counter: Path) -> list[str]:
    return counter.read_text().splitlines() if counter.exists() else []
