"""The tvm-ffi C ABI through ctypes: load a TileLang tvm_ffi executable and call its function, without
importing the `tvm_ffi` Python package (~100 ms of a fresh process's start).

A call is one `TVMFFIFunctionCall` on a prebuilt array of `TVMFFIAny` args pointing at `DLTensor`s.
The DLTensors of one signature (shapes, strides, dtypes, device) are built once (`FfiKernel.bind`);
a call writes only the data pointers (and scalars), sets the env stream to torch's current stream
as `tvm_ffi`'s own call does, and launches. The kernel's host code still checks every DLTensor it
is given (ndim, dtype, shape, strides, device) as it does under `tvm_ffi`.

Layouts (tvm/ffi/c_api.h, dlpack/dlpack.h, 64-bit):
  TVMFFIAny  {int32 type_index; uint32 zero_padding; union {int64, double, void*} value}   16 bytes
  DLTensor   {void* data; int32 device_type, device_id; int32 ndim; uint8 code, bits;
              uint16 lanes; int64* shape; int64* strides; uint64 byte_offset}               48 bytes
"""

from __future__ import annotations

import ctypes
import importlib.util
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tkjit.errors import LaunchError

# TVMFFITypeIndex values used here.
NONE, INT, BOOL, FLOAT, RAW_STR, DLTENSOR_PTR, STATIC_OBJECT_BEGIN = 0, 1, 2, 3, 8, 7, 64
KDL_CPU, KDL_CUDA = 1, 2
_ANY = struct.Struct("=iIQ")  # an Any holding a pointer / int bits
_ANY_F = struct.Struct("=iId")  # an Any holding a double
_DLTENSOR = struct.Struct("=QiiiBBHQQQ")
assert _ANY.size == 16 and _DLTENSOR.size == 48

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_globals: dict[str, int] = {}
_DTYPES: dict[Any, tuple[int, int]] = {}  # torch dtype -> (DLPack type code, bits)


def _dtype_table() -> None:
    import torch

    kdl_int, kdl_uint, kdl_float, kdl_bfloat, kdl_bool, kdl_e4m3fn, kdl_e5m2 = 0, 1, 2, 4, 6, 10, 12
    table = {
        torch.float32: (kdl_float, 32), torch.float16: (kdl_float, 16), torch.float64: (kdl_float, 64),
        torch.bfloat16: (kdl_bfloat, 16), torch.int64: (kdl_int, 64), torch.int32: (kdl_int, 32),
        torch.int16: (kdl_int, 16), torch.int8: (kdl_int, 8), torch.uint8: (kdl_uint, 8), torch.bool: (kdl_bool, 8),
        torch.float8_e4m3fn: (kdl_e4m3fn, 8), torch.float8_e5m2: (kdl_e5m2, 8),
    }
    _DTYPES.update(table)


def dl_dtype(dtype: Any) -> tuple[int, int]:
    """(DLPack type code, bits) of a torch dtype, the codes torch's own DLPack export writes."""
    if not _DTYPES:
        _dtype_table()
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise LaunchError(f"dtype {dtype} cannot be passed to a tvm_ffi kernel") from None


def _lib_path() -> Path:
    # find_spec on a top-level package locates it without executing tvm_ffi/__init__.py.
    spec = importlib.util.find_spec("tvm_ffi")
    if spec is None or not spec.submodule_search_locations:
        raise LaunchError("apache-tvm-ffi is not installed: its libtvm_ffi.so is needed to load CUDA kernels")
    return Path(next(iter(spec.submodule_search_locations))) / "lib" / "libtvm_ffi.so"


