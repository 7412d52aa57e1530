"""Load a verified artifact into a callable, without importing the TileLang compiler.

CUDA artifacts are built for one of two launchers (TKJIT_LAUNCHER, in the key): tvm_ffi executables,
which need `libtvm_ffi.so` plus TileLang's small `libtvm_runtime.so` (it registers the CUDA module
loader) and are called through the tvm-ffi C ABI (tkjit/ffi.py) without importing the `tvm_ffi`
Python package; or "cudart" libraries, TileLang's C launcher linked to the CUDA runtime torch has
loaded, one ctypes call a launch (CudartKernel). CPU (C target) artifacts expose a plain C ABI and
are called through ctypes as well.

Both launchers take (tensors..., scalars...) and have `bind(tensors)`: a launcher specialised on
those tensors' shapes and strides, which `CompiledKernel` keeps per call signature.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tkjit.errors import LaunchError
from tkjit.key import launcher_of

if TYPE_CHECKING:
    from tkjit.ffi import FfiKernel

_rt_lock = threading.Lock()
_rt_loaded = False


def _tilelang_lib_dir() -> Path:
    # find_spec on a top-level package locates it without executing tilelang/__init__.py.
    spec = importlib.util.find_spec("tilelang")
    if spec is None or not spec.submodule_search_locations:
        raise LaunchError("tilelang is not installed: its runtime library is needed to load CUDA kernels")
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def _import_tvm_ffi():
    global _rt_loaded
    if _rt_loaded:
        import tvm_ffi

        return tvm_ffi
    with _rt_lock:
        if "tvm_ffi" not in sys.modules and "ml_dtypes" not in sys.modules:
            # tvm_ffi imports ml_dtypes only to map numpy dtypes, which we never pass; that
            # import is most of tvm_ffi's start-up cost, so skip it (it stays importable).
            sys.modules["ml_dtypes"] = None  # type: ignore[assignment]
            try:
                import tvm_ffi
            finally:
                sys.modules.pop("ml_dtypes", None)
        import tvm_ffi

        if not _rt_loaded:
            ctypes.CDLL(str(_tilelang_lib_dir() / "libtvm_runtime.so"), mode=ctypes.RTLD_GLOBAL)
            _rt_loaded = True
    return tvm_ffi


_tl_loaded = False


def _load_tilelang_runtime() -> None:
    """libtilelang.so (C++ only, no Python import): registers the TMA tensor-map builders."""
    global _tl_loaded
    with _rt_lock:
        if not _tl_loaded:
            ctypes.CDLL(str(_tilelang_lib_dir() / "libtilelang.so"), mode=ctypes.RTLD_GLOBAL)
            _tl_loaded = True


def _load_tvm_ffi_py(lib: Path, meta: dict[str, Any]) -> Callable[..., Any]:
    """The artifact through the `tvm_ffi` Python package (a reference for tests and tools; `load` uses the
    C ABI, `_load_tvm_ffi`, which spares the ~100 ms import)."""
    tvm_ffi = _import_tvm_ffi()
    if meta["abi"].get("tilelang_runtime", True) and not _tl_loaded:
        _load_tilelang_runtime()
    mod = tvm_ffi.load_module(str(lib))
    fn = mod["main"]

    def launch(*args):  # tensors, then the scalars (Python numbers: tvm_ffi converts them)
        fn(*args)

    launch._module = mod  # keep the module (and its CUDA code) alive as long as the callable
    return launch


def _load_tvm_ffi(lib: Path, meta: dict[str, Any]) -> FfiKernel:
    from tkjit import ffi

    ffi.load_runtime(_tilelang_lib_dir)
    if meta["abi"].get("tilelang_runtime", True) and not _tl_loaded:
        _load_tilelang_runtime()
    scalars = [s["dtype"] for s in meta["abi"].get("scalars", ())]
    return ffi.FfiKernel(ffi.load_function(lib, "main"), scalars)


class CtypesKernel:
    """A C-target kernel: `int call(T* tensors..., scalars..., int32 sizes/strides...)` through ctypes.

    Called with the tensors then the scalars; `bind(tensors)` gives a launcher specialised on those tensors'
    shapes and strides (the int args computed once), for `CompiledKernel`'s per-signature fast path."""

    def __init__(self, dll: ctypes.CDLL, dyn: list[tuple[int, int, bool]], scalar_types: list[Any]):
        self._dll = dll
        self._dyn = dyn
        self._scalar_types = scalar_types
        self._call = dll.call
        self._call.restype = ctypes.c_int
        self._typed = False

    def _dims(self, tensors: Sequence[Any]) -> tuple[int, ...]:
        return tuple(tensors[a].stride(ax) if st else tensors[a].shape[ax] for a, ax, st in self._dyn)

    def _type_args(self, n_tensors: int) -> None:
        # Typed args: ctypes converts plain ints/floats in C (no ctypes object per argument per call).
        if not self._typed:
            self._call.argtypes = ([ctypes.c_void_p] * n_tensors + self._scalar_types
                                   + [ctypes.c_int32] * len(self._dyn))
            self._typed = True

    def _fail(self, rc: int) -> None:
        raise LaunchError(f"kernel returned {rc}: {self._dll.get_last_error().decode(errors='replace')}")

    def __call__(self, *given: Any) -> None:
        n = len(given) - len(self._scalar_types)
        tensors = given[:n]
        self._type_args(n)
        rc = self._call(*[t.data_ptr() for t in tensors], *given[n:], *self._dims(tensors))
        if rc != 0:
            self._fail(rc)

    def bind(self, tensors: Sequence[Any], n_in: int | None = None) -> Callable[..., None]:
        """launch(inputs, outputs, scalars=()) for tensors of these shapes and strides (inputs then outputs;
        n_in, how many are inputs, is the FfiKernel's parameter: here the order alone matters)."""
        self._type_args(len(tensors))
        dims, call, fail = self._dims(tensors), self._call, self._fail

        def launch(ins: Sequence[Any], outs: Sequence[Any], scalars: Sequence[Any] = ()) -> None:
            rc = call(*[t.data_ptr() for t in ins], *[t.data_ptr() for t in outs], *scalars, *dims)
            if rc != 0:
                fail(rc)

        return launch


