#!/usr/bin/env python
"""Tune every study of a manifest, write the tuned DB, warm the cache, print a summary.

    python tools/pretune.py                                 # tools/manifest.toml, current GPU
    python tools/pretune.py --update-shipped --json out.json
    python tools/pretune.py --arch cpu --kernels sinkhorn_fwd --max-configs 4     # CI, no GPU

One study per (kernel, static shape, runtime bucket, arch, GPU). Trials are journaled as they
finish (<cache>/v1/tuned/journal.log, or --storage URL), so a killed run resumes (--no-resume
starts studies over). The compile pool and the bench worker live across all studies.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def expand(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """[[study]] tables -> one dict per concrete study (list values expanded as a product)."""
    defaults = dict(manifest.get("defaults", {}))
    out = []
    for i, st in enumerate(manifest.get("study", [])):
        if "kernel" not in st:
            raise SystemExit(f"manifest: study {i} has no 'kernel'")
        shape = dict(st.get("shape", {}))
        keys = list(shape)
        lists = [v if isinstance(v, list) else [v] for v in shape.values()]
        for combo in itertools.product(*lists):
            s = {**defaults, **{k: v for k, v in st.items() if k != "shape"}}
            s["shape"] = dict(zip(keys, combo))
            out.append(s)
    return out


def detect_arch() -> str:
    """The GPU's arch, asked of a child process: this process never touches CUDA."""
    env = os.environ.get("TKJIT_ARCH")
    if env:
        return env
    code = "from tkjit.arch import current_arch; print(current_arch() or '')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    arch = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    if not arch:
        raise SystemExit("no CUDA GPU found: pass --arch (e.g. --arch cpu to tune the C target)")
    return arch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", default=str(ROOT / "tools" / "manifest.toml"))
    ap.add_argument("--kernels", default=None, help="comma-separated kernel names to tune (default: all)")
    ap.add_argument("--arch", default=None, help="arch to tune for (default: the current GPU); 'cpu': C target")
    ap.add_argument("--trials", type=int, default=None, help="distinct configs measured per study")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds per study")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compile processes (default: cores)")
    ap.add_argument("--storage", default=None,
                    help="Optuna storage URL (sqlite:///tune.db, journal:PATH); default: the cache's journal")
    ap.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                    help="reuse the trials already in the storage (default on)")
    ap.add_argument("--json", dest="json_out", default=None, help="write the results as JSON here")
    ap.add_argument("--update-shipped", action="store_true",
                    help="also write the shipped tkjit/tuning_db_data/<arch>/<GPU>.json (in this source tree; "
                    "TKJIT_TUNING_DB names another directory)")
    ap.add_argument("--no-user-db", action="store_true", help="do not write the user DB")
    ap.add_argument("--max-configs", type=int, default=None, help="tune a slice of each space (CI)")
    ap.add_argument("--exhaustive-max", type=int, default=64, help="enumerate spaces up to this many configs")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds before a benchmark counts as hung")
    ap.add_argument("--bench-budget", type=float, default=None, help="timing seconds per candidate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--import", dest="imports", action="append", default=[],
                    help="module to import first, in every process (registers extra specs)")
    ap.add_argument("--timer", default=None, help="timer import path module:attr (tests)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    return ap.parse_args(argv)


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def summary_table(rows: list[dict[str, Any]]) -> str:
    head = ["kernel", "shape", "default us", "tuned us", "speedup", "% copy", "trials", "s", "note"]
    lines = [head]
    for r in rows:
        if r.get("error"):
            lines.append([r["kernel"], _shape_text(r["shape"]), "-", "-", "-", "-", "-", "-", r["error"][:60]])
            continue
        note = "win" if r["won"] else "no win (kept default)"
        if r.get("failed"):
            note += f", {len(r['failed'])} failed"
        lines.append([
            r["kernel"], _shape_text(r["full_shape"]), _fmt(r["default_us"], ".2f"), _fmt(r["tuned_us"], ".2f"),
            _fmt(r["speedup"], ".3f") + ("x" if r["speedup"] else ""), _fmt(r.get("pct_copy"), ".0f"),
            str(r["trials"]), f"{r.get('elapsed_s', 0):.0f}", note,
        ])
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    out = []
    for j, row in enumerate(lines):
        out.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _shape_text(shape: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for m in args.imports:
        __import__(m)
    import tkjit
    from tkjit.errors import ShapeError, UnknownKernelError
    from tkjit.tuning import LocalEvaluator, tune
    from tkjit.tuning_db import gpu_model, shipped_db_path, user_db_path, write_entries

    with open(args.manifest, "rb") as f:
        studies = expand(tomllib.load(f))
    wanted = set(args.kernels.split(",")) if args.kernels else None
    if wanted is not None:
        studies = [s for s in studies if s["kernel"] in wanted]
    resolved = []
    for s in studies:
        try:
            spec = tkjit.get_spec(s["kernel"])
            full = spec.canonical_shape(s["shape"])
        except UnknownKernelError:
            warnings.warn(f"pretune: kernel {s['kernel']!r} is not in the catalog; skipped", stacklevel=1)
            continue
        except ShapeError as e:
            warnings.warn(f"pretune: {s['kernel']} shape {s['shape']} invalid ({e}); skipped", stacklevel=1)
            continue
        resolved.append((s, spec, full))
    if not resolved:
        print("pretune: nothing to tune", file=sys.stderr)
        return 1
    arch = args.arch or detect_arch()
    t_all = time.perf_counter()
    rows: list[dict[str, Any]] = []
    entries = []
    with LocalEvaluator(arch, jobs=args.jobs, timer=args.timer, imports=args.imports, timeout_s=args.timeout,
                        budget_s=args.bench_budget) as ev:
        ev.pool.warm()  # processes import TileLang while the bench worker starts
        info = ev.device_info()
        gpu = gpu_model(arch, info.get("gpu"))
        copy_gbps = ev.copy_bandwidth_gbps()
        print(f"pretune: {len(resolved)} studies, arch {arch}, {gpu}, compile jobs {ev.pool.n_jobs}, "
              f"copy {_fmt(copy_gbps, '.0f')} GB/s", file=sys.stderr)
        for s, spec, full in resolved:
            bar = None
            if not args.quiet:
                from tqdm import tqdm

                bar = tqdm(total=0, desc=f"{spec.name} {_shape_text(full)}", unit="cfg", leave=True,
                           file=sys.stderr, dynamic_ncols=True)

            def progress(done: int, total: int, best: float | None, bar=bar) -> None:
                if bar is None:
                    return
                bar.total = total
                bar.n = done
                bar.set_postfix_str(f"best {best:.2f}us" if best else "")
                bar.refresh()

            try:
                r = tune(spec, full, arch=arch, gpu=gpu, evaluator=ev, storage=args.storage,
                         trials=s.get("trials") if args.trials is None else args.trials,
                         time_budget=s.get("time_budget") if args.time_budget is None else args.time_budget,
                         exhaustive_max=args.exhaustive_max, seed=args.seed, resume=args.resume,
                         max_configs=args.max_configs, progress=progress)
            except Exception as e:  # one study failing (every config broken?) must not lose the others
                if bar is not None:
                    bar.close()
                print(f"pretune: {spec.name} {full}: {type(e).__name__}: {e}", file=sys.stderr)
                rows.append({"kernel": spec.name, "shape": full, "error": f"{type(e).__name__}: {e}"})
                continue
            if bar is not None:
                bar.close()
            row = r.to_json()
            if copy_gbps and r.tuned_us:
                gbps = spec.bytes_moved(r.full_shape) / (r.tuned_us * 1e-6) / 1e9
                row["gbps"] = gbps
                row["pct_copy"] = 100.0 * gbps / copy_gbps
            rows.append(row)
            entries.append(r.db_entry())
        # Warm the cache: every served config is published (normally a cache hit from the search).
        warm = [(e["kernel"], e["shape"], e["config"], arch, "tuned:user") for e in entries]
        errs = [err for _, err in ev.pool.compile(warm) if err]
        for err in errs:
            print(f"pretune: warming the cache: {err}", file=sys.stderr)
    written = []
    if entries and not args.no_user_db:
        written.append(write_entries(user_db_path(arch, gpu), entries, arch=arch, gpu=gpu))
    if entries and args.update_shipped:
        written.append(write_entries(shipped_db_path(arch, gpu), entries, arch=arch, gpu=gpu))
    print(summary_table(rows))
    print(f"pretune: {len(entries)}/{len(rows)} studies tuned in {time.perf_counter() - t_all:.1f}s; "
          f"copy ceiling {_fmt(copy_gbps, '.0f')} GB/s" + "".join(f"\n  wrote {p}" for p in written))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"arch": arch, "gpu": gpu, "copy_gbps": copy_gbps, "results": rows}, indent=1, sort_keys=True,
            default=str) + "\n")
    return 0 if entries and len(entries) == len(rows) else 2


if __name__ == "__main__":
    sys.exit(main())
