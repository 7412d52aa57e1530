"""File locks between processes: one scheme for every lock tkjit takes on disk.

The scheme:
  - A lock is `fcntl.flock` on a regular file, opened through `tkjit.fs.open_private` (ours, not
    a link, never a FIFO) and created 0600 if absent. The kernel releases a flock when its holder
    dies, so a crashed process never leaves a stale lock behind; a lock that stays held means a
    live process.
  - Only a holder of the lock may unlink its file. A waiter re-checks after acquiring that the
    inode it locked is still the one at the path, and starts over if not: two processes never
    both believe they hold "the" lock on different inodes.
  - Lock files live in private dirs, so a dir, FIFO, socket or device at a lock path is damage,
    not anyone's data: it is removed and replaced (serialised by a flock on the parent dir). A
    link stays refused with an error.
  - Exclusive or shared (`shared=True`: many holders, e.g. processes using a cache entry, which
    keep an exclusive taker such as eviction out).

API: `file_lock` (a context manager, LockTimeout after `timeout` seconds), `acquire` / `try_lock`
(an fd to hold as long as needed, `release` it), `is_locked`, and `open_lock_file` (open a lock
file, repairing a wrong kind at its path, without locking it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from tkjit.errors import CacheError
from tkjit.fs import WrongKind, kind_name, open_private


class LockTimeout(CacheError):
    """A lock was not acquired within its timeout: a live process holds it."""


def _poll_flock(fd: int, op: int, timeout: float | None) -> bool:
    """flock with a timeout (None: forever, 0: one try); True when acquired."""
    if timeout is None:
        fcntl.flock(fd, op)
        return True
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        now = time.monotonic()
        if now >= deadline:
            return False
        # flock has no timed wait: poll, backing off so a long wait costs little CPU.
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, 0.05)


def _remove_wrong_kind(path: Path) -> None:
    """Remove a dir, FIFO, socket or device where a lock file belongs.

    Those live in our private dirs, so such a thing is damage, not anyone's data. Repairs are
    serialised by a flock on the parent dir and re-check the path under it: one repairer never
    removes the regular file that another process created (and may hold locked) after an
    earlier repair. Links are not removed here: they stay refused with an error.
    """
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
            return
        try:
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise CacheError(
                f"{path} should be a regular file, not a {kind_name(st.st_mode)}, and cannot be removed "
                f"({e.strerror}); remove it: `rm -r {path}`"
            ) from None
    finally:
        os.close(dfd)


def open_lock_file(path: Path, flags: int) -> int:
    """open_private for a lock file: a dir or FIFO in its place is removed, then one retry.

    flags as for os.open (add os.O_CREAT to create it 0600); the fd is not locked.
    """
    try:
        return open_private(path, flags)
    except WrongKind:
        _remove_wrong_kind(path)
    return open_private(path, flags)


def acquire(path: Path, *, shared: bool = False, timeout: float | None) -> int | None:
    """An fd holding a flock on path (created 0600 if absent), or None after timeout seconds.

    timeout None waits forever, 0 tries once. Close the fd (`release`) to unlock. A holder may
    unlink the file; then the inode we locked is no longer the one at the path and we start over.
    """
    op = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        fd = open_lock_file(path, os.O_RDWR | os.O_CREAT)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not _poll_flock(fd, op, left):
            os.close(fd)
            return None
        try:
            same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # unlinked under us: lock the new file


def try_lock(path: Path, *, shared: bool = False) -> int | None:
    """acquire with one try; None when another process holds the lock or it cannot be taken.

    A path that cannot be locked at all (unwritable dir, a link) reads as "held": callers use this
    to leave alone what might belong to a live process.
    """
    try:
        return acquire(path, shared=shared, timeout=0)
    except (OSError, CacheError):
        return None


def release(fd: int) -> None:
    """Unlock: close the fd acquire or try_lock returned."""
    os.close(fd)


@contextlib.contextmanager
def file_lock(path: Path, *, shared: bool = False, timeout: float | None = None, hint: str = "") -> Iterator[None]:
    """Hold the lock on path for the block; LockTimeout after timeout seconds (None: wait forever).

    hint is appended to the timeout message (what holds the lock, how to wait longer).
    """
    fd = acquire(path, shared=shared, timeout=timeout)
    if fd is None:
        raise LockTimeout(f"timed out after {timeout:g}s waiting for the lock {path}{hint}")
    try:
        yield
    finally:
        release(fd)


def is_locked(path: Path) -> bool:
    """True when some open file (of any process, this one included) holds a lock on path.

    False when there is no file at path; it is never created here.
    """
    try:
        fd = open_lock_file(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        return not _poll_flock(fd, fcntl.LOCK_EX, 0)
    finally:
        os.close(fd)
