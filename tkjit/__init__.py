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
    JitDisabledError,
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
    "TensorError", "CompileError", "JitDisabledError", "CacheError", "LaunchError", "TuningDBError", "__version__",
]


def _log_from_env() -> None:
    """TKJIT_LOG set at first import: one stderr handler on the `tkjit` logger at that level (never otherwise)."""
    import logging
    import os

    from tkjit import envs

    if not os.environ.get(envs.LOG.name):
        return
    try:
        level = envs.log_level()
    except ConfigError:
        return  # the tkjit command reports the typo; a library import must not fail on it
    logger = logging.getLogger("tkjit")
    logger.setLevel(level)
    if not any(getattr(h, "_tkjit_env", False) for h in logger.handlers):
        h = logging.StreamHandler()
        h._tkjit_env = True  # type: ignore[attr-defined]
        h.setFormatter(logging.Formatter("tkjit: %(levelname)s: %(message)s"))
        logger.addHandler(h)


_log_from_env()


def __getattr__(name: str):
    if name == "ops":  # lazy: tkjit.ops imports torch.autograd machinery
        import importlib

        return importlib.import_module("tkjit.ops")
    raise AttributeError(f"module 'tkjit' has no attribute {name!r}")
