"""The on-disk cache: private dirs, per-key locks, atomic publish, verified reads.

Layout under the root (one version dir, so a new layout never reads an old one):

    v1/entries/<key>/        a published entry: kernel.so, kernel source, manifest.json
    v1/entries/<key>.used    touched on every load (LRU); outside the entry so the entry never changes
    v1/staging/<key>.*       entries being built; renamed into entries/ when complete
    v1/locks/<key>.lock      per-key filelock
    v1/quarantine/           entries that failed verification, kept for inspection
    v1/tuned/                the user's tuning DB and Optuna journals

The cache holds shared libraries that get dlopen'ed, so it is treated like ~/.ssh: every dir and
file must belong to this user and not be writable by group or others, and every file is checked
against the manifest's size and sha256 before anything is loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
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


class CorruptEntry(Exception):
    """An entry that must not be loaded; the message says why."""


def cache_root() -> Path:
    env = envs.CACHE_DIR.get()
    if env:
        return Path(env).expanduser().absolute()
    import platformdirs

    return Path(platformdirs.user_cache_dir("tkjit", appauthor=False))


def check_private(path: Path, *, is_dir: bool) -> None:
    """Refuse a path another user owns or can write: it could plant code we would dlopen."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise
    if stat.S_ISLNK(st.st_mode):
        raise CacheError(f"{path} is a symbolic link; the tkjit cache refuses links (remove it)")
    if is_dir != stat.S_ISDIR(st.st_mode):
        raise CacheError(f"{path} should be a {'directory' if is_dir else 'file'}; remove it")
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


def _private_dir(path: Path) -> Path:
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass
    check_private(path, is_dir=True)
    return path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Entry:
    key: str
    path: Path
    manifest: dict[str, Any]

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest["meta"]

    def file(self, name: str) -> Path:
        return self.path / name


