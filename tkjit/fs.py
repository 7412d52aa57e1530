"""Private-filesystem primitives: the checks that keep a dir we dlopen from like ~/.ssh.

What the cache (and anything else that reads code or data back from disk) builds on:

  - `check_private`, `check_ancestors`: a path must be ours, not writable by group or others,
    of the expected kind (dir or regular file), and not a link; its parents must not let another
    user rename it away (ssh's StrictModes).
  - `mkdir_private`, `private_dir`, `make_parents`: dirs created 0700 whatever the umask.
  - `open_private`, `read_private`: open a regular file of ours without following links and
    without blocking on a FIFO or touching a device; a bounded read.
  - `sha256_file`, `check_elf`: what a file holds, read through `open_private`.
  - `fsync_dir`: make a rename in a dir durable.
  - `private_tempdir`: a private temp dir removed when the process exits.

Errors: `CacheError` for a path that is not private (the message says how to fix it), `WrongKind`
(a `CacheError`) for a dir/FIFO/socket/device where another kind belongs, `BadFile` for a file
whose content is not what it must be. Nothing here knows about cache entries or keys.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import os
import platform
import shutil
import stat
import tempfile
from pathlib import Path

from tkjit.errors import CacheError

# e_machine of the ELF header per host architecture (platform.machine(), lowercased).
_ELF_MACHINE = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183, "ppc64le": 21, "s390x": 22}


class WrongKind(CacheError):
    """A dir where a file belongs, or a FIFO, socket or device where either belongs (not a link)."""


class BadFile(ValueError):
    """A file whose content is not what it must be (too large, not a library for this host)."""


def _link_error(path: Path | str) -> CacheError:
    return CacheError(f"{path} is a symbolic link; the tkjit cache refuses links (remove it: `rm {path}`)")


def kind_name(mode: int) -> str:
    """'directory', 'FIFO', 'regular file'... for an st_mode: error messages say what was found."""
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISLNK, "symbolic link"), (stat.S_ISREG, "regular file")):
        if test(mode):
            return name
    return "special file"


def check_private(path: Path, *, is_dir: bool) -> None:
    """Refuse a path another user owns or can write: it could plant code we would dlopen."""
    st = os.lstat(path)  # FileNotFoundError propagates: callers treat it as "absent"
    _check_stat(path, st, is_dir)


def _check_stat(path: Path | str, st: os.stat_result, is_dir: bool) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise _link_error(path)
    if is_dir != stat.S_ISDIR(st.st_mode) or not (is_dir or stat.S_ISREG(st.st_mode)):
        raise WrongKind(
            f"{path} should be a {'directory' if is_dir else 'regular file'}, not a {kind_name(st.st_mode)}; "
            f"remove it: `rm -r {path}`"
        )
    if st.st_uid != os.getuid():
        raise CacheError(
            f"{path} is owned by uid {st.st_uid}, not you (uid {os.getuid()}); the tkjit cache "
            f"must be private: use your own TKJIT_CACHE_DIR or `chown -R {os.getuid()} {path}`"
        )
    if st.st_mode & 0o022:
        raise CacheError(
            f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"fix with `chmod go-w {path}`"
        )


def check_ancestors(path: Path) -> None:
    """Like ssh's StrictModes: a parent another user could rename our root out of is refused.

    Each existing parent must be owned by us or root, and writable by group/others only with the
    sticky bit (like /tmp).
    """
    for parent in Path(path).parents:
        try:
            st = os.stat(parent)
        except FileNotFoundError:
            continue
        if st.st_uid not in (0, os.getuid()):
            raise CacheError(
                f"the cache dir {path} is inside {parent}, owned by uid {st.st_uid}: that user could "
                "replace the cache; use a TKJIT_CACHE_DIR under a dir owned by you or root"
            )
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise CacheError(
                f"the cache dir {path} is inside {parent}, writable by group or others without the "
                f"sticky bit (mode {stat.S_IMODE(st.st_mode):o}): fix with `chmod go-w {parent}` or "
                "use another TKJIT_CACHE_DIR"
            )


def mkdir_private(path: Path) -> bool:
    """mkdir 0700 whatever the umask (which may leave it 0500, say); False if it already existed."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return False
    os.chmod(path, 0o700)
    return True


