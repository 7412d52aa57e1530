"""Compile one (spec, static shape, config, arch) into artifact files; many of them in parallel.

This is the only module that imports TileLang. Serving a cached kernel never comes here.

Many variants compile on a spawn pool whose processes import TileLang once and publish through
`ensure_entry`; the tuner keeps one pool alive across its batches and studies. A process that
dies (a compiler segfault) breaks the pool: it is rebuilt and the batch's remaining jobs retried
one at a time, so only the job that kills it again fails.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import shutil
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from tkjit import envs
from tkjit.arch import tilelang_target
from tkjit.errors import CompileError
from tkjit.spec import KernelSpec

KERNEL_LIB = "kernel.so"
KERNEL_SRC = "kernel.cu"


def _import_tilelang():
    # Our cache is the cache: TileLang's own would keep a second copy of every variant.
    os.environ.setdefault("TILELANG_DISABLE_CACHE", "1")
    os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
    import tilelang

    return tilelang


def _dynamic_args(prim_func) -> list[dict[str, Any]]:
    """The C-ABI's trailing int args: each dynamic dim, with the tensor and axis it is read from."""
    from tvm import tirx

    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for idx, p in enumerate(prim_func.params):
        buf = prim_func.buffer_map.get(p)
        if buf is None:
            raise CompileError("tkjit kernels take tensors only (compile scalars in as static params)")
        for axis, dim in enumerate(buf.shape):
            if isinstance(dim, tirx.Var) and dim.name not in seen:
                seen.add(dim.name)
                out.append({"name": dim.name, "arg": idx, "axis": axis})
    return out


def compile_to_dir(spec: KernelSpec, static_shape: dict, config: dict, arch: str, out_dir: Path) -> dict[str, Any]:
    """Build and compile into out_dir; returns the ABI metadata the loader needs."""
    tilelang = _import_tilelang()
    try:
        func = spec.build(dict(static_shape), dict(config))
    except Exception as e:
        raise CompileError(f"{spec.name}: building config {config} failed: {type(e).__name__}: {e}") from e
    n_args = len(spec.inputs) + len(spec.outputs)
    if len(func.params) != n_args:
        raise CompileError(f"{spec.name}: builder made {len(func.params)} params, spec declares {n_args}")
    cpu = arch == "cpu"
    try:
        kernel = tilelang.compile(
            func,
            target=tilelang_target(arch),
            execution_backend="cython" if cpu else "tvm_ffi",
            pass_configs=spec.pass_configs(dict(config)) or None,
        )
    except Exception as e:
        raise CompileError(
            f"{spec.name}: TileLang failed on config {config} for {arch}: {type(e).__name__}: {e}"
        ) from e
    out_dir = Path(out_dir)
    src = kernel.get_kernel_source() or ""
    (out_dir / KERNEL_SRC).write_text(src)
    if cpu:
        # The C target's library has a plain C ABI: int call(T* buf..., int32 dyn...), loaded by ctypes.
        lib = getattr(kernel.adapter, "libpath", None) or kernel.adapter.lib_generator.libpath
        shutil.copyfile(lib, out_dir / KERNEL_LIB)
        abi = {"loader": "ctypes", "dynamic": _dynamic_args(func)}
    else:
        kernel.adapter.get_exportable_executable().export_library(str(out_dir / KERNEL_LIB))
        host = kernel.adapter.get_host_source() or ""
        # TMA kernels build their tensor maps on the host through a function registered by
        # libtilelang.so; record it so the loader brings that library in only when needed.
        abi = {"loader": "tvm_ffi", "tilelang_runtime": "__tvm_tensormap_create" in host}
    return {"abi": abi, "lib": KERNEL_LIB}


def default_jobs() -> int:
    env = envs.JOBS.get()
    if env:
        return max(1, int(env))
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


Job = tuple[str, dict, dict, str, str]  # (kernel, static shape, config, arch, config source)


def _init(imports: Sequence[str]) -> None:
    for m in imports:
        importlib.import_module(m)
    _import_tilelang()  # once per process, not per job


def _compile_one(job: Job) -> tuple[str | None, str | None]:
    from tkjit.api import ensure_entry
    from tkjit.registry import get_spec

    name, static, config, arch, source = job
    try:
        _, key = ensure_entry(get_spec(name), static, config, arch, source)
        return key, None
    except Exception as e:  # one bad config must not stop the batch
        return None, f"{type(e).__name__}: {e}"


def _noop() -> None:
    return None


class CompilePool:
    def __init__(self, n_jobs: int | None = None, imports: Sequence[str] = ()) -> None:
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


def compile_many(jobs: Sequence[Job], n_jobs: int | None = None) -> list[tuple[str | None, str | None]]:
    """Compile and publish (name, static_shape, config, arch, config_source) variants in parallel.

    Returns (key, error) per job, in order. Specs are looked up by name in the workers, so they must
    be importable there (built-in, or registered through a `tkjit.specs` entry point).
    """
    pool = CompilePool(min(n_jobs or default_jobs(), max(1, len(jobs))))
    try:
        return pool.compile(jobs)
    finally:
        pool.close()
