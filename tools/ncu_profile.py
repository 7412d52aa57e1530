#!/usr/bin/env python3
"""Launch one kernel a few times so Nsight Compute can profile it (GPU host): tkjit's, or TileKernels' on the
same benchmark shape to read beside it (one process per implementation: ncu's --launch-skip counts one
kernel's launches).

    ncu --clock-control none --launch-skip 3 --launch-count 1 --set detailed \\
        python tools/ncu_profile.py topk_gate --shape num_tokens=65536 num_experts=256 k=8 [--config '{"lanes": 8}']
    ncu ... -k regex:get_fused_mapping python tools/ncu_profile.py get_fused_mapping --shape-index 0 --impl tk

--shape-index N takes tools/baselines.py's N-th benchmark shape of the kernel (the only way to name a shape
for --impl tk). tkjit's kernel is the one tkjit.get serves (tuned config unless --config is given). Inputs come
from the spec's make_inputs with seed 1, as tools/bench.py times them. The first launches are warm-up, so skip
them in ncu.
"""

from __future__ import annotations

import argparse
import json

import torch
from baselines import SHAPES, TILE_KERNELS

import tkjit
from tkjit.cli import add_shape_arg, parse_shape


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel")
    add_shape_arg(ap)
    ap.add_argument("--shape-index", type=int, default=None, help="the kernel's N-th benchmark shape")
    ap.add_argument("--impl", choices=("tkjit", "tk"), default="tkjit", help="tk: TileKernels' kernel")
    ap.add_argument("--config", help="tkjit's config as JSON (default: what tkjit.get picks)")
    ap.add_argument("--launches", type=int, default=5)
    args = ap.parse_args()
    if (args.shape_index is None) == (not args.shape):
        ap.error("give one of --shape and --shape-index")
    if args.impl == "tk" and args.shape_index is None:
        ap.error("--impl tk takes a benchmark shape: --shape-index")
    spec = tkjit.get_spec(args.kernel)
    shape = SHAPES[args.kernel][args.shape_index] if args.shape_index is not None else parse_shape(args.shape)
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
        sizes = {r: full[r] for r in k.caller_sized}  # caller-sized outputs' sizes, by name

        def fn():
            return k(*inputs, **sizes)

        what = f"tkjit config={k.config} ({k.config_source})"
    for _ in range(args.launches):
        fn()
    torch.cuda.synchronize()
    print(f"{args.kernel} {full}: {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
