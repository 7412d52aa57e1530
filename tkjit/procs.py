"""Processes: how a helper (compile pool, bench worker) ended, helpers dying with the parent, this one's age."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time

_PR_SET_PDEATHSIG = 1


def exit_status(code: int | None) -> str:
    """A process's exit code in words: 'SIGSEGV', 'exit code 3'."""
    if code is None:
        return "no exit code"
    if code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
        return f"signal {-code}"
    return f"exit code {code}"


def die_with_parent(parent: int) -> None:
    """Call first thing in a child: on Linux the kernel SIGKILLs it when `parent` dies, so a killed
    CLI or tuner leaves no orphan compiling or benchmarking to completion. The signal comes when
    the *thread* that started the child exits: start helper processes from a long-lived thread."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc, to the kernel's clock tick); None elsewhere. What a
    CLI command spends before its own clock starts (the interpreter, imports) is this at that moment."""
    try:
        with open("/proc/self/stat", "rb") as f:  # field 22, starttime: clock ticks after boot
            start_ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