def _load_ctypes(lib: Path, meta: dict[str, Any]) -> CtypesKernel:
    dll = ctypes.CDLL(str(lib), mode=os.RTLD_LOCAL)
    dll.get_last_error.restype = ctypes.c_char_p
    if dll.init() != 0:
        raise LaunchError(f"kernel init failed: {dll.get_last_error().decode(errors='replace')}")
    # Scalars follow the tensor pointers (they are the PrimFunc's last params), before the sizes.
    return CtypesKernel(dll, _dynamic_of(meta), _scalar_types_of(meta))


_thread = threading.local()  # .devices: the CUDA devices whose context CudartKernel made current on a thread


class CudartKernel(CtypesKernel):
    """A CUDA kernel with TileLang's C launcher beside it: `int call(T* tensors..., scalars..., int32
    sizes/strides..., cudaStream_t)`, one ctypes call that runs cudaLaunchKernelEx, and `int init()`, which
    sets the kernels' dynamic shared memory limits on the current device (once per device, before its
    first launch there). No tvm-ffi runtime: the per-signature checks of `CompiledKernel` are the checks.

    The library is opened at the first launch: it needs the CUDA runtime torch loads (libcudart.so.<major>,
    found by its soname), and a build host without a GPU still gets a kernel object. The launch goes to
    torch's current stream on the tensors' device; with several GPUs visible, the call switches to that
    device when it is not the current one."""

    def __init__(self, lib: Path, dyn: list[tuple[int, int, bool]], scalar_types: list[Any]):
        self._lib = lib
        self._dyn = dyn
        self._scalar_types = scalar_types
        self._dll: ctypes.CDLL | None = None
        self._typed = False
        self._ready: set[int] = set()  # device indices init() ran on
        self._lock = threading.Lock()

    def _open(self) -> None:
        with self._lock:
            if self._dll is not None:
                return
            import torch

            try:
                torch.cuda.init()
            except Exception as e:  # a CPU build of torch, no driver, no device
                raise LaunchError(f"cannot launch {self._lib}: CUDA is not available here ({e})") from e
            try:
                dll = ctypes.CDLL(str(self._lib), mode=os.RTLD_LOCAL)
            except OSError as e:
                raise LaunchError(f"loading {self._lib} failed: {e} (the kernel links the CUDA runtime of the nvcc "
                                  f"that built it; torch here has CUDA {torch.version.cuda})") from e
            dll.get_last_error.restype = ctypes.c_char_p
            self._call, self._init = dll.call, dll.init
            self._call.restype = self._init.restype = ctypes.c_int
            # The runtime the library links (torch's), found through the library's own dependencies.
            self._set_device = dll.cudaSetDevice
            self._set_device.restype = ctypes.c_int
            self._set_device.argtypes = [ctypes.c_int]
            self._dll = dll

    def _type_args(self, n_tensors: int) -> None:
        if not self._typed:
            self._call.argtypes = ([ctypes.c_void_p] * n_tensors + self._scalar_types
                                   + [ctypes.c_int32] * len(self._dyn) + [ctypes.c_void_p])
            self._typed = True

    def _bind_thread(self, index: int) -> None:
        """Make device index's primary context current on this thread. A launch of a TMA kernel encodes its
        tensor maps through the driver before any runtime call, and the driver needs a current context:
        a thread torch never switched devices on (autograd's device threads: torch skips the switch when
        the device asked for is the one the runtime reports, 0 on a new thread) has none. tvm_ffi's host
        code sets the device before each launch; here it is done once a thread."""
        if self._set_device(index) != 0:
            raise LaunchError(f"could not make CUDA device {index} current on this thread")
        bound = getattr(_thread, "devices", None)
        if bound is None:
            bound = _thread.devices = set()
        bound.add(index)

    def _device_of(self, tensors: Sequence[Any]) -> int:
        device = None
        for t in tensors:
            d = t.device
            if d.type != "cuda":
                raise LaunchError(f"a CUDA kernel was given a tensor on {d}")
            if device is None:
                device = d
            elif d != device:
                raise LaunchError(f"tensors on {device} and {d} in one launch")
        if device is None:
            raise LaunchError("a CUDA kernel launch needs at least one tensor")
        return device.index or 0

    def _ready_on(self, index: int) -> None:
        if index in self._ready:
            return
        import torch

        with self._lock, torch.cuda.device(index):
            if index not in self._ready:
                if self._init() != 0:
                    raise LaunchError(f"kernel init failed: {self._dll.get_last_error().decode(errors='replace')}")
                self._ready.add(index)

    def __call__(self, *given: Any) -> None:
        n = len(given) - len(self._scalar_types)
        self.bind(given[:n], n)(given[:n], (), given[n:])

    def bind(self, tensors: Sequence[Any], n_in: int | None = None) -> Callable[..., None]:
        import torch

        from tkjit.ffi import raw_stream

        index = self._device_of(tensors)  # (before opening: a CPU tensor is refused as such on any host)
        if self._dll is None:
            self._open()
        self._ready_on(index)
        self._type_args(len(tensors))
        dims, call, fail, stream_of = self._dims(tensors), self._call, self._fail, raw_stream()
        bind_thread, thread = self._bind_thread, _thread
        if n_in == 1 and len(tensors) == 2 and not self._scalar_types:  # one input, one output: unrolled

            def go(ins: Sequence[Any], outs: Sequence[Any], scalars: Sequence[Any] = ()) -> None:
                if index not in getattr(thread, "devices", ()):
                    bind_thread(index)
                rc = call(ins[0].data_ptr(), outs[0].data_ptr(), *dims, stream_of(index))
                if rc != 0:
                    fail(rc)
        else:

            def go(ins: Sequence[Any], outs: Sequence[Any], scalars: Sequence[Any] = ()) -> None:
                if index not in getattr(thread, "devices", ()):
                    bind_thread(index)
                rc = call(*[t.data_ptr() for t in ins], *[t.data_ptr() for t in outs], *scalars, *dims,
                          stream_of(index))
                if rc != 0:
                    fail(rc)

        if torch.cuda.device_count() <= 1:
            return go
        current, on = torch.cuda.current_device, torch.cuda.device

        def launch(ins: Sequence[Any], outs: Sequence[Any], scalars: Sequence[Any] = ()) -> None:
            if current() == index:
                go(ins, outs, scalars)
            else:
                with on(index):
                    go(ins, outs, scalars)

        return launch