def lib() -> ctypes.CDLL:
    """libtvm_ffi.so, loaded once (RTLD_GLOBAL: TileLang's runtime library links against it)."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            # PyDLL keeps the GIL across a call: a launch is µs, and the per-signature arg buffers are then
            # never written by another thread while a call reads them (see FfiKernel._go's lock too).
            dll = ctypes.PyDLL(str(_lib_path()), mode=ctypes.RTLD_GLOBAL)
            vp, i32 = ctypes.c_void_p, ctypes.c_int32
            dll.TVMFFIFunctionCall.argtypes = [vp, vp, i32, vp]
            dll.TVMFFIFunctionCall.restype = ctypes.c_int
            dll.TVMFFIFunctionGetGlobal.argtypes = [vp, vp]
            dll.TVMFFIFunctionGetGlobal.restype = ctypes.c_int
            dll.TVMFFIObjectDecRef.argtypes = [vp]
            dll.TVMFFIObjectDecRef.restype = ctypes.c_int
            dll.TVMFFIErrorMoveFromRaised.argtypes = [vp]
            dll.TVMFFIErrorMoveFromRaised.restype = None
            dll.TVMFFIEnvSetStream.argtypes = [i32, i32, vp, vp]
            dll.TVMFFIEnvSetStream.restype = ctypes.c_int
            dll.TVMFFIEnvGetStream.argtypes = [i32, i32]
            dll.TVMFFIEnvGetStream.restype = vp
            _lib = dll
    return _lib


_rt_loaded = False


def load_runtime(tilelang_lib_dir: Callable[[], Path]) -> None:
    """libtvm_ffi.so, then TileLang's small libtvm_runtime.so (it registers the CUDA module loader)."""
    global _rt_loaded
    if _rt_loaded:
        return
    lib()
    with _lock:
        if not _rt_loaded:
            ctypes.CDLL(str(tilelang_lib_dir() / "libtvm_runtime.so"), mode=ctypes.RTLD_GLOBAL)
            _rt_loaded = True


def _raise_error(what: str) -> None:
    """The error a failed call left in TLS as a LaunchError naming its kind and message."""
    dll = lib()
    h = ctypes.c_void_p()
    dll.TVMFFIErrorMoveFromRaised(ctypes.byref(h))
    if not h.value:
        raise LaunchError(f"{what} failed (no error recorded)")
    try:
        # The ErrorCell follows the 24-byte object header: kind {data, size}, message {data, size}.
        kind_p, kind_n, msg_p, msg_n = (ctypes.c_uint64 * 4).from_address(h.value + 24)
        kind = ctypes.string_at(kind_p, kind_n).decode(errors="replace")
        msg = ctypes.string_at(msg_p, msg_n).decode(errors="replace")
    finally:
        dll.TVMFFIObjectDecRef(h)
    raise LaunchError(f"{what} failed: {kind}: {msg}")


def _global(name: str) -> int:
    h = _globals.get(name)
    if h is None:
        raw = name.encode()
        arr = (ctypes.c_uint64 * 2)(ctypes.cast(ctypes.c_char_p(raw), ctypes.c_void_p).value, len(raw))
        out = ctypes.c_void_p()
        if lib().TVMFFIFunctionGetGlobal(ctypes.addressof(arr), ctypes.byref(out)) != 0:
            _raise_error(f"looking up {name}")
        if not out.value:
            raise LaunchError(f"libtvm_ffi has no global function {name}")
        h = _globals[name] = out.value  # kept for the process's life
    return h


