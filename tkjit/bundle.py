"""Bundles: verified cache entries of one arch in one tar file, compiled once, installed on many hosts.

    tkjit bundle export --arch sm_90a --manifest FILE -o tkjit-sm_90a.tar   # a build host (cross-compiles)
    tkjit bundle import tkjit-sm_90a.tar                                     # each GPU host
    TKJIT_DISABLE_JIT=1 python serve.py                                      # serves them, never compiles

A bundle is a tar (gzip'ed when its name ends in .gz or .tgz) with members in this layout only:

    index.json              arch, each entry's key, kernel, shape, config and files (size, sha256),
                            and the tuned-DB entries that select them; sealed by `sha256` over the rest
    entries/<key>/<file>    one cache entry as the cache holds it: its files and manifest.json

Import trusts nothing in the file. The bundle must be a regular file owned by you or root and not
writable by group or others (it carries code that gets dlopen'ed, like the cache). Every member
must be a regular file or dir with a name of the layout (no absolute path, `..`, link, device or
FIFO; no setuid or group/other-writable mode; no name twice); the index must match its seal and
the members the index (nothing missing, nothing extra, every size and sha256). Each entry is then
unpacked into a private temp dir and checked by the cache's own verification (`verify_dir`:
manifest seal, files, an ELF library for this host), the tuned-DB entries by the DB's validation.
Only when all of it passes is anything installed: entries through the cache's publish path
(atomic, under the key's lock; an entry already there is kept), tuned entries merged into the
user's DB. Any failure refuses the whole bundle.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import stat
import tarfile
import tempfile
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tkjit import envs
from tkjit.cache import KEY_FIELDS, MANIFEST, Cache, CorruptEntry, Entry, check_file_record, valid_key, verify_dir
from tkjit.canon import canonical_json
from tkjit.errors import BundleError, TkjitError, TuningDBError, UnknownKernelError
from tkjit.fs import open_private
from tkjit.key import PINNABLE

FORMAT = "tkjit-bundle"
SCHEMA = 1
INDEX = "index.json"
MAX_INDEX = 64 << 20  # ~300 bytes per file listed: far more entries than any cache holds
_ENTRY_RE = re.compile(r"entries/([^/]+)(?:/([^/]+))?")  # names are then checked against the index


@dataclass
class Item:
    """One entry of a bundle, as the commands report it."""

    key: str
    kernel: str
    shape: dict[str, Any]
    config: dict[str, Any]
    source: str  # where the config came from (tuned:shipped, default, ...)
    status: str  # export: cached or built; import: installed or present


@dataclass
class Report:
    path: Path
    arch: str
    items: list[Item] = field(default_factory=list)
    tuned: int = 0  # tuned-DB entries in the bundle
    tuned_changed: int = 0  # import: of those, new or different in the user's DB
    tuned_files: list[Path] = field(default_factory=list)
    size: int = 0  # export: bytes written


# ----------------------------------------------------------------------------------------------
# export
# ----------------------------------------------------------------------------------------------
def export_bundle(
    out: str | os.PathLike,
    arch: str,
    *,
    studies: Sequence[Mapping[str, Any]] | None = None,
    jobs: int | None = None,
    with_defaults: bool = False,
    log: Any = None,
) -> Report:
    """Write the bundle of `studies` (a manifest's, see tkjit.tuning.pretune) or, when None, of every
    verified cache entry for arch. For studies: the config tkjit.get serves at each shape (tuned
    winner, else default; with_defaults: the heuristic default too), compiled first when missing
    unless TKJIT_DISABLE_JIT=1. `log(line)` hears progress."""
    from tkjit.arch import check_arch
    from tkjit.build import cache

    check_arch(arch)
    say = log or (lambda line: None)
    c = cache()
    if studies is None:
        picked = _cached_entries(c, arch)
        if not picked:
            raise BundleError(f"the cache {c.root} holds no entries for {arch}: compile some first")
    else:
        picked = _manifest_entries(c, arch, studies, jobs, with_defaults, say)
    tuned = _selecting_tuned(arch, [e for e, _ in picked])
    report = Report(Path(out), arch, tuned=len(tuned))
    for e, (source, status) in picked:
        m = e.meta
        report.items.append(Item(e.key, m["kernel"], m["shape"], m["config"], source, status))
    report.size = _write(Path(out), arch, [e for e, _ in picked], tuned)
    return report


def _cached_entries(c: Cache, arch: str) -> list[tuple[Entry, tuple[str, str]]]:
    out = []
    for row in c.entries():
        if row.get("arch") != arch or row.get("status") == "corrupt":
            continue
        e = c.lookup(row["key"], {"arch": arch})  # verified (a corrupt one is quarantined, not shipped)
        if e is not None:
            out.append((e, (str(e.meta.get("config_source", "?")), "cached")))
    return out


def _manifest_entries(
    c: Cache, arch: str, studies: Sequence[Mapping[str, Any]], jobs: int | None, with_defaults: bool, say: Any
) -> list[tuple[Entry, tuple[str, str]]]:
    from tkjit.build import variant_meta
    from tkjit.tuning.pretune import resolve_studies
    from tkjit.tuning_db import choose_config

    wanted: dict[str, tuple[Any, dict, dict, str, dict]] = {}
    for _study, spec, full in resolve_studies(studies):
        cfg, source = choose_config(spec, full, arch, None)
        configs = [(cfg, source)]
        if with_defaults and spec.default_config(full, arch) != cfg:
            configs.append((spec.default_config(full, arch), "default"))
        static = spec.static_shape(full)
        for cfg, source in configs:
            key, meta, _ = variant_meta(spec, static, cfg, arch, source)
            wanted.setdefault(key, (spec, static, cfg, source, {k: meta[k] for k in KEY_FIELDS}))
    if not wanted:
        raise BundleError("nothing to export: no study of the manifest names a known kernel with a valid shape")
    found = {k: c.lookup(k, w[4]) for k, w in wanted.items()}
    missing = [k for k, e in found.items() if e is None]
    if missing:
        names = ", ".join(f"{wanted[k][0].name} {_compact(wanted[k][1])}" for k in missing[:3])
        names += f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        if envs.flag(envs.DISABLE_JIT):
            raise BundleError(f"{len(missing)} of {len(wanted)} kernels are not in the cache ({names}) and "
                              f"{envs.DISABLE_JIT.name}=1 forbids compiling them")
        from tkjit.pool import compile_many

        say(f"compiling {len(missing)} missing kernel(s) for {arch} ...")
        results = compile_many([(wanted[k][0].name, wanted[k][1], wanted[k][2], arch, wanted[k][3]) for k in missing],
                               jobs)
        failed = [(k, err) for k, (_, err) in zip(missing, results) if err is not None]
        if failed:
            k, err = failed[0]
            first = str(err).strip().splitlines()[0] if str(err).strip() else "unknown error"
            raise BundleError(f"{len(failed)} kernel(s) failed to compile, e.g. {wanted[k][0].name} "
                              f"{_compact(wanted[k][1])}: {first}")
        for k in missing:
            found[k] = c.lookup(k, wanted[k][4])
            if found[k] is None:
                raise BundleError(f"{wanted[k][0].name} {_compact(wanted[k][1])} compiled but is not in the cache "
                                  f"{c.root} (pruned meanwhile? see TKJIT_CACHE_MAX_BYTES)")
    return [(e, (wanted[k][3], "built" if k in missing else "cached")) for k, e in found.items() if e is not None]


def _selecting_tuned(arch: str, entries: Sequence[Entry]) -> list[dict[str, Any]]:
    """The tuned-DB entries (user's, then shipped, as lookup ranks them) whose config is one of the
    bundle's entries: on a host that imports them, tkjit.get picks exactly the shipped binaries."""
    from tkjit.registry import get_spec
    from tkjit.tuning_db import tuned_entries, with_added

    have = {(e.meta["kernel"], canonical_json(e.meta["shape"]), canonical_json(e.meta["config"])) for e in entries}
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for _label, _path, t in tuned_entries(arch):
        try:  # an entry from before the space gained a tunable selects the binary built with its old value
            config = with_added(get_spec(t["kernel"]), t["config"])
        except UnknownKernelError:  # a kernel this install does not have: no binary of it to select
            continue
        k = (t["kernel"], canonical_json(t["shape"]), canonical_json(t["bucket"]))
        if k not in out and (t["kernel"], canonical_json(t["shape"]), canonical_json(config)) in have:
            out[k] = t
    return [out[k] for k in sorted(out)]


class _Hashing:
    """A file object that hashes what is read through it: the bytes written to the tar are the ones checked."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.h = f, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.h.update(data)
        return data


def _tarinfo(name: str, size: int, mtime: int, *, is_dir: bool = False) -> tarfile.TarInfo:
    # Fixed owner and private modes: the tar says nothing about the build host's users.
    ti = tarfile.TarInfo(name)
    ti.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    ti.mode, ti.size, ti.mtime = (0o700 if is_dir else 0o600), size, mtime
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def _seal(doc: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical_json({k: v for k, v in doc.items() if k != "sha256"}).encode()).hexdigest()


def _write(out: Path, arch: str, entries: Sequence[Entry], tuned: list[dict[str, Any]]) -> int:
    from tkjit.version import __version__

    # A manifest is written as the cache writes it, from the verified dict (its seal covers the content).
    manifests = {e.key: json.dumps(e.manifest, indent=1, sort_keys=True).encode() for e in entries}
    index: dict[str, Any] = {"format": FORMAT, "schema": SCHEMA, "arch": arch, "tkjit": __version__,
                             "created": int(time.time()), "entries": {}, "tuned": tuned}
    for e in entries:
        files = {**e.manifest["files"],
                 MANIFEST: {"size": len(manifests[e.key]), "sha256": hashlib.sha256(manifests[e.key]).hexdigest()}}
        index["entries"][e.key] = {"kernel": e.meta["kernel"], "shape": e.meta["shape"], "config": e.meta["config"],
                                   "files": files}
    index["sha256"] = _seal(index)
    raw_index = json.dumps(index, indent=1, sort_keys=True).encode()
    mtime = index["created"]
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as raw:
            mode = "w:gz" if out.name.endswith((".gz", ".tgz")) else "w"
            with tarfile.open(fileobj=raw, mode=mode, format=tarfile.PAX_FORMAT) as tar:
                tar.addfile(_tarinfo(INDEX, len(raw_index), mtime), io.BytesIO(raw_index))
                tar.addfile(_tarinfo("entries", 0, mtime, is_dir=True))
                for e in entries:
                    tar.addfile(_tarinfo(f"entries/{e.key}", 0, mtime, is_dir=True))
                    tar.addfile(_tarinfo(f"entries/{e.key}/{MANIFEST}", len(manifests[e.key]), mtime),
                                io.BytesIO(manifests[e.key]))
                    for name, info in sorted(e.manifest["files"].items()):
                        with os.fdopen(open_private(e.path / name), "rb") as f:
                            src = _Hashing(f)
                            tar.addfile(_tarinfo(f"entries/{e.key}/{name}", info["size"], mtime), src)
                        if src.h.hexdigest() != info["sha256"]:
                            raise BundleError(f"entry {e.key[:12]} {name} changed while being exported: run it again")
            raw.flush()
            os.fsync(raw.fileno())
        os.chmod(tmp, 0o644)  # read by whoever deploys it; never writable by others (import refuses that)
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return os.stat(out).st_size


def _compact(d: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in d.items())


# ----------------------------------------------------------------------------------------------
# import
# ----------------------------------------------------------------------------------------------
def import_bundle(path: str | os.PathLike) -> Report:
    """Verify the whole bundle (see the module doc), then install its entries into this process's
    cache and its tuned-DB entries into the user's DB. BundleError, with nothing installed, if any
    check fails."""
    path = Path(path)
    tmp = Path(tempfile.mkdtemp(prefix="tkjit-bundle-"))  # 0700: what is unpacked is ours alone
    try:
        with _open_bundle(path) as f:
            try:
                with tarfile.open(fileobj=f, mode="r:*") as tar:
                    index, entries = _unpack(tar, tmp)
            except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
                raise BundleError(f"{path} is not a readable tar file: {e}") from None
        arch = index["arch"]
        verified = [_verify_entry(key, tmp / key, arch, e) for key, e in entries.items()]
        _check_tuned(index["tuned"], arch, path)
        return _install(path, arch, verified, index["tuned"])
    except BundleError as e:
        raise BundleError(f"{path}: refused, nothing installed: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _open_bundle(path: Path) -> Iterator[IO[bytes]]:
    """The bundle opened for reading; refused when someone else could have changed it (as the cache
    refuses a file another user owns or can write). Checked on the fd, so a swap after the check
    does not matter; non-blocking open, so a FIFO cannot hang the import."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise BundleError("no such file") from None
    except IsADirectoryError:
        raise BundleError("is a directory, not a bundle") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BundleError("is not a regular file")
        if st.st_uid not in (os.getuid(), 0):
            raise BundleError(f"is owned by uid {st.st_uid}, not you (uid {os.getuid()}) or root: another user "
                              f"could have changed it (copy it, or `chown {os.getuid()} {path}`)")
        if st.st_mode & 0o022:
            raise BundleError(f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): fix with "
                              f"`chmod go-w {path}`")
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


def _kind(m: tarfile.TarInfo) -> str:
    if m.issym():
        return f"a symbolic link to {m.linkname[:80]!r}"
    if m.islnk():
        return f"a hard link to {m.linkname[:80]!r}"
    for test, name in ((m.ischr, "a character device"), (m.isblk, "a block device"), (m.isfifo, "a FIFO"),
                       (m.issparse, "a sparse file")):
        if test():
            return name
    return f"of tar type {m.type!r}"


def _check_member(m: tarfile.TarInfo) -> None:
    name = m.name[:200]
    if not (m.isreg() or m.isdir()) or m.issparse():
        raise BundleError(f"member {name!r} is {_kind(m)}: a bundle holds only regular files and directories")
    if m.name.startswith("/") or ".." in m.name.split("/"):
        raise BundleError(f"member {name!r} escapes the bundle (an absolute path or '..')")
    if m.mode & 0o7022:
        raise BundleError(f"member {name!r} has mode {m.mode:o}: setuid, setgid, sticky or group/other-writable "
                          "members are refused")
    if m.name == (INDEX if m.isreg() else "entries"):
        return
    em = _ENTRY_RE.fullmatch(m.name)
    key, fname = em.groups() if em else ("", None)
    if not valid_key(key) or m.isreg() != (fname is not None):
        want = "index.json or entries/<key>/<file>" if m.isreg() else "entries/<key>"
        raise BundleError(f"member {name!r} is not part of a tkjit bundle (expected {want})")


def _unpack(tar: tarfile.TarFile, tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Check every member, read the index, unpack the files it lists into tmp/<key>/, each checked
    against the index's size and sha256; (index, its entries). The tar's own modes, owners and times
    are never applied: files are created here, 0600."""
    members: dict[str, tarfile.TarInfo] = {}
    for m in tar.getmembers():
        _check_member(m)
        if m.name in members:
            raise BundleError(f"member {m.name!r} appears twice (a later copy would replace the first)")
        members[m.name] = m
    if INDEX not in members:
        raise BundleError(f"no {INDEX}: not a tkjit bundle")
    index = _read_index(tar, members[INDEX])
    listed = {INDEX} | {f"entries/{k}/{n}" for k, e in index["entries"].items() for n in e["files"]}
    dirs = {"entries"} | {f"entries/{k}" for k in index["entries"]}
    for name, m in members.items():
        if name not in (dirs if m.isdir() else listed):
            raise BundleError(f"member {name!r} is not in the bundle's index")
    for key, e in index["entries"].items():
        os.mkdir(tmp / key, 0o700)
        for fname, info in e["files"].items():
            where = f"entries/{key}/{fname}"
            m = members.get(where)
            if m is None:
                raise BundleError(f"{where} is missing (the index lists it)")
            if m.size != info["size"]:
                raise BundleError(f"{where} has {m.size} bytes, the index says {info['size']}")
            src = tar.extractfile(m)
            assert src is not None  # a regular member (checked above)
            h = hashlib.sha256()
            fd = os.open(tmp / key / fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as dst:
                while chunk := src.read(1 << 20):
                    h.update(chunk)
                    dst.write(chunk)
            if h.hexdigest() != info["sha256"]:
                raise BundleError(f"{where} does not match its sha256 in the index (changed or damaged)")
    return index, index["entries"]


def _read_index(tar: tarfile.TarFile, m: tarfile.TarInfo) -> dict[str, Any]:
    if m.size > MAX_INDEX:
        raise BundleError(f"{INDEX} has {m.size} bytes, over the {MAX_INDEX}-byte cap")
    src = tar.extractfile(m)
    assert src is not None
    try:
        doc = json.loads(src.read(MAX_INDEX + 1))
    except (ValueError, RecursionError) as e:
        raise BundleError(f"{INDEX} is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise BundleError(f"{INDEX} is not a tkjit bundle index")
    if doc.get("schema") != SCHEMA:
        raise BundleError(f"{INDEX} has schema {doc.get('schema')!r}, this tkjit reads {SCHEMA}")
    if doc.get("sha256") != _seal(doc):
        raise BundleError(f"{INDEX} does not match its checksum (edited or damaged)")
    # Sealed is not trusted (anyone can reseal): the structure is checked before anything becomes a path.
    from tkjit.arch import check_arch

    try:
        check_arch(doc.get("arch"))  # type: ignore[arg-type]  # checked: a str of an arch's form
    except TkjitError as e:
        raise BundleError(f"{INDEX}: {e}") from None
    entries, tuned = doc.get("entries"), doc.get("tuned")
    if not isinstance(entries, dict) or not entries or not isinstance(tuned, list):
        raise BundleError(f"{INDEX} lists no entries")
    for key, e in entries.items():
        files = e.get("files") if isinstance(e, dict) else None
        if not valid_key(key) or not isinstance(files, dict) or MANIFEST not in files:
            raise BundleError(f"{INDEX}: entry {key[:60]!r} is malformed")
        for name, info in files.items():  # before a name becomes a path: as a manifest's files are checked
            try:
                check_file_record(name, info)
            except CorruptEntry as err:
                raise BundleError(f"{INDEX}: entry {key[:12]}: {err}") from None
    return doc


def _verify_entry(key: str, path: Path, arch: str, listed: Mapping[str, Any]) -> Entry:
    """The unpacked entry through the cache's own verification, and what the index says it is."""
    try:
        entry = verify_dir(key, path)
    except CorruptEntry as e:
        raise BundleError(f"entry {key[:12]} ({listed.get('kernel', '?')}): {e}") from None
    meta = entry.meta
    if meta.get("arch") != arch:
        raise BundleError(f"entry {key[:12]} is built for {meta.get('arch')!r}, the bundle is for {arch}")
    for k in ("kernel", "shape", "config"):
        if listed.get(k) != meta.get(k):
            raise BundleError(f"entry {key[:12]}: the index says {k} {listed.get(k)!r}, its manifest {meta.get(k)!r}")
    return entry


def _check_tuned(tuned: list[Any], arch: str, path: Path) -> None:
    from tkjit.tuning_db import SCHEMA as DB_SCHEMA
    from tkjit.tuning_db import validate_doc

    try:
        validate_doc({"schema": DB_SCHEMA, "entries": tuned}, Path(f"{path.name}:{INDEX}"))
    except TuningDBError as e:
        raise BundleError(str(e)) from None
    for t in tuned:
        if t.get("arch", arch) != arch:
            raise BundleError(f"tuned entry for {t['kernel']} is for {t['arch']!r}, the bundle is for {arch}")


def _install(path: Path, arch: str, entries: Sequence[Entry], tuned: list[dict[str, Any]]) -> Report:
    from tkjit.build import cache
    from tkjit.tuning_db import load_db, user_db_path, write_entries

    c = cache()
    report = Report(path, arch, tuned=len(tuned))
    for e in entries:
        expect = {k: e.meta[k] for k in KEY_FIELDS if k in e.meta}
        present = c.lookup(e.key, expect) is not None

        def copy(staging: Path, src: Path = e.path, names: Sequence[str] = tuple(e.manifest["files"])) -> dict:
            for name in names:
                shutil.copyfile(src / name, staging / name)  # our private, verified temp copy
            return {}  # the meta is the manifest's own: the published manifest seals the same content

        if not present:
            c.get_or_build(e.key, e.meta, copy, expect)
        m = e.meta
        report.items.append(Item(e.key, m["kernel"], m["shape"], m["config"], str(m.get("config_source", "?")),
                                 "present" if present else "installed"))
    # A GPU host that only serves has no nvcc: record the build host's versions, which its keys then use.
    built_with = {canonical_json({k: e.meta["toolchain"].get(k) for k in PINNABLE}) for e in entries}
    if len(built_with) == 1:
        c.pin_toolchain(arch, json.loads(built_with.pop()))
    by_gpu: dict[str, list[dict[str, Any]]] = {}
    for t in tuned:
        by_gpu.setdefault(t["gpu"], []).append(t)
    for gpu, ts in sorted(by_gpu.items()):
        dest = user_db_path(arch, gpu)
        try:
            before = {canonical_json(x) for x in load_db(dest).doc["entries"]}
        except (OSError, TuningDBError):  # absent or broken (write_entries keeps a broken one aside)
            before = set()
        report.tuned_changed += sum(canonical_json(t) not in before for t in ts)
        report.tuned_files.append(write_entries(dest, ts, arch=arch, gpu=gpu))
    return report
