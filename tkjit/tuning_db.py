"""Tuned-config databases: the user's (in the cache) and the shipped one (package data).

`tkjit.get` asks `lookup` for a config when none is given. Order:
  1. the user's DB      <cache>/v1/tuned/<arch>/<GPU_model>.json          -> "tuned:user"
  2. the shipped DB     tkjit/tuning_db_data/<arch>/<GPU_model>.json      -> "tuned:shipped"
     (package data, found through importlib.resources; TKJIT_TUNING_DB points elsewhere)
  3. the nearest tuned bucket of the same static shape, user's first       -> "tuned:nearest(user, num_tokens=65536)"
  4. None: the heuristic default serves. So does an entry whose study kept a default that has changed since
     (`kept_old_default`).
GPU_model is the GPU name with spaces as underscores (NVIDIA_H200). A model without its own file
uses any file of the same arch. On a host without that GPU (cross-compiling for a named arch)
the model is TKJIT_GPU_NAME, or any file of the arch. TKJIT_NO_TUNED_DB=1 turns lookups off.

A file is JSON (indent=1, sorted keys, entries sorted: diffable):
  {"schema": 1, "arch": "sm_90a", "gpu": "NVIDIA H200", "entries": [
    {"kernel": ..., "shape": {static params}, "bucket": {runtime param: bucket}, "config": {...},
     "tuned_us": 12.3, "default_us": 14.0, "speedup": 1.14, "spread": 0.01,
     "versions": {"tilelang": ..., "nvcc": ..., "tkjit": ...}, "date": "2026-12-02", "gpu": "NVIDIA H200",
     optional: "won", "trials", "spec_source", "default_config"}]}
Files are parsed once per process (re-read only when they change) and validated. Only JSON is ever
read, and only from regular files of at most MAX_DB_BYTES: a link, FIFO, directory or device is
refused before it is read, NaN/Infinity and deep nesting are rejected.

A malformed file is a unit: one bad entry condemns the whole file (the file was not written by
`write_entries`, which validates every entry, so its other entries are not to be trusted either, and
dropping some would silently change which neighbour the nearest-bucket search picks).
  - `load_db` (tools that write or validate a DB) raises TuningDBError naming the file and the entry.
  - `lookup` (serving `tkjit.get`) never raises for a DB file: it warns once per file and problem
    (naming both) and serves the next source, as if that file were absent.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import json
import logging
import math
import os
import platform
import re
import stat
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from tkjit import envs
from tkjit.canon import canonical_json
from tkjit.errors import ConfigError, TuningDBError
from tkjit.locks import file_lock
from tkjit.spec import KernelSpec

SCHEMA = 1
REQUIRED = {
    "kernel": str, "shape": dict, "bucket": dict, "config": dict, "tuned_us": (int, float, type(None)),
    "default_us": (int, float, type(None)), "speedup": (int, float, type(None)), "spread": (int, float),
    "versions": dict, "date": str, "gpu": str,
}
OPTIONAL = {"won": bool, "trials": int, "spec_source": str, "default_config": dict, "arch": str, "note": str}
_SCALAR = (bool, int, float, str)
TUNING_DB_DIR = envs.TUNING_DB
# A DB entry is ~600 bytes: 8 MiB is >10k tuned shapes of one GPU. A bigger file is not a DB we wrote,
# and is refused from its size without being read.
MAX_DB_BYTES = 8 << 20
_log = logging.getLogger("tkjit")


# ----------------------------------------------------------------------------------------------
# where the files are
# ----------------------------------------------------------------------------------------------
def file_stem(model: str) -> str:
    """'NVIDIA H200' -> 'NVIDIA_H200' (and nothing that could leave the directory)."""
    stem = re.sub(r"[^A-Za-z0-9_.+-]", "_", model.strip().replace(" ", "_")).strip(".")
    return stem or "unknown"


def gpu_model(arch: str, detected: str | None = None) -> str:
    """The model name a DB file is named after: TKJIT_GPU_NAME, the detected GPU, or (CPU) cpu-<machine>."""
    env = envs.GPU_NAME.get()
    if env:
        return env
    if detected:
        return detected
    if arch == "cpu":
        return f"cpu-{platform.machine() or 'unknown'}"
    return arch  # a named arch without its GPU here: no file is named so, any file of the arch serves


_models: dict[str, str] = {}


def _current_model(arch: str) -> str:
    env = envs.GPU_NAME.get()
    if env or arch == "cpu":
        return gpu_model(arch)
    hit = _models.get(arch)
    if hit is not None:
        return hit
    model = arch
    try:
        from tkjit.arch import current_arch, gpu_name

        if current_arch() == arch:
            model = gpu_name() or arch
    except Exception:
        pass
    _models[arch] = model
    return model


def user_db_dir() -> Path:
    from tkjit.build import cache

    return cache().base / "tuned"


SHIPPED_DATA = "tuning_db_data"  # package data of tkjit: tkjit/tuning_db_data/<arch>/<GPU_model>.json


def shipped_db_dir() -> Path:
    """TKJIT_TUNING_DB, else the DB installed with the package (the checkout's tkjit/ when editable)."""
    env = TUNING_DB_DIR.get()
    if env:
        return Path(env).expanduser()
    data = importlib.resources.files("tkjit") / SHIPPED_DATA
    if isinstance(data, Path):
        return data
    return Path(__file__).resolve().parent / SHIPPED_DATA  # a loader without real paths (never zip-safe)


_logged_missing: set[tuple[str, str, str]] = set()


def _log_no_shipped_db(arch: str, model: str, root: Path) -> None:
    """Once per process and (arch, model, dir): say where the shipped DB was looked for. INFO, not a
    warning: most GPUs have no shipped DB and are served the heuristic defaults by design."""
    key = (arch, model, str(root))
    if key in _logged_missing:
        return
    _logged_missing.add(key)
    how = "TKJIT_TUNING_DB" if TUNING_DB_DIR.get() else "package data"
    _log.info("no shipped tuning DB for %s %s: looked in %s (%s) and the user's DB %s; serving heuristic "
              "defaults unless the user tuned the shape", arch, model, db_path(root, arch, model).parent, how,
              user_db_dir())


def db_path(root: Path, arch: str, model: str) -> Path:
    from tkjit.arch import check_arch

    return Path(root) / check_arch(arch) / f"{file_stem(model)}.json"


def user_db_path(arch: str, model: str) -> Path:
    return db_path(user_db_dir(), arch, model)


def shipped_db_path(arch: str, model: str) -> Path:
    return db_path(shipped_db_dir(), arch, model)


def db_files(root: Path, arch: str, model: str) -> list[Path]:
    """The model's own file first, then the arch's other files (sorted) as fallbacks.

    Every *.json name is listed whatever it is (not stat'ed here): a FIFO, directory or link under a
    DB name is refused by load_db and warned about by lookup, not skipped without a word.
    """
    own = db_path(root, arch, model)
    try:
        names = sorted(n for n in os.listdir(own.parent) if n.endswith(".json"))
    except (FileNotFoundError, NotADirectoryError):
        return []  # no DB for this arch: the common case
    except OSError as e:  # unreadable: the other source still serves
        _warn_once(own.parent, f"tuning DB dir {own.parent}: cannot list: {e}")
        return []
    return ([own] if own.name in names else []) + [own.parent / n for n in names if n != own.name]


# ----------------------------------------------------------------------------------------------
# loading and validation
# ----------------------------------------------------------------------------------------------
class DBFile(NamedTuple):
    path: Path
    doc: dict[str, Any]
    index: dict[tuple[str, str], list[tuple[dict, dict]]]  # (kernel, static) -> [(bucket, entry)]


# path -> (signature of the file read, the DBFile or the TuningDBError message it gave): a broken file
# is not parsed again on every lookup either.
_loaded: dict[str, tuple[tuple[int, ...], DBFile | str]] = {}
_warned: set[tuple[str, str]] = set()  # (path, problem) already warned about
_load_lock = threading.Lock()
# O_NOFOLLOW: a link could point anywhere (/dev/zero, a FIFO, another user's file).
# O_NONBLOCK: open() of a FIFO would wait for a writer; with it, open returns and fstat refuses it.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def _bad(path: Path, where: str, problem: str) -> TuningDBError:
    return TuningDBError(f"tuning DB {path}: {where}: {problem}")


def validate_entry(e: Any, path: Path, i: int) -> None:
    where = f"entry {i}"
    if not isinstance(e, dict):
        raise _bad(path, where, f"must be an object, got {type(e).__name__}")
    if isinstance(e.get("kernel"), str):
        where += f" ({e['kernel']} {e.get('shape')} {e.get('bucket')})"
    for k, t in REQUIRED.items():
        if k not in e:
            raise _bad(path, where, f"missing field {k!r}")
        if not isinstance(e[k], t) or (t is not bool and isinstance(e[k], bool) and k != "config"):
            raise _bad(path, where, f"field {k!r} has the wrong type ({type(e[k]).__name__})")
    for k in e:
        if k not in REQUIRED and k not in OPTIONAL:
            raise _bad(path, where, f"unknown field {k!r}")
        if k in OPTIONAL and not isinstance(e[k], OPTIONAL[k]):
            raise _bad(path, where, f"field {k!r} has the wrong type ({type(e[k]).__name__})")
    for k in ("shape", "config", "default_config"):
        for name, v in e.get(k, {}).items():
            if not isinstance(v, _SCALAR):
                raise _bad(path, where, f"{k}.{name} must be a scalar, got {v!r}")
    for name, v in e["bucket"].items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise _bad(path, where, f"bucket.{name} must be a positive int, got {v!r}")
    for k in ("tuned_us", "default_us", "speedup", "spread"):
        v = e[k]
        if v is not None and (not math.isfinite(v) or v < 0):
            raise _bad(path, where, f"{k} must be a finite non-negative number, got {v!r}")
    if not e["config"]:
        raise _bad(path, where, "config is empty")


def validate_doc(doc: Any, path: Path) -> None:
    if not isinstance(doc, dict):
        raise _bad(path, "top level", "must be an object with 'schema' and 'entries'")
    if doc.get("schema") != SCHEMA:
        raise _bad(path, "top level", f"schema {doc.get('schema')!r} is not {SCHEMA}")
    if not isinstance(doc.get("entries"), list):
        raise _bad(path, "top level", "'entries' must be a list")
    seen: dict[tuple, int] = {}
    for i, e in enumerate(doc["entries"]):
        validate_entry(e, path, i)
        k = (e["kernel"], canonical_json(e["shape"]), canonical_json(e["bucket"]))
        if k in seen:
            raise _bad(path, f"entry {i} ({e['kernel']})", f"duplicates entry {seen[k]} (same shape and bucket)")
        seen[k] = i


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link (links are not followed)"), (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return f"of mode {mode:o}"


def _check_regular(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise _bad(path, "file", f"is {_kind(st.st_mode)}, not a regular file")


@contextlib.contextmanager
def _open_db(path: Path) -> Iterator[tuple[BinaryIO, os.stat_result]]:
    """The open file and its fstat; TuningDBError for anything but a regular file (FileNotFoundError passes).

    lstat first, so a device or FIFO is never even opened; the fd is checked again after open, as the
    path may have been swapped in between (what is read is the fd, not the path).
    """
    _check_regular(path, os.lstat(path))
    fd = os.open(path, _OPEN_FLAGS)
    try:
        st = os.fstat(fd)
        _check_regular(path, st)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f, st


def _read_capped(f: BinaryIO, st: os.stat_result, path: Path) -> bytes:
    """The whole file, refused from its fstat size if over the cap; the read itself stops at cap+1
    bytes, for a file that grows meanwhile (or reports a size of 0, as /proc files do)."""
    cap = MAX_DB_BYTES
    if st.st_size > cap:
        raise _bad(path, "file", f"{st.st_size} bytes, over the {cap}-byte cap of a DB file; not read")
    raw = f.read(cap + 1)
    if len(raw) > cap:
        raise _bad(path, "file", f"grew past the {cap}-byte cap of a DB file while being read")
    return raw


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in a DB file")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):  # 1e999: json parses it to inf without asking parse_constant
        raise ValueError(f"{text} overflows a float")
    return v


def _parse(path: Path, raw: bytes) -> DBFile:
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite_float)
    except UnicodeDecodeError as e:
        raise _bad(path, "file", f"not UTF-8 text: {e}") from None
    except RecursionError:  # "[" * 100000: the C parser recurses once per level
        raise _bad(path, "file", "not valid JSON: nested too deeply") from None
    except ValueError as e:
        raise _bad(path, "file", f"not valid JSON: {e}") from None
    validate_doc(doc, path)
    index: dict[tuple[str, str], list[tuple[dict, dict]]] = {}
    for e in doc["entries"]:
        index.setdefault((e["kernel"], canonical_json(e["shape"])), []).append((e["bucket"], e))
    return DBFile(path, doc, index)


def load_db(path: Path) -> DBFile:
    """Parsed and validated, once per process while the file is unchanged.

    Raises TuningDBError naming the file and the problem (FileNotFoundError if there is none, OSError
    if it cannot be read); a failure is remembered like a success, so it is re-raised without re-reading.
    """
    path = Path(path)
    key = str(path)
    with _open_db(path) as (f, st):
        sig = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)  # os.replace gives a new inode
        hit = _loaded.get(key)
        if hit is None or hit[0] != sig:
            try:
                result: DBFile | str = _parse(path, _read_capped(f, st, path))
            except TuningDBError as e:
                result = str(e)
            hit = (sig, result)
            with _load_lock:
                _loaded[key] = hit
    if isinstance(hit[1], str):
        raise TuningDBError(hit[1])
    return hit[1]


