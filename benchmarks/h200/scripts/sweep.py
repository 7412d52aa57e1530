#!/usr/bin/env python3
"""Time every allowed config of one kernel at one shape (exhaustive; no isolation, no tuner).

    python benchmarks/h200/scripts/sweep.py sinkhorn_fwd --shape num_tokens=1048576 [--json out.json] [--reps 30]
        [--only threads=128,256 recip=True] [--check-shape num_tokens=4096] [--compile-only --arch sm_90a]

--check-shape runs the correctness check at other runtime sizes (the same compiled kernel; a big shape's CPU
reference can take seconds a config). --only keeps the configs whose listed keys take one of the listed
values. --compile-only builds them and stops (no GPU: a CPU build host fills the cache a GPU run then hits,
see prebuild.py).

Each config is checked against the reference first (poisoned outputs); wrong ones are listed, not
timed. The JSON (config -> median us) is the ground truth for judging the sampler.
"""

from __future__ import annotations

import argparse
import json
import sys

import tkjit
from tkjit.cli import add_shape_arg, parse_shape
from tkjit.pool import compile_many
from tkjit.testing import check
from tkjit.timing import median, rel_spread, time_cuda


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("kernel")
    add_shape_arg(ap)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--only", nargs="*", default=[], metavar="K=V[,V]")
    ap.add_argument("--check-shape", nargs="*", default=[], metavar="K=V")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--arch", default="sm_90a")
    args = ap.parse_args()
    spec = tkjit.get_spec(args.kernel)
    shape = parse_shape(args.shape)
    full = spec.canonical_shape(shape)
    keep = {k: v.split(",") for k, v in (item.split("=", 1) for item in args.only)}
    cfgs = [c for c in spec.configs(full, args.arch) if all(str(c.get(k)) in vs for k, vs in keep.items())]
    errs = compile_many([(spec.name, spec.static_shape(full), c, args.arch, "explicit") for c in cfgs])
    if args.compile_only:
        bad = [c for c, (_, err) in zip(cfgs, errs) if err]
        print(f"{spec.name} {shape}: {len(cfgs) - len(bad)} of {len(cfgs)} configs compiled for {args.arch}")
        return 1 if bad else 0
    inputs = spec.make_inputs(full, device="cuda", seed=7)
    check_at = {**full, **parse_shape(args.check_shape)}
    rows, wrong = [], []
    for c, (_, err) in zip(cfgs, errs):
        if err:
            wrong.append((c, err))
            continue
        k = tkjit.get(spec.name, full, config=c)
        msg = check(k, check_at, seed=11)
        if msg:
            wrong.append((c, msg))
            continue
        sizes = {r: full[r] for r in k.caller_sized}  # outputs no input sizes (get_fused_mapping's buffer)
        ts = time_cuda(lambda k=k, sizes=sizes: k(*inputs, **sizes), reps=args.reps)
        rows.append({"config": c, "us": median(ts), "spread": rel_spread(ts)})
    rows.sort(key=lambda r: r["us"])
    d = spec.default_config(full, "sm_90a")
    dus = next((r["us"] for r in rows if r["config"] == d), None)
    print(f"{spec.name} {shape}: {len(rows)} timed, {len(wrong)} failed; default {d} = {dus}")
    for r in rows[: args.top]:
        print(f"  {r['us']:9.2f} us  ±{100 * r['spread']:.1f}%  {r['config']}")
    for c, msg in wrong[:10]:
        print(f"  FAILED {c}: {msg[:200]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernel": spec.name, "shape": full, "default": d, "rows": rows,
                       "failed": [{"config": c, "error": m} for c, m in wrong]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