def _load_cudart(lib: Path, meta: dict[str, Any]) -> CudartKernel:
    return CudartKernel(lib, _dynamic_of(meta), _scalar_types_of(meta))


def _dynamic_of(meta: dict[str, Any]) -> list[tuple[int, int, bool]]:
    # (arg, axis, is a stride): a runtime size is read off a tensor's shape, a runtime stride off its strides.
    return [(int(d["arg"]), int(d["stride"]), True) if "stride" in d else (int(d["arg"]), int(d["axis"]), False)
            for d in meta["abi"]["dynamic"]]


def _scalar_types_of(meta: dict[str, Any]) -> list[Any]:
    # The ctypes type of each scalar arg, in order (the C ABIs take them after the tensor pointers).
    return [_C_SCALARS[s["dtype"]] for s in meta["abi"].get("scalars", ())]


_C_SCALARS = {
    "float32": ctypes.c_float, "float64": ctypes.c_double, "int32": ctypes.c_int32, "int64": ctypes.c_int64,
    "bool": ctypes.c_bool,
}

LOADERS = {"tvm_ffi": _load_tvm_ffi, "ctypes": _load_ctypes, "cudart": _load_cudart}


def loader_for(arch: str) -> str:
    return launcher_of(arch)


def dynamic_args(tensors: Sequence[Any], runtime: Iterable[str]) -> list[dict[str, Any]]:
    """The C ABI's trailing int args as the spec implies them (the compiler records the same from the
    built function): each runtime size, at the first tensor axis that is exactly that size; then each
    strided tensor's leading strides, `{"name": stride_name(arg, axis), "arg": i, "stride": axis}`.

    tensors: the spec's TensorArgs, inputs then outputs (a plain dims tuple stands for a contiguous one).
    """
    names, out, seen = set(runtime), [], set()
    for arg, t in enumerate(tensors):
        for axis, d in enumerate(getattr(t, "dims", t)):
            if isinstance(d, str) and d in names and d not in seen:
                seen.add(d)
                out.append({"name": d, "arg": arg, "axis": axis})
    for arg, t in enumerate(tensors):
        for axis, name in enumerate(t.stride_names() if hasattr(t, "stride_names") else ()):
            out.append({"name": name, "arg": arg, "stride": axis})
    return out