def _call_global(name: str, args: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """Call a global function on (type_index, value bits) args; the result's (type_index, value bits).
    An object result comes back owned by the caller."""
    buf = (ctypes.c_uint64 * (2 * len(args) + 2))()
    for i, (ti, v) in enumerate(args):
        _ANY.pack_into(buf, 16 * i, ti, 0, v)
    res = ctypes.addressof(buf) + 16 * len(args)
    if lib().TVMFFIFunctionCall(_global(name), ctypes.addressof(buf), len(args), res) != 0:
        _raise_error(name)
    return buf[2 * len(args)] & 0xFFFFFFFF, buf[2 * len(args) + 1]


class Function:
    """An owned tvm-ffi Function handle (and the module it came from, kept alive with it)."""

    def __init__(self, handle: int, module: int):
        self.handle = handle
        self.module = module

    def __del__(self) -> None:
        if _lib is not None:
            _lib.TVMFFIObjectDecRef(self.handle)
            _lib.TVMFFIObjectDecRef(self.module)


def load_function(path: Path, name: str) -> Function:
    """`name` of the module at `path` (the `tvm_ffi.load_module(path)[name]` of the Python package)."""
    raw = str(path).encode()
    ti, mod = _call_global("ffi.ModuleLoadFromFile", [(RAW_STR, ctypes.cast(ctypes.c_char_p(raw),
                                                                                 ctypes.c_void_p).value)])
    if ti < STATIC_OBJECT_BEGIN:
        raise LaunchError(f"loading {path} gave no module (type index {ti})")
    try:
        # Never unloaded (tvm_ffi.load_module's keep_module_alive): its functions may outlive our handles.
        _call_global("ffi.ModuleGlobalsAdd", [(ti, mod)])
        fname = name.encode()
        fti, fn = _call_global("ffi.ModuleGetFunction", [(ti, mod), (RAW_STR, ctypes.cast(
            ctypes.c_char_p(fname), ctypes.c_void_p).value), (BOOL, 0)])
    except BaseException:
        lib().TVMFFIObjectDecRef(mod)
        raise
    if fti < STATIC_OBJECT_BEGIN:
        lib().TVMFFIObjectDecRef(mod)
        raise LaunchError(f"{path} has no function {name!r}")
    return Function(fn, mod)


_SCALAR_TYPE = {"bool": BOOL, "int32": INT, "int64": INT, "float32": FLOAT, "float64": FLOAT}


def raw_stream() -> Callable[[int], int]:
    """device index -> torch's current CUDA stream there, as an int (0: the legacy default stream)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda index: torch.cuda.current_stream(index).cuda_stream


class FfiKernel:
    """A loaded tvm_ffi kernel function called through the C ABI.

    Called with the tensors (inputs then outputs) then the scalars; `bind(tensors)` gives a launcher
    specialised on those tensors' shapes, strides, dtypes and device, for `CompiledKernel`'s fast path."""

    def __init__(self, fn: Function, scalar_dtypes: Sequence[str]):
        self._fn = fn
        self._scalar_types = [_SCALAR_TYPE[d] for d in scalar_dtypes]
        self._bound: dict[tuple, Callable[..., None]] = {}

    def __call__(self, *given: Any) -> None:
        n = len(given) - len(self._scalar_types)
        tensors = given[:n]
        sig = tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors)
        go = self._bound.get(sig)
        if go is None:
            go = self.bind(tensors)
            if len(self._bound) >= 64:
                self._bound.clear()
            self._bound[sig] = go
        go(tensors, (), given[n:])

    def bind(self, tensors: Sequence[Any], n_in: int | None = None) -> Callable[..., None]:
        """launch(inputs, outputs, scalars=()) for tensors like these (inputs then outputs, the first n_in
        of them inputs; all by default): same shapes, strides, dtypes and device. Only the data pointers
        (and scalars) are read at each call."""
        dll = lib()
        n_t, n_s = len(tensors), len(self._scalar_types)
        n_args = n_t + n_s
        # One buffer: the Any args, the DLTensors, the shapes and strides, the result Any, a stream slot.
        dims_off = 16 * n_args + 48 * n_t
        ndims = [t.dim() for t in tensors]
        res_off = dims_off + 16 * sum(ndims)
        prev_off = res_off + 16
        words = (ctypes.c_uint64 * ((prev_off + 8) // 8))()
        base = ctypes.addressof(words)
        device = None
        off = dims_off
        for i, t in enumerate(tensors):
            d = t.device
            if device is None:
                device = d
            elif d != device:
                raise LaunchError(f"tensors on {device} and {d} in one launch")
            code, bits = dl_dtype(t.dtype)
            nd = ndims[i]
            shape_at, stride_at = base + off, base + off + 8 * nd
            for ax in range(nd):
                words[off // 8 + ax] = t.shape[ax]
                words[off // 8 + nd + ax] = t.stride(ax) & 0xFFFFFFFFFFFFFFFF
            off += 16 * nd
            dl_at = 16 * n_args + 48 * i
            dev_type = KDL_CUDA if d.type == "cuda" else KDL_CPU
            if d.type not in ("cuda", "cpu"):
                raise LaunchError(f"tensors on {d} cannot be passed to a tvm_ffi kernel")
            _DLTENSOR.pack_into(words, dl_at, 0, dev_type, d.index or 0, nd, code, bits, 1,
                                shape_at if nd else 0, stride_at if nd else 0, 0)
            _ANY.pack_into(words, 16 * i, DLTENSOR_PTR, 0, base + dl_at)
        data_idx = [(16 * n_args + 48 * i) // 8 for i in range(n_t)]
        n_in = n_t if n_in is None else n_in
        in_idx, out_idx = data_idx[:n_in], data_idx[n_in:]
        scalar_slots = [(16 * (n_t + j), ti) for j, ti in enumerate(self._scalar_types)]
        # The call's own args never change: ctypes objects made once, passed without argtypes conversion
        # (a raw function pointer, not the typed one `lib()` set up; ~0.6 us less per call).
        call = dll["TVMFFIFunctionCall"]
        call.restype = ctypes.c_int
        set_stream = dll["TVMFFIEnvSetStream"]
        set_stream.restype = ctypes.c_int
        vp, i32 = ctypes.c_void_p, ctypes.c_int32
        c_fn, c_args, c_n, c_res = vp(self._fn.handle), vp(base), i32(n_args), vp(base + res_off)
        res_w, prev_w = res_off // 8, prev_off // 8
        cuda = device is not None and device.type == "cuda"
        dev_index = (device.index or 0) if cuda else 0
        c_cuda, c_dev, c_prev = i32(KDL_CUDA), i32(dev_index), vp(base + prev_off)
        stream_of = raw_stream() if cuda else None
        streams: dict[int, ctypes.c_void_p] = {}  # stream int -> its ctypes object (a process has a few)
        lock = threading.Lock()
        keep = (self._fn, words)  # the function and the buffer live as long as the launcher

        def fail_or_release(rc: int) -> None:
            if rc != 0:
                _raise_error("kernel launch")
            if words[res_w] & 0xFFFFFFFF >= STATIC_OBJECT_BEGIN:  # an object result: not ours to keep
                dll.TVMFFIObjectDecRef(words[res_w + 1])

        def run() -> int:  # with the lock held and the args written
            words[res_w] = 0  # result: None (the callee requires it)
            if not cuda:
                return call(c_fn, c_args, c_n, c_res)
            # As tvm_ffi's own call: the env stream is torch's current stream for the call, then restored.
            stream = stream_of(dev_index)
            c_stream = streams.get(stream)
            if c_stream is None:
                c_stream = streams[stream] = vp(stream)
            words[prev_w] = 0
            if set_stream(c_cuda, c_dev, c_stream, c_prev) != 0:
                _raise_error("setting the CUDA stream")
            rc = call(c_fn, c_args, c_n, c_res)
            prev = words[prev_w]
            if prev != stream:
                set_stream(c_cuda, c_dev, vp(prev), None)
            return rc

        if len(in_idx) == 1 and len(out_idx) == 1 and not scalar_slots:  # the common form, without loops
            (x_w,), (y_w,) = in_idx, out_idx

            def launch(ins: Sequence[Any], outs: Sequence[Any], scalars: Sequence[Any] = ()) -> None:
                with lock:  # the buffer is this signature's: one call at a time writes and reads it
                    words[x_w] = ins[0].data_ptr()
                    words[y_w] = outs[0].data_ptr()
                    rc = run()
                    if rc != 0 or words[res_w]:
                        fail_or_release(rc)
        else:
            def launch(ins: Sequence[Any], outs: Sequence[Any], scalars: Sequence[Any] = ()) -> None:
                with lock:
                    for i, t in zip(in_idx, ins):
                        words[i] = t.data_ptr()
                    for i, t in zip(out_idx, outs):
                        words[i] = t.data_ptr()
                    for (at, ti), v in zip(scalar_slots, scalars):
                        if ti == FLOAT:
                            _ANY_F.pack_into(words, at, FLOAT, 0, v)
                        else:
                            _ANY.pack_into(words, at, ti, 0, int(v) & 0xFFFFFFFFFFFFFFFF)
                    rc = run()
                    if rc != 0 or words[res_w]:
                        fail_or_release(rc)

        launch._keep = keep  # type: ignore[attr-defined]
        return launch
