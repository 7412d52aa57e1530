"""Exceptions: every user-facing failure is one of these, with a message naming the problem."""


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
    """A config outside the space or rejected by the spec's constraints."""


class TensorError(TkjitError, ValueError):
    """A tensor passed to a kernel has the wrong dtype, shape, device or layout."""


class CompileError(TkjitError):
    """TileLang or nvcc failed to build a variant."""


class CacheError(TkjitError):
    """The on-disk cache cannot be used (permissions, ownership, lock timeout)."""


class LaunchError(TkjitError, RuntimeError):
    """The kernel launch reported an error."""


class TuningDBError(TkjitError, ValueError):
    """A tuning database file is malformed."""