def clear_memo() -> None:
    """Forget parsed files and the warnings given (tests; a warning is given once per process)."""
    with _load_lock:
        _loaded.clear()
        _warned.clear()
    _logged_missing.clear()


def _warn_once(path: Path, problem: str) -> None:
    with _load_lock:
        if (str(path), problem) in _warned:
            return
        _warned.add((str(path), problem))
    warnings.warn(f"tkjit: ignoring {problem}", stacklevel=4)


def _serving_db(path: Path) -> DBFile | None:
    """load_db for lookup: a file that cannot serve is warned about (once) and skipped, never raised."""
    try:
        return load_db(path)
    except FileNotFoundError:
        return None  # removed since the dir was listed: as if absent, nothing is wrong
    except TuningDBError as e:
        _warn_once(path, str(e))
    except OSError as e:  # EACCES, EIO, or a link swapped in after lstat (ELOOP)
        _warn_once(path, f"tuning DB {path}: file: cannot read: {e}")
    return None


# ----------------------------------------------------------------------------------------------
# lookup
# ----------------------------------------------------------------------------------------------
def _distance(a: Mapping[str, int], b: Mapping[str, int]) -> float | None:
    if set(a) != set(b):
        return None
    return sum(abs(math.log2(a[k]) - math.log2(b[k])) for k in a)


