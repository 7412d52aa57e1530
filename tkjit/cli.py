"""The `tkjit` command: inspect the catalog and the cache, fill the cache (also cross-compiling)."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from tkjit.errors import TkjitError, UsageError, brief

log = logging.getLogger("tkjit")


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def parse_kv(items: Iterable[str], what: str) -> dict[str, Any]:
    """`key=value` arguments (`--shape`, `--config`) as a dict; UsageError names a bad one.

    Values are scalars: true/false, ints, JSON numbers and strings, else the text as a str.
    An item may hold several pairs separated by commas (`n=4,num_tokens=4096`), so a tool's
    one-string form and the `--shape k=v ...` form read the same: a comma followed by `key=` starts
    a new pair (no shape param or tunable value holds one).
    """
    out: dict[str, Any] = {}
    for item in items:
        for part in _PAIR_SEP.split(item):
            if "=" not in part:
                raise UsageError(f"--{what} takes key=value, got {brief(part)}")
            k, v = part.split("=", 1)
            k = k.strip()
            if not k:
                raise UsageError(f"--{what} takes key=value, got {brief(part)} (no key)")
            out[k] = _parse_value(v.strip(), f"--{what} {k}")
    return out


def parse_shape(items: Iterable[str] | str) -> dict[str, Any]:
    """The shape syntax of every tkjit tool: `--shape num_tokens=4096 n=4` (or `num_tokens=4096,n=4`).

    `items` is the option's list of words, or one string. Returns {param: value}; values are parsed as
    in `parse_kv`. UsageError names a word it cannot read.
    """
    return parse_kv([items] if isinstance(items, str) else items, "shape")


def add_shape_arg(parser: argparse.ArgumentParser, *, help: str | None = None) -> None:
    """Add the shared `--shape K=V ...` option (repeatable; read it with `parse_shape(args.shape)`)."""
    parser.add_argument(
        "--shape", nargs="+", action="extend", default=[], metavar="K=V",
        help=help or "shape params, e.g. --shape num_tokens=4096 n=4 (`tkjit specs NAME` lists them)",
    )


# A comma starts a new pair only where a `key=` follows: a quoted string value may hold commas.
_PAIR_SEP = re.compile(r",(?=\s*[A-Za-z_][A-Za-z0-9_]*\s*=)")
_INT_RE = re.compile(r"[+-]?[0-9]+", re.ASCII)
_MAX_DIGITS = 100  # an int64 has 19; int() refuses (or takes long over) thousands


def _parse_value(v: str, where: str) -> Any:
    # Parsed, never eval'd. No shape param or tunable takes a list or object, and a deeply
    # nested one would exhaust the JSON parser's recursion: refused before parsing.
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if _INT_RE.fullmatch(v):  # before JSON, which refuses leading zeros (04)
        digits = len(v.lstrip("+-"))
        if digits > _MAX_DIGITS:
            raise UsageError(f"{where}: a number of {digits} digits is out of range")
        return int(v)
    if v[:1] in ("[", "{"):
        raise UsageError(f"{where}: values are numbers, true/false or strings, not JSON lists or objects")
    try:
        return json.loads(v)
    except ValueError:
        return v


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _when(ts: float | None) -> str:
    if not ts:
        return "-"
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


def _compact(d: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in d.items())


def known_kernel(name: str):
    """The spec called `name`; an unknown one is a TkjitError naming the closest names (did you mean)."""
    import difflib

    from tkjit.errors import UnknownKernelError
    from tkjit.registry import all_specs, get_spec

    try:
        return get_spec(name)
    except UnknownKernelError:
        names = sorted(s.name for s in all_specs())
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
        # A prefix or part of a name (`sinkhorn`, `cast`) is a near miss difflib scores low.
        close += [n for n in names if name and name in n and n not in close][: 3 - len(close)]
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise UnknownKernelError(f"unknown kernel {brief(name)}{hint} (known: {', '.join(names)})") from None


def _shape_of(spec, words: list[str]) -> dict[str, Any]:
    """The full shape from `--shape` words; a missing param's error says how to pass it."""
    from tkjit.errors import ShapeError

    given = parse_shape(words)
    if not given and any(p.default is None for p in spec.params):
        example = " ".join(f"{p.name}={spec.examples[0].get(p.name, 'N') if spec.examples else 'N'}"
                           for p in spec.params if p.default is None)
        raise UsageError(f"{spec.name} needs --shape, e.g. --shape {example} (`tkjit specs {spec.name}` lists "
                         "the params)")
    try:
        return spec.canonical_shape(given)
    except ShapeError as e:
        missing = [p.name for p in spec.params if p.name not in given and p.default is None]
        if not missing or "missing shape params" not in str(e):
            raise
        ex = {**spec.examples[0], **given} if spec.examples else {}
        example = " ".join(f"{k}={ex.get(k, 'N')}" for k in [*given, *missing] if k in ex or k in missing)
        raise ShapeError(f"{e}; pass them as --shape {example}") from None


def _cli_arch(arch: str | None) -> str:
    """resolve_arch, its errors worded for the command line."""
    from tkjit.arch import resolve_arch

    try:
        return resolve_arch(arch)
    except TkjitError as e:
        raise type(e)(cli_syntax(str(e))) from None


def cli_syntax(message: str) -> str:
    """An API error's keyword syntax as the command's options: `arch='sm_90a'` -> `--arch sm_90a`."""
    return _KW_RE.sub(lambda m: f"--{m.group(1)} {m.group(3)}", message)


_KW_RE = re.compile(r"\b(arch)=(['\"]?)([A-Za-z0-9_]+)\2")


