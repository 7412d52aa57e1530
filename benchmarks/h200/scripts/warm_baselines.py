#!/usr/bin/env python3
"""Compile ahead what a benchmark of KERNEL will build, without timing anything: tkjit's default and served
variants and TileKernels' kernels at each of its benchmark shapes, each called once. TileKernels compiles its
kernels on first call (into TileLang's disk cache) one at a time in the benchmark's process; several of these
processes side by side fill both caches on all cores first, so the benchmark's minutes go to measuring:

    printf '%s\\n' expand_to_mhc pre_apply_mix ... | xargs -P 8 -n 1 python benchmarks/h200/scripts/warm_baselines.py
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tools"))

from baselines import SHAPES  # noqa: E402
from bench import implementations  # noqa: E402

import tkjit  # noqa: E402


def main() -> int:
    name = sys.argv[1]
    spec = tkjit.get_spec(name)
    t0, failed = time.perf_counter(), 0
    for shape in SHAPES[name]:
        full = spec.canonical_shape(shape)
        try:
            inputs = spec.make_inputs(full, device="cuda", seed=1)
            for _, call, _ in implementations(name, full, inputs, with_torch=False):  # the benchmark's, once
                call()
            torch.cuda.synchronize()
        except Exception as e:  # the benchmark says it again, in its table
            failed += 1
            print(f"{name} {shape}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
    print(f"warmed {name}: {len(SHAPES[name])} shapes, {failed} failed, {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
