"""Every environment variable tkjit reads, in one registry (after tilelang/env.py).

Values are read at call time, not import time, so tests and tools can set them per process.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

from tkjit.errors import ConfigError


class EnvVar(NamedTuple):
    name: str
    default: str | None
    doc: str

    def get(self) -> str | None:
        value = os.environ.get(self.name)
        return self.default if value in (None, "") else value


CACHE_DIR = EnvVar("TKJIT_CACHE_DIR", None, "cache root (default: platformdirs user cache dir)")
ARCH = EnvVar("TKJIT_ARCH", None, "GPU arch to compile for, e.g. sm_90a (default: the current GPU)")
JOBS = EnvVar("TKJIT_JOBS", None, "parallel compile processes (default: number of cores)")
LOCK_TIMEOUT = EnvVar("TKJIT_LOCK_TIMEOUT", "900", "seconds to wait for another process's compile")
CACHE_MAX_BYTES = EnvVar("TKJIT_CACHE_MAX_BYTES", None, "size cap of the cache; LRU entries evicted")
NVCC = EnvVar("TKJIT_NVCC", None, "nvcc to use and key on (default: CUDA_HOME/bin/nvcc or PATH)")
NO_TUNED_DB = EnvVar("TKJIT_NO_TUNED_DB", "0", "1: ignore tuned databases, serve heuristic defaults")
GPU_NAME = EnvVar("TKJIT_GPU_NAME", None, "GPU model for tuning-DB lookup (default: the current GPU)")
NUM_SMS = EnvVar(
    "TKJIT_NUM_SMS", None,
    "SM count of the GPUs the kernels will run on, for persistent grids that must fit them (default: the "
    "current GPU's). Set it when cross-compiling for a fleet of smaller GPUs of the arch (an H20: 78)",
)
TUNING_DB = EnvVar("TKJIT_TUNING_DB", None, "shipped tuning DB directory (default: tkjit/tuning_db_data, package data)")
LOG = EnvVar(
    "TKJIT_LOG", "warning",
    "log level of the `tkjit` logger: debug (key material, entry paths; errors with tracebacks), info (one line "
    "per compile, per first disk hit, per tuned-DB choice), warning, error. The tkjit command logs to stderr at "
    "this level; a library user setting it before `import tkjit` gets one stderr handler at that level "
    "(unset: tkjit configures no handler)",
)
PRINT_CONFIGS = EnvVar("TKJIT_PRINT_CONFIGS", "0", "1: print (stderr) the config each new kernel shape gets, once")
DISABLE_JIT = EnvVar(
    "TKJIT_DISABLE_JIT", "0",
    "1: serve only cached kernels; a miss raises JitDisabledError (`tkjit compile` refuses to run)",
)

CHECK_INDICES = EnvVar(
    "TKJIT_CHECK_INDICES", "0",
    "1: ops taking index tensors (MoE routing maps, expert and group ids) check every entry on the host before "
    "launching and raise TensorError naming the first bad one (one device sync per call). Unset, the kernels "
    "still never access memory out of bounds: an out-of-range entry is treated as -1 (skipped)",
)

EXACT_MATH = EnvVar(
    "TKJIT_EXACT_MATH", "0",
    "1: kernels whose fastest configs trade the last bits for speed (fast-math exp, reciprocal-multiply "
    "instead of divide: sinkhorn_fwd, sinkhorn_bwd) serve their IEEE variant instead, the served config "
    "with the spec's `exact` overrides. Read when a kernel is first resolved in a process",
)

LAUNCHER = EnvVar(
    "TKJIT_LAUNCHER", "tvm_ffi",
    "how CUDA kernels are built and launched: tvm_ffi (TileLang's host function, called through the tvm-ffi C "
    "ABI) or cudart (TileLang's C launcher compiled beside the kernel: one ctypes call into cudaLaunchKernelEx; "
    "no tvm-ffi runtime). Part of the cache key",
)
LAUNCHERS = ("tvm_ffi", "cudart")

REGISTRY: tuple[EnvVar, ...] = (
    CACHE_DIR, ARCH, JOBS, LOCK_TIMEOUT, CACHE_MAX_BYTES, NVCC, NO_TUNED_DB, GPU_NAME, NUM_SMS, TUNING_DB, LOG,
    PRINT_CONFIGS, DISABLE_JIT, CHECK_INDICES, EXACT_MATH, LAUNCHER,
)

_LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def flag(var: EnvVar) -> bool:
    return (var.get() or "").lower() in ("1", "true", "yes", "on")


def count(var: EnvVar, expected: str) -> int | None:
    """An env var holding a count in [1, 4096]; None when unset. Anything else is an error naming the
    variable, its value and what was `expected` (e.g. "the GPU's SM count, e.g. 132")."""
    text = var.get()
    if not text:
        return None
    try:
        n = int(text.strip())
    except ValueError:
        n = 0
    if not 1 <= n <= 4096:
        raise ConfigError(f"{var.name}={text!r} is not valid: expected {expected}")
    return n


def launcher() -> str:
    """The CUDA launcher TKJIT_LAUNCHER names (one of LAUNCHERS); a typo is an error."""
    text = (LAUNCHER.get() or LAUNCHER.default or "").strip().lower()
    if text not in LAUNCHERS:
        raise ConfigError(f"{LAUNCHER.name}={LAUNCHER.get()!r} is not a launcher: use one of {', '.join(LAUNCHERS)}")
    return text


def log_level() -> int:
    """The `logging` level TKJIT_LOG names; a typo is an error, not silently the default."""
    text = LOG.get() or "warning"
    level = _LOG_LEVELS.get(text.strip().lower())
    if level is None:
        raise ConfigError(f"{LOG.name}={text!r} is not a log level: use one of {', '.join(_LOG_LEVELS)}")
    return level