def cmd_specs(args) -> int:
    from tkjit.registry import all_specs

    for name in args.name:
        known_kernel(name)  # an unknown name is an error naming the near misses, not silently skipped
    for spec in all_specs():
        if args.name and spec.name not in args.name:
            continue
        ex = spec.canonical_shape(spec.examples[0])
        print(f"{spec.name}  ({spec.family})  {spec.doc}")
        for p in spec.params:
            print(f"  shape  {p.describe()}")
        n_allowed = len(spec.configs(ex))
        print(f"  space  {n_allowed} allowed configs at {_compact(ex)}")
        for k, vals in spec.space.items():
            print(f"         {k}: {list(vals)}")
        print(f"  default at {_compact(ex)}: {_compact(spec.default_config(ex))}")
        if spec.exact:
            print(f"  exact  TKJIT_EXACT_MATH=1 serves the chosen config with {_compact(spec.exact)}")
        print()
    return 0


def _iso(ts: Any) -> Any:
    """An epoch time as local ISO 8601 with its offset (`2026-12-03T07:55:12+00:00`); other values as is."""
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not 0 < ts < 1e11:
        return ts
    return datetime.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")


def _source(r: dict) -> str:
    return str(r.get("config_source", r.get("status", "?")))


def _matches(r: dict, args) -> bool:
    import fnmatch

    if args.name and not fnmatch.fnmatchcase(str(r.get("kernel", "")), args.name):
        return False
    if args.arch and r.get("arch") != args.arch:
        return False
    # --source tuned matches tuned:user, tuned:shipped and tuned:nearest(...)
    return not args.source or _source(r) == args.source or _source(r).startswith(args.source + ":")


def _width() -> int | None:
    """Columns to fit: $COLUMNS, else the terminal's; None when stdout is no terminal (a pipe, a file)."""
    import shutil

    if os.environ.get("COLUMNS", "").strip().isdigit() or sys.stdout.isatty():
        return max(40, shutil.get_terminal_size().columns)
    return None


def _fit(rows: list[list[str]], header: list[str], width: int | None, squeeze: Sequence[int]) -> list[list[str]]:
    """Shorten the `squeeze` columns (widest first, ending in `…`) until the table fits `width`."""
    if width is None or not rows:
        return rows
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    over = sum(widths) + 2 * (len(widths) - 1) - width
    while over > 0:
        i = max(squeeze, key=lambda j: widths[j])
        floor = max(len(header[i]), 8)
        if widths[i] <= floor:
            break
        cut = min(over, widths[i] - floor)
        widths[i] -= cut
        over -= cut
    return [[_clip(str(x), widths[j]) if j in squeeze else x for j, x in enumerate(r)] for r in rows]


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def cmd_list(args) -> int:
    from tkjit.build import cache

    if args.name and not any(c in args.name for c in "*?["):
        known_kernel(args.name)  # a typo is an error with near misses, not an empty table
    every = cache().entries()
    entries = sorted((r for r in every if _matches(r, args)),
                     key=lambda r: (str(r.get("kernel", "")), str(r.get("arch", "")), -(r.get("last_used") or 0)))
    if args.json:
        out = [{k: _iso(v) if k in ("created", "last_used") else v for k, v in r.items()} for r in entries]
        print(json.dumps(out, indent=1, sort_keys=True, default=str))
        return 0
    if not entries:
        what = "matching entries" if len(every) else "entries"
        print(f"cache {cache().root} has no {what}" if len(every) else f"cache {cache().root} is empty")
        return 0
    header = ["kernel", "shape", "arch", "source", "size", "last used", "key"]
    if args.wide:
        header.insert(3, "config")
    rows = []
    for r in entries:
        row = [str(r.get("kernel", "?")), _compact(r.get("shape", {})), str(r.get("arch", "?")), _source(r),
               _size(r.get("size", 0)), _when(r.get("last_used")), r["key"] if args.wide else r["key"][:12]]
        if args.wide:
            row.insert(3, _compact(r.get("config", {})))
        rows.append(row)
    if not args.wide:
        rows = _fit(rows, header, _width(), squeeze=[1, 3])  # shape and source give way first
    print(_table(rows, header))
    total = _size(sum(r.get("size", 0) for r in entries))
    shown = f"{len(rows)} of {len(every)}" if len(rows) != len(every) else f"{len(rows)}"
    shown += " entry" if len(every) == 1 else " entries"
    print(f"\n{shown}, {total} in {cache().root}" + ("" if args.wide else " (--wide adds config and full key)"))
    return 0


def _served_arch(arch: str | None) -> str | None:
    """The arch `tkjit.get` would build for (--arch, TKJIT_ARCH, the GPU); None when there is none."""
    if arch is not None:
        return arch
    try:
        return _cli_arch(None)
    except TkjitError:
        return None


def cmd_show(args) -> int:
    from tkjit.tuning_db import choose_config

    spec = known_kernel(args.name)
    full = _shape_of(spec, args.shape) if args.shape else None
    arch = _cli_arch(args.arch) if full is not None else _served_arch(args.arch)
    print(f"{spec.name} ({spec.family}): {spec.doc}")
    for p in spec.params:
        print(f"  shape  {p.describe()}  {p.doc}")
    for t in spec.inputs:
        print(f"  input  {t.name}: {t.dtype if isinstance(t.dtype, str) else '(by shape)'} {t.dims}")
    for t in spec.outputs:
        print(f"  output {t.name}: {t.dtype if isinstance(t.dtype, str) else '(by shape)'} {t.dims}")
    for k, vals in spec.space.items():
        print(f"  space  {k}: {list(vals)}")

    def served(shape: dict) -> str:
        # Exactly what tkjit.get picks for this shape: explicit > tuned DB (user, shipped, nearest) > default.
        cfg, source = choose_config(spec, shape, arch, None)
        line = f"{_compact(cfg)}  ({source}"
        default = spec.default_config(shape, arch)
        return line + (f"; heuristic default {_compact(default)})" if default != cfg else ")")

    if full is not None:
        print(f"  config at {_compact(full)} for {arch}: {served(full)}")
        print(f"         {len(spec.configs(full, arch))} allowed configs")
    else:
        for ex in spec.examples:
            shape = spec.canonical_shape(ex)
            n = len(spec.configs(shape, arch))
            if arch is None:
                print(f"  example {_compact(ex)}: heuristic default {_compact(spec.default_config(shape))}, "
                      f"{n} allowed configs")
            else:
                print(f"  example {_compact(ex)} for {arch}: {served(shape)}, {n} allowed configs")
        if arch is None:
            print("  (no GPU here: pass --arch sm_90a to see the tuned configs tkjit.get serves for an arch)")
    from tkjit.build import cache

    mine = [r for r in cache().entries() if r.get("kernel") == spec.name]
    print(f"  cached  {len(mine)} {'entry' if len(mine) == 1 else 'entries'}")
    for r in mine:
        print(f"    {r['key'][:12]} {r.get('arch')} {_compact(r.get('shape', {}))} {_compact(r.get('config', {}))} "
              f"({_source(r)})")
    return 0


