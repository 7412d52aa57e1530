"""The cache store: atomic publish, verified reads, quarantine, use marks, LRU size cap.

`Store` is what the rest of tkjit needs from a cache of built kernels, by key:

    lookup(key, expect)                     the verified entry, or None (a corrupt one is moved aside)
    get_or_build(key, meta, build, expect)  the verified entry, built and published at most once
                                            across processes when absent
    entry_path(key)                         where the entry's files are (a local dir the loader
                                            dlopens from)
    pin(key), touch(key)                    mark in use by this process (eviction skips it); record
                                            a use (the LRU clock)
    entries(), remove(key), prune(max_bytes), clear()   `tkjit list`, `rm`, `prune`, `clear`

`Cache` implements it on a private local dir. Another backend (a read-only shared dir, an object
store mirrored to a local dir) implements the same methods with the same guarantees: whatever
lookup/get_or_build return has been verified as below, so callers never check again.

Layout of `Cache` under the root (one version dir, so a new layout never reads an old one):

    v1/entries/<key>/        a published entry: kernel.so, kernel source, manifest.json
    v1/entries/<key>.used    mtime = last use (LRU); a process that uses the entry holds a shared
                             flock on it for its lifetime, so eviction skips entries in use
    v1/staging/<key>.*       entries being built (renamed into entries/ when complete), and
                             entries being removed (renamed out first, deleted after)
    v1/locks/<key>.lock      per-key build lock (flock: released by the kernel when a process dies)
    v1/quarantine/           entries that failed verification, kept for inspection (newest few)
    v1/tuned/                the user's tuning DB and Optuna journals
    v1/toolchain-<arch>.json the compiler versions `tkjit bundle import` pinned for arch (key.toolchain)

The cache holds shared libraries that get dlopen'ed, so it is treated like ~/.ssh: every dir and
file must belong to this user and not be writable by group or others (missing parents of the
root are created 0700, whatever the umask), links are refused, and before anything is loaded the
manifest's structure and types are checked (`check_manifest`), its checksum (`meta_sha256`, over
key, files and meta) is recomputed, every file is checked against the manifest's size and sha256,
and the meta against what was asked for (kernel, shape, config, arch, toolchain). Nothing read
from disk is unpickled or evaluated: manifests are JSON. The checks on paths and files are in
`tkjit.fs`.

Damaged contents never hang or crash a command: a file's kind is checked (lstat) before it is
opened, and it is opened non-blocking, so a FIFO or device where a manifest belongs makes the
entry corrupt rather than blocking `tkjit list` forever. A dir, FIFO, socket or device where a
lock file or use mark belongs is removed and replaced (those dirs are private to us).

Build locks and use marks follow the one lock scheme of `tkjit.locks` (flock on files only ever
unlinked by a holder of the lock; a waiter re-checks the inode it locked).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

from tkjit import envs
from tkjit.canon import canonical_json
from tkjit.errors import CacheError, ConfigError
from tkjit.fs import (
    BadFile,
    WrongKind,
    check_ancestors,
    check_elf,
    check_private,
    fsync_dir,
    make_parents,
    open_private,
    private_dir,
    private_tempdir,
    read_private,
    sha256_file,
)
from tkjit.key import PINNABLE
from tkjit.locks import acquire, file_lock, is_locked, open_lock_file, release, try_lock
from tkjit.sizes import parse_size

LAYOUT = "v1"
MANIFEST = "manifest.json"
_KEY_RE = re.compile(r"^[0-9a-f]{40}$")
_ARCH_NAME = re.compile(r"[a-z0-9_]{1,32}")
_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_MAX_MANIFEST = 1 << 20
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_MAX_SIZE = 1 << 53  # a claimed file size beyond this is nonsense (and no longer exact as a float)
_MAX_TIME = float(1 << 37)  # about the year 6300: later `created` times cannot be shown as dates
# Meta fields that `tkjit list`/`show` and the loader read, by their JSON type.
_META_STR = ("kernel", "arch", "config_source", "family", "lib", "spec_source")
_META_DICT = ("shape", "config", "toolchain", "abi")
# Manifest fields the checksum leaves out: the checksum itself, and the publish time (shown only).
_UNSEALED = ("meta_sha256", "created")
QUARANTINE_KEEP = 16
# Meta fields that define the binary: a manifest whose meta disagrees is for another variant.
KEY_FIELDS = ("kernel", "shape", "config", "arch", "toolchain", "spec_source")
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
    """The cache's root dir: TKJIT_CACHE_DIR, else the platform's per-user cache dir."""
    env = envs.CACHE_DIR.get()
    if env:
        return Path(env).expanduser().absolute()
    import platformdirs

    return Path(platformdirs.user_cache_dir("tkjit", appauthor=False))


def _json_norm(v: Any) -> Any:
    return json.loads(json.dumps(v, sort_keys=True))


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of a manifest minus `created` and the checksum itself.

    Binds key, files table and meta (the loader kind, dynamic axes, lib), which the file hashes
    alone leave open to a flipped bit or a stray edit. Not a signature: anyone who can write the
    cache could reseal it, but such a user is already refused (the cache must be private).
    """
    body = {k: v for k, v in manifest.items() if k not in _UNSEALED}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def valid_key(key: Any) -> bool:
    """A cache key: 40 lowercase hex digits (nothing else ever becomes an entry's path)."""
    return isinstance(key, str) and _KEY_RE.fullmatch(key) is not None


