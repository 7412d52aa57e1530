"""A compile pool that lives across batches and studies.

`tkjit.compiler.compile_many` starts a fresh pool per call, so every batch would pay TileLang's
import again in every process. The tuner compiles many small batches, so it keeps one spawn
pool whose processes import TileLang (and any test-only spec modules) once, and publish through
the same `ensure_entry` path as `compile_many`. A process that dies (a compiler segfault) breaks
the pool: it is rebuilt and the batch's remaining jobs retried one at a time, so only the job
that kills it again fails.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

Job = tuple[str, dict, dict, str]  # (kernel, static shape, config, arch)


def _init(imports: Sequence[str]) -> None:
    import os

    os.environ.setdefault("TILELANG_DISABLE_CACHE", "1")
    os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
    for m in imports:
        importlib.import_module(m)
    import tilelang  # noqa: F401  - once per process, not per job


def _compile_one(job: Job) -> tuple[str | None, str | None]:
    from tkjit.api import ensure_entry
    from tkjit.registry import get_spec

    name, static, config, arch = job
    try:
        _, key = ensure_entry(get_spec(name), static, config, arch, "tuning")
        return key, None
    except Exception as e:  # one bad config must not stop the batch
        return None, f"{type(e).__name__}: {e}"


def _noop() -> None:
    return None


class CompilePool:
    def __init__(self, n_jobs: int | None = None, imports: Sequence[str] = ()) -> None:
        from tkjit.compiler import default_jobs

        self.n_jobs = max(1, n_jobs or default_jobs())
        self.imports = tuple(imports)
        self._ex: ProcessPoolExecutor | None = None
        self.compiled = 0  # jobs submitted (cache hits included): tests count these

    def _pool(self) -> ProcessPoolExecutor:
        if self._ex is None:
            self._ex = ProcessPoolExecutor(
                max_workers=self.n_jobs, mp_context=mp.get_context("spawn"),
                initializer=_init, initargs=(self.imports,),
            )
        return self._ex

    def warm(self) -> None:
        """Start the processes now (they import TileLang in the background)."""
        ex = self._pool()
        for _ in range(self.n_jobs):
            ex.submit(_noop)

    def compile(self, jobs: Sequence[Job]) -> list[tuple[str | None, str | None]]:
        """(key, error) per job, in order."""
        self.compiled += len(jobs)
        if not jobs:
            return []
        try:
            return list(self._pool().map(_compile_one, jobs))
        except BrokenProcessPool:
            self._reset()
        out: list[tuple[str | None, str | None]] = []
        for job in jobs:  # isolate the job that kills the compiler
            try:
                out.append(self._pool().submit(_compile_one, job).result())
            except BrokenProcessPool:
                self._reset()
                out.append((None, "compiler process died (segfault?) on this config"))
        return out

    def compile_iter(self, jobs: Sequence[Job]):
        """Yield (key, error) per job, in order, each as soon as it is done: the caller benchmarks
        early results while the rest compile. A broken pool falls back to `compile` for the rest."""
        self.compiled += len(jobs)
        try:
            futures = [self._pool().submit(_compile_one, j) for j in jobs]
        except BrokenProcessPool:
            self._reset()
            futures = []
        for i, f in enumerate(futures):
            try:
                res = f.result()
            except BrokenProcessPool:
                self._reset()
                self.compiled -= len(jobs) - i
                yield from self.compile(jobs[i:])
                return
            yield res
        if not futures and jobs:
            self.compiled -= len(jobs)
            yield from self.compile(jobs)

    def _reset(self) -> None:
        if self._ex is not None:
            self._ex.shutdown(wait=False, cancel_futures=True)
        self._ex = None

    def close(self) -> None:
        if self._ex is not None:
            self._ex.shutdown(wait=True, cancel_futures=True)
        self._ex = None