def lookup(spec: KernelSpec, shape: dict[str, Any], arch: str) -> tuple[dict[str, Any], str] | None:
    """(config, source label) from the tuned DBs for this full shape, or None. The config has the tunables the
    space gained since the entry was written filled in (`with_added`).

    A DB file that cannot be used is skipped with one warning (see the module doc): serving never fails
    because of one.
    """
    found = find_tuned(spec, shape, arch)
    if found is None or kept_old_default(spec, shape, arch, found.entry):
        return None  # (an entry that says "serve the default" of before: today's serves)
    return with_added(spec, found.entry["config"]), found.source


def kept_old_default(spec: KernelSpec, shape: dict[str, Any], arch: str, entry: Mapping[str, Any]) -> bool:
    """Whether `lookup` passes this entry over: its study found nothing that beat the heuristic default, so its
    config is the default of the day it was tuned, and the spec's default for this shape is another now. The
    entry says "serve the default": while that is still the spec's default it serves as tuned; pinning it once
    the default has changed would undo the change (and fill a tunable added since with its old value)."""
    return (entry.get("won") is False and entry.get("default_config") == entry["config"]
            and with_added(spec, entry["config"]) != spec.default_config(shape, arch))


class Found(NamedTuple):
    """A tuned entry `lookup` serves: the entry, its source label and the file it is in."""

    entry: dict[str, Any]
    source: str  # tuned:user, tuned:shipped, tuned:nearest(user, num_tokens=65536)
    path: Path