def check_file_record(name: Any, info: Any) -> None:
    """One record of a manifest's `files` (or a bundle index's): a simple file name, {size, sha256}.

    CorruptEntry if not; the name is then safe as one path component.
    """
    if not isinstance(name, str) or not _FILE_RE.fullmatch(name):
        raise CorruptEntry(f"manifest names a bad file {str(name)[:80]!r}")  # (values are shown cut short)
    if not isinstance(info, dict):
        raise CorruptEntry(f"manifest entry for {name} is not an object")
    size, sha = info.get("size"), info.get("sha256")
    if not (_is_int(size) and 0 <= size < _MAX_SIZE):
        raise CorruptEntry(f"manifest gives {name} a bad size ({type(size).__name__} {str(size)[:20]})")
    if not (isinstance(sha, str) and _SHA_RE.fullmatch(sha)):
        raise CorruptEntry(f"manifest gives {name} a bad sha256 ({type(sha).__name__} {str(sha)[:70]!r})")


def check_manifest(manifest: Any, key: str) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The (files, meta) of a manifest whose structure and types are sound; CorruptEntry if not.

    The one place the JSON's shape is checked, for verify and for `tkjit list`: everything read
    from a manifest afterwards can rely on these types. The checksum is checked by verify.
    """
    if not isinstance(manifest, dict) or manifest.get("key") != key:
        raise CorruptEntry("manifest does not name this key")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise CorruptEntry("manifest lists no files")
    for name, info in files.items():
        if name == MANIFEST:
            raise CorruptEntry(f"manifest names a bad file {name!r}")
        check_file_record(name, info)
    meta = manifest.get("meta")
    if not isinstance(meta, dict):
        raise CorruptEntry("manifest has no meta")
    for k in _META_STR:
        if not isinstance(meta.get(k, ""), str):
            raise CorruptEntry(f"manifest meta {k} is not a string")
    for k in _META_DICT:
        if not isinstance(meta.get(k, {}), dict):
            raise CorruptEntry(f"manifest meta {k} is not an object")
    created = manifest.get("created")
    if created is not None and not ((_is_int(created) or isinstance(created, float)) and 0 <= created <= _MAX_TIME):
        raise CorruptEntry(f"manifest created ({type(created).__name__} {str(created)[:20]}) is not a time")
    return files, meta


def _parse_manifest(raw: bytes, key: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, Any]]:
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptEntry(f"manifest is not JSON: {e}") from None
    files, meta = check_manifest(manifest, key)
    return manifest, files, meta


def _read_manifest(path: Path) -> bytes:
    try:
        return read_private(path, _MAX_MANIFEST)
    except BadFile as e:
        raise CorruptEntry(str(e)) from None


def lock_timeout() -> float:
    """TKJIT_LOCK_TIMEOUT: seconds to wait for another process's build lock (default 900)."""
    text = envs.LOCK_TIMEOUT.get()
    if text is None:
        return 900.0
    try:
        v = float(text.strip())
    except ValueError:
        v = float("nan")
    if not (v >= 0 and v != float("inf")):  # NaN fails the first test
        raise CacheError(f"{envs.LOCK_TIMEOUT.name}={text!r} is not valid: expected a number of seconds, e.g. 900")
    return v


