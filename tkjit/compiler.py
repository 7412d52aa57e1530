"""Compile one (spec, static shape, config, arch) into artifact files; many of them in parallel.

This is the only module that imports TileLang. Serving a cached kernel never comes here.

Every compile runs in a private build dir (0700, ours, made atomically, beside the output dir):
TileLang and the host compiler write their temporary sources and libraries under `tempfile`'s
dir, and in a shared /tmp another local user could plant a link at the predictable `tmpXXXX.so`
beside a `tmpXXXX.cpp` and have their library loaded and published. The dir is removed after
the compile.

The nvcc that runs is the one the key names (`TKJIT_NVCC`, else TileLang's own lookup, which
`tkjit.key.nvcc_path` mirrors): checked once TileLang is imported, so a key never describes a
binary another compiler built.

Many variants compile in parallel on `tkjit.pool.CompilePool`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tkjit import envs
from tkjit.arch import tilelang_target
from tkjit.errors import CompileError, ConfigError
from tkjit.fs import check_private
from tkjit.loader import dynamic_args, loader_for
from tkjit.spec import KernelSpec

KERNEL_LIB = "kernel.so"
KERNEL_SRC = "kernel.cu"
LAUNCHER_SRC = "launcher.cu"  # (cudart entries)


def import_tilelang():
    # Our cache is the cache: TileLang's own would keep a second copy of every variant.
    os.environ.setdefault("TILELANG_DISABLE_CACHE", "1")
    os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
    nvcc = envs.NVCC.get()
    if nvcc and "tilelang" not in sys.modules:
        # TileLang runs $CUDA_HOME/bin/nvcc, with CUDA_HOME read once at its import.
        os.environ["CUDA_HOME"] = str(_cuda_home_of(nvcc))
    import tilelang

    return tilelang


def _cuda_home_of(nvcc: str) -> Path:
    path = Path(nvcc)
    if path.name != "nvcc" or path.parent.name != "bin":
        raise ConfigError(f"TKJIT_NVCC={nvcc!r} must name an nvcc inside a CUDA install: <cuda home>/bin/nvcc")
    return path.parent.parent


def _check_nvcc() -> None:
    """The nvcc TileLang will run must have the version the cache key records: the key names a
    compiler by version (a copied CUDA install still hits), so that is what has to agree."""
    from tilelang.contrib.nvcc import get_nvcc_compiler

    from tkjit.key import nvcc_path, nvcc_version, nvcc_version_of

    runs = get_nvcc_compiler()
    keyed, ran = nvcc_version(), nvcc_version_of(runs)
    if keyed != ran:
        how = "TKJIT_NVCC" if envs.NVCC.get() else "CUDA_HOME or PATH"
        raise CompileError(
            f"TileLang would compile with {runs} (nvcc {ran}) but the cache key names {nvcc_path() or 'no nvcc'} "
            f"(nvcc {keyed}, from {how}); set TKJIT_NVCC (or CUDA_HOME) before the first compile in this process"
        )


_tmp_lock = threading.Lock()

# TileLang names a library after its temp source file by a plain string replace over the whole path
# (`name.replace(".cpp", ".so")`, ".cu" for CUDA launchers): a dir anywhere above the temp file whose
# name holds one of these (a cache root `~/.cuda-cache`, a random mkdtemp suffix starting "cu")
# would be rewritten too, and the compiler asked to write into a dir that does not exist.
_SOURCE_SUFFIXES = (".cu", ".cpp", ".asc")


def _names_a_source_suffix(d: Path) -> bool:
    return any(s in os.path.realpath(d) for s in _SOURCE_SUFFIXES)


@contextlib.contextmanager
def private_build_dir(beside: Path) -> Iterator[Path]:
    """A fresh private dir next to the output dir, which `tempfile` (TileLang's temp files) and the
    child compilers use meanwhile; removed afterwards.

    mkdtemp makes it 0700 with O_EXCL semantics, so nobody else can have made it or put anything
    in it. Beside a cache staging dir it is named after the key (`<key>.build-XXXX`), so a compile
    killed midway leaves nothing that the cache's staging cleanup does not remove. Where the path
    beside the output holds a source suffix (see _SOURCE_SUFFIXES) it goes in the system temp dir
    instead. `tempfile.tempdir` is process-wide: compiles in one process take turns.
    """
    with _tmp_lock:
        stem = beside.name.split(".", 1)[0]  # after "-" a random suffix can start with anything
        d = Path(tempfile.mkdtemp(prefix=f"{stem}.build-", dir=beside.parent))
        if _names_a_source_suffix(d):
            shutil.rmtree(d, ignore_errors=True)
            d = Path(tempfile.mkdtemp(prefix="tkjit-build-"))
            if _names_a_source_suffix(d):
                shutil.rmtree(d, ignore_errors=True)
                raise CompileError(
                    f"TileLang cannot compile in {beside.parent} nor in {d.parent}: their paths hold one of "
                    f"{', '.join(_SOURCE_SUFFIXES)}, which TileLang's library naming rewrites; set TMPDIR "
                    "to a dir whose path does not"
                )
        try:
            check_private(d, is_dir=True)
            saved = tempfile.tempdir, os.environ.get("TMPDIR")
            tempfile.tempdir = str(d)
            os.environ["TMPDIR"] = str(d)  # gcc / nvcc temporaries
            try:
                yield d
            finally:
                tempfile.tempdir = saved[0]
                if saved[1] is None:
                    os.environ.pop("TMPDIR", None)
                else:
                    os.environ["TMPDIR"] = saved[1]
        finally:
            shutil.rmtree(d, ignore_errors=True)


def _copy_artifact(src: str | os.PathLike, build_dir: Path, dst: Path) -> None:
    """Copy a library TileLang wrote, only from inside our private build dir, never through a link."""
    src = Path(src)
    if os.path.realpath(src.parent) != os.path.realpath(build_dir):
        raise CompileError(f"TileLang wrote its library to {src}, outside the private build dir {build_dir}")
    check_private(src, is_dir=False)  # ours, a regular file, not a link, not writable by others
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f, open(dst, "wb") as out:
        shutil.copyfileobj(f, out)


def _cudart_flags(build_dir: Path) -> list[str]:
    """nvcc flags of a "cudart" kernel library: the CUDA runtime linked shared (libcudart.so.<major>, the one
    torch has loaded; a static copy would be ~1 MB a kernel), and a link-time stand-in for the driver
    library. TileLang links `-lcuda`, but its wrapper reaches the driver only through the runtime's entry
    points (tensor maps), so nothing is bound to it: a build host without a GPU driver links against an
    empty libcuda.so (soname libcuda.so.1, as the toolkit's own stub), made in the compile's private build
    dir (one host-compiler call)."""
    import subprocess

    stub_dir = build_dir / "stub"
    stub = stub_dir / "libcuda.so"
    if not stub.exists():
        stub_dir.mkdir(mode=0o700)
        src = stub_dir / "stub.c"
        src.write_text("/* link-time stand-in for the CUDA driver library: see tkjit.compiler._cudart_flags */\n")
        cc = shutil.which("cc") or shutil.which("gcc") or "cc"
        r = subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stub), str(src)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise CompileError(f"building the link stub for libcuda with {cc} failed: {r.stderr.strip()[:500]}")
    return ["--cudart=shared", f"-L{stub_dir}"]


class _NotLoaded:
    """Stands in for the library TileLang's cython adapter loads and initialises right after building it:
    `init` sets the kernels' shared memory limits on the current GPU, and a build host may have none.
    tkjit loads the library itself when it serves it (tkjit.loader.CudartKernel)."""

    def __init__(self) -> None:
        self.get_last_error = lambda: b""

    def init(self) -> int:
        return 0


@contextlib.contextmanager
def _library_not_loaded() -> Iterator[None]:
    # Compiles in a process take turns (private_build_dir's lock), so the class patch is this compile's.
    from tilelang.jit.adapter.libgen import LibraryGenerator

    saved = LibraryGenerator.load_lib
    LibraryGenerator.load_lib = lambda self, lib_path=None: _NotLoaded()
    try:
        yield
    finally:
        LibraryGenerator.load_lib = saved


def _dynamic_args(prim_func) -> list[dict[str, Any]]:
    """The C-ABI's trailing int args: each dynamic dim, with the tensor and axis it is read from; then
    each dynamic stride (a `T.StridedTensor`'s), with the tensor and the axis whose stride it is.
    The order is the one `_c_wrapper_passes_strides` gives TileLang's C wrapper (sizes, then strides)."""
    from tvm import tirx

    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    bufs = []
    for idx, p in enumerate(prim_func.params):
        buf = prim_func.buffer_map.get(p)
        if buf is None:  # a scalar: _scalar_args records it
            continue
        bufs.append(buf)
        for axis, dim in enumerate(buf.shape):
            if isinstance(dim, tirx.Var) and dim.name not in seen:
                seen.add(dim.name)
                out.append({"name": dim.name, "arg": idx, "axis": axis})
    for idx, buf in enumerate(bufs):
        for axis, stride in enumerate(buf.strides or ()):
            if isinstance(stride, tirx.Var) and stride.name not in seen:
                seen.add(stride.name)
                out.append({"name": stride.name, "arg": idx, "stride": axis})
    return out


def _scalar_args(prim_func, n_tensors: int) -> list[dict[str, str]]:
    """The scalar params ({"name", "dtype"}), which must all come after the tensor params."""
    out = []
    for idx, p in enumerate(prim_func.params):
        is_tensor = p in prim_func.buffer_map
        if is_tensor != (idx < n_tensors):
            raise CompileError(f"param {idx} ({p.name}): the builder must declare the tensors first, then the scalars")
        if not is_tensor:
            out.append({"name": p.name, "dtype": str(p.dtype)})
    return out


def _c_wrapper_passes_strides() -> None:
    """TileLang's C-target wrapper gives its `call` the runtime sizes but not the runtime strides that
    the kernel function also takes, so a `T.StridedTensor` kernel does not compile for the C target.
    Its CUDA wrapper lists both (sizes, then strides, each in parameter order): use that list."""
    from tilelang.jit.adapter import wrapper

    cpu, cuda = wrapper.TLCPUSourceWrapper, wrapper.TLCUDASourceWrapper
    if cpu.get_dynamic_symbolic_set is not cuda.get_dynamic_symbolic_set:
        cpu.get_dynamic_symbolic_set = cuda.get_dynamic_symbolic_set


def compile_to_dir(spec: KernelSpec, static_shape: dict, config: dict, arch: str, out_dir: Path) -> dict[str, Any]:
    """Build and compile into out_dir; returns the ABI metadata the loader needs."""
    tilelang = import_tilelang()
    if arch != "cpu":
        _check_nvcc()
    else:
        _c_wrapper_passes_strides()
    out_dir = Path(out_dir)
    with private_build_dir(out_dir) as build_dir:
        return _compile_in(tilelang, spec, static_shape, config, arch, out_dir, build_dir)


def _compile_in(
    tilelang, spec: KernelSpec, static_shape: dict, config: dict, arch: str, out_dir: Path, build_dir: Path
) -> dict[str, Any]:
    try:
        func = spec.build(dict(static_shape), dict(config))
    except Exception as e:
        raise CompileError(f"{spec.name}: building config {config} failed: {type(e).__name__}: {e}") from e
    tensors = spec.abi_tensors(static_shape)
    n_args = len(tensors) + len(spec.scalars)
    if len(func.params) != n_args:
        raise CompileError(f"{spec.name}: builder made {len(func.params)} params, spec declares {n_args}")
    try:
        scalars = _scalar_args(func, len(tensors))
    except CompileError as e:
        raise CompileError(f"{spec.name}: {e}") from None
    if scalars != spec.abi_scalars():
        raise CompileError(f"{spec.name}: the built function's scalar params {scalars} are not the spec's "
                           f"{spec.abi_scalars()} (names and dtypes, in order)")
    launcher = loader_for(arch)
    try:
        with _library_not_loaded() if launcher == "cudart" else contextlib.nullcontext():
            kernel = tilelang.compile(
                func,
                target=tilelang_target(arch),
                execution_backend="tvm_ffi" if launcher == "tvm_ffi" else "cython",
                pass_configs=spec.pass_configs(dict(config)) or None,
                compile_flags=_cudart_flags(build_dir) if launcher == "cudart" else None,
            )
    except Exception as e:
        raise CompileError(
            f"{spec.name}: TileLang failed on config {config} for {arch}: {type(e).__name__}: {e}"
        ) from e
    src = kernel.get_kernel_source() or ""
    (out_dir / KERNEL_SRC).write_text(src)
    if launcher != "tvm_ffi":
        # TileLang's C wrapper: a plain C ABI, int call(T* buf..., scalars..., int32 dyn...[, cudaStream_t]),
        # loaded by ctypes (the C target's, and CUDA's "cudart" launcher).
        lib = getattr(kernel.adapter, "libpath", None) or kernel.adapter.lib_generator.libpath
        _copy_artifact(lib, build_dir, out_dir / KERNEL_LIB)
        if launcher == "cudart":  # the host side, for reading what a launch does (`call`'s args, its grid)
            (out_dir / LAUNCHER_SRC).write_text(kernel.adapter.host_kernel_source or "")
        abi = {"loader": launcher, "dynamic": _dynamic_args(func)}
        implied = dynamic_args(tensors, [p.name for p in spec.runtime_params])
        if abi["dynamic"] != implied:  # the loader would refuse it: say so now, naming both
            raise CompileError(f"{spec.name}: the built function's runtime sizes/strides {abi['dynamic']} are not "
                               f"the spec's tensors' {implied} (T.dynamic names must be the spec's param names, "
                               "and a strided TensorArg's strides tkjit.spec.stride_name(arg, axis))")
    else:
        kernel.adapter.get_exportable_executable().export_library(str(out_dir / KERNEL_LIB))
        host = kernel.adapter.get_host_source() or ""
        # TMA kernels build their tensor maps on the host through a function registered by
        # libtilelang.so; record it so the loader brings that library in only when needed.
        abi = {"loader": "tvm_ffi", "tilelang_runtime": "__tvm_tensormap_create" in host}
    if scalars:  # recorded only where there are some: entries without scalars keep their ABI record
        abi["scalars"] = scalars
    return {"abi": abi, "lib": KERNEL_LIB}