def tuned_entries(arch: str) -> list[tuple[str, Path, dict[str, Any]]]:
    """(source, file, entry) of every entry `lookup` may serve for arch on this host, user's first
    (`tkjit db show`); files that cannot serve are warned about and skipped, as in lookup."""
    out = []
    model = _current_model(arch)
    for label, root in (("user", user_db_dir()), ("shipped", shipped_db_dir())):
        for path in db_files(root, arch, model):
            db = _serving_db(path)
            out += [(label, path, e) for e in (db.doc["entries"] if db else ())]
    return out


def find_tuned(spec: KernelSpec, shape: dict[str, Any], arch: str) -> Found | None:
    """The entry `lookup` serves for this full shape, with where it comes from (`tkjit db show`)."""
    if envs.flag(envs.NO_TUNED_DB):
        return None
    model = _current_model(arch)
    static_key = canonical_json(spec.static_shape(shape))
    bucket = spec.bucket(shape)
    bucket_key = canonical_json(bucket)
    sources = (("user", user_db_dir()), ("shipped", shipped_db_dir()))
    candidates: list[tuple[float, int, int, str, dict, Path]] = []
    for rank, (label, root) in enumerate(sources):
        paths = db_files(root, arch, model)
        if not paths and label == "shipped":
            _log_no_shipped_db(arch, model, root)
        for path in paths:
            db = _serving_db(path)
            if db is None:
                continue
            for b, e in db.index.get((spec.name, static_key), ()):
                if canonical_json(b) == bucket_key:
                    return Found(e, f"tuned:{label}", path)
                dist = _distance(b, bucket)
                if dist is not None:
                    candidates.append((dist, rank, -sum(b.values()), label, e, path))
    if not candidates:
        return None
    candidates.sort(key=lambda c: c[:3])
    _, _, _, label, e, path = candidates[0]
    where = ", ".join(f"{k}={v}" for k, v in sorted(e["bucket"].items()))
    return Found(e, f"tuned:nearest({label}, {where})", path)