def private_dir(path: Path) -> Path:
    """path as a private dir: created 0700 if absent, checked (ours, not a link) either way."""
    mkdir_private(path)
    check_private(path, is_dir=True)
    return path


def make_parents(path: Path) -> None:
    """Create the missing dirs above path, private (0700) whatever the umask.

    os.makedirs would make them 0775 under umask 002, and check_ancestors then refuses the cache
    on every later run. Existing parents are left as they are (check_ancestors vets them).
    """
    missing = []
    for parent in path.parents:
        if os.path.lexists(parent):
            break
        missing.append(parent)
    for parent in reversed(missing):
        mkdir_private(parent)  # FileExistsError-safe: a concurrent run may create it too


def open_private(path: Path, flags: int = os.O_RDONLY) -> int:
    """Open a regular file of ours without following links; the fd is checked, not the path.

    The kind is checked before opening: opening a FIFO blocks until a writer comes (forever), and
    opening a device can have side effects. O_NONBLOCK covers a swap between the check and the
    open; it is cleared once the fd is known to be a regular file. With O_CREAT the file is
    created 0600 if absent.
    """
    try:
        _check_stat(path, os.lstat(path), False)
    except FileNotFoundError:
        if not flags & os.O_CREAT:
            raise
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a link swapped in since the check
            raise _link_error(path) from None
        if e.errno in (errno.EISDIR, errno.ENXIO):  # a dir, or a FIFO without a reader, swapped in
            raise WrongKind(f"{path} should be a regular file; remove it: `rm -r {path}`") from None
        raise
    try:
        _check_stat(path, os.fstat(fd), False)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_private(path: Path, limit: int) -> bytes:
    """The content of a private regular file; BadFile if it holds more than limit bytes.

    Reads at most limit + 1 bytes: a huge (or endless) file costs no more than a small one.
    """
    fd = open_private(path)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise BadFile(f"{path.name} is larger than {limit} bytes")
    return data


def sha256_file(path: Path) -> str:
    """Hex sha256 of a private regular file (opened as open_private does)."""
    h = hashlib.sha256()
    with os.fdopen(open_private(path), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_elf(path: Path) -> None:
    """A library must be an ELF shared object for this machine: catches artifacts from elsewhere.

    BadFile saying why not.
    """
    with os.fdopen(open_private(path), "rb") as f:
        head = f.read(20)
    if len(head) < 20 or head[:4] != b"\x7fELF":
        raise BadFile(f"{path.name} is not an ELF shared library")
    want = _ELF_MACHINE.get(platform.machine().lower())
    little = head[5] == 1
    machine = int.from_bytes(head[18:20], "little" if little else "big")
    etype = int.from_bytes(head[16:18], "little" if little else "big")
    if etype != 3:  # ET_DYN
        raise BadFile(f"{path.name} is an ELF of type {etype}, not a shared library")
    if want is not None and machine != want:
        raise BadFile(f"{path.name} is built for ELF machine {machine}, this host is {platform.machine()}")


def fsync_dir(path: Path) -> None:
    """fsync a dir: a rename into (or out of) it survives a crash only once its dir is synced."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_TEMP_DIRS: list[str] = []


def private_tempdir() -> Path:
    """A fresh temp dir (mkdtemp: 0700, unique) removed, with its contents, when the process exits.

    For builds that cannot be cached (read-only or full disk): the library in it is still dlopen'ed
    from a dir nobody else can write.
    """
    d = tempfile.mkdtemp(prefix="tkjit-")
    if not _TEMP_DIRS:
        atexit.register(lambda: [shutil.rmtree(p, ignore_errors=True) for p in _TEMP_DIRS])
    _TEMP_DIRS.append(d)
    return Path(d)
