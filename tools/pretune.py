#!/usr/bin/env python
"""Tune every study of a manifest, write the tuned DB, warm the cache, print a summary.

    python tools/pretune.py                                 # tools/manifest.toml, current GPU
    python tools/pretune.py --update-shipped --json out.json
    python tools/pretune.py --arch cpu --kernels sinkhorn_fwd --max-configs 4     # CI, no GPU

A thin wrapper over tkjit.tuning.pretune, which `tkjit tune` also runs (the installed command; it takes
the same manifests: `tkjit tune --manifest tools/manifest.toml`). This script keeps its flags and
their meaning: --json PATH writes a file, the default manifest is tools/manifest.toml.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a source checkout without an install
    sys.path.insert(0, str(ROOT))

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from tkjit.tuning.pretune import (  # noqa: E402  (re-exported: tests and old callers use them from here)
    PretuneOptions,
    expand,
    footer,
    load_manifest,
    run_studies,
    summary_table,
)

__all__ = ["expand", "summary_table", "tomllib", "parse_args", "main"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", default=str(ROOT / "tools" / "manifest.toml"))
    ap.add_argument("--kernels", default=None, help="comma-separated kernel names to tune (default: all)")
    ap.add_argument("--arch", default=None, help="arch to tune for (default: the current GPU); 'cpu': C target")
    ap.add_argument("--trials", type=int, default=None, help="distinct configs measured per study")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds per study")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compile processes (default: cores)")
    ap.add_argument("--storage", default=None,
                    help="journal:PATH, sqlite:///PATH or postgresql://...; default: the cache's journal")
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


def main(argv: list[str] | None = None) -> int:
    from tkjit.errors import TkjitError

    args = parse_args(argv)
    try:
        studies = load_manifest(args.manifest)
        if args.kernels:
            wanted = set(args.kernels.split(","))
            studies = [s for s in studies if s["kernel"] in wanted]
        report = run_studies(studies, PretuneOptions(
            arch=args.arch, trials=args.trials, time_budget=args.time_budget, jobs=args.jobs, storage=args.storage,
            resume=args.resume, max_configs=args.max_configs, exhaustive_max=args.exhaustive_max,
            timeout_s=args.timeout, bench_budget_s=args.bench_budget, seed=args.seed, imports=args.imports,
            timer=args.timer, progress=not args.quiet, user_db=not args.no_user_db,
            update_shipped=args.update_shipped))
    except TkjitError as e:
        print(f"pretune: {e}", file=sys.stderr)
        return 1
    print(summary_table(report.rows))
    print(footer(report))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report.to_json(), indent=1, sort_keys=True, default=str) + "\n")
    return report.status


if __name__ == "__main__":
    sys.exit(main())