def neighbour_configs(spec: KernelSpec, shape: dict[str, Any], arch: str, limit: int = 4) -> list[dict[str, Any]]:
    """Configs to try first when tuning this full shape: the tuned winners of the same kernel on this arch
    (user's DB, then shipped; this GPU's file, then the arch's other GPUs), nearest first: the same static
    shape before others (fewer differing static params first), then the nearest bucket (log2 distance),
    then this GPU before others. At most `limit`, without repeats; the caller checks them against its space.
    A study's own earlier winner, if any, comes first. Files that cannot serve are skipped, as in lookup."""
    if envs.flag(envs.NO_TUNED_DB):
        return []
    model = _current_model(arch)
    static = spec.static_shape(shape)
    bucket = spec.bucket(shape)
    ranked: list[tuple[tuple, dict[str, Any]]] = []
    for src_rank, root in enumerate((user_db_dir(), shipped_db_dir())):
        for path in db_files(root, arch, model):
            db = _serving_db(path)
            if db is None:
                continue
            other_gpu = int(path.name != f"{file_stem(model)}.json")
            for e in db.doc["entries"]:
                if e["kernel"] != spec.name:
                    continue
                differ = sum(1 for k in set(static) | set(e["shape"]) if static.get(k) != e["shape"].get(k))
                dist = _distance(e["bucket"], bucket)
                ranked.append(((differ, math.inf if dist is None else dist, other_gpu, src_rank),
                               with_added(spec, e["config"])))
    ranked.sort(key=lambda r: r[0])
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _, cfg in ranked:
        key = canonical_json(cfg)
        if key not in seen:
            seen.add(key)
            out.append(dict(cfg))
        if len(out) >= limit:
            break
    return out


