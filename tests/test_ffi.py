"""tkjit.ffi: tvm_ffi kernels called through the tvm-ffi C ABI (ctypes), without the tvm_ffi package.

A small tvm-ffi module (tests/helpers/ffi_record.c, built here with the C compiler) records every
argument as it arrives; the C-ABI launcher must hand it exactly what `tvm_ffi`'s own call of the same
torch tensors does (the tensor object's DLTensor: data, device, dtype, shape, strides, byte_offset),
and compute with it.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "helpers"))

from common import toy_spec  # noqa: E402

from tkjit import ffi, loader  # noqa: E402
from tkjit.errors import LaunchError  # noqa: E402

HERE = Path(__file__).parent
SCALARS = [{"name": "k", "dtype": "int32"}, {"name": "a", "dtype": "float32"}, {"name": "flag", "dtype": "bool"}]
META = {"abi": {"loader": "tvm_ffi", "tilelang_runtime": False, "scalars": SCALARS}}


@pytest.fixture(scope="module")
def module_path(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    lib_path = ffi._lib_path()
    out = tmp_path_factory.mktemp("ffi") / "record.so"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", f"-I{lib_path.parent.parent / 'include'}",
                    str(HERE / "helpers" / "ffi_record.c"), "-o", str(out), f"-L{lib_path.parent}", "-ltvm_ffi"],
                   check=True)
    return out


REC = torch.zeros(256, dtype=torch.int64)


def _record(launch, x, y, *scalars) -> list[int]:
    """What the kernel saw: (num_args, result type, then per arg its type, padding, fields...)."""
    REC.zero_()
    launch(x, y, REC, *scalars)
    return REC.tolist()


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]


def _layouts(dtype):
    base = torch.arange(240).to(dtype)
    return [base[:12].view(3, 4), base.view(6, 40)[::2, 3:11], base.view(4, 6, 10).transpose(1, 2),
            base[:1].view(1, 1, 1), base[:0].view(0, 5), base[7:19]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_c_abi_passes_what_tvm_ffi_passes(module_path, dtype):
    """Field for field, the DLTensors (and scalars) the kernel receives are tvm_ffi's own for the same tensors."""
    ours = loader.load(module_path, META)
    ref = loader._load_tvm_ffi_py(module_path, META)
    for x in _layouts(dtype):
        y = torch.empty(2, 3, dtype=torch.int8)  # not float32: recorded, not computed
        for scalars in [(3, 2.5, True), (-(2**31), -0.0, False), (2**31 - 1, float("inf"), True)]:
            assert _record(ours, x, y, *scalars) == _record(ref, x, y, *scalars), (x.shape, x.stride(), scalars)


def test_the_dtype_codes_are_torchs_dlpack_codes(module_path):
    """What torch's own DLPack export writes, read back through tvm_ffi: ffi.dl_dtype must agree for every
    dtype a spec may name."""
    from tkjit.kernel import _TORCH_DTYPES, torch_dtype

    torch_dtype("float32")  # fills the table
    ref = loader._load_tvm_ffi_py(module_path, META)
    for dtype in _TORCH_DTYPES.values():
        got = _record(ref, torch.zeros(2, dtype=dtype), torch.empty(1), 1, 1.0, True)
        assert (got[8], got[9], got[10]) == (*ffi.dl_dtype(dtype), 1), dtype


def test_it_computes_and_bind_serves_a_signature(module_path):
    k = loader.load(module_path, META)
    x = torch.randn(5, 7)
    y = torch.empty(5, 7)
    k(x, y, torch.zeros(256, dtype=torch.int64), 4, 0.5, True)
    torch.testing.assert_close(y, x * 0.5 + 4)
    rec = torch.zeros(256, dtype=torch.int64)
    go = k.bind([x, y, rec], 1)
    for a in (1.0, -3.0):
        x2, y2 = torch.randn(5, 7), torch.empty(5, 7)
        go((x2,), (y2, rec), (2, a, False))
        torch.testing.assert_close(y2, x2 * a)