def max_bytes_from_env() -> int | None:
    """TKJIT_CACHE_MAX_BYTES as bytes (`10G`, `500M`, ...), None when unset: no cap."""
    text = envs.CACHE_MAX_BYTES.get()
    if text is None:
        return None
    try:
        return parse_size(text)
    except ConfigError as e:  # a CacheError, as before: the cache cannot be used with this setting
        raise CacheError(f"{envs.CACHE_MAX_BYTES.name}={text!r} is not valid: {e}") from None


# Entries this process uses: key path -> fd holding a shared flock on <key>.used (process lifetime).
_PINS: dict[str, int] = {}
_pins_lock = threading.Lock()


class Entry(NamedTuple):
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


class Cleared(NamedTuple):
    """What Cache.clear did: entries removed, and keys kept because in use or being built."""

    removed: int
    skipped: tuple[str, ...]


@runtime_checkable
class Store(Protocol):
    """What tkjit needs from a cache of built kernels (see the module docstring); Cache is one."""

    def entry_path(self, key: str) -> Path:
        """Where the entry's files are: a local dir the loader can dlopen from."""
        ...

    def lookup(self, key: str, expect: dict[str, Any] | None = None) -> Entry | None:
        """The verified entry for key whose meta matches expect, or None."""
        ...

    def get_or_build(
        self,
        key: str,
        meta: dict[str, Any],
        build: Callable[[Path], dict[str, Any]],
        expect: dict[str, Any] | None = None,
    ) -> Entry:
        """The verified entry for key; when absent, build(dir) writes it and it is published once."""
        ...

    def pin(self, key: str) -> bool:
        """Mark key in use by this process (eviction skips it); False if that cannot be recorded."""
        ...

    def touch(self, key: str) -> None:
        """Record a use of key (least recently used entries are evicted first)."""
        ...

    def entries(self) -> list[dict[str, Any]]:
        """One row per entry: its meta plus key, size, created, last_used (corrupt ones flagged)."""
        ...

    def remove(self, key: str, *, force: bool = False) -> bool:
        """Remove one entry (one in use only with force); True if removed."""
        ...

    def prune(self, max_bytes: int) -> list[str]:
        """Evict least recently used entries not in use down to max_bytes; the removed keys."""
        ...

    def clear(self, *, force: bool = False) -> Cleared:
        """Remove every entry not in use (all with force)."""
        ...