def cmd_compile(args) -> int:
    from tkjit import envs
    from tkjit.pool import compile_many, unique_jobs
    from tkjit.registry import all_specs
    from tkjit.tuning_db import choose_config

    # The arguments first: a usage error is reported before any lookup or environment problem.
    cfg_in = parse_kv(args.config, "config") if args.config else None
    if not args.all_defaults:
        if not args.name:
            raise UsageError("compile: missing the kernel NAME: `tkjit compile NAME --shape K=V ...` "
                             "(or --all-defaults for every spec's example shapes)")
        if len(args.name) > 1:
            raise UsageError(f"compile takes one kernel NAME with --shape (got {len(args.name)}: "
                             f"{' '.join(args.name)}); --all-defaults takes several")
    elif args.shape or cfg_in:
        raise UsageError("--all-defaults compiles each spec's example shapes with default configs: "
                         "it takes no --shape or --config")
    if envs.flag(envs.DISABLE_JIT):
        raise TkjitError(f"{envs.DISABLE_JIT.name}=1 forbids compiling: unset it to fill the cache")
    if args.all_defaults:
        specs = [known_kernel(n) for n in args.name] if args.name else all_specs()
        shapes = [(s, s.canonical_shape(ex)) for s in specs for ex in s.examples]
    else:
        s = known_kernel(args.name[0])
        shapes = [(s, _shape_of(s, args.shape))]
    arch = _cli_arch(args.arch)
    jobs = []
    for spec, full in shapes:
        cfg, source = choose_config(spec, full, arch, cfg_in)
        jobs.append((spec.name, spec.static_shape(full), cfg, arch, source))
    jobs = unique_jobs(jobs)
    print(f"compiling {len(jobs)} kernel(s) for {arch} with {args.jobs or 'all'} jobs ...", flush=True)
    failed = 0
    results = compile_many(jobs, args.jobs)
    for job, res in zip(jobs, _progress(results)):
        key, err = res
        if err is not None:
            status = f"FAILED: {_first_line(err)}"
        elif getattr(res, "built", False):
            secs = getattr(res, "compile_s", None)
            status = f"ok built {key[:12]}" + (f" ({secs:.1f} s)" if secs is not None else "")
        else:
            status = f"ok cached {key[:12]}"
        failed += err is not None
        print(f"  {job[0]} {_compact(job[1])} {_compact(job[2])}: {status}")
        if err is not None:
            log.debug("%s: the whole error:\n%s", job[0], err)
    if failed:
        print(f"tkjit: error: {failed} of {len(jobs)} kernel(s) failed to compile (TKJIT_LOG=debug prints the "
              "whole errors)", file=sys.stderr)
    return 1 if failed else 0


