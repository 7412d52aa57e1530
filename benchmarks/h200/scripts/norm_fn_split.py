#!/usr/bin/env python3
"""mhc_pre_norm_fn's forward at small token counts, whole-op figures for choosing between the op's two paths
(`tkjit.torch_ops.PRE_NORM_FN_SPLIT_TOKENS`): the forward kernel (out, out_mul, sqrsum in one launch) against
mhc_pre_norm_fn_split over k_splits K ranges plus the sums and the norm in torch (`pre_norm_fn_split`), beside
TileKernels' op, on the same inputs (fn already TF32).

    python benchmarks/h200/scripts/norm_fn_split.py [--tokens 256 512 1024 2048 4096] [--json out.json]

Each split is checked first as the tuner checks a kernel: against the spec's float64 reference, within
mhc_pre_norm_fn's tolerance (two TF32 products summed in another order differ by ~5e-5 of each other, so
comparing the paths with each other bit for bit says nothing). Median of CUDA-event runs, L2 flushed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tools"))

from baselines import _norm_fn_tk  # noqa: E402

import tkjit  # noqa: E402
from tkjit import torch_ops  # noqa: E402
from tkjit.timing import median, rel_spread, time_cuda  # noqa: E402

FWD, SPLIT, M, EPS = "mhc_pre_norm_fn", "mhc_pre_norm_fn_split", 24, 1e-6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="*", default=[256, 512, 1024, 2048, 4096])
    ap.add_argument("--hidden", type=int, nargs="*", default=[16384, 28672])
    ap.add_argument("--splits", type=int, nargs="*", default=[2, 4, 8])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    print(f"# {torch.cuda.get_device_name()}  us, median of {a.reps} (spread)")
    for k in a.hidden:
        for n in a.tokens:
            shape = {"num_tokens": n, "mhc_mult3": M, "mhc_hidden": k, "norm_eps": EPS}
            x, fn = tkjit.get_spec(FWD).make_inputs(shape, "cuda", 1)
            spec = tkjit.get_spec(FWD)
            ref = spec.reference(spec.canonical_shape(shape), x, fn)
            # the op's two paths (fn rounded to TF32 in torch on both: a no-op on these values, as in the op)
            paths = {"forward": lambda x=x, fn=fn: torch_ops.mhc_pre_norm_fn_impl(x, fn, EPS)}
            tk = _norm_fn_tk(shape, (x, fn))
            if tk is not None:
                paths["TileKernels"] = tk
            for s in a.splits:
                if k % (64 * s) == 0:
                    run = functools.partial(torch_ops.pre_norm_fn_split, x, fn, EPS, s)
                    kernel = tkjit.get(SPLIT, {"num_tokens": n, "mhc_mult3": M, "mhc_hidden": k, "k_splits": s})
                    bad = [m for name, g, r in zip(("out", "out_mul", "sqrsum"), run(), ref)
                           if (m := spec.tolerance.check(name, g, r))]
                    if bad:
                        print(f"{n} x {k} split {s}: WRONG ({'; '.join(bad)})")
                        continue
                    paths[f"split {s}"] = run
                    paths[f"split {s} kernel"] = functools.partial(kernel, x, fn)
            for name, fn_ in paths.items():
                ts = time_cuda(fn_, reps=a.reps)
                rows.append({"num_tokens": n, "mhc_hidden": k, "path": name, "us": median(ts),
                             "spread": rel_spread(ts)})
                print(f"{n:6d} x {k:6d}  {name:16s} {median(ts):9.2f}  ({100 * rel_spread(ts):.1f}%)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
