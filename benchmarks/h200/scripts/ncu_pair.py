#!/usr/bin/env python3
"""Launch one benchmark shape of a kernel a few times, tkjit's or TileKernels', so Nsight Compute can profile
the two side by side (one process per implementation: ncu's --launch-skip counts one kernel's launches).

    ncu --launch-skip 3 --launch-count 1 -k regex:get_fused_mapping --set detailed \\
        python benchmarks/h200/scripts/ncu_pair.py get_fused_mapping --impl tk [--shape-index 0] [--config JSON]

Shapes are tools/baselines.py's benchmark shapes; inputs come from the spec's make_inputs (seed 1, as
tools/bench.py times them). tkjit's kernel object is the one tkjit.get serves (or --config).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tools"))

import torch  # noqa: E402
from baselines import SHAPES, TILE_KERNELS  # noqa: E402

import tkjit  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel")
    ap.add_argument("--impl", choices=("tkjit", "tk"), default="tkjit")
    ap.add_argument("--shape-index", type=int, default=0)
    ap.add_argument("--config", default=None, help="tkjit config as JSON (default: what tkjit.get serves)")
    ap.add_argument("--launches", type=int, default=5)
    args = ap.parse_args()
    spec = tkjit.get_spec(args.kernel)
    shape = SHAPES[args.kernel][args.shape_index]
    full = spec.canonical_shape(shape)
    inputs = spec.make_inputs(full, device="cuda", seed=1)
    if args.impl == "tk":
        fn = TILE_KERNELS[args.kernel](full, inputs)
        if fn is None:
            print(f"TileKernels cannot run {args.kernel} {shape}")
            return 1
        what = "TileKernels"
    else:
        k = tkjit.get(args.kernel, full, config=json.loads(args.config) if args.config else None)
        kw = {r: full[r] for r in k.caller_sized}

        def fn():
            return k(*inputs, **kw)

        what = f"tkjit config={k.config} ({k.config_source})"
    for _ in range(args.launches):
        fn()
    torch.cuda.synchronize()
    print(f"{args.kernel} {shape}: {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