def _first_line(err: Any) -> str:
    """A compile error's first line (TileLang's carry the generated source and the nvcc command after it),
    plus nvcc's own `fatal`/`error` line when there is one."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else "unknown error"
    # TileLang puts the generated source right after its message, on the same line.
    first = re.split(r":\s*(?=#if|#include|#define|extern \"C\")", first, maxsplit=1)[0]
    rest = [ln.strip() for ln in text.splitlines()[1:]]
    fatal = next((ln for ln in rest if re.search(r"\bfatal\b", ln)), None) or next(
        (ln for ln in rest if re.search(r"\berror\b", ln) and not ln.endswith(":")), None)
    return f"{first} [{fatal}]" if fatal and fatal not in first else first


def _progress(results: list) -> Iterable:
    """A tqdm bar over the results when tqdm is installed and stderr is a terminal; else as is."""
    if len(results) < 2 or not sys.stderr.isatty():
        return results
    try:
        from tqdm import tqdm
    except ImportError:
        return results
    return tqdm(results, file=sys.stderr, leave=False)


def cmd_clear(args) -> int:
    from tkjit.build import cache

    c = cache()
    res = c.clear()
    msg = f"removed {res.removed} entries from {c.root}"
    if res.skipped:
        msg += f"; skipped {len(res.skipped)} in use or being built: {', '.join(k[:12] for k in res.skipped)}"
    print(msg)
    tuned = c.base / "tuned"
    dbs, journal = _tuned_files(tuned)
    if args.all:
        removed = _remove_tuned(tuned)
        print(f"removed the tuned DB ({len(dbs)} files) and the tuning journal"
              f"{'' if journal else ' (there was none)'} from {tuned}" if removed else f"{tuned} held nothing")
    elif dbs or journal:
        what = [f"the tuned DB ({len(dbs)} files, {_size(sum(_fsize(p) for p in dbs))})"] if dbs else []
        what += [f"the tuning journal ({_size(_fsize(journal))})"] if journal else []
        print(f"kept {' and '.join(what)} in {tuned}: `tkjit clear --all` removes them too")
    else:
        print(f"no tuned DB or tuning journal in {tuned}")
    return 0


def _fsize(p: Path | None) -> int:
    try:
        return os.lstat(p).st_size if p else 0
    except OSError:
        return 0


def _tuned_files(tuned: Path) -> tuple[list[Path], Path | None]:
    """The user's tuned-DB files (`<arch>/<GPU>.json`) and the Optuna journal under the cache's tuned dir."""
    dbs = sorted(p for p in tuned.glob("*/*.json") if p.is_file() and not p.is_symlink())
    journal = tuned / "journal.log"
    return dbs, journal if os.path.lexists(journal) else None


def _remove_tuned(tuned: Path) -> int:
    """Everything under the tuned dir (DB files, journal, their locks and `.bad` copies); the count removed.

    Links are removed, never followed; the dir itself stays (the cache's layout).
    """
    import shutil

    n = 0
    try:
        children = list(os.scandir(tuned))
    except FileNotFoundError:
        return 0
    for d in children:
        try:
            if d.is_dir(follow_symlinks=False):
                shutil.rmtree(d.path)
            else:
                os.unlink(d.path)
            n += 1
        except FileNotFoundError:  # removed meanwhile by another process
            pass
    return n


def cmd_prune(args) -> int:
    from tkjit.build import cache

    removed = cache().prune(args.max_size)
    print(f"evicted {len(removed)} least recently used entries; {_size(cache().total_bytes())} left")
    return 0


def cmd_doctor(args) -> int:
    import platform

    from tkjit import envs, key
    from tkjit.arch import current_arch
    from tkjit.build import cache
    from tkjit.errors import CacheError
    from tkjit.version import __version__

    try:
        import torch

        torch_v = torch.__version__
        gpu = "none"
        if torch.cuda.is_available():  # the SM count: what persistent (cooperative) grids are fitted to
            gpu = f"{torch.cuda.get_device_name(0)} ({torch.cuda.get_device_properties(0).multi_processor_count} SMs)"
    except Exception as e:  # doctor reports, it does not fail
        torch_v, gpu = f"unavailable ({e})", "none"
    arch = current_arch() if gpu != "none" else None
    rows = [
        ["tkjit", __version__], ["python", platform.python_version()], ["torch", torch_v],
        ["tilelang", key.tilelang_version()], ["nvcc", f"{key.nvcc_version()} ({key.nvcc_path() or 'not found'})"],
        ["gpu", gpu], ["arch", arch or f"none (set TKJIT_ARCH or pass --arch; env: {envs.ARCH.get()})"],
        ["cache dir", str(cache().root)],
    ]
    ok = True
    try:
        cache().ensure()
        rows.append(["cache perms", f"ok (private to uid {os.getuid()})"])
    except CacheError as e:
        rows.append(["cache perms", f"PROBLEM: {e}"])
        ok = False
    except OSError as e:  # not a dir, no such parent, read-only: said in the table, not raised
        rows.append(["cache perms", f"PROBLEM: {os_error_message(e)}"])
        ok = False
    for var in envs.REGISTRY:
        rows.append([var.name, str(var.get())])
    print(_table(rows, ["item", "value"]))
    return 0 if ok else 1


def os_error_message(e: OSError) -> str:
    """One line for an OSError: `cannot use the cache at ROOT: <strerror>` when it is the cache's."""
    from tkjit.cache import cache_root

    reason = e.strerror or str(e)
    named = isinstance(e.filename, (str, bytes, os.PathLike))  # some calls report an fd, or nothing
    path = os.fsdecode(e.filename) if named else None
    try:
        root = cache_root()
    except Exception:  # the error being reported matters more than naming the root
        return f"{path}: {reason}" if path else reason
    if path is None or _on_the_way(Path(path), root):
        # The path is the root, inside it, or a parent it needs: the cache is what failed.
        where = f" ({path})" if path and Path(path) != root else ""
        return f"cannot use the cache at {root}: {reason}{where}"
    return f"{path}: {reason}"


def _on_the_way(path: Path, root: Path) -> bool:
    return path == root or root in path.parents or path in root.parents


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line like every other error (argparse prints the usage block first); main exits 2.
        raise UsageError(f"{message} (see `{self.prog} --help`)") from None


def _size_arg(text: str) -> int:
    from tkjit.errors import ConfigError
    from tkjit.sizes import parse_size

    try:
        return parse_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _jobs_arg(text: str) -> int:
    t = text.strip()
    n = int(t) if _INT_RE.fullmatch(t) and len(t) < 10 else 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"takes a number of processes (1 or more, e.g. 4), got {brief(text)}")
    return n


def version_line() -> str:
    """`tkjit <version> (tilelang <v>, torch <v>)`, read without importing tilelang or torch."""
    from importlib.metadata import PackageNotFoundError, version

    from tkjit.key import tilelang_version
    from tkjit.version import __version__

    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = "none"
    return f"tkjit {__version__} (tilelang {tilelang_version()}, torch {torch})"


class _VersionAction(argparse.Action):
    def __init__(self, option_strings, dest, **kw) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None) -> NoReturn:
        print(version_line())
        sys.stdout.flush()
        raise SystemExit(0)


