#!/usr/bin/env python3
"""Where a launch-bound call spends its time: tkjit's kernel object beside TileKernels' function.

    python benchmarks/h200/scripts/profile_calls.py [--kernels aux_fi group_count ...] [--ops] [--json out.json]

For each kernel and each of its benchmark shapes (tools/baselines.py), both implementations get:
  event      median µs of CUDA events around one call after an L2 flush (what tools/bench.py reports)
  warm       the same without the flush
  host       wall µs per call over 300 back-to-back calls, one sync at the end (the host cost, or
             the GPU time where that is larger)
  api        CUDA runtime/driver calls per call from torch.profiler (launches, memsets, syncs,
             copies): a sync inside the call makes the events time the host work after it
  kernels    device µs per call of each kernel launched
and tkjit's call gets a cProfile of its Python frames (top functions by own time). --ops adds a row for
the routing ops' `tkjit.ops` call (the op's own allocations, e.g. get_fused_mapping's one buffer), which is
what a user calls and what TileKernels' row (its function, allocating its outputs) compares with.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tools"))

import torch  # noqa: E402
from baselines import SHAPES, TILE_KERNELS  # noqa: E402

import tkjit  # noqa: E402
from tkjit.timing import median, time_cuda  # noqa: E402

CALLS = 300


def host_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / CALLS * 1e6


def api_and_kernels(fn, calls: int = 20) -> tuple[dict, dict]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    api, kern = Counter(), Counter()
    for e in prof.events():
        name = e.name
        if name.startswith("cu"):  # runtime and driver API calls (the harness's one final sync included)
            api[name] += 1
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kern[name[:60]] += getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
    api = {k: round(v / calls, 2) for k, v in api.most_common()}
    kern = {k: round(v / calls, 2) for k, v in kern.most_common()}
    return api, kern


def py_profile(fn, top: int = 14) -> str:
    fn()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(CALLS):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return "\n".join(line for line in s.getvalue().splitlines() if line.strip())


def _ops_call(name: str, full: dict, inputs: tuple):
    """The op a user calls (`tkjit.ops`, eager: outputs allocated as the op does, as TileKernels' function
    allocates its own), for the routing ops; None for the others."""
    import tkjit.ops as ops

    x = inputs[0]
    calls = {
        "get_fused_mapping": lambda: ops.get_fused_mapping(x, full.get("num_experts"), full.get("num_expanded_tokens"),
                                                           full.get("alignment")),
        "aux_fi": lambda: ops.aux_fi(x, full.get("num_experts"), inputs[-1]),
        "group_count": lambda: ops.group_count(x, full.get("num_groups")),
        # (per_gpu experts on each of 1 EP rank: the op's n // num_ep_ranks is the kernel's per_gpu)
        "mask_indices_by_tp": lambda: ops.mask_indices_by_tp(x, inputs[1], 1, inputs[2], inputs[3]),
        "inplace_unique_group_indices": lambda: ops.inplace_unique_group_indices(x, full.get("num_groups")),
    }
    return calls.get(name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", nargs="*", default=["get_fused_mapping", "aux_fi", "group_count"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-pyprofile", action="store_true")
    ap.add_argument("--ops", action="store_true", help="also time tkjit.ops' call (the routing ops)")
    args = ap.parse_args()
    rows = []
    for name in args.kernels:
        spec = tkjit.get_spec(name)
        for shape in SHAPES[name]:
            full = spec.canonical_shape(shape)
            inputs = spec.make_inputs(full, device="cuda", seed=1)
            kt = tkjit.get(name, full)
            kw = {r: full[r] for r in kt.caller_sized}
            impls = [("tkjit", lambda kt=kt, inputs=inputs, kw=kw: kt(*inputs, **kw))]
            op = _ops_call(name, full, inputs) if args.ops else None
            if op is not None:
                impls.append(("tkjit.ops", op))
            tk = TILE_KERNELS.get(name)
            f = tk(full, inputs) if tk else None
            if f is not None:
                impls.append(("TileKernels", f))
            label = ",".join(f"{k}={v}" for k, v in shape.items())
            for impl, fn in impls:
                cfg = str(kt.config) if impl == "tkjit" else ""
                row = {"kernel": name, "shape": label, "impl": impl, "config": cfg}
                row["event_us"] = round(median(time_cuda(fn)), 2)
                row["warm_us"] = round(median(time_cuda(fn, flush=False)), 2)
                row["host_us"] = round(host_us(fn), 2)
                row["api"], row["kernels"] = api_and_kernels(fn)
                rows.append(row)
                print(f"== {name} {label} {impl} {row['config']}")
                print(f"   event {row['event_us']} us  warm {row['warm_us']} us  host {row['host_us']} us/call")
                print(f"   api/call {row['api']}")
                print(f"   kernels us/call {row['kernels']}")
                if impl.startswith("tkjit") and not args.no_pyprofile and shape is SHAPES[name][0]:
                    print(py_profile(fn))
                sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