class Cache:
    """The Store on a private local dir (layout in the module docstring)."""

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
        make_parents(self.root)
        private_dir(self.root)
        private_dir(self.base)
        for sub in ("entries", "staging", "locks", "quarantine", "tuned"):
            private_dir(self._dir(sub))
        self._ready = True

    # -- the toolchain a compiler-less host keys on ------------------------------------------------
    def _toolchain_path(self, arch: str) -> Path:
        if not _ARCH_NAME.fullmatch(arch):  # arch names only ever become file names
            raise CacheError(f"malformed arch {arch!r}")
        return self.base / f"toolchain-{arch}.json"

    def pinned_toolchain(self, arch: str) -> dict[str, str]:
        """The compiler versions `pin_toolchain` recorded for arch ({} if none, or if unreadable: a bad
        record only changes keys, and every entry they find is still verified)."""
        try:
            doc = json.loads(read_private(self._toolchain_path(arch), 4096))
        except (OSError, ValueError, CacheError):
            return {}
        if not isinstance(doc, dict):
            return {}
        return {k: v for k, v in doc.items() if k in PINNABLE and isinstance(v, str) and 0 < len(v) <= 64}

    def pin_toolchain(self, arch: str, versions: dict[str, str]) -> None:
        """Record the compiler versions arch's entries were built with (atomically, privately): a host
        without that compiler keys on them (key.toolchain)."""
        self.ensure()
        path = self._toolchain_path(arch)
        doc = {k: versions[k] for k in PINNABLE if isinstance(versions.get(k), str)}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(canonical_json(doc))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.base)

    @staticmethod
    def _check_key(key: str) -> str:
        if not valid_key(key):  # hex digests only ever become paths
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
        try:
            check_private(path, is_dir=True)
        except WrongKind:  # a file or FIFO in our private entries dir: damage, moved aside like any
            raise CorruptEntry(f"entry {key} is not a directory") from None
        ino = os.lstat(path).st_ino
        try:
            return verify_dir(key, path, expect)
        except CorruptEntry:
            try:
                still = os.lstat(path).st_ino == ino
            except FileNotFoundError:
                still = False
            if not still:  # removed or replaced while we read it: not corrupt, just gone
                raise FileNotFoundError(f"entry {key} vanished while being verified") from None
            raise

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
                fd = acquire(Path(path), shared=True, timeout=lock_timeout())
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
            release(fd)

    def in_use(self, key: str) -> bool:
        """True when some process (this one included) has the entry pinned."""
        p = self._used_path(key)
        if str(p) in _PINS:
            return True
        return is_locked(p)

    def touch(self, key: str) -> None:
        """Record a use (the LRU clock): the .used file's mtime."""
        p = self._used_path(key)
        fd = _PINS.get(str(p))
        with contextlib.suppress(OSError, CacheError):
            if fd is not None:
                os.utime(fd)
                return
            fd = open_lock_file(p, os.O_WRONLY | os.O_CREAT)
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
        hint = (
            ": another process is compiling or removing this kernel (raise TKJIT_LOCK_TIMEOUT to wait "
            "longer; a lock of a process that died is released by the OS, so a stuck lock means a live process)"
        )
        with file_lock(self._lock_path(key), timeout=timeout, hint=hint):
            yield

    def quarantine(self, key: str, reason: str) -> None:
        """Move an entry aside (call under the key's lock); the newest few are kept."""
        src = self.entry_path(key)
        qdir = self._dir("quarantine")
        dst = qdir / f"{key}.{int(time.time())}.{uuid.uuid4().hex[:8]}"
        try:
            if not stat.S_ISDIR(os.lstat(src).st_mode):
                os.unlink(src)  # a file, FIFO or link where an entry should be: nothing to keep
                return
            os.rename(src, dst)
        except FileNotFoundError:
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
            tmp = private_tempdir()
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
            with os.fdopen(open_private(p), "rb") as f:
                os.fsync(f.fileno())
            files[p.name] = {"size": p.lstat().st_size, "sha256": sha256_file(p)}
        if not files:
            raise CacheError(f"the build of {key} wrote no files")
        # Normalised as it will read back (tuples become lists), then sealed; `created` is not sealed.
        manifest = _json_norm({"key": key, "files": files, "meta": meta})
        manifest["meta_sha256"] = manifest_digest(manifest)
        manifest["created"] = time.time()
        mpath = staging / MANIFEST
        fd = os.open(mpath, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(staging, 0o700)
        fsync_dir(staging)
        dst = self.entry_path(key)
        if os.path.lexists(dst):  # a leftover that failed verification under our lock
            self.quarantine(key, "replaced by a rebuild")
        os.rename(staging, dst)  # atomic: readers see nothing or the whole entry
        fsync_dir(dst.parent)
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
            fd = try_lock(self._lock_path(key)) if _KEY_RE.fullmatch(key) else None
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
                    release(fd)
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
                    rows.append({"key": p.name, "status": "corrupt", "size": st.st_size, "created": None,
                                 "last_used": st.st_mtime})
                    continue
                try:
                    raw = _read_manifest(Path(p.path) / MANIFEST)
                except FileNotFoundError:
                    if not os.path.lexists(p.path):
                        continue  # removed while we looked
                    raise CorruptEntry("manifest missing") from None
                except (OSError, CacheError):  # not ours, a link, a FIFO, a dir...: never opened blocking
                    raise CorruptEntry("unreadable manifest") from None
                manifest, files, meta = _parse_manifest(raw, p.name)
                row: dict[str, Any] = {k: v for k, v in meta.items() if k != "status"}  # status: ours to set
                row["key"] = p.name
                row["size"] = sum(info["size"] for info in files.values())
                row["created"] = manifest.get("created")
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
        kfd = acquire(self._lock_path(key), timeout=timeout)
        if kfd is None:
            if wait == 0:
                return False
            raise CacheError(f"timed out after {timeout:g}s waiting for the lock of {key}")
        ufd = None
        try:
            if not force:
                ufd = try_lock(used)
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
                release(ufd)
            release(kfd)

    def remove(self, key: str, *, force: bool = False) -> bool:
        """Remove one entry under its lock (never while another process builds it).

        An entry in use by a running process is kept (False) unless force: removing it is safe
        for processes that already loaded it, but not for one between verifying and loading.
        """
        self.ensure()
        return self._evict(key, force=force, wait=None)

    def clear(self, *, force: bool = False) -> Cleared:
        """Remove every entry not in use (all with force), the quarantine and dead staging dirs.

        A key whose lock is held (a live process compiling or removing it) is skipped at once,
        like prune does, rather than waited for up to the lock timeout; so is an entry in use
        (unless force). Both are reported in `skipped`.
        """
        removed, skipped = 0, []
        for row in self.entries():
            k = row["key"]
            if self._evict(k, force=force, wait=0):
                removed += 1
            elif os.path.lexists(self.entry_path(k)):  # not merely removed by someone else meanwhile
                skipped.append(k)
        self.clean_staging()
        self._empty_quarantine()
        return Cleared(removed, tuple(skipped))

    def _empty_quarantine(self) -> None:
        """Remove what the quarantine holds, never the dir itself.

        Removing and re-creating it let a concurrent clear (or quarantine) find it missing in
        between: the other process's check failed, or its rename into it did.
        """
        qdir = private_dir(self._dir("quarantine"))
        with contextlib.suppress(FileNotFoundError):
            for p in list(os.scandir(qdir)):
                if p.is_dir(follow_symlinks=False):
                    shutil.rmtree(p.path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(p.path)

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
        gfd = acquire(gpath, timeout=lock_timeout() if wait else 0)
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
            release(gfd)
        return removed

    def _drop_orphan_marks(self) -> None:
        """<key>.used files without an entry and without a pinning process."""
        for p in os.scandir(self._dir("entries")):
            if not p.name.endswith(".used"):
                continue
            key = p.name[: -len(".used")]
            if not _KEY_RE.fullmatch(key) or os.path.lexists(self.entry_path(key)) or p.path in _PINS:
                continue
            kfd = try_lock(self._lock_path(key))
            if kfd is None:
                continue
            try:
                ufd = try_lock(Path(p.path))
                if ufd is not None:
                    try:
                        if not os.path.lexists(self.entry_path(key)):
                            os.unlink(p.path)
                    finally:
                        release(ufd)
            except OSError:
                pass
            finally:
                release(kfd)


def verify_dir(key: str, path: Path, expect: dict[str, Any] | None = None) -> Entry:
    """The entry in dir `path` if it is complete, intact and what was asked for; CorruptEntry if not.

    The one verification of an entry's contents (manifest structure and seal, every file's kind,
    owner, mode, size and sha256, no unlisted file, the library's ELF header, `expect`), for the
    cache's own entries and for entries unpacked from a bundle before they are installed.
    """
    try:
        _check_kind(path / MANIFEST)
        raw = _read_manifest(path / MANIFEST)
    except FileNotFoundError:
        raise CorruptEntry("manifest missing") from None
    manifest, files, meta = _parse_manifest(raw, key)
    if manifest.get("meta_sha256") != manifest_digest(manifest):  # absent, too: no unsealed manifests
        raise CorruptEntry("manifest meta does not match its checksum")
    try:
        present = set(os.listdir(path))
    except FileNotFoundError:
        raise CorruptEntry("entry vanished") from None
    extra = present - set(files) - {MANIFEST}
    if extra:
        raise CorruptEntry(f"entry holds files the manifest does not list: {sorted(extra)}")
    for name, info in files.items():  # names and types already checked by check_manifest
        fpath = path / name
        try:
            _check_kind(fpath)
            check_private(fpath, is_dir=False)
            size = os.lstat(fpath).st_size
        except FileNotFoundError:
            raise CorruptEntry(f"{name} is missing") from None
        if size != info["size"]:
            raise CorruptEntry(f"{name} has {size} bytes, manifest says {info['size']}")
        if sha256_file(fpath) != info["sha256"]:
            raise CorruptEntry(f"{name} does not match its sha256")
    lib = meta.get("lib")
    if lib is not None:
        if lib not in files:
            raise CorruptEntry(f"manifest's library {lib!r} is not one of its verified files")
        try:
            check_elf(path / lib)
        except BadFile as e:
            raise CorruptEntry(str(e)) from None
    for k, want in (expect or {}).items():
        got = meta.get(k)
        if got != _json_norm(want):
            raise CorruptEntry(
                f"manifest meta {k}={got!r} but {want!r} was asked for (an artifact for another variant)"
            )
    return Entry(key, path, manifest)


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
