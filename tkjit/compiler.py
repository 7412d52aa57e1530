"""Compile one (spec, static shape, config, arch) into artifact files; many of them in parallel.

This is the only module that imports TileLang. Serving a cached kernel never comes here.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
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


def _worker(args: tuple) -> tuple[int, str | None, str | None]:
    idx, name, static_shape, config, arch, source = args
    from tkjit.api import ensure_entry
    from tkjit.registry import get_spec

    try:
        _, key = ensure_entry(get_spec(name), static_shape, config, arch, source)
        return idx, key, None
    except Exception as e:  # reported per variant; one bad config must not stop the batch
        return idx, None, f"{type(e).__name__}: {e}"


def default_jobs() -> int:
    env = envs.JOBS.get()
    if env:
        return max(1, int(env))
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def compile_many(
    jobs: Sequence[tuple[str, dict, dict, str, str]], n_jobs: int | None = None
) -> list[tuple[str | None, str | None]]:
    """Compile and publish (name, static_shape, config, arch, config_source) variants over a process pool.

    Returns (key, error) per job, in order. Specs are looked up by name in the workers, so they must
    be importable there (built-in, or registered through a `tkjit.specs` entry point).
    """
    import multiprocessing as mp

    n = min(n_jobs or default_jobs(), max(1, len(jobs)))
    results: list[tuple[str | None, str | None]] = [(None, None)] * len(jobs)
    if n == 1:
        for i, j in enumerate(jobs):
            results[i] = _worker((i, *j))[1:]
        return results
    # spawn: a forked TVM/CUDA state is not safe to reuse in the children.
    with ProcessPoolExecutor(max_workers=n, mp_context=mp.get_context("spawn")) as ex:
        for i, key, err in ex.map(_worker, [(i, *j) for i, j in enumerate(jobs)]):
            results[i] = (key, err)
    return results
