"""The `tkjit` command: inspect the catalog and the cache, fill the cache (also cross-compiling)."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import sys
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
    """
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UsageError(f"--{what} takes key=value, got {brief(item)}")
        k, v = item.split("=", 1)
        out[k.strip()] = _parse_value(v.strip(), f"--{what} {k.strip()}")
    return out


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


def cmd_specs(args) -> int:
    from tkjit.registry import all_specs, get_spec

    for name in args.name:
        get_spec(name)  # an unknown name is an error listing the known ones, not silently skipped
    for spec in all_specs():
        if args.name and spec.name not in args.name:
            continue
        ex = spec.canonical_shape(spec.examples[0])
        print(f"{spec.name}  ({spec.family})  {spec.doc}")
        for p in spec.params:
            print(f"  shape  {p.describe()}")
        n_allowed = len(spec.configs(ex))
        print(f"  space  {n_allowed} allowed configs at {ex}")
        for k, vals in spec.space.items():
            print(f"         {k}: {list(vals)}")
        print(f"  default at {ex}: {spec.default_config(ex)}")
        print()
    return 0


def cmd_list(args) -> int:
    from tkjit.build import cache

    entries = cache().entries()
    rows = []
    for r in sorted(entries, key=lambda r: (r.get("kernel", ""), r.get("arch", ""))):
        rows.append([
            r.get("kernel", "?"), _compact(r.get("shape", {})), r.get("arch", "?"), _compact(r.get("config", {})),
            r.get("config_source", r.get("status", "?")), _size(r.get("size", 0)), _when(r.get("last_used")),
            r["key"][:12],
        ])
    if args.json:
        print(json.dumps(entries, indent=1, sort_keys=True, default=str))
        return 0
    if not rows:
        print(f"cache {cache().root} is empty")
        return 0
    print(_table(rows, ["kernel", "shape", "arch", "config", "source", "size", "last used", "key"]))
    print(f"\n{len(rows)} entries, {_size(sum(r.get('size', 0) for r in entries))} in {cache().root}")
    return 0


def cmd_show(args) -> int:
    from tkjit.registry import get_spec

    spec = get_spec(args.name)
    print(f"{spec.name} ({spec.family}): {spec.doc}")
    for p in spec.params:
        print(f"  shape  {p.describe()}  {p.doc}")
    for t in spec.inputs:
        print(f"  input  {t.name}: {t.dtype if isinstance(t.dtype, str) else '(by shape)'} {t.dims}")
    for t in spec.outputs:
        print(f"  output {t.name}: {t.dtype if isinstance(t.dtype, str) else '(by shape)'} {t.dims}")
    for k, vals in spec.space.items():
        print(f"  space  {k}: {list(vals)}")
    for ex in spec.examples:
        full = spec.canonical_shape(ex)
        print(f"  example {ex}: default {spec.default_config(full)}, {len(spec.configs(full))} allowed configs")
    from tkjit.build import cache

    mine = [r for r in cache().entries() if r.get("kernel") == spec.name]
    print(f"  cached  {len(mine)} entries")
    for r in mine:
        print(f"    {r['key'][:12]} {r.get('arch')} {_compact(r.get('shape', {}))} {_compact(r.get('config', {}))}")
    return 0


def cmd_compile(args) -> int:
    from tkjit import envs
    from tkjit.arch import resolve_arch
    from tkjit.canon import canonical_json
    from tkjit.pool import compile_many
    from tkjit.registry import all_specs, get_spec
    from tkjit.tuning_db import choose_config

    # The arguments first: a usage error is reported before any lookup or environment problem.
    cfg_in = parse_kv(args.config, "config") if args.config else None
    if envs.flag(envs.DISABLE_JIT):
        raise TkjitError(f"{envs.DISABLE_JIT.name}=1 forbids compiling: unset it to fill the cache")
    if args.all_defaults:
        specs = [get_spec(n) for n in args.name] if args.name else all_specs()
        shapes = [(s, s.canonical_shape(ex)) for s in specs for ex in s.examples]
    else:
        if len(args.name) != 1:
            raise UsageError("compile takes one kernel NAME with --shape, or --all-defaults")
        shape_in = parse_kv(args.shape, "shape")
        s = get_spec(args.name[0])
        shapes = [(s, s.canonical_shape(shape_in))]
    arch = resolve_arch(args.arch)
    jobs, seen = [], set()
    for spec, full in shapes:
        cfg, source = choose_config(spec, full, arch, cfg_in)
        job = (spec.name, spec.static_shape(full), cfg, arch, source)
        ident = canonical_json(job[:4])
        if ident not in seen:
            seen.add(ident)
            jobs.append(job)
    print(f"compiling {len(jobs)} kernel(s) for {arch} with {args.jobs or 'all'} jobs ...", flush=True)
    failed = 0
    results = compile_many(jobs, args.jobs)
    for job, res in zip(jobs, _progress(results)):
        key, err = res
        if err is not None:
            status = f"FAILED: {err}"
        elif getattr(res, "built", False):
            secs = getattr(res, "compile_s", None)
            status = f"ok built {key[:12]}" + (f" ({secs:.1f} s)" if secs is not None else "")
        else:
            status = f"ok cached {key[:12]}"
        failed += err is not None
        print(f"  {job[0]} {_compact(job[1])} {_compact(job[2])}: {status}")
    return 1 if failed else 0


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

    res = cache().clear()
    msg = f"removed {res.removed} entries from {cache().root}"
    if res.skipped:
        msg += f"; skipped {len(res.skipped)} in use or being built: {', '.join(k[:12] for k in res.skipped)}"
    print(msg)
    return 0


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
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
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


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="tkjit", description=__doc__)
    ap.add_argument("--version", action=_VersionAction, help="print tkjit's version (and tilelang's, torch's)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("specs", help="the kernel catalog: shape params, space, default")
    p.add_argument("name", nargs="*")
    p.set_defaults(fn=cmd_specs)
    p = sub.add_parser("list", help="cache entries")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_list)
    p = sub.add_parser("show", help="one kernel: spec and cached entries")
    p.add_argument("name")
    p.set_defaults(fn=cmd_show)
    p = sub.add_parser("compile", help="fill the cache (cross-compiles on a CPU-only host with --arch)")
    p.add_argument("name", nargs="*")
    p.add_argument("--shape", nargs="*", default=[], metavar="K=V")
    p.add_argument("--config", nargs="*", default=[], metavar="K=V")
    p.add_argument("--arch", default=None)
    p.add_argument("--all-defaults", action="store_true", help="every spec's example shapes, default configs")
    p.add_argument("-j", "--jobs", type=_jobs_arg, default=None)
    p.set_defaults(fn=cmd_compile)
    p = sub.add_parser("clear", help="remove every cache entry")
    p.set_defaults(fn=cmd_clear)
    p = sub.add_parser("prune", help="evict least recently used entries down to a size")
    p.add_argument("--max-size", required=True, type=_size_arg, help="e.g. 500M, 2G, 1.5GiB or bytes")
    p.set_defaults(fn=cmd_prune)
    p = sub.add_parser("doctor", help="versions, arch, nvcc, cache dir, permissions")
    p.set_defaults(fn=cmd_doctor)
    return ap


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
    first, *rest = message.strip().splitlines() or ["unknown error"]
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


if __name__ == "__main__":
    sys.exit(main())