def _arch_arg(text: str) -> str:
    from tkjit.arch import check_arch

    try:
        return check_arch(text.strip())
    except TkjitError:
        raise argparse.ArgumentTypeError(f"takes an arch such as sm_90a, sm_100a, sm_89 or cpu, got {brief(text)}")\
            from None


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="tkjit", description=__doc__,
                 epilog="Exit status: 0 ok, 1 a tkjit error, 2 a usage error (the same for every command).")
    ap.add_argument("--version", action=_VersionAction, help="print tkjit's version (and tilelang's, torch's)")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    p = sub.add_parser("specs", help="the kernel catalog: shape params, space, default")
    p.add_argument("name", nargs="*", metavar="NAME")
    p.set_defaults(fn=cmd_specs)
    p = sub.add_parser("list", help="cache entries (a table that fits the terminal; --wide, --json)")
    p.add_argument("name", nargs="?", metavar="NAME", help="only this kernel (a glob such as 'sinkhorn*' too)")
    p.add_argument("--arch", type=_arch_arg, default=None, help="only entries built for this arch")
    p.add_argument("--source", default=None, metavar="S",
                   help="only configs from this source: default, explicit, tuned (any), tuned:user, tuned:shipped")
    p.add_argument("--wide", action="store_true", help="every column (config, full key), nothing shortened")
    p.add_argument("--json", action="store_true", help="the rows as JSON (times in ISO 8601)")
    p.set_defaults(fn=cmd_list)
    p = sub.add_parser("show", help="one kernel: spec, the config tkjit.get serves, cached entries")
    p.add_argument("name", metavar="NAME")
    add_shape_arg(p, help="the config tkjit.get would serve at this shape, and its source")
    p.add_argument("--arch", type=_arch_arg, default=None, help="the arch to serve for (default: TKJIT_ARCH, the GPU)")
    p.set_defaults(fn=cmd_show)
    p = sub.add_parser("compile", help="fill the cache (cross-compiles on a CPU-only host with --arch)")
    p.add_argument("name", nargs="*", metavar="NAME")
    add_shape_arg(p)
    p.add_argument("--config", nargs="+", action="extend", default=[], metavar="K=V",
                   help="an explicit config (default: what tkjit.get would serve)")
    p.add_argument("--arch", type=_arch_arg, default=None, help="e.g. sm_90a (default: TKJIT_ARCH, the GPU)")
    p.add_argument("--all-defaults", action="store_true", help="every spec's example shapes, default configs")
    p.add_argument("-j", "--jobs", type=_jobs_arg, default=None)
    p.set_defaults(fn=cmd_compile)
    p = sub.add_parser("clear", help="remove every cache entry (--all: the tuned DB and tuning journal too)")
    p.add_argument("--all", action="store_true", help="also remove the user's tuned DB and the tuning journal")
    p.set_defaults(fn=cmd_clear)
    p = sub.add_parser("prune", help="evict least recently used entries down to a size")
    p.add_argument("--max-size", required=True, type=_size_arg, help="e.g. 500M, 2G, 1.5GiB or bytes")
    p.set_defaults(fn=cmd_prune)
    p = sub.add_parser("doctor", help="versions, arch, nvcc, cache dir, permissions")
    p.set_defaults(fn=cmd_doctor)
    p = sub.add_parser("plot", help="charts (needs matplotlib: pip install 'tkjit[plot]')")
    what = p.add_subparsers(dest="what", required=True, metavar="CHART")
    q = what.add_parser("bench", help="a bench JSON (tools/bench.py --json) against the copy ceiling")
    q.add_argument("json", metavar="BENCH_JSON")
    q.add_argument("-o", "--out", required=True, metavar="PNG")
    q.add_argument("--title", default=None)
    q.set_defaults(fn=cmd_plot_bench)
    q = what.add_parser("study", help="a tuning study: time per trial and the best so far")
    q.add_argument("name", nargs="?", metavar="KERNEL", help="the study's kernel (needed when several match)")
    add_shape_arg(q, help="the study's shape (a study is per static shape and runtime bucket)")
    q.add_argument("--arch", type=_arch_arg, default=None)
    q.add_argument("--storage", default=None, metavar="URL",
                   help="journal:PATH, a .log path or an Optuna URL (default: the cache's journal)")
    q.add_argument("-o", "--out", required=True, metavar="PNG")
    q.add_argument("--title", default=None)
    q.set_defaults(fn=cmd_plot_study)
    _add_tune(sub)
    _add_db(sub)
    _add_bundle(sub)
    return ap


# ----------------------------------------------------------------------------------------------
# tkjit tune
# ----------------------------------------------------------------------------------------------
_STORAGE_HELP = ("journal:PATH, sqlite:///PATH or postgresql://USER@HOST/DB (psycopg: pip install "
                 "'tkjit[distributed]'); default: the cache's journal")


def _positive_int(text: str) -> int:
    return _jobs_arg(text)


