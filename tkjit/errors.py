"""Exceptions: every user-facing failure is one of these, with a message naming the problem."""

from __future__ import annotations

import reprlib
from typing import Any

# Bounded repr for messages: a user value may be megabytes long or nested 100000 deep.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 60, 60, 60


def brief(value: Any) -> str:
    """repr() of a user value for an error message: short, and never itself an error.

    Ints too long to print (Python refuses str() past 4300 digits) show their size instead.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<int of {value.bit_length()} bits>"
    try:
        return _REPR.repr(value)
    except Exception:  # a huge int inside a container, or a __repr__ that raises
        return f"<{type(value).__name__}>"


class TkjitError(Exception):
    """Base of all tkjit errors."""


class SpecError(TkjitError):
    """A kernel spec is malformed (raised at registration)."""


class UnknownKernelError(TkjitError, KeyError):
    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class ShapeError(TkjitError, ValueError):
    """Missing, extra or out-of-domain shape params."""


class ConfigError(TkjitError, ValueError):
    """A config outside the space or rejected by the spec's constraints; a bad setting (env var, size)."""


class UsageError(TkjitError, ValueError):
    """A command-line argument the `tkjit` command cannot read (it exits 2, like argparse)."""


class TensorError(TkjitError, ValueError):
    """A tensor passed to a kernel has the wrong dtype, shape, device or layout."""


class CompileError(TkjitError):
    """TileLang or nvcc failed to build a variant."""


class JitDisabledError(CompileError):
    """TKJIT_DISABLE_JIT=1 and the variant is not in the cache."""


class CacheError(TkjitError):
    """The on-disk cache cannot be used (permissions, ownership, lock timeout)."""


class BundleError(TkjitError):
    """A bundle cannot be exported, or is malformed or tampered with (then nothing of it is installed)."""


class LaunchError(TkjitError, RuntimeError):
    """The kernel launch reported an error."""


class TuningDBError(TkjitError, ValueError):
    """A tuning database file is malformed."""