def test_kernel_errors_are_launch_errors_naming_kind_and_message(module_path):
    k = loader.load(module_path, META)
    x, y = torch.randn(2), torch.empty(2)
    with pytest.raises(LaunchError, match="RuntimeError: kernel main: k must be >= 0"):
        k(x, y, torch.zeros(256, dtype=torch.int64), -1, 1.0, True)
    twice = ffi.FfiKernel(ffi.load_function(module_path, "twice"), [])
    with pytest.raises(LaunchError, match="TypeError: twice takes two float32 tensors"):
        twice(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    twice(x, y)  # the error state does not stick
    torch.testing.assert_close(y, 2 * x)


def test_a_missing_function_or_file_is_a_launch_error(module_path, tmp_path):
    with pytest.raises(LaunchError, match="has no function 'nope'"):
        ffi.load_function(module_path, "nope")
    with pytest.raises(LaunchError, match="ModuleLoadFromFile"):
        ffi.load_function(tmp_path / "missing.so", "main")
    bad = tmp_path / "bad.so"
    bad.write_bytes(b"not an ELF file")
    with pytest.raises(LaunchError):
        ffi.load_function(bad, "main")


def test_threads_share_a_bound_launcher(module_path):
    twice = ffi.FfiKernel(ffi.load_function(module_path, "twice"), [])
    x0 = torch.randn(64)
    go = twice.bind([x0, torch.empty(64)], 1)
    errors = []

    def work(seed):
        try:
            for i in range(300):
                x = torch.full((64,), float(seed * 1000 + i))
                y = torch.empty(64)
                go((x,), (y,))
                assert torch.equal(y, 2 * x)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_a_kernel_object_over_the_c_abi(module_path):
    """A CompiledKernel whose launcher is an FfiKernel: its fast path binds it once per signature."""
    from tkjit.kernel import CompiledKernel
    from tkjit.spec import validate

    spec = toy_spec()
    validate(spec)
    k = CompiledKernel(spec, spec.canonical_shape({"n": 5}), {"block": 32}, "cpu", "0" * 40, "explicit", Path("."),
                       ffi.FfiKernel(ffi.load_function(module_path, "twice"), []))
    for n in (5, 5, 9, 5):
        x = torch.randn(n, 4)
        torch.testing.assert_close(k(x), 2 * x)
    assert len(k._plans) == 2


def test_loading_and_calling_imports_no_tvm_ffi_package(module_path):
    code = (
        "import sys, torch; from pathlib import Path; from tkjit import loader\n"
        f"k = loader.load(Path({str(module_path)!r}), {META!r})\n"
        "x = torch.randn(3); y = torch.empty(3)\n"
        "k(x, y, torch.zeros(256, dtype=torch.int64), 1, 2.0, True)\n"
        "assert torch.allclose(y, 2 * x + 1)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tvm_ffi', 'tilelang', 'tvm')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("bad", ["device", "dtype", "arity", "shape"])
def test_a_real_tilelang_artifact_checks_the_c_abi_args_as_tvm_ffis(cache_dir, bad):
    """topk_gate cross-compiled for sm_90a, loaded through the C ABI on this CPU host: its host code parses
    our args and refuses CPU tensors (and any other wrong argument) with the message tvm_ffi's call gets."""
    import json

    import tkjit

    k = tkjit.get("topk_gate", {"num_tokens": 1, "num_experts": 256, "k": 8}, arch="sm_90a")
    meta = json.loads((k.path / "manifest.json").read_text())["meta"]
    assert isinstance(k._launch, ffi.FfiKernel)
    x, y = torch.randn(1, 256), torch.empty(1, 8, dtype=torch.int64)
    args = {"device": (x, y), "dtype": (x.double(), y), "arity": (x, y, y), "shape": (torch.randn(1, 255), y)}[bad]
    with pytest.raises(RuntimeError) as ref:
        loader._load_tvm_ffi_py(k.path / meta["lib"], meta)(*args)
    with pytest.raises(LaunchError) as ours:
        k._launch(*args)
    assert str(ours.value) == f"kernel launch failed: RuntimeError: {ref.value}"
    assert {"device": "device_type mismatch", "dtype": "dtype mismatch", "arity": "num_args should be 2",
            "shape": "shape[1]"}[bad] in str(ours.value)


class _OnCuda:
    """A CPU tensor that says it is on cuda:1 (the CUDA launch path, run on this host)."""

    def __init__(self, t):
        self.t, self.device, self.shape, self.dtype = t, torch.device("cuda", 1), t.shape, t.dtype

    def stride(self, *a):
        return self.t.stride(*a)

    def dim(self):
        return self.t.dim()

    def data_ptr(self):
        return self.t.data_ptr()


def test_a_cuda_launch_runs_on_torchs_current_stream_and_restores_the_env_stream(module_path, monkeypatch):
    current = {"stream": 0x1234}
    monkeypatch.setattr(ffi, "raw_stream", lambda: lambda index: current["stream"] if index == 1 else -1)
    k = ffi.FfiKernel(ffi.load_function(module_path, "stream"), [])
    rec = torch.zeros(1, dtype=torch.int64)
    t = _OnCuda(rec)
    go = k.bind([t], 1)
    env = ffi.lib().TVMFFIEnvGetStream
    assert env(ffi.KDL_CUDA, 1) is None
    go((t,), ())
    assert rec.item() == 0x1234 and env(ffi.KDL_CUDA, 1) is None  # set for the call, then restored
    current["stream"] = 0  # the legacy default stream
    go((t,), ())
    assert rec.item() == 0 and env(ffi.KDL_CUDA, 1) is None
    prev = ctypes.c_void_p()
    ffi.lib().TVMFFIEnvSetStream(ffi.KDL_CUDA, 1, 0x99, ctypes.byref(prev))  # another library's stream
    try:
        current["stream"] = 0x5678
        go((t,), ())
        assert rec.item() == 0x5678 and env(ffi.KDL_CUDA, 1) == 0x99
    finally:
        ffi.lib().TVMFFIEnvSetStream(ffi.KDL_CUDA, 1, prev, None)