def _add_tune(sub: Any) -> None:
    p = sub.add_parser(
        "tune", help="tune a kernel's shape, or a manifest; several workers may share one storage",
        description="Tune one kernel at a shape (NAME --shape K=V ...) or every study of a manifest (--manifest). "
        "Trials are stored as they finish, so a killed run resumes; workers given one --storage (on many "
        "GPUs and hosts) share each study. Writes the winners into the user's tuned DB.")
    p.add_argument("name", nargs="?", metavar="NAME")
    add_shape_arg(p)
    p.add_argument("--manifest", default=None, metavar="FILE", help="a TOML manifest of studies (tools/manifest.toml)")
    p.add_argument("--kernels", default=None, metavar="A,B", help="with --manifest: only these kernels")
    p.add_argument("--arch", type=_arch_arg, default=None, help="default: the GPU's; cpu: TileLang's C target")
    n = p.add_mutually_exclusive_group()
    n.add_argument("--trials", type=_positive_int, default=None, metavar="N",
                   help="distinct configs to measure per study (default: all of a space up to 64, else TPE)")
    n.add_argument("--max-configs", type=_positive_int, default=None, metavar="N",
                   help="tune an evenly spread slice of N configs of each space (CI, smoke runs)")
    p.add_argument("--time-budget", type=float, default=None, metavar="S", help="seconds per study")
    p.add_argument("--storage", default=None, metavar="URL", help=_STORAGE_HELP)
    p.add_argument("--study-prefix", default="", metavar="P",
                   help="before each study's name: only workers with the same prefix share studies")
    p.add_argument("--heartbeat", type=_positive_int, default=None, metavar="S",
                   help="RDB storages: heartbeat seconds; a dead worker's trials are retried after 3x "
                   "(default 10)")
    p.add_argument("-j", "--jobs", type=_jobs_arg, default=None, help="parallel compile processes (default: cores)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="seconds before a benchmark counts as hung")
    p.add_argument("--bench-budget", type=float, default=None, metavar="S", help="timing seconds per candidate")
    d = p.add_mutually_exclusive_group()
    d.add_argument("--device", type=int, default=None, metavar="N", help="the GPU to measure on (of the visible ones)")
    d.add_argument("--devices", choices=["all"], default=None,
                   help="one worker process per visible GPU, sharing the studies")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the trials already stored (default on)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exhaustive-max", type=int, default=64, metavar="N", help="enumerate spaces up to N configs")
    p.add_argument("--update-shipped", action="store_true",
                   help="also write the shipped DB (tkjit/tuning_db_data, or TKJIT_TUNING_DB)")
    p.add_argument("--no-user-db", action="store_true", help="do not write the user's tuned DB")
    p.add_argument("--json", action="store_true", help="the results as JSON on stdout (the table goes to stderr)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    # Test hooks: a deterministic timer, extra specs imported in every process.
    p.add_argument("--timer", default=None, help=argparse.SUPPRESS)
    p.add_argument("--import", dest="imports", action="append", default=[], help=argparse.SUPPRESS)
    p.set_defaults(fn=cmd_tune)


def _studies_of(args) -> list[dict[str, Any]]:
    from tkjit.tuning.pretune import load_manifest

    if args.manifest:
        if args.name or args.shape:
            raise UsageError("tune: give NAME --shape K=V ... or --manifest FILE, not both")
        studies = load_manifest(args.manifest)
        if args.kernels:
            wanted = set(args.kernels.split(","))
            for k in wanted:
                known_kernel(k)
            studies = [s for s in studies if s["kernel"] in wanted]
        return studies
    if not args.name:
        raise UsageError("tune: missing the kernel NAME: `tkjit tune NAME --shape K=V ...` (or --manifest FILE)")
    if args.kernels:
        raise UsageError("tune: --kernels filters a --manifest")
    import importlib

    for m in args.imports:  # a test's extra specs: registered before the NAME is looked up
        importlib.import_module(m)
    spec = known_kernel(args.name)
    return [{"kernel": spec.name, "shape": _shape_of(spec, args.shape)}]


def cmd_tune(args) -> int:
    from tkjit import envs
    from tkjit.procs import process_age_s
    from tkjit.tuning.pretune import (
        PretuneOptions,
        footer,
        run_studies,
        select_device,
        start_evaluator,
        summary_table,
    )

    if envs.flag(envs.DISABLE_JIT):
        raise TkjitError(f"{envs.DISABLE_JIT.name}=1 forbids compiling: unset it to tune")
    if args.devices:
        _studies_of(args)  # a bad name or shape fails here, once, not in every worker
        return _tune_on_every_device(args)
    if args.device is not None:
        select_device(args.device)
    opts = PretuneOptions(
        arch=args.arch, trials=args.trials, time_budget=args.time_budget, jobs=args.jobs, storage=args.storage,
        heartbeat_s=args.heartbeat, study_prefix=args.study_prefix, resume=args.resume,
        max_configs=args.max_configs, exhaustive_max=args.exhaustive_max, timeout_s=args.timeout,
        bench_budget_s=args.bench_budget, seed=args.seed, imports=args.imports, timer=args.timer,
        progress=not args.quiet and sys.stderr.isatty(), user_db=not args.no_user_db,
        update_shipped=args.update_shipped)
    # The bench worker starts CUDA (seconds) while this process reads the specs (torch) and opens the storage.
    with start_evaluator(opts) as ev:
        studies = _studies_of(args)
        age = process_age_s()  # the run's clock starts now: what came before is the footer's "before"
        report = run_studies(studies, opts, evaluator=ev)
        closing = time.perf_counter()
    report.closed(time.perf_counter() - closing)
    report.before_s = age
    table = summary_table(report.rows) + "\n" + footer(report)
    if args.json:
        print(table, file=sys.stderr)
        print(json.dumps(report.to_json(), indent=1, sort_keys=True, default=str))
    else:
        print(table)
    return 0 if report.status == 0 else 1


def _without_devices(argv: Sequence[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--devices":
            skip = True
        elif not a.startswith("--devices="):
            out.append(a)
    return out


def _tune_on_every_device(args) -> int:
    """`--devices all`: one `tkjit tune --device I` worker per visible GPU, all on the same storage;
    each takes its share of the compile cores. The status is the worst of theirs."""
    import subprocess

    from tkjit.tuning.pretune import visible_devices

    devices = visible_devices()
    if not devices:
        raise TkjitError("--devices all: no CUDA GPU is visible")
    if args.arch == "cpu":
        raise UsageError("--devices all runs one worker per GPU: the C target (--arch cpu) has none")
    base = _without_devices(args.argv)
    jobs = [] if args.jobs else ["--jobs", str(max(1, (os.cpu_count() or 1) // len(devices)))]
    procs = [subprocess.Popen([sys.executable, "-m", "tkjit.cli", *base, *jobs, "--device", str(i), "--quiet"],
                              stdout=subprocess.PIPE if args.json else None, text=True)
             for i in range(len(devices))]
    print(f"tune: {len(procs)} workers, one per GPU ({', '.join(devices)})", file=sys.stderr)
    outs = [p.communicate()[0] for p in procs]
    if args.json:
        docs = []
        for i, o in enumerate(outs):
            try:
                docs.append({"device": i, **json.loads(o)})
            except (TypeError, ValueError):
                docs.append({"device": i, "error": f"exit status {procs[i].returncode}"})
        print(json.dumps({"workers": docs}, indent=1, sort_keys=True, default=str))
    return max(p.returncode for p in procs)


# ----------------------------------------------------------------------------------------------
# tkjit db
# ----------------------------------------------------------------------------------------------
def _add_db(sub: Any) -> None:
    p = sub.add_parser("db", help="tuned DBs: export winners from a storage, merge winner files, show what serves")
    what = p.add_subparsers(dest="what", required=True, metavar="ACTION")
    q = what.add_parser("export", help="the winners of a study storage as JSON on stdout")
    q.add_argument("name", nargs="?", metavar="NAME", help="only this kernel's studies")
    q.add_argument("--storage", default=None, metavar="URL", help=_STORAGE_HELP)
    q.set_defaults(fn=cmd_db_export)
    q = what.add_parser("merge", help="merge winner files into <DIR>/<arch>/<GPU>.json")
    q.add_argument("files", nargs="+", metavar="FILE", help="`tkjit db export` output or DB files")
    q.add_argument("--into", default=None, metavar="DIR",
                   help="default: the user's DB in the cache (what tkjit.get serves first on this host); "
                   "tkjit/tuning_db_data for the shipped one")
    q.add_argument("--allow-other-versions", action="store_true",
                   help="take entries tuned with another tkjit, TileLang or spec source")
    q.add_argument("--dry-run", action="store_true", help="print what would change, write nothing")
    q.set_defaults(fn=cmd_db_merge)
    q = what.add_parser("show", help="the tuned entries, or what tkjit.get serves at a shape and where from")
    q.add_argument("name", nargs="?", metavar="NAME")
    add_shape_arg(q, help="the shape to serve (with NAME)")
    q.add_argument("--arch", type=_arch_arg, default=None, help="default: TKJIT_ARCH, the GPU")
    q.set_defaults(fn=cmd_db_show)


def cmd_db_export(args) -> int:
    from tkjit.tuning.winners import dumps, export_winners

    if args.name:
        known_kernel(args.name)
    if args.storage is None:
        from tkjit.build import cache

        path = cache().base / "tuned" / "journal.log"
        if not path.exists():
            raise TkjitError(f"no tuning journal at {path}: nothing tuned with this cache (pass --storage)")
        args.storage = f"journal:{path}"
    doc, notes = export_winners(args.storage, args.name)
    for note in notes:
        print(f"tkjit db export: {note}", file=sys.stderr)
    sys.stdout.write(dumps(doc))
    n = len(doc["entries"])
    print(f"tkjit db export: {n} {'winner' if n == 1 else 'winners'}", file=sys.stderr)
    return 0


def cmd_db_merge(args) -> int:
    from tkjit.tuning.winners import merge_winners
    from tkjit.tuning_db import user_db_dir

    into = Path(args.into) if args.into else user_db_dir()
    changes = merge_winners(args.files, into, allow_other_versions=args.allow_other_versions, dry_run=args.dry_run)
    for c in changes:
        print(c.line())
    counts: dict[str, int] = {}
    for c in changes:
        counts[c.action] = counts.get(c.action, 0) + 1
    summary = ", ".join(f"{n} {a}" for a, n in sorted(counts.items())) or "no entries"
    print(f"{'would merge' if args.dry_run else 'merged'} into {into}: {summary}")
    return 0


def cmd_db_show(args) -> int:
    from tkjit.tuning_db import choose_config, find_tuned, kept_old_default

    arch = _served_arch(args.arch)
    if arch is None:
        raise UsageError("db show: no GPU here: pass --arch (e.g. --arch sm_90a)")
    if args.shape and not args.name:
        raise UsageError("db show: --shape needs the kernel NAME")
    if args.name and args.shape:
        spec = known_kernel(args.name)
        full = _shape_of(spec, args.shape)
        cfg, source = choose_config(spec, full, arch, None)
        found = find_tuned(spec, full, arch)
        print(f"{spec.name} at {_compact(full)} for {arch}: {_compact(cfg)}  ({source})")
        if found is not None and source.startswith("tuned"):
            e = found.entry
            print(f"  from {found.path}")
            print(f"  tuned {e.get('date')} on {e.get('gpu')}: {e.get('tuned_us')} us vs default {e.get('default_us')}"
                  f" us, speedup {e.get('speedup')}, spread {e.get('spread')}, {e.get('trials', '?')} trials, "
                  f"versions {_compact(e.get('versions', {}))}")
        if found is not None and kept_old_default(spec, full, arch, found.entry):  # what lookup passed over
            e = found.entry
            print(f"  from {found.path}: tuned {e.get('date')} on {e.get('gpu')}, {e.get('trials', '?')} trials, "
                  f"none beat the default of then ({_compact(e['config'])}), which has changed since: today's serves")
        default = spec.default_config(full, arch)
        if default != cfg:
            print(f"  heuristic default: {_compact(default)}")
        return 0
    return _db_list(args.name and known_kernel(args.name).name, arch)


def _db_list(kernel: str | None, arch: str) -> int:
    from tkjit.tuning_db import shipped_db_dir, tuned_entries, user_db_dir

    rows = []
    for label, path, e in tuned_entries(arch):
        if kernel and e["kernel"] != kernel:
            continue
        rows.append([e["kernel"], _compact(e["shape"]), ",".join(f"{k}~{v}" for k, v in e["bucket"].items()),
                     _compact(e["config"]), str(e.get("speedup")), str(e.get("trials", "-")), f"{label}:{path.stem}"])
    if not rows:
        print(f"no tuned entries for {kernel or 'any kernel'} on {arch} (user DB {user_db_dir()}, shipped "
              f"{shipped_db_dir()})")
        return 0
    print(_table(rows, ["kernel", "shape", "bucket", "config", "speedup", "trials", "db"]))
    return 0


# ----------------------------------------------------------------------------------------------
# tkjit bundle
# ----------------------------------------------------------------------------------------------
def _add_bundle(sub: Any) -> None:
    p = sub.add_parser("bundle", help="ship compiled kernels: verified cache entries to a tar file, and back",
                       description="Compile once (a CPU build host cross-compiles), serve everywhere: `export` "
                       "writes the verified entries of a manifest or of the cache, with the tuned-DB entries that "
                       "select them; `import` checks all of it and installs it, so GPU hosts with "
                       "TKJIT_DISABLE_JIT=1 serve them without a compiler.")
    what = p.add_subparsers(dest="what", required=True, metavar="ACTION")
    q = what.add_parser("export", help="write a bundle: a manifest's kernels (compiled when missing) or the cache's")
    src = q.add_mutually_exclusive_group(required=True)
    src.add_argument("--manifest", default=None, metavar="FILE",
                     help="a TOML manifest (tools/manifest.toml's format): the config tkjit.get serves at each shape")
    src.add_argument("--from-cache", action="store_true", help="every verified cache entry for --arch")
    q.add_argument("--arch", type=_arch_arg, default=None, help="e.g. sm_90a (default: TKJIT_ARCH, the GPU)")
    q.add_argument("--with-defaults", action="store_true",
                   help="with --manifest: also each tuned shape's heuristic default (served under TKJIT_NO_TUNED_DB=1)")
    q.add_argument("-o", "--out", default=None, metavar="FILE",
                   help="default: tkjit-<arch>.tar; a name ending in .gz or .tgz is gzip'ed")
    q.add_argument("-j", "--jobs", type=_jobs_arg, default=None, help="parallel compile processes (default: cores)")
    q.set_defaults(fn=cmd_bundle_export)
    q = what.add_parser("import", help="verify a bundle whole, then install its entries and tuned-DB entries")
    q.add_argument("file", metavar="FILE")
    q.set_defaults(fn=cmd_bundle_import)


def cmd_bundle_export(args) -> int:
    from tkjit.bundle import export_bundle

    if args.from_cache and args.with_defaults:
        raise UsageError("bundle export: --with-defaults goes with --manifest (--from-cache takes what is cached)")
    studies = None
    if args.manifest:
        from tkjit.tuning.pretune import load_manifest

        studies = load_manifest(args.manifest)
    arch = _cli_arch(args.arch)
    out = Path(args.out or f"tkjit-{arch}.tar")
    report = export_bundle(out, arch, studies=studies, jobs=args.jobs, with_defaults=args.with_defaults,
                           log=lambda line: print(line, flush=True))
    for it in report.items:
        print(f"  {it.kernel} {_compact(it.shape)} {_compact(it.config)}: {it.status} {it.key[:12]} ({it.source})")
    n = len(report.items)
    print(f"wrote {out}: {n} {'entry' if n == 1 else 'entries'} for {arch}, {report.tuned} tuned DB "
          f"{'entry' if report.tuned == 1 else 'entries'}, {_size(report.size)}")
    return 0


def cmd_bundle_import(args) -> int:
    from tkjit.build import cache
    from tkjit.bundle import import_bundle

    report = import_bundle(args.file)
    for it in report.items:
        print(f"  {it.kernel} {_compact(it.shape)} {_compact(it.config)}: {it.status} {it.key[:12]}")
    n, new = len(report.items), sum(it.status == "installed" for it in report.items)
    line = (f"imported {args.file} ({report.arch}) into {cache().root}: {n} {'entry' if n == 1 else 'entries'} "
            f"({new} new, {n - new} already there)")
    if report.tuned:
        line += (f"; {report.tuned} tuned DB entries ({report.tuned_changed} new or changed) into "
                 f"{', '.join(str(p) for p in report.tuned_files)}")
    print(line)
    return 0


def cmd_plot_bench(args) -> int:
    from tkjit import plot

    out = plot.bench_chart(plot.load_bench(args.json), args.out, title=args.title)
    print(f"wrote {out}")
    return 0


def cmd_plot_study(args) -> int:
    from tkjit import plot

    if args.name:
        known_kernel(args.name)
    shape = parse_shape(args.shape) if args.shape else None
    storage = plot.open_journal(args.storage)
    name = plot.pick_study(storage, kernel=args.name, shape=shape, arch=args.arch)
    trials = plot.study_trials(storage, name)
    out = plot.study_chart(trials, args.out, title=args.title or plot.study_title(name))
    print(f"wrote {out} ({len(trials)} trials of {plot.study_title(name)})")
    return 0


class _StderrHandler(logging.StreamHandler):
    """Logs to whatever sys.stderr is at the time (callers and tests swap it)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("tkjit: %(levelname)s: %(message)s"))

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _setup_logging() -> None:
    from tkjit import envs

    log.setLevel(envs.log_level())
    for h in [h for h in log.handlers if getattr(h, "_tkjit_env", False)]:  # import's handler: ours replaces it
        log.removeHandler(h)
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):  # main() may run many times
        log.addHandler(_StderrHandler())


def _fail(message: str, status: int) -> int:
    """Print the error in one line (the traceback only at TKJIT_LOG=debug); return the exit status."""
    log.debug("the error below came from:", exc_info=True)
    first, *rest = cli_syntax(message).strip().splitlines() or ["unknown error"]
    if rest:
        first += f" (+{len(rest)} more lines; TKJIT_LOG=debug shows them)"
    print(f"tkjit: error: {first}", file=sys.stderr)
    return status


def _stdout_closed() -> int:
    # The reader went away (`tkjit list | head -1`): stop quietly. Point stdout at devnull so the
    # interpreter's flush at exit does not fail on the broken pipe again ("Exception ignored").
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is no file descriptor (redirected in-process): nothing to flush
        pass
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Exit status: 0 ok, 1 a tkjit or OS error, 2 a usage error."""
    try:
        _setup_logging()
        args = _parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # `tune --devices all` re-runs it per GPU
        status = args.fn(args)
        sys.stdout.flush()  # a closed pipe raises here, inside the handlers, not at exit
        return status
    except BrokenPipeError:
        return _stdout_closed()
    except UsageError as e:
        return _fail(str(e), 2)
    except TkjitError as e:
        return _fail(str(e), 1)
    except OSError as e:
        return _fail(os_error_message(e), 1)
    except SystemExit as e:
        if isinstance(e.code, str):  # a helper's SystemExit("tkjit prune: message"): a usage error
            return _fail(re.sub(r"^tkjit[\w -]*:\s*", "", e.code), 2)
        raise  # --help, or an exit status
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug: still one line, the traceback at TKJIT_LOG=debug
        return _fail(f"internal error: {type(e).__name__}: {e} (TKJIT_LOG=debug shows the traceback)", 1)


def run() -> None:
    """The `tkjit` command: main(), then the process ends. With torch loaded (tune, compile, list...), without
    the interpreter's teardown: freeing torch's and TileLang's modules took 0.7 s at the end of every `tkjit tune` on
    a 2-core host, where every file the command wrote is closed by then (each is written in a `with`, SQLite and
    journal storages commit as they go); the exit handlers run (multiprocessing's reaps its children, logging's
    flushes) and the streams are flushed first."""
    status = main()
    if "torch" not in sys.modules:
        sys.exit(status)
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more to say on it
            pass
    os._exit(status)


if __name__ == "__main__":
    run()
