#!/usr/bin/env python3
"""Host cost per call: many back-to-back launches of a 1-token input, then one sync.

    python tools/hostcost.py [--calls 3000] [--json out.json]

For µs-sized kernels the host path is the whole cost in eager mode, so each figure is wall time
per call over `--calls` calls (kernels queue asynchronously; one sync at the end), reported beside
torch.topk's on the same host. Rows: the `tkjit.ops` function (eager fast path), the same op through
the dispatcher (`torch.ops.tkjit`), a kernel object from `tkjit.get`, TileKernels where installed,
and sinkhorn forward + backward under autograd at 4096 tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

import tkjit
import tkjit.ops


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(min(200, calls)):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):  # best of three: the figure is a cost floor, other host activity only adds
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = "cuda"
    scores = torch.randn(1, 256, device=dev)
    x = torch.randn(1, 4, 4, device=dev)
    k_topk = tkjit.get("topk_gate", {"num_tokens": 1, "num_experts": 256, "k": 8})
    k_sink = tkjit.get("sinkhorn_fwd", {"num_tokens": 1, "n": 4})
    rows = {
        "torch.topk": lambda: torch.topk(scores, 8),
        "tkjit.ops.topk_gate": lambda: tkjit.ops.topk_gate(scores, 8),
        "torch.ops.tkjit.topk_gate": lambda: torch.ops.tkjit.topk_gate(scores, 8),
        "tkjit.get(topk_gate) kernel": lambda: k_topk(scores),
        "tkjit.ops.sinkhorn_fwd": lambda: tkjit.ops.sinkhorn_fwd(x),
        "tkjit.get(sinkhorn_fwd) kernel": lambda: k_sink(x),
    }
    try:
        from tile_kernels.moe import topk_gate as tk_topk

        rows["tile_kernels.moe.topk_gate"] = lambda: tk_topk(scores, 8)
    except Exception as e:  # a baseline, never a dependency
        print(f"TileKernels not available: {type(e).__name__}: {e}")
    xs = torch.randn(4096, 4, 4, device=dev, requires_grad=True)
    g = torch.randn(4096, 4, 4, device=dev)

    def step():
        y = tkjit.ops.sinkhorn(xs)
        y.backward(g)

    rows["tkjit.ops.sinkhorn fwd+bwd 4096 tokens"] = step
    out = {name: per_call_us(fn, a.calls if "4096" not in name else a.calls // 10) for name, fn in rows.items()}
    ref = out["torch.topk"]
    print(f"{'call':44s} {'us/call':>8s} {'x torch.topk':>13s}")
    for name, us in out.items():
        print(f"{name:44s} {us:8.2f} {us / ref:13.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "us_per_call": out}, f,
                      indent=1)


if __name__ == "__main__":
    main()