# ----------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------
def choose_config(
    spec: KernelSpec, full: dict[str, Any], arch: str, config: Mapping[str, Any] | None, *, exact: bool = False
) -> tuple[dict[str, Any], str]:
    """The config to build and where it came from: explicit -> tuned DB (user's, then shipped) ->
    nearest tuned bucket -> the spec's heuristic default. exact (TKJIT_EXACT_MATH): a chosen config that
    uses fast math or reciprocals gets the spec's `exact` overrides (source "...+exact"); an explicit
    config is the caller's choice and is served as given."""
    device = _device_of(spec, arch)
    if config is not None:
        cfg = spec.check_config(full, config, arch)
        reason = device and spec.device_constraint(full, cfg, device)
        if reason:
            raise ConfigError(f"{spec.name}: config {cfg} does not fit this GPU ({device['sms']} SMs): {reason}")
        return cfg, "explicit"
    cfg, source = None, "default"
    found = lookup(spec, full, arch)
    if found is not None:
        try:
            cfg, source = spec.check_config(full, found[0], arch), found[1]
        except ConfigError as e:  # a DB written for an older space: say so, serve the default
            warnings.warn(f"tkjit: ignoring tuned config from {found[1]}: {e}", stacklevel=3)
        reason = cfg and device and spec.device_constraint(full, cfg, device)
        if reason:  # tuned on a GPU with more SMs (a model without its own file uses the arch's others)
            _log.info("%s: tuned config %s from %s does not fit this GPU (%d SMs): %s; serving the default",
                     spec.name, cfg, source, device["sms"], reason)
            cfg, source = None, "default"
    if cfg is None:
        cfg = spec.default_config(full, arch)
        if device and spec.device_constraint(full, cfg, device):
            cfg, source = nearest_fitting(spec, full, arch, cfg, device), "default+fit"
    if exact and any(cfg.get(k) != v for k, v in spec.exact.items()):
        return _exact_config(spec, full, arch, cfg), f"{source}+exact"
    return cfg, source


def with_added(spec: KernelSpec, config: Mapping[str, Any]) -> dict[str, Any]:
    """A tuned config with the tunables the space gained since it was written (`KernelSpec.added`) filled in
    with their values of before; a config that has them, or lacks others, is left as it is."""
    return {**{k: v for k, v in spec.added.items() if k not in config}, **config}


def _device_of(spec: KernelSpec, arch: str) -> dict[str, int] | None:
    """The GPU limits a spec with a device constraint must fit (None: no such constraint, or not known)."""
    if spec.device_constraint is None:
        return None
    from tkjit.arch import device_limits

    return device_limits(arch)


