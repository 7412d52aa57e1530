"""Compile many variants in parallel: a pool of spawned processes that import TileLang once.

Each job is `build.ensure_entry` in a worker: compiled and published into the cache; one the cache already
holds is found by the caller's process itself, without a worker.
The tuner keeps one pool alive across its batches and studies. Workers die with their parent. A
process that dies (a compiler segfault) breaks the pool: it is rebuilt and the batch's jobs retried
one at a time, each job that kills its worker once more in a fresh one; only a job that kills it
twice fails, with the worker's exit signal in its error.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import signal
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from tkjit import envs
from tkjit.canon import canonical_json
from tkjit.procs import die_with_parent, exit_status


def default_jobs() -> int:
    n = envs.count(envs.JOBS, "a number of processes >= 1, e.g. 4")
    if n is not None:
        return n
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


Job = tuple[str, dict, dict, str, str]  # (kernel, static shape, config, arch, config source)


def unique_jobs(jobs: Iterable[Job]) -> list[Job]:
    """jobs in order without repeats: two jobs naming one (kernel, static shape, config, arch) build one variant,
    whatever config source each names (the first one's is kept)."""
    seen: dict[str, Job] = {}
    for job in jobs:
        seen.setdefault(canonical_json(list(job[:4])), tuple(job))
    return list(seen.values())


class Result(tuple):
    """(key, error): a key only when the entry is in the cache. Unpacks as a pair; also carries
    `built` (this job compiled the variant, rather than finding it cached) and `compile_s`."""

    built: bool = False
    compile_s: float | None = None

    def __new__(cls, key: str | None, error: str | None, built: bool = False, compile_s: float | None = None):
        self = super().__new__(cls, (key, error))
        self.built, self.compile_s = built, compile_s
        return self

    def __reduce__(self):
        return (Result, (self[0], self[1], self.built, self.compile_s))


def _init(imports: Sequence[str], parent: int) -> None:
    from tkjit.compiler import import_tilelang

    die_with_parent(parent)
    for m in imports:
        importlib.import_module(m)
    import_tilelang()  # once per process, not per job


def _compile_one(job: Job) -> Result:
    from tkjit.build import cache, ensure_entry
    from tkjit.registry import get_spec

    name, static, config, arch, source = job
    report: dict = {}
    try:
        entry, key = ensure_entry(get_spec(name), static, config, arch, source, report=report)
    except Exception as e:  # one bad config must not stop the batch
        return Result(None, f"{type(e).__name__}: {e}")
    if entry.path != cache().entry_path(key):  # served from a temp dir: the disk refused it
        why = entry.meta.get("uncached_reason", "the cache refused the entry")
        return Result(None, f"compiled but not cached: {why}")
    built = bool(report.get("built"))
    return Result(key, None, built, entry.meta.get("compile_s") if built else None)


def _noop() -> None:
    return None


def _cached(job: Job) -> Result | None:
    """The job's result when its variant is already verified in the cache, found in this process (no TileLang
    import: `get` serves from disk without one), else None. A pool process's first job waits for its TileLang
    import, seconds at the start of every tuning run, even when the cache holds everything."""
    from tkjit.build import cache, variant_meta
    from tkjit.cache import KEY_FIELDS
    from tkjit.registry import get_spec

    name, static, config, arch, source = job
    try:
        key, meta, _ = variant_meta(get_spec(name), static, config, arch, source)
        entry = cache().lookup(key, {k: meta[k] for k in KEY_FIELDS})
    except Exception:  # whatever is wrong, the pool's job names it (_compile_one)
        return None
    return None if entry is None else Result(key, None)


def _cause(codes: Sequence[int | None]) -> str:
    """How a broken pool's worker ended: the pool SIGTERMs the survivors, so another code is the cause."""
    for code in sorted((c for c in codes if c), key=lambda c: c == -signal.SIGTERM):
        return f"worker ended by {exit_status(code)}"
    return "worker exit status unknown"


class CompilePool:
    def __init__(self, n_jobs: int | None = None, imports: Sequence[str] = ()) -> None:
        self.n_jobs = max(1, n_jobs or default_jobs())
        self.imports = tuple(imports)
        self._ex: ProcessPoolExecutor | None = None
        self._jobs: list[Future] = []  # compile jobs submitted (warm()'s no-ops are not): close() asks if any runs
        self.compiled = 0  # jobs submitted (cache hits included): tests count these

    def _pool(self) -> ProcessPoolExecutor:
        if self._ex is None:
            self._ex = ProcessPoolExecutor(
                max_workers=self.n_jobs, mp_context=mp.get_context("spawn"),
                initializer=_init, initargs=(self.imports, os.getpid()),
            )
        return self._ex

    def _submit(self, job: Job) -> Future:
        f = self._pool().submit(_compile_one, job)
        self._jobs = [j for j in self._jobs if not j.done()] + [f]
        return f

    def warm(self) -> None:
        """Start the processes now (they import TileLang in the background)."""
        ex = self._pool()
        for _ in range(self.n_jobs):
            ex.submit(_noop)

    def compile(self, jobs: Sequence[Job]) -> list[Result]:
        """(key, error) per job, in order."""
        return list(self.compile_iter(jobs))

    def _isolated(self, job: Job) -> Result:
        """One job alone, in a fresh worker if it kills one: compilers crash now and then (a flaky
        nvcc or ptxas); a job that kills its worker twice is reported with how the worker died."""
        for attempt in range(2):
            try:
                return self._submit(job).result()
            except BrokenProcessPool:
                how = self._reset()
                if attempt:
                    return Result(None, f"the compiler process died twice on this config ({how})")
        raise AssertionError("unreachable")

    def compile_iter(self, jobs: Sequence[Job]):
        """Yield (key, error) per job, in order, each as soon as it is done: the caller benchmarks
        early results while the rest compile. Variants the cache holds are answered here (`_cached`), the
        rest compiled by the pool; a broken pool runs the rest one at a time (`_isolated`)."""
        self.compiled += len(jobs)
        hits = [_cached(j) for j in jobs]
        try:
            futures = [None if hit else self._submit(j) for j, hit in zip(jobs, hits)]
        except BrokenProcessPool:
            self._reset()
            futures = [None] * len(jobs)
        for i, (job, hit, f) in enumerate(zip(jobs, hits, futures)):
            if hit is not None:
                yield hit
                continue
            if f is None:  # the pool broke while the jobs were submitted
                yield self._isolated(job)
                continue
            try:
                yield f.result()
            except BrokenProcessPool:
                self._reset()
                for j, h in zip(jobs[i:], hits[i:]):  # (the cache hits among them were found above)
                    yield h or self._isolated(j)
                return

    def _reset(self) -> str:
        """Drop a (broken) pool; returns how its workers ended."""
        ex, self._ex = self._ex, None
        if ex is None:
            return "worker exit status unknown"
        procs = list(getattr(ex, "_processes", {}).values())  # the stdlib keeps no public handle
        ex.shutdown(wait=True, cancel_futures=True)
        return _cause([p.exitcode for p in procs])

    def close(self) -> None:
        ex, self._ex = self._ex, None
        if ex is None:
            return
        if all(f.done() for f in self._jobs):
            # No compile job running (warm()'s no-ops may be: processes still importing TileLang when every
            # variant was a cache hit): nothing is lost by ending the processes now, where a shutdown waits for
            # each to finish its import and tear down its interpreter (TileLang and torch loaded: a second or
            # more, at the end of every tuning run).
            for p in list(getattr(ex, "_processes", {}).values()):  # the stdlib keeps no public handle
                with contextlib.suppress(Exception):
                    p.terminate()
        ex.shutdown(wait=True, cancel_futures=True)


def compile_many(
    jobs: Sequence[Job], n_jobs: int | None = None, imports: Sequence[str] = ()
) -> list[Result]:
    """Compile and publish (name, static_shape, config, arch, config_source) variants in parallel.

    Returns (key, error) per job, in order; a variant that compiled but could not be cached (a
    read-only or full disk) is an error. Specs are looked up by name in the workers, so they must be
    importable there (built-in, registered through a `tkjit.specs` entry point, or in `imports`).
    """
    pool = CompilePool(min(n_jobs or default_jobs(), max(1, len(jobs))), imports)
    try:
        return pool.compile(jobs)
    finally:
        pool.close()
