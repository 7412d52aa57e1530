"""The `tkjit` command: inspect the catalog and the cache, fill the cache (also cross-compiling)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Sequence
from typing import Any


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _kv(items: Sequence[str], what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"tkjit: --{what} takes key=value, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = _parse_value(v.strip())
    return out


def _parse_value(v: str) -> Any:
    # JSON literals (numbers, true/false), else the plain string: no eval.
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
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
    from tkjit.registry import all_specs

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
    from tkjit.api import cache

    rows = []
    for r in sorted(cache().entries(), key=lambda r: (r.get("kernel", ""), r.get("arch", ""))):
        rows.append([
            r.get("kernel", "?"), _compact(r.get("shape", {})), r.get("arch", "?"), _compact(r.get("config", {})),
            r.get("config_source", r.get("status", "?")), _size(r.get("size", 0)), _when(r.get("last_used")),
            r["key"][:12],
        ])
    if args.json:
        print(json.dumps(cache().entries(), indent=1, sort_keys=True, default=str))
        return 0
    if not rows:
        print(f"cache {cache().root} is empty")
        return 0
    print(_table(rows, ["kernel", "shape", "arch", "config", "source", "size", "last used", "key"]))
    print(f"\n{len(rows)} entries, {_size(sum(r.get('size', 0) for r in cache().entries()))} in {cache().root}")
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
    from tkjit.api import cache

    mine = [r for r in cache().entries() if r.get("kernel") == spec.name]
    print(f"  cached  {len(mine)} entries")
    for r in mine:
        print(f"    {r['key'][:12]} {r.get('arch')} {_compact(r.get('shape', {}))} {_compact(r.get('config', {}))}")
    return 0


def cmd_compile(args) -> int:
    from tkjit.api import choose_config
    from tkjit.arch import resolve_arch
    from tkjit.compiler import compile_many
    from tkjit.registry import all_specs, get_spec

    arch = resolve_arch(args.arch)
    if args.all_defaults:
        specs = [get_spec(n) for n in args.name] if args.name else all_specs()
        shapes = [(s, s.canonical_shape(ex)) for s in specs for ex in s.examples]
    else:
        if len(args.name) != 1:
            raise SystemExit("tkjit compile: give one kernel NAME with --shape, or use --all-defaults")
        s = get_spec(args.name[0])
        shapes = [(s, s.canonical_shape(_kv(args.shape, "shape")))]
    cfg_in = _kv(args.config, "config") if args.config else None
    jobs, seen = [], set()
    for spec, full in shapes:
        cfg, source = choose_config(spec, full, arch, cfg_in)
        job = (spec.name, spec.static_shape(full), cfg, arch, source)
        ident = json.dumps(job[:4], sort_keys=True)
        if ident not in seen:
            seen.add(ident)
            jobs.append(job)
    print(f"compiling {len(jobs)} kernel(s) for {arch} with {args.jobs or 'all'} jobs ...", flush=True)
    failed = 0
    for job, (key, err) in zip(jobs, compile_many(jobs, args.jobs)):
        status = f"ok {key[:12]}" if err is None else f"FAILED: {err}"
        failed += err is not None
        print(f"  {job[0]} {_compact(job[1])} {_compact(job[2])}: {status}")
    return 1 if failed else 0


def cmd_clear(args) -> int:
    from tkjit.api import cache

    n = cache().clear()
    print(f"removed {n} entries from {cache().root}")
    return 0


def cmd_prune(args) -> int:
    from tkjit.api import cache

    removed = cache().prune(_parse_bytes(args.max_size))
    print(f"evicted {len(removed)} least recently used entries; {_size(cache().total_bytes())} left")
    return 0


def _parse_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().rstrip("b")
    mult = units.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if t[-1:] in units else t) * mult)
    except ValueError:
        raise SystemExit(f"tkjit prune: cannot read size {text!r} (e.g. 500M, 2G)") from None


def cmd_doctor(args) -> int:
    import platform

    from tkjit import envs, key
    from tkjit.api import cache
    from tkjit.arch import current_arch
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
    for var in envs.REGISTRY:
        rows.append([var.name, str(var.get())])
    print(_table(rows, ["item", "value"]))
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tkjit", description=__doc__)
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
    p.add_argument("-j", "--jobs", type=int, default=None)
    p.set_defaults(fn=cmd_compile)
    p = sub.add_parser("clear", help="remove every cache entry")
    p.set_defaults(fn=cmd_clear)
    p = sub.add_parser("prune", help="evict least recently used entries down to a size")
    p.add_argument("--max-size", required=True, help="e.g. 500M, 2G")
    p.set_defaults(fn=cmd_prune)
    p = sub.add_parser("doctor", help="versions, arch, nvcc, cache dir, permissions")
    p.set_defaults(fn=cmd_doctor)
    args = ap.parse_args(argv)
    from tkjit.errors import TkjitError

    try:
        return args.fn(args)
    except TkjitError as e:
        print(f"tkjit: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