def nearest_fitting(spec: KernelSpec, full: dict[str, Any], arch: str, cfg: dict[str, Any],
                    device: Mapping[str, int]) -> dict[str, Any]:
    """The allowed config that fits the GPU nearest cfg: the most tunables equal, then the nearest numeric
    values (log2 distance: 66 blocks before 8 for a default of 132). A default sized for an H200 on a GPU
    with fewer SMs."""
    ok = [c for c in spec.configs(full, arch) if not spec.device_constraint(full, c, device)]
    if not ok:
        raise ConfigError(f"{spec.name}: no config of the space fits this GPU ({device['sms']} SMs) at {full}")

    def distance(c: dict[str, Any]) -> float:
        return sum(abs(math.log2(c[k] / v)) for k, v in cfg.items()
                   if isinstance(v, int) and not isinstance(v, bool) and v > 0 and c[k] > 0)

    return min(ok, key=lambda c: (-sum(c[k] == v for k, v in cfg.items()), distance(c)))


def _exact_config(spec: KernelSpec, full: dict[str, Any], arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """cfg with the spec's exact overrides; where the space does not allow that combination, the allowed
    config sharing the most tunables with cfg among those that have the overrides."""
    want = {**cfg, **spec.exact}
    try:
        return spec.check_config(full, want, arch)
    except ConfigError:
        pass
    ok = [c for c in spec.configs(full, arch) if all(c.get(k) == v for k, v in spec.exact.items())]
    if not ok:
        raise ConfigError(f"{spec.name}: no config of the space has the exact overrides {dict(spec.exact)} on {arch}")
    return max(ok, key=lambda c: sum(c.get(k) == v for k, v in want.items()))


def versions(arch: str) -> dict[str, str]:
    from tkjit.key import nvcc_version, tilelang_version
    from tkjit.version import __version__

    v = {"tilelang": tilelang_version(), "tkjit": __version__}
    if arch != "cpu":
        v["nvcc"] = nvcc_version()
    return v


def make_entry(r: Any) -> dict[str, Any]:
    """The DB entry of a TuneResult."""
    return {
        "kernel": r.kernel, "shape": dict(r.shape), "bucket": dict(r.bucket), "config": dict(r.config),
        "tuned_us": _round(r.tuned_us), "default_us": _round(r.default_us), "speedup": _round(r.speedup, 4),
        "spread": _round(r.spread, 4) or 0.0, "versions": versions(r.arch), "date": time.strftime("%Y-%m-%d"),
        "gpu": r.gpu, "won": bool(r.won), "trials": int(r.trials), "spec_source": r.spec_source,
        "default_config": dict(r.default_config),
    }


def _round(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(float(v), nd)


def _sort_key(e: Mapping[str, Any]) -> tuple:
    return (e["kernel"], canonical_json(e["shape"]), sorted(e["bucket"].items()))


def _lock_path(path: Path) -> Path:
    """Writers of one DB file serialise on a lock in the cache (not beside a file in the repo)."""
    import hashlib

    from tkjit.build import cache

    c = cache()
    c.ensure()
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    return c.base / "locks" / f"tuning-db-{digest}.lock"


def write_entries(path: Path, entries: Iterable[Mapping[str, Any]], *, arch: str, gpu: str) -> Path:
    """Merge entries into the file at path (same kernel+shape+bucket replaced), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with file_lock(_lock_path(path)):  # no timeout: writers hold it only to merge one small file
        merged: dict[tuple, dict] = {}
        if path.exists():
            try:
                for e in load_db(path).doc["entries"]:
                    merged[(e["kernel"], canonical_json(e["shape"]), canonical_json(e["bucket"]))] = e
            except TuningDBError:
                bad = path.with_name(path.name + f".bad.{int(time.time())}")
                os.replace(path, bad)  # keep it for inspection; never merge into a broken file
        for i, e in enumerate(entries):
            e = dict(e)
            validate_entry(e, path, i)
            merged[(e["kernel"], canonical_json(e["shape"]), canonical_json(e["bucket"]))] = e
        doc = {"schema": SCHEMA, "arch": arch, "gpu": gpu, "entries": sorted(merged.values(), key=_sort_key)}
        validate_doc(doc, path)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    return path

