"""The on-disk cache: private dirs, per-key locks, atomic publish, verified reads, LRU size cap.

Layout under the root (one version dir, so a new layout never reads an old one):

    v1/entries/<key>/        a published entry: kernel.so, kernel source, manifest.json
    v1/entries/<key>.used    mtime = last use (LRU); a process that uses the entry holds a shared
                             flock on it for its lifetime, so eviction skips entries in use
    v1/staging/<key>.*       entries being built (renamed into entries/ when complete), and
                             entries being removed (renamed out first, deleted after)
    v1/locks/<key>.lock      per-key build lock (flock: released by the kernel when a process dies)
    v1/quarantine/           entries that failed verification, kept for inspection (newest few)
    v1/tuned/                the user's tuning DB and Optuna journals

The cache holds shared libraries that get dlopen'ed, so it is treated like ~/.ssh: every dir and
file must belong to this user and not be writable by group or others, links are refused, and
every file is checked against the manifest's size and sha256, and the manifest's meta against
what was asked for (kernel, shape, config, arch, toolchain), before anything is loaded. Nothing
read from disk is unpickled or evaluated: manifests are JSON.

Locks are `fcntl.flock` on files that are only ever unlinked by a holder of the lock; a waiter
re-checks after acquiring that the file it locked is still the one at the path.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tkjit import envs
from tkjit.errors import CacheError

LAYOUT = "v1"
MANIFEST = "manifest.json"
_KEY_RE = re.compile(r"^[0-9a-f]{40}$")
_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_MAX_MANIFEST = 1 << 20
QUARANTINE_KEEP = 16
# Meta fields that define the binary: a manifest whose meta disagrees is for another variant.
KEY_FIELDS = ("kernel", "shape", "config", "arch", "toolchain", "spec_source")
_ELF_MACHINE = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183, "ppc64le": 21, "s390x": 22}
DISK_ERRNOS = frozenset(
    {errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EFBIG, errno.EMLINK}
)


class CorruptEntry(Exception):
    """An entry that must not be loaded; the message says why."""


class PublishFailed(OSError):
    """The variant was built but could not be published (read-only or full disk).

    `entry` is an unpublished copy in a private temp dir (or None if even that failed), so the
    caller can serve it without compiling again.
    """

    def __init__(self, err: OSError, entry: Entry | None) -> None:
        super().__init__(err.errno, f"cannot publish to the cache: {err}")
        self.entry = entry


def cache_root() -> Path:
    env = envs.CACHE_DIR.get()
    if env:
        return Path(env).expanduser().absolute()
    import platformdirs

    return Path(platformdirs.user_cache_dir("tkjit", appauthor=False))


def check_private(path: Path, *, is_dir: bool) -> None:
    """Refuse a path another user owns or can write: it could plant code we would dlopen."""
    st = os.lstat(path)  # FileNotFoundError propagates: callers treat it as "absent"
    _check_stat(path, st, is_dir)


def _check_stat(path: Path | str, st: os.stat_result, is_dir: bool) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise CacheError(f"{path} is a symbolic link; the tkjit cache refuses links (remove it: `rm {path}`)")
    if is_dir != stat.S_ISDIR(st.st_mode) or not (is_dir or stat.S_ISREG(st.st_mode)):
        raise CacheError(f"{path} should be a {'directory' if is_dir else 'regular file'}; remove it")
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


def _private_dir(path: Path) -> Path:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    check_private(path, is_dir=True)
    return path


def _open_private(path: Path, flags: int = os.O_RDONLY) -> int:
    """Open a regular file of ours without following links; the fd is checked, not the path."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        _check_stat(path, os.fstat(fd), False)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_private(path: Path, limit: int) -> bytes:
    try:
        fd = _open_private(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CacheError(f"{path} is a symbolic link; the tkjit cache refuses links (remove it)") from None
        raise
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CorruptEntry(f"{path.name} is larger than {limit} bytes")
    return data


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with os.fdopen(_open_private(path), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _json_norm(v: Any) -> Any:
    return json.loads(json.dumps(v, sort_keys=True))


def _check_elf(path: Path) -> None:
    """A library must be an ELF shared object for this machine: catches artifacts from elsewhere."""
    with os.fdopen(_open_private(path), "rb") as f:
        head = f.read(20)
    if len(head) < 20 or head[:4] != b"\x7fELF":
        raise CorruptEntry(f"{path.name} is not an ELF shared library")
    want = _ELF_MACHINE.get(platform.machine().lower())
    little = head[5] == 1
    machine = int.from_bytes(head[18:20], "little" if little else "big")
    etype = int.from_bytes(head[16:18], "little" if little else "big")
    if etype != 3:  # ET_DYN
        raise CorruptEntry(f"{path.name} is an ELF of type {etype}, not a shared library")
    if want is not None and machine != want:
        raise CorruptEntry(f"{path.name} is built for ELF machine {machine}, this host is {platform.machine()}")


# -- flock helpers -----------------------------------------------------------------------------


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
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, 0.05)


def _lock_file(path: Path, op: int, timeout: float | None) -> int | None:
    """An fd holding flock `op` on path (created 0600 if absent), or None on timeout.

    A holder may unlink the file; then the inode we locked is no longer the one at the path and
    we start over, so two processes never believe they hold "the" lock on different inodes.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            fd = _open_private(path, os.O_RDWR | os.O_CREAT)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CacheError(f"{path} is a symbolic link; the tkjit cache refuses links (remove it)") from None
            raise
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


def _env_number(var: envs.EnvVar, *, allow_suffix: bool = False) -> float | None:
    text = var.get()
    if text is None:
        return None
    t = text.strip().lower()
    mult = 1
    if allow_suffix:
        units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
        t = t.removesuffix("ib").removesuffix("b")
        if t[-1:] in units:
            t, mult = t[:-1], units[t[-1:]]
    try:
        v = float(t) * mult
    except ValueError:
        v = float("nan")
    if not (v >= 0 and v != float("inf")):
        example = "10G, 500M or a number of bytes" if allow_suffix else "a number of seconds, e.g. 900"
        raise CacheError(f"{var.name}={text!r} is not valid: expected {example}")
    return v


def lock_timeout() -> float:
    v = _env_number(envs.LOCK_TIMEOUT)
    return 900.0 if v is None else v


def max_bytes_from_env() -> int | None:
    v = _env_number(envs.CACHE_MAX_BYTES, allow_suffix=True)
    return None if v is None else int(v)


# Entries this process uses: key path -> fd holding a shared flock on <key>.used (process lifetime).
_PINS: dict[str, int] = {}
_pins_lock = threading.Lock()
_TEMP_DIRS: list[str] = []


def _private_tempdir() -> Path:
    d = tempfile.mkdtemp(prefix="tkjit-")
    if not _TEMP_DIRS:
        atexit.register(lambda: [shutil.rmtree(p, ignore_errors=True) for p in _TEMP_DIRS])
    _TEMP_DIRS.append(d)
    return Path(d)


@dataclass
class Entry:
    key: str
    path: Path
    manifest: dict[str, Any]

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest["meta"]

    def file(self, name: str) -> Path:
        if name not in self.manifest.get("files", {}) and self.manifest.get("files"):
            raise CacheError(f"entry {self.key} has no file {name!r}")
        return self.path / name


class Cache:
    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root).absolute() if root is not None else cache_root()
        self._ready = False

    # -- dirs ---------------------------------------------------------------------------
    @property
    def base(self) -> Path:
        return self.root / LAYOUT

    def _dir(self, name: str) -> Path:
        return self.base / name

    def ensure(self) -> None:
        if self._ready:
            return
        check_ancestors(self.root)
        try:
            os.makedirs(self.root.parent, exist_ok=True)
        except FileExistsError:
            pass
        _private_dir(self.root)
        _private_dir(self.base)
        for sub in ("entries", "staging", "locks", "quarantine", "tuned"):
            _private_dir(self._dir(sub))
        self._ready = True

    @staticmethod
    def _check_key(key: str) -> str:
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):  # hex digests only ever become paths
            raise CacheError(f"malformed cache key {key!r}")
        return key

    def entry_path(self, key: str) -> Path:
        return self._dir("entries") / self._check_key(key)

    def _used_path(self, key: str) -> Path:
        return self._dir("entries") / f"{self._check_key(key)}.used"

    def _lock_path(self, key: str) -> Path:
        return self._dir("locks") / f"{self._check_key(key)}.lock"

    # -- reads --------------------------------------------------------------------------
    def verify(self, key: str, expect: dict[str, Any] | None = None) -> Entry:
        """The entry if it is complete, intact and what was asked for (`expect`: meta fields).

        CorruptEntry if not, FileNotFoundError if absent, CacheError if it is not private.
        """
        path = self.entry_path(key)
        check_private(path, is_dir=True)
        ino = os.lstat(path).st_ino
        try:
            return self._verify(key, path, expect)
        except CorruptEntry:
            try:
                still = os.lstat(path).st_ino == ino
            except FileNotFoundError:
                still = False
            if not still:  # removed or replaced while we read it: not corrupt, just gone
                raise FileNotFoundError(f"entry {key} vanished while being verified") from None
            raise

    def _verify(self, key: str, path: Path, expect: dict[str, Any] | None) -> Entry:
        try:
            _check_kind(path / MANIFEST)
            raw = _read_private(path / MANIFEST, _MAX_MANIFEST)
        except FileNotFoundError:
            raise CorruptEntry("manifest missing") from None
        try:
            manifest = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise CorruptEntry(f"manifest is not JSON: {e}") from None
        if not isinstance(manifest, dict) or manifest.get("key") != key:
            raise CorruptEntry("manifest does not name this key")
        files = manifest.get("files")
        if not isinstance(files, dict) or not files:
            raise CorruptEntry("manifest lists no files")
        meta = manifest.get("meta")
        if not isinstance(meta, dict):
            raise CorruptEntry("manifest has no meta")
        try:
            present = set(os.listdir(path))
        except FileNotFoundError:
            raise CorruptEntry("entry vanished") from None
        extra = present - set(files) - {MANIFEST}
        if extra:
            raise CorruptEntry(f"entry holds files the manifest does not list: {sorted(extra)}")
        for name, info in files.items():
            if not isinstance(name, str) or not _FILE_RE.fullmatch(name) or name == MANIFEST:
                raise CorruptEntry(f"manifest names a bad file {name!r}")
            if not isinstance(info, dict):
                raise CorruptEntry(f"manifest entry for {name} is not an object")
            fpath = path / name
            try:
                _check_kind(fpath)
                check_private(fpath, is_dir=False)
                size = os.lstat(fpath).st_size
            except FileNotFoundError:
                raise CorruptEntry(f"{name} is missing") from None
            if size != info.get("size"):
                raise CorruptEntry(f"{name} has {size} bytes, manifest says {info.get('size')}")
            if sha256_file(fpath) != info.get("sha256"):
                raise CorruptEntry(f"{name} does not match its sha256")
        lib = meta.get("lib")
        if lib is not None:
            if lib not in files:
                raise CorruptEntry(f"manifest's library {lib!r} is not one of its verified files")
            _check_elf(path / lib)
        for k, want in (expect or {}).items():
            got = meta.get(k)
            if got != _json_norm(want):
                raise CorruptEntry(
                    f"manifest meta {k}={got!r} but {want!r} was asked for (an artifact for another variant)"
                )
        return Entry(key, path, manifest)

    def lookup(self, key: str, expect: dict[str, Any] | None = None) -> Entry | None:
        """A verified entry, or None; a corrupt one is moved aside (under the key's lock)."""
        self.ensure()
        try:
            return self.verify(key, expect)
        except FileNotFoundError:
            return None
        except CorruptEntry:
            pass
        with self.lock(key):
            return self._lookup_locked(key, expect)

    def _lookup_locked(self, key: str, expect: dict[str, Any] | None) -> Entry | None:
        try:
            return self.verify(key, expect)
        except FileNotFoundError:
            return None
        except CorruptEntry as e:  # still corrupt now that nobody can be publishing it
            self.quarantine(key, str(e))
            return None

    # -- use marks ----------------------------------------------------------------------
    def pin(self, key: str) -> bool:
        """Mark key in use by this process until it exits (a shared flock on <key>.used).

        Eviction skips pinned entries. Best effort: False where the cache is not writable.
        """
        path = str(self._used_path(key))
        with _pins_lock:
            if path in _PINS:
                return True
            try:
                self.ensure()
                fd = _lock_file(Path(path), fcntl.LOCK_SH, lock_timeout())
            except OSError:
                return False
            if fd is None:
                return False
            _PINS[path] = fd
            return True

    def unpin(self, key: str) -> None:
        with _pins_lock:
            fd = _PINS.pop(str(self._used_path(key)), None)
        if fd is not None:
            os.close(fd)

    def in_use(self, key: str) -> bool:
        """True when some process (this one included) has the entry pinned."""
        p = self._used_path(key)
        if str(p) in _PINS:
            return True
        try:
            fd = _open_private(p, os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            return not _poll_flock(fd, fcntl.LOCK_EX, 0)
        finally:
            os.close(fd)

    def touch(self, key: str) -> None:
        """Record a use (the LRU clock): the .used file's mtime."""
        p = self._used_path(key)
        fd = _PINS.get(str(p))
        with contextlib.suppress(OSError, CacheError):
            if fd is not None:
                os.utime(fd)
                return
            fd = _open_private(p, os.O_WRONLY | os.O_CREAT)
            try:
                os.utime(fd)
            finally:
                os.close(fd)

    # -- writes -------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, key: str, timeout: float | None = None) -> Iterator[None]:
        """The key's build lock; CacheError after TKJIT_LOCK_TIMEOUT seconds."""
        self.ensure()
        timeout = lock_timeout() if timeout is None else timeout
        path = self._lock_path(key)
        fd = _lock_file(path, fcntl.LOCK_EX, timeout)
        if fd is None:
            raise CacheError(
                f"timed out after {timeout:g}s waiting for the lock {path}: another process is "
                "compiling or removing this kernel (raise TKJIT_LOCK_TIMEOUT to wait longer; a lock "
                "of a process that died is released by the OS, so a stuck lock means a live process)"
            )
        try:
            yield
        finally:
            os.close(fd)

    def _try_lock(self, path: Path, op: int = fcntl.LOCK_EX) -> int | None:
        try:
            return _lock_file(path, op, 0)
        except (OSError, CacheError):
            return None

    def quarantine(self, key: str, reason: str) -> None:
        """Move an entry aside (call under the key's lock); the newest few are kept."""
        src = self.entry_path(key)
        qdir = self._dir("quarantine")
        dst = qdir / f"{key}.{int(time.time())}.{uuid.uuid4().hex[:8]}"
        try:
            os.rename(src, dst)
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno not in (errno.ENOTDIR, errno.EISDIR):
                raise
            os.unlink(src)  # a file (or link) where an entry should be: nothing to keep
            return
        with contextlib.suppress(OSError):
            fd = os.open(dst / "REASON", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(reason + "\n")
        with contextlib.suppress(OSError):
            items = sorted(qdir.iterdir(), key=lambda p: p.lstat().st_mtime)
            for old in items[:-QUARANTINE_KEEP]:
                if old.is_dir() and not old.is_symlink():
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    old.unlink(missing_ok=True)

    def get_or_build(
        self,
        key: str,
        meta: dict[str, Any],
        build: Callable[[Path], dict[str, Any]],
        expect: dict[str, Any] | None = None,
    ) -> Entry:
        """Return the verified entry for key, building and publishing it at most once across processes.

        build(staging_dir) writes the artifact files and returns extra meta (the ABI). Checked
        before and after taking the lock: N processes asking for one cold key compile it once.
        expect: meta fields the entry must carry (default: the KEY_FIELDS present in meta).
        """
        self._check_key(key)
        if expect is None:
            expect = {k: meta[k] for k in KEY_FIELDS if k in meta}
        cap = max_bytes_from_env()
        entry = self.lookup(key, expect)
        if entry is not None:
            return entry
        with self.lock(key):
            entry = self._lookup_locked(key, expect)
            if entry is not None:
                return entry
            self.clean_staging()
            for old in self._dir("staging").glob(f"{key}.*"):  # ours, of a process that died: we hold the lock
                if old.is_dir() and not old.is_symlink():
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    old.unlink(missing_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=self._dir("staging")))
            try:
                extra = build(staging)
                try:
                    self._publish(key, staging, {**meta, **extra})
                except OSError as e:
                    raise PublishFailed(e, self._rescue(key, staging, {**meta, **extra})) from e
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            if cap is not None:
                with contextlib.suppress(OSError):
                    self._prune(cap, wait=False)
            entry = self._lookup_locked(key, expect)
        if entry is None:
            raise CacheError(f"entry {key} failed verification right after it was published")
        return entry

    def _rescue(self, key: str, staging: Path, meta: dict[str, Any]) -> Entry | None:
        try:
            tmp = _private_tempdir()
            for p in staging.iterdir():
                if p.name != MANIFEST:
                    shutil.copyfile(p, tmp / p.name)
        except OSError:
            return None
        return Entry(key, tmp, {"key": key, "files": {}, "meta": meta})

    def _publish(self, key: str, staging: Path, meta: dict[str, Any]) -> None:
        files = {}
        for p in sorted(staging.iterdir()):
            if p.name == MANIFEST:
                continue
            if not _FILE_RE.fullmatch(p.name) or not stat.S_ISREG(p.lstat().st_mode):
                raise CacheError(f"the build wrote {p.name!r}: an entry holds plain files with simple names only")
            os.chmod(p, 0o600)
            with os.fdopen(_open_private(p), "rb") as f:
                os.fsync(f.fileno())
            files[p.name] = {"size": p.lstat().st_size, "sha256": sha256_file(p)}
        if not files:
            raise CacheError(f"the build of {key} wrote no files")
        manifest = {"key": key, "files": files, "meta": meta, "created": time.time()}
        mpath = staging / MANIFEST
        fd = os.open(mpath, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(staging, 0o700)
        _fsync_dir(staging)
        dst = self.entry_path(key)
        if os.path.lexists(dst):  # a leftover that failed verification under our lock
            self.quarantine(key, "replaced by a rebuild")
        os.rename(staging, dst)  # atomic: readers see nothing or the whole entry
        _fsync_dir(dst.parent)
        self.touch(key)

    def clean_staging(self) -> int:
        """Remove staging dirs of dead processes: a live builder or remover holds its key's lock."""
        removed = 0
        try:
            items = list(os.scandir(self._dir("staging")))
        except FileNotFoundError:
            return 0
        for p in items:
            key = p.name.split(".", 1)[0]
            fd = self._try_lock(self._lock_path(key)) if _KEY_RE.fullmatch(key) else None
            if _KEY_RE.fullmatch(key) and fd is None:
                continue  # its builder is alive
            try:
                if p.is_dir(follow_symlinks=False):
                    shutil.rmtree(p.path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(p.path)
                removed += 1
            finally:
                if fd is not None:
                    os.close(fd)
        return removed

    # -- inspection and maintenance -------------------------------------------------------
    def entries(self) -> list[dict[str, Any]]:
        """Rows for `tkjit list`: one per published entry (corrupt ones flagged, never loaded).

        Safe while other processes build, prune or clear: an entry that vanishes is skipped.
        """
        self.ensure()
        rows = []
        edir = self._dir("entries")
        for p in sorted(os.scandir(edir), key=lambda d: d.name):
            if not _KEY_RE.fullmatch(p.name):
                continue
            try:
                st = os.lstat(p.path)
                if not stat.S_ISDIR(st.st_mode):
                    rows.append({"key": p.name, "status": "corrupt", "size": st.st_size, "last_used": st.st_mtime})
                    continue
                row: dict[str, Any] = {"key": p.name}
                try:
                    manifest = json.loads(_read_private(Path(p.path) / MANIFEST, _MAX_MANIFEST))
                    meta = manifest.get("meta", {})
                    row.update(meta if isinstance(meta, dict) else {})
                    row["key"] = p.name
                    row["size"] = sum(int(f.get("size", 0)) for f in manifest.get("files", {}).values())
                    row["created"] = manifest.get("created")
                except FileNotFoundError:
                    if not os.path.lexists(p.path):
                        continue  # removed while we looked
                    raise CorruptEntry("manifest missing") from None
                except (OSError, ValueError, AttributeError, TypeError, CorruptEntry, CacheError):
                    raise CorruptEntry("unreadable manifest") from None
            except FileNotFoundError:
                continue
            except CorruptEntry:
                row = {"key": p.name, "status": "corrupt", "size": _du(Path(p.path)), "created": None}
            row["last_used"] = self._last_used(p.name, row.get("created"), Path(p.path))
            rows.append(row)
        return rows

    def _last_used(self, key: str, created: Any, path: Path) -> float:
        try:
            return os.stat(self._used_path(key), follow_symlinks=False).st_mtime
        except OSError:
            pass
        if isinstance(created, (int, float)):
            return float(created)
        try:
            return os.lstat(path).st_mtime
        except OSError:
            return 0.0

    def _evict(self, key: str, *, force: bool = False, wait: float | None = 0) -> bool:
        """Remove a published entry unless it is in use (pinned) or being built; True if removed.

        Takes the key lock (waiting `wait` seconds; None: the lock timeout) and, unless force, an
        exclusive non-blocking lock on <key>.used: a pinning process blocks eviction.
        """
        path = self.entry_path(key)
        used = self._used_path(key)
        if not force and str(used) in _PINS:
            return False
        timeout = lock_timeout() if wait is None else wait
        kfd = _lock_file(self._lock_path(key), fcntl.LOCK_EX, timeout)
        if kfd is None:
            if wait == 0:
                return False
            raise CacheError(f"timed out after {timeout:g}s waiting for the lock of {key}")
        ufd = None
        try:
            if not force:
                ufd = self._try_lock(used)
                if ufd is None:
                    return False
            if not os.path.lexists(path):
                return False
            trash = self._dir("staging") / f"{key}.rm.{uuid.uuid4().hex[:8]}"
            os.rename(path, trash)  # atomic removal first; the slow rmtree after
            with contextlib.suppress(FileNotFoundError):
                if ufd is not None or not self.in_use(key):
                    os.unlink(used)  # we hold its lock (or nobody does)
            if trash.is_dir() and not trash.is_symlink():
                shutil.rmtree(trash, ignore_errors=True)
            else:
                trash.unlink(missing_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._lock_path(key))  # we hold it; waiters re-check the inode
            return True
        finally:
            if ufd is not None:
                os.close(ufd)
            os.close(kfd)

    def remove(self, key: str, *, force: bool = False) -> bool:
        """Remove one entry under its lock (never while another process builds it).

        An entry in use by a running process is kept (False) unless force: removing it is safe
        for processes that already loaded it, but not for one between verifying and loading.
        """
        self.ensure()
        return self._evict(key, force=force, wait=None)

    def clear(self, *, force: bool = False) -> int:
        """Remove every entry not in use (all with force), the quarantine and dead staging dirs."""
        n = 0
        for row in self.entries():
            n += self.remove(row["key"], force=force)
        self.clean_staging()
        shutil.rmtree(self._dir("quarantine"), ignore_errors=True)
        _private_dir(self._dir("quarantine"))
        return n

    def total_bytes(self) -> int:
        return sum(int(r.get("size", 0)) for r in self.entries())

    def prune(self, max_bytes: int) -> list[str]:
        """Evict least recently used entries until the cache holds at most max_bytes.

        Entries in use (pinned by a live process) or being built are skipped, so the result can
        stay above max_bytes. Returns the removed keys.
        """
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise CacheError(f"prune needs a byte count >= 0, got {max_bytes!r}")
        self.ensure()
        return self._prune(max_bytes, wait=True)

    def _prune(self, max_bytes: int, *, wait: bool) -> list[str]:
        gpath = self._dir("locks") / "prune.lock"
        gfd = _lock_file(gpath, fcntl.LOCK_EX, lock_timeout() if wait else 0)
        if gfd is None:
            if not wait:
                return []  # another process is pruning
            raise CacheError(f"timed out waiting for {gpath}: another process is pruning the cache")
        removed: list[str] = []
        try:
            self.clean_staging()
            rows = self.entries()
            total = sum(int(r.get("size", 0)) for r in rows)
            for row in sorted(rows, key=lambda r: (r.get("last_used") or 0.0, r["key"])):
                if total <= max_bytes:
                    break
                if self._evict(row["key"]):
                    removed.append(row["key"])
                    total -= int(row.get("size", 0))
            self._drop_orphan_marks()
        finally:
            os.close(gfd)
        return removed

    def _drop_orphan_marks(self) -> None:
        """<key>.used files without an entry and without a pinning process."""
        for p in os.scandir(self._dir("entries")):
            if not p.name.endswith(".used"):
                continue
            key = p.name[: -len(".used")]
            if not _KEY_RE.fullmatch(key) or os.path.lexists(self.entry_path(key)) or p.path in _PINS:
                continue
            kfd = self._try_lock(self._lock_path(key))
            if kfd is None:
                continue
            try:
                ufd = self._try_lock(Path(p.path))
                if ufd is not None:
                    try:
                        if not os.path.lexists(self.entry_path(key)):
                            os.unlink(p.path)
                    finally:
                        os.close(ufd)
            except OSError:
                pass
            finally:
                os.close(kfd)


def _check_kind(path: Path) -> None:
    """Inside an entry (a private dir only we can write) a link or non-file is damage: CorruptEntry."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise CorruptEntry(f"{path.name} is a symbolic link (links are never followed)")
    if not stat.S_ISREG(st.st_mode):
        raise CorruptEntry(f"{path.name} is not a regular file")


def _du(path: Path) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for f in path.iterdir():
            with contextlib.suppress(OSError):
                st = f.lstat()
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total