class Cache:
    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else cache_root()
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
        _private_dir(self.root)
        _private_dir(self.base)
        for sub in ("entries", "staging", "locks", "quarantine", "tuned"):
            _private_dir(self._dir(sub))
        self._ready = True

    def entry_path(self, key: str) -> Path:
        if not _KEY_RE.match(key):  # keys are hex digests; nothing else may become a path
            raise CacheError(f"malformed cache key {key!r}")
        return self._dir("entries") / key

    # -- reads --------------------------------------------------------------------------
    def verify(self, key: str) -> Entry:
        """The entry if it is complete and intact; CorruptEntry otherwise (FileNotFoundError if absent)."""
        path = self.entry_path(key)
        check_private(path, is_dir=True)
        mpath = path / MANIFEST
        try:
            check_private(mpath, is_dir=False)
            raw = mpath.read_bytes()
        except FileNotFoundError:
            raise CorruptEntry("manifest missing") from None
        try:
            manifest = json.loads(raw)
        except ValueError as e:
            raise CorruptEntry(f"manifest is not JSON: {e}") from None
        if not isinstance(manifest, dict) or manifest.get("key") != key:
            raise CorruptEntry("manifest does not name this key")
        files = manifest.get("files")
        if not isinstance(files, dict) or not files:
            raise CorruptEntry("manifest lists no files")
        for name, info in files.items():
            if not isinstance(name, str) or "/" in name or name.startswith("."):
                raise CorruptEntry(f"manifest names a bad file {name!r}")
            fpath = path / name
            try:
                check_private(fpath, is_dir=False)
                size = fpath.stat().st_size
            except FileNotFoundError:
                raise CorruptEntry(f"{name} is missing") from None
            if not isinstance(info, dict) or size != info.get("size"):
                raise CorruptEntry(f"{name} has {size} bytes, manifest says {info.get('size')}")
            if sha256_file(fpath) != info.get("sha256"):
                raise CorruptEntry(f"{name} does not match its sha256")
        if not isinstance(manifest.get("meta"), dict):
            raise CorruptEntry("manifest has no meta")
        return Entry(key, path, manifest)

    def lookup(self, key: str) -> Entry | None:
        """A verified entry, or None; a corrupt one is moved aside."""
        self.ensure()
        try:
            return self.verify(key)
        except FileNotFoundError:
            return None
        except CorruptEntry as e:
            self.quarantine(key, str(e))
            return None

    def touch(self, key: str) -> None:
        with contextlib.suppress(OSError):
            p = self._dir("entries") / f"{key}.used"
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            os.close(fd)
            os.utime(p)

    # -- writes -------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        from filelock import FileLock, Timeout

        self.ensure()
        timeout = float(envs.LOCK_TIMEOUT.get() or 900)
        path = self._dir("locks") / f"{key}.lock"
        lk = FileLock(str(path), timeout=timeout, mode=0o600)
        try:
            lk.acquire()
        except Timeout:
            raise CacheError(
                f"timed out after {timeout:.0f}s waiting for the lock {path}: another process is "
                "compiling this kernel (raise TKJIT_LOCK_TIMEOUT, or remove the lock file if no "
                "tkjit process is running)"
            ) from None
        try:
            yield
        finally:
            lk.release()

    def quarantine(self, key: str, reason: str) -> None:
        src = self.entry_path(key)
        dst = self._dir("quarantine") / f"{key}.{int(time.time())}.{uuid.uuid4().hex[:8]}"
        with contextlib.suppress(FileNotFoundError):
            os.rename(src, dst)
            with contextlib.suppress(OSError):
                (dst / "REASON").write_text(reason + "\n")

    def get_or_build(self, key: str, meta: dict[str, Any], build: Callable[[Path], dict[str, Any]]) -> Entry:
        """Return the verified entry for key, building and publishing it at most once across processes.

        build(staging_dir) writes the artifact files and returns extra meta (the ABI). Checked
        before and after taking the lock: N processes asking for one cold key compile it once.
        """
        entry = self.lookup(key)
        if entry is not None:
            return entry
        with self.lock(key):
            entry = self.lookup(key)
            if entry is not None:
                return entry
            self.clean_staging()
            for old in self._dir("staging").glob(f"{key}.*"):  # ours, from a process that died
                shutil.rmtree(old, ignore_errors=True)
            staging = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=self._dir("staging")))
            try:
                extra = build(staging)
                self._publish(key, staging, {**meta, **extra})
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        entry = self.lookup(key)
        if entry is None:
            raise CacheError(f"entry {key} failed verification right after it was published")
        return entry

    def _publish(self, key: str, staging: Path, meta: dict[str, Any]) -> None:
        files = {}
        for p in sorted(staging.iterdir()):
            if p.name == MANIFEST:
                continue
            os.chmod(p, 0o600)
            with open(p, "rb") as f:
                os.fsync(f.fileno())
            files[p.name] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
        manifest = {"key": key, "files": files, "meta": meta, "created": time.time()}
        mpath = staging / MANIFEST
        with open(mpath, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(mpath, 0o600)
        os.chmod(staging, 0o700)
        _fsync_dir(staging)
        dst = self.entry_path(key)
        if dst.exists():  # a leftover that failed verification under our lock
            self.quarantine(key, "replaced by a rebuild")
        os.rename(staging, dst)  # atomic: readers see nothing or the whole entry
        _fsync_dir(dst.parent)
        self.touch(key)

    def clean_staging(self) -> int:
        """Remove staging dirs of dead processes: a live builder holds its key's lock."""
        removed = 0
        for p in self._dir("staging").iterdir():
            key = p.name.split(".", 1)[0]
            if _KEY_RE.match(key) and self._lock_held(key):
                continue
            shutil.rmtree(p, ignore_errors=True)
            removed += 1
        return removed

    def _lock_held(self, key: str) -> bool:
        from filelock import FileLock, Timeout

        lk = FileLock(str(self._dir("locks") / f"{key}.lock"), timeout=0, mode=0o600)
        try:
            lk.acquire()
        except Timeout:
            return True
        lk.release()
        return False

    # -- inspection and maintenance -------------------------------------------------------
    def entries(self) -> list[dict[str, Any]]:
        """Rows for `tkjit list`: one per published entry (corrupt ones flagged, not loaded)."""
        self.ensure()
        rows = []
        for p in sorted(self._dir("entries").iterdir()):
            if not p.is_dir() or not _KEY_RE.match(p.name):
                continue
            row: dict[str, Any] = {"key": p.name}
            try:
                manifest = json.loads((p / MANIFEST).read_text())
                row.update(manifest.get("meta", {}))
                row["size"] = sum(int(f.get("size", 0)) for f in manifest.get("files", {}).values())
                row["created"] = manifest.get("created")
            except (OSError, ValueError, AttributeError):
                row["status"] = "corrupt"
                row["size"] = sum(f.stat().st_size for f in p.iterdir() if f.is_file())
            used = self._dir("entries") / f"{p.name}.used"
            row["last_used"] = used.stat().st_mtime if used.exists() else row.get("created")
            rows.append(row)
        return rows

    def remove(self, key: str) -> bool:
        """Remove one entry under its lock (never while another process is building it)."""
        path = self.entry_path(key)
        with self.lock(key):
            if not path.exists():
                return False
            trash = self._dir("staging") / f"{key}.rm.{uuid.uuid4().hex[:8]}"
            os.rename(path, trash)  # atomic removal first; the slow rmtree after
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._dir("entries") / f"{key}.used")
            shutil.rmtree(trash, ignore_errors=True)
        return True

    def clear(self) -> int:
        n = 0
        for row in self.entries():
            n += self.remove(row["key"])
        shutil.rmtree(self._dir("quarantine"), ignore_errors=True)
        _private_dir(self._dir("quarantine"))
        return n

    def total_bytes(self) -> int:
        return sum(int(r.get("size", 0)) for r in self.entries())
