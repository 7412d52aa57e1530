"""tkjit: JIT compilation, tuning and caching of TileLang kernels.

    k = tkjit.get("sinkhorn_fwd", {"num_tokens": 65536, "n": 4})
    y = k(x)

Importing tkjit imports neither TileLang nor Optuna: serving a cached kernel needs neither.
"""

from tkjit.api import get, reset
from tkjit.errors import (
    CacheError,
    CompileError,
    ConfigError,
    LaunchError,
    ShapeError,
    SpecError,
    TensorError,
    TkjitError,
    TuningDBError,
    UnknownKernelError,
)
from tkjit.registry import all_specs, get_spec, register
from tkjit.spec import Align, KernelSpec, Param, Runtime, Static, TensorArg, Tolerance
from tkjit.version import __version__

__all__ = [
    "get", "reset", "register", "get_spec", "all_specs", "Align", "KernelSpec", "Param", "Static", "Runtime",
    "TensorArg", "Tolerance", "TkjitError", "SpecError", "UnknownKernelError", "ShapeError", "ConfigError",
    "TensorError", "CompileError", "CacheError", "LaunchError", "TuningDBError", "__version__",
]


def __getattr__(name: str):
    if name == "ops":  # lazy: tkjit.ops imports torch.autograd machinery
        import importlib

        return importlib.import_module("tkjit.ops")
    raise AttributeError(f"module 'tkjit' has no attribute {name!r}")
