#!/usr/bin/env python3
"""Launch one kernel a few times so Nsight Compute can profile it (GPU host).

    ncu --clock-control none --launch-skip 3 --launch-count 1 --set detailed \\
        python tools/ncu_profile.py topk_gate --shape num_tokens=65536 num_experts=256 k=8 \\
            [--config '{"lanes": 8}']

The kernel is served by tkjit.get (tuned config unless --config is given); inputs come from the
spec's make_inputs. The first launches are warm-up, so skip them in ncu.
"""

from __future__ import annotations

import argparse
import json

import torch

import tkjit
from tkjit.cli import add_shape_arg, parse_shape


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel")
    add_shape_arg(ap)
    ap.add_argument("--config", help="JSON config (default: what tkjit.get picks)")
    ap.add_argument("--launches", type=int, default=5)
    args = ap.parse_args()
    if not args.shape:
        ap.error("--shape is required")
    spec = tkjit.get_spec(args.kernel)
    full = spec.canonical_shape(parse_shape(args.shape))
    k = tkjit.get(args.kernel, full, config=json.loads(args.config) if args.config else None)
    inputs = spec.make_inputs(full, device="cuda", seed=0)
    for _ in range(args.launches):
        k(*inputs)
    torch.cuda.synchronize()
    print(f"{args.kernel} {full} config={k.config} ({k.config_source})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