def check_abi(
    meta: dict[str, Any], arch: str, tensors: Sequence[Any], runtime: Iterable[str],
    scalars: Sequence[dict[str, str]] = (),
) -> None:
    """Refuse an entry whose recorded ABI is not the one its spec and arch imply.

    tensors: the variant's tensor params (`KernelSpec.abi_tensors`); scalars: `KernelSpec.abi_scalars()`,
    recorded (for both loaders) only by kernels that take scalars.

    The loader trusts the ABI to place pointers and sizes: a wrong axis or loader kind would run
    the kernel on wrong sizes (unwritten rows, reads past the end) instead of failing.
    """
    abi = meta.get("abi")
    want_dynamic = dynamic_args(tensors, runtime)
    problem = None
    if not isinstance(abi, dict):
        problem = "it records no ABI"
    elif abi.get("loader") != loader_for(arch):
        problem = f"its loader is {abi.get('loader')!r}, {arch} kernels use {loader_for(arch)!r}"
    elif abi.get("scalars", []) != list(scalars):
        problem = f"its scalar args {abi.get('scalars', [])!r} are not the spec's {list(scalars)}"
    elif abi["loader"] in ("ctypes", "cudart") and abi.get("dynamic") != want_dynamic:
        problem = f"its runtime size/stride args {abi.get('dynamic')!r} are not the spec's {want_dynamic}"
    elif abi["loader"] == "tvm_ffi" and not isinstance(abi.get("tilelang_runtime", False), bool):
        problem = "its tilelang_runtime flag is not a bool"
    if problem:
        raise LaunchError(
            f"cache entry for {meta.get('kernel')!r} has a wrong ABI ({problem}); it was not loaded. "
            "Remove it with `tkjit clear` (or delete the entry dir) and it is rebuilt"
        )


def load(lib: Path, meta: dict[str, Any]) -> Callable[..., Any]:
    abi = meta.get("abi")
    kind = abi.get("loader") if isinstance(abi, dict) else None
    loader = LOADERS.get(kind) if isinstance(kind, str) else None
    if loader is None:
        raise LaunchError(f"artifact {lib} has unknown loader {kind!r}")
    return loader(lib, meta)
